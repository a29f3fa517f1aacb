"""Scale out on Ray (``mapper serve --ray``): map workers are Ray actors, each running the ordinary map
service (``mapper.api.MapService`` behind its own app: WAL, snapshots, writers, queries) on a data directory
of a shared root; an ingress app with the public HTTP/WebSocket API routes each map's requests to the
worker that owns it (``mapper.cluster.ingress``). Nothing here is imported unless ``--ray`` is used, and
``ray`` is imported lazily (the ``ray`` extra)."""

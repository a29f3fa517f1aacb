"""The cluster's public app: the same HTTP/WebSocket API as ``mapper serve``, in front of map workers.

Every ``/v1/maps/{id}/...`` request (frames, queries, meshes, slices, snapshots, export, the viewer's
routes) is forwarded, as it is, to the worker that owns the map (its internal HTTP server, with the
cluster's internal token); the user's token is checked here first with the rules of the single-process
app (the auth level of each route is read from that app's own route table). A WebSocket stream is relayed
frame by frame to the owner's stream, acks back in order; the owner's backpressure reaches the robot.

Routing state: ``map id -> Route`` (owner worker, name), rebuilt from the workers' map lists at start and
whenever a worker answers 404 for a map it should own. A route is a gate: a move closes it (new requests
and stream frames wait), waits until the requests and frames in flight are answered, moves the map
(snapshot + WAL tail on the shared root, ``MapWorker.detach`` / ``attach``), switches the owner and
reopens. A stream whose map moved reconnects to the new owner before its next frame.

Worker failure: a request that cannot connect waits for Ray to restart the worker (its address is
resolved again, up to ``RESOLVE_TIMEOUT_S``) and is sent then; a request cut while the worker ran it is
answered 502 ``worker_lost`` (it may or may not have been applied); a stream is closed with 1011 (frames
without an ack may or may not be in the map), as a single-process server that crashed would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
from fastapi import APIRouter, Body, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from .. import __version__, io, render, viewer, wire
from ..api import create_app, errors
from ..api.app import BodyLimit, HttpMetrics, _offline_docs
from ..api.auth import AuthGate, route_table
from ..api.deps import VERSION_HEADER, ReadAuth, WriteAuth, check_metrics_token, check_token, reply
from ..api.errors import Unavailable
from ..api.routes.frames import _deny
from ..api.routes.viewer import MAX_OCCUPIED
from ..errors import Conflict, InvalidArgument, MapperError, NotFound
from ..persistence import META_KEY
from ..queries import Slice
from ..settings import Settings
from ..store import NAME_PATTERN
from ..store_backends import is_object_store, open_store
from ..viewer import STATIC_DIR

# shards imports this module back only inside its functions (Route, WorkerLost): the loop closes at
# call time, not at import time
from . import ray_cluster, shards
from .ray_cluster import WorkerHandle
from .worker import worker_dir

log = logging.getLogger("mapper.cluster.ingress")

RESOLVE_TIMEOUT_S = 90.0  # a request to a restarting worker waits this long for its new address
MOVE_QUIESCE_S = 60.0
MAP_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "server", "date", "upgrade"}
STREAM_LOST = "map worker failed: frames without an ack may or may not be in the map; reconnect and resend"


class InvalidMapId(InvalidArgument):
    """A map id outside the API's pattern: answered as ``mapper serve``'s path validation does (422)."""


class WorkerLost(MapperError):
    """The worker serving the request failed while running it (HTTP 502): it may or may not be applied."""


@dataclass
class Route:
    """Where a map lives, and the gate a move closes."""

    worker: int
    name: str
    version: int = 0  # bumped when the map moves: streams reconnect
    paused: bool = False
    inflight: int = 0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self):
        self.resumed.set()
        self.idle.set()

    async def open(self) -> None:
        """Wait while the map is moving."""
        while self.paused:
            await self.resumed.wait()

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self, n: int = 1) -> None:
        self.inflight -= n
        if self.inflight <= 0:
            self.inflight = 0
            self.idle.set()

    @contextlib.asynccontextmanager
    async def use(self):
        await self.open()
        self.enter()
        try:
            yield self.worker
        finally:
            self.leave()


class IngressMetrics:
    """The ingress's own series (the workers' series are appended by ``/metrics`` with a worker label)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.http = Histogram(
            "mapper_ingress_http_request_seconds",
            "Ingress HTTP request latency (forwarding included)",
            ["method", "route", "status"],
            registry=self.registry,
        )


class Router:
    """The ingress's state: workers, routes, the HTTP client to the workers."""

    def __init__(self, settings: Settings, workers: list[WorkerHandle]):
        self.settings = settings
        self.workers = workers
        self.routes: dict[str, Route] = {}
        self.sharded: dict = {}  # map id -> shards.ShardedMap
        self.lock = asyncio.Lock()  # creates, moves and refreshes, one at a time
        self.ready = False
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=5.0), limits=httpx.Limits(max_connections=100)
        )
        self.levels = route_table(create_app(settings).router.routes)  # the single-process app's auth

    async def close(self) -> None:
        await self.http.aclose()

    # ---------------------------------------------------------------------------------- workers
    def worker(self, index: int) -> WorkerHandle:
        return self.workers[index]

    async def resolve(self, index: int, stale: bool = False) -> tuple[str, str]:
        """The worker's (URL, token); asks its actor again when ``stale`` (Ray restarts a dead one first)."""
        h = self.workers[index]
        if stale or h.url is None:
            h.url = None
            try:
                h.url, h.token = await asyncio.wait_for(_await(h.actor.address.remote()), RESOLVE_TIMEOUT_S)
            except Exception as e:
                raise Unavailable(
                    f"map worker {index} is not reachable ({type(e).__name__}); retry"
                ) from None
        return h.url, h.token

    async def send(self, index: int, method: str, path: str, *, params=None, headers=None, content=None):
        """One request to a worker (streamed response). Connection failures wait for the worker's restart
        and retry; a failure after the request reached the worker raises ``WorkerLost``."""
        stale = False
        for _ in range(3):
            url, token = await self.resolve(index, stale)
            hdrs = {**(headers or {}), "authorization": f"Bearer {token}"}
            req = self.http.build_request(method, url + path, params=params, headers=hdrs, content=content)
            try:
                return await self.http.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                stale = True
                await asyncio.sleep(0.2)
            except httpx.TransportError as e:
                self.workers[index].url = None
                raise WorkerLost(
                    f"map worker {index} failed during the request ({type(e).__name__}); it may or may not "
                    "have been applied"
                ) from None
        raise Unavailable(f"map worker {index} does not accept connections; retry")

    async def json(self, index: int, method: str, path: str, **kw):
        resp = await self.send(index, method, path, **kw)
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        return resp

    # ----------------------------------------------------------------------------------- routes
    async def refresh(self) -> None:
        """Rebuild the routes from the workers' map lists."""
        lists = await asyncio.gather(*(self.json(i, "GET", "/v1/maps") for i in range(len(self.workers))))
        found: dict[str, tuple[int, str]] = {}
        summaries: dict[str, tuple[int, dict]] = {}
        for i, resp in enumerate(lists):
            if resp.status_code != 200:
                raise Unavailable(f"map worker {i}: listing maps answered {resp.status_code}")
            for m in resp.json()["maps"]:
                summaries[m["id"]] = (i, m)
        sharded, shard_ids = shards.group_shards(summaries)
        for map_id, sm in sharded.items():  # keep the live objects (their frame lock, gate and cursors)
            old = self.sharded.get(map_id)
            if old is not None and not old.gate.paused:
                old.workers, old.ids = sm.workers, sm.ids
            sharded[map_id] = old or sm
        self.sharded = {**{k: v for k, v in self.sharded.items() if v.gate.paused}, **sharded}
        for mid, (i, m) in summaries.items():
            if mid not in shard_ids:
                found[mid] = (i, m["name"])
        for map_id in list(self.routes):
            if map_id not in found and not self.routes[map_id].paused:
                del self.routes[map_id]
        for map_id, (i, name) in found.items():
            r = self.routes.get(map_id)
            if r is None:
                self.routes[map_id] = Route(i, name)
            elif not r.paused and r.worker != i:
                r.worker, r.version = i, r.version + 1

    async def adopt(self, root) -> list[str]:
        """Serve the maps on the shared root that no worker owns: those of a plain ``mapper serve`` on the
        same data directory (``<root>/maps``) and those of workers beyond the current count (``--ray-workers``
        lowered). Each is placed like a new map and moved into its worker's directory. Returns their ids."""
        if is_object_store(self.settings.store):
            return await self._adopt_from_store()
        root = Path(root)
        n = len(self.workers)
        sources = [root / "maps"]
        extra = root / "workers"
        if extra.is_dir():
            for p in sorted(extra.iterdir()):
                if p.name[:1] == "w" and p.name[1:].isdigit() and int(p.name[1:]) >= n:
                    sources.append(worker_dir(root, int(p.name[1:])) / "maps")
        adopted = []
        for maps_dir in sources:
            if not maps_dir.is_dir():
                continue
            for d in sorted(maps_dir.iterdir()):
                if d.name.startswith(".") or not (d / "info.json").exists() or d.name in self.routes:
                    continue
                i = await self.place()
                try:
                    summary = await _await(self.workers[i].actor.attach.remote(d.name, str(d)))
                except Exception:
                    log.exception("map %s in %s: could not be adopted; left there", d.name, maps_dir)
                    continue
                self.routes[d.name] = Route(i, summary["name"])
                adopted.append(d.name)
        if adopted:
            log.info("adopted %d maps: %s", len(adopted), ", ".join(adopted))
        return adopted

    async def _adopt_from_store(self) -> list[str]:
        """``adopt`` on an object store: the maps with no owner object (made by a plain ``mapper serve``)
        or owned by a worker beyond the current count; each is placed like a new map and claimed."""
        data = await asyncio.to_thread(open_store, self.settings, None)
        owners = await asyncio.to_thread(data.owners)
        current = {f"w{i}" for i in range(len(self.workers))}
        adopted = []
        for map_id, owner in sorted(owners.items()):
            if owner in current or map_id in self.routes:
                continue
            i = await self.place()
            try:
                summary = await _await(self.workers[i].actor.attach.remote(map_id, None))
            except Exception:
                log.exception("map %s in %s: could not be adopted; left there", map_id, data.root)
                continue
            self.routes[map_id] = Route(i, summary["name"])
            adopted.append(map_id)
        if adopted:
            log.info("adopted %d maps: %s", len(adopted), ", ".join(adopted))
        return adopted

    def route(self, map_id: str) -> Route:
        if not MAP_ID.match(map_id):
            raise InvalidMapId(f"path.map_id: String should match pattern '{MAP_ID.pattern}'")
        r = self.routes.get(map_id)
        if r is None:
            raise NotFound(f"map {map_id!r} not found")
        return r

    async def place(self) -> int:
        """The least loaded worker: fewest maps, then fewest bytes in maps (ties: lowest index)."""
        return (await self.ranked())[0]

    async def ranked(self) -> list[int]:
        """The workers, least loaded first: fewest maps (a shard counts as one), then fewest bytes in maps
        (ties: lowest index); workers not answering last."""
        infos = await asyncio.gather(*(self.info(i) for i in range(len(self.workers))))
        counts = [0] * len(self.workers)
        for r in self.routes.values():
            counts[r.worker] += 1
        for sm in self.sharded.values():
            for w in sm.workers:
                counts[w] += 1
        load = [
            ("error" in infos[i], counts[i], (infos[i].get("memory") or {}).get("maps_bytes", 0), i)
            for i in range(len(counts))
        ]
        return [x[3] for x in sorted(load)]

    async def info(self, index: int) -> dict:
        try:
            return await asyncio.wait_for(_await(self.workers[index].actor.info.remote()), 10.0)
        except Exception as e:
            return {"worker": index, "error": f"{type(e).__name__}: not answering (restarting?)"}

    async def move(self, map_id: str, target: int, shard: int | None = None) -> dict:
        """Move a map (or, of a sharded map, its shard ``shard``) to worker ``target``: close its gate, wait
        for the work in flight, snapshot and close it on its owner, rename its directory into the target's,
        recover it there (snapshot + WAL tail), switch the route, reopen. No acknowledged frame can be lost:
        frames are acked only once in the WAL, and the WAL travels with the directory."""
        if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < len(self.workers):
            raise InvalidArgument(f"worker: {target!r} is not a worker (0..{len(self.workers) - 1})")
        if map_id in self.sharded:
            return await self._move_shard(self.sharded[map_id], shard, target)
        if shard is not None:
            raise InvalidArgument(f"shard: map {map_id!r} is not sharded (leave shard out)")
        async with self.lock:
            r = self.route(map_id)
            src = r.worker
            if src == target:
                return await self._summary(target, map_id)
            async with _closed(r):
                await self._transfer(map_id, src, target)
                r.worker, r.version = target, r.version + 1
        return await self._summary(target, map_id)

    async def _move_shard(self, sm, shard: int | None, target: int) -> dict:
        """Move shard ``shard`` of a sharded map: its gate closes every request to the map (frames, reads)
        while the shard is handed over, as ``move`` does for one map."""
        if shard is None or isinstance(shard, bool) or not isinstance(shard, int):
            raise InvalidArgument(
                f"shard: map {sm.id!r} is sharded: say which of its shards 0..{sm.count - 1} moves "
                f"(got {shard!r})"
            )
        if not 0 <= shard < sm.count:
            raise InvalidArgument(f"shard: {shard} is not a shard of map {sm.id!r} (0..{sm.count - 1})")
        async with self.lock:
            src = sm.workers[shard]
            if src != target:
                async with _closed(sm.gate):
                    await self._transfer(sm.ids[shard], src, target)
                    sm.workers[shard] = target
        parts = await asyncio.gather(*(shards._summary_of(self, sm, i) for i in range(sm.count)))
        return shards.summary(sm, parts)

    async def _transfer(self, map_id: str, src: int, target: int) -> None:
        """Hand a quiet map over from worker ``src`` to ``target`` (detach, rename, attach; back to ``src``
        when the target cannot recover it)."""
        t = time.perf_counter()
        a, b = self.workers[src].actor, self.workers[target].actor
        await _await(a.detach.remote(map_id))
        path = await _await(a.map_path.remote(map_id))
        try:
            await _await(b.attach.remote(map_id, path))
        except Exception:
            log.exception("map %s: attach on worker %d failed; back to worker %d", map_id, target, src)
            await _await(a.attach.remote(map_id, await _await(b.map_path.remote(map_id))))
            raise
        log.info("map %s: moved %d -> %d in %.2f s", map_id, src, target, time.perf_counter() - t)

    async def _summary(self, index: int, map_id: str) -> dict:
        resp = await self.json(index, "GET", f"/v1/maps/{map_id}")
        out = resp.json()
        out.pop("stats", None)
        out.pop("snapshot", None)
        return {**out, "worker": index}


async def _await(ref):
    return await ref


@contextlib.asynccontextmanager
async def _closed(gate: Route):
    """Close a gate (new requests wait), wait until the ones in flight are answered, reopen on exit."""
    gate.paused = True
    gate.resumed.clear()
    try:
        try:
            await asyncio.wait_for(gate.idle.wait(), MOVE_QUIESCE_S)
        except TimeoutError:
            raise Unavailable(f"requests in flight did not finish within {MOVE_QUIESCE_S:g} s") from None
        yield
    finally:
        gate.paused = False
        gate.resumed.set()


def _forward_headers(request: Request) -> dict:
    keep = ("content-type", "accept", "content-length")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


def _response(resp: httpx.Response, body: bytes | None = None):
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
    if body is not None:
        headers.pop("content-length", None)
        return Response(body, status_code=resp.status_code, headers=headers)

    async def chunks():
        try:
            async for b in resp.aiter_raw():
                yield b
        finally:
            await resp.aclose()

    return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers)


def stored_name(snapshot: bytes) -> str | None:
    """The map name stored in an exported snapshot (safetensors header metadata), or None (none stored,
    or not readable here: the worker validates the file)."""
    try:
        n = int.from_bytes(snapshot[:8], "little")
        if not 0 < n <= min(len(snapshot) - 8, 100 << 20):
            return None
        meta = json.loads(json.loads(snapshot[8 : 8 + n])["__metadata__"][META_KEY])
        name = (meta.get("info") or {}).get("name")
        return name if isinstance(name, str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of several workers -> one text, every sample labelled ``worker="<name>"`` and the
    samples of each family kept together under one HELP/TYPE."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for worker, text in texts:
        current = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], ([], []))
                    if line not in current[0]:
                        current[0].append(line)
                continue
            if current is None:
                current = families.setdefault("", ([], []))
            label = f'worker="{worker}"'
            brace = line.find("{")
            space = line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                inner = line[brace + 1 :]
                line = line[: brace + 1] + label + ("," if not inner.startswith("}") else "") + inner
            else:
                line = line[:space] + "{" + label + "}" + line[space:]
            current[1].append(line)
    out = []
    for head, samples in families.values():
        out.extend(head)
        out.extend(samples)
    return "\n".join(out) + "\n"


def create_cluster_app(
    settings: Settings,
    workers: int | None = None,
    address: str | None = None,
    num_cpus: int | None = None,
) -> FastAPI:
    """The ingress app of ``mapper serve --ray``. Its lifespan joins the Ray cluster at ``address`` (or
    uses the one this process already joined, or starts a local one), starts ``workers`` map workers
    (default: one per GPU, 2 without), and stops them (every map snapshotted) at shutdown."""
    metrics = IngressMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.check_bind()
        started = await asyncio.to_thread(ray_cluster.connect_ray, address, num_cpus)
        handles = await asyncio.to_thread(ray_cluster.start_workers, settings, workers)
        router = Router(settings, handles)
        app.state.router = router
        try:
            await router.refresh()
            await router.adopt(settings.data_dir)
            router.ready = True
            yield
        finally:
            router.ready = False
            await router.close()
            await asyncio.to_thread(ray_cluster.stop_workers, handles)
            if started:
                import ray

                await asyncio.to_thread(ray.shutdown)

    app = FastAPI(
        title="mapper",
        version=__version__,
        description="mapper on Ray: the API of `mapper serve`, maps spread over map workers.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    _offline_docs(app)
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_exception_handler(WorkerLost, _worker_lost)
    app.add_exception_handler(InvalidMapId, _invalid_map_id)
    app.add_exception_handler(MapperError, errors.mapper_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.internal_error_handler)

    def router_of(request) -> Router:
        r = getattr(request.app.state, "router", None)
        if r is None or not r.ready:
            raise Unavailable("the cluster is starting or stopping")
        return r

    api = APIRouter()

    @api.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        return {"status": "ok"}

    @api.get("/readyz", tags=["health"])
    async def readyz(request: Request):
        r = getattr(request.app.state, "router", None)
        if r is None or not r.ready:
            return JSONResponse({"type": "unavailable", "detail": "starting"}, status_code=503)
        return {"status": "ready", "maps": len(r.routes), "workers": len(r.workers)}

    @api.get("/metrics", tags=["health"], response_class=Response)
    async def prometheus(request: Request):
        """The ingress's series, then every worker's (labelled ``worker``). Auth as ``mapper serve``."""
        auth = request.headers.get("authorization", "")
        check_metrics_token(settings, auth[7:].strip() if auth.lower().startswith("bearer ") else None)
        r = router_of(request)

        async def one(i):
            try:
                resp = await r.json(i, "GET", "/metrics")
                return (f"w{i}", resp.text) if resp.status_code == 200 else None
            except MapperError:
                return None

        texts = [t for t in await asyncio.gather(*(one(i) for i in range(len(r.workers)))) if t]
        body = generate_latest(metrics.registry).decode() + merge_metrics(texts)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/cluster", tags=["cluster"], dependencies=[ReadAuth])
    async def cluster(request: Request) -> dict:
        """The map workers: node, device, pid, maps, memory, frames/s (``error`` for one not answering)."""
        r = router_of(request)
        infos = await asyncio.gather(*(r.info(i) for i in range(len(r.workers))))
        return {"workers": list(infos), "maps": len(r.routes)}

    @api.post("/v1/maps", status_code=201, tags=["maps"], dependencies=[ReadAuth, WriteAuth])
    async def create_map(request: Request):
        """As ``mapper serve``; the map is placed on the least loaded worker. With ``"shards": K`` (2 <= K
        <= workers) the map is split over K workers by root-tile blocks (README "Sharded maps")."""
        r = router_of(request)
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the worker answers the validation error
        name = parsed.get("name") if isinstance(parsed, dict) else None
        k = shards.check_shards(parsed, len(r.workers)) if isinstance(parsed, dict) else None
        async with r.lock:
            if len(r.routes) + len(r.sharded) >= settings.max_maps:
                raise Conflict(f"map limit reached ({settings.max_maps} maps; MAPPER_MAX_MAPS)")
            if isinstance(name, str) and any(x.name == name for x in shards._all_maps(r)):
                raise Conflict(f"name: a map named {name!r} exists")
            if k is not None and k > 1:
                return await shards.create(r, parsed, k, _forward_headers(request))
            index = await r.place()
            resp = await r.json(index, "POST", "/v1/maps", headers=_forward_headers(request), content=body)
            if resp.status_code == 201:
                m = resp.json()
                r.routes[m["id"]] = Route(index, m["name"])
        return _response(resp, resp.content)

    @api.post("/v1/maps/import", status_code=201, tags=["maps"], dependencies=[ReadAuth, WriteAuth])
    async def import_map(request: Request):
        """As ``mapper serve``; the map is placed on the least loaded worker. A sharded map's export (a tar)
        becomes a sharded map again (README "Sharded maps")."""
        r = router_of(request)
        body = await request.body()
        name = request.query_params.get("name")
        if shards.is_sharded_export(body):  # a sharded map's export: K shards again
            if name is not None:
                if not re.fullmatch(NAME_PATTERN, name):
                    raise InvalidMapId(f"query.name: String should match pattern '{NAME_PATTERN}'")
            async with r.lock:
                return await shards.import_export(r, body, name)
        async with r.lock:
            if name is not None and any(x.name == name for x in r.routes.values()):
                raise Conflict(f"name: a map named {name!r} exists")
            stored = stored_name(body) if name is None else None
            taken = [x.worker for x in r.routes.values() if stored is not None and x.name == stored]
            # a stored name taken in the cluster: import on the worker that has it, which then falls back
            # to the id exactly as mapper serve does
            index = taken[0] if taken else await r.place()
            params = {"name": name} if name is not None else None
            resp = await r.json(
                index,
                "POST",
                "/v1/maps/import",
                params=params,
                headers=_forward_headers(request),
                content=body,
            )
            if resp.status_code == 201:
                m = resp.json()
                r.routes[m["id"]] = Route(index, m["name"])
        return _response(resp, resp.content)

    @api.get("/v1/maps", tags=["maps"], dependencies=[ReadAuth])
    async def list_maps(request: Request) -> dict:
        r = router_of(request)
        lists = await asyncio.gather(*(r.json(i, "GET", "/v1/maps") for i in range(len(r.workers))))
        maps = []
        for i, resp in enumerate(lists):
            if resp.status_code != 200:
                raise Unavailable(f"map worker {i}: listing maps answered {resp.status_code}; retry")
            maps.extend(m for m in resp.json()["maps"] if "shard" not in (m.get("config") or {}))
        maps.extend(await _sharded_summaries(r))
        return {"maps": sorted(maps, key=lambda m: m.get("created") or "")}

    @api.post("/v1/maps/{map_id}/move", tags=["cluster"], dependencies=[ReadAuth, WriteAuth])
    async def move_map(
        request: Request, map_id: str, worker: int = Body(..., embed=True), shard: int | None = Body(None)
    ) -> dict:
        """Move the map to another worker (snapshot, WAL tail, routing switch); frames sent meanwhile wait.
        A sharded map moves one shard at a time: ``shard`` says which (0..K-1)."""
        return await router_of(request).move(map_id, worker, shard)

    @api.websocket("/v1/maps/{map_id}/stream")
    async def stream(ws: WebSocket, map_id: str):
        try:
            auth = ws.headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ws.query_params.get("token")
            check_token(settings, token, write=True)
            r = router_of(ws)
            sm = r.sharded.get(map_id)
            route = r.route(map_id) if sm is None else None
        except MapperError as e:
            await _deny(ws, e)
            return
        await ws.accept()
        if sm is not None:
            await _sharded_stream(r, sm, ws, settings)
            return
        await StreamRelay(r, route, map_id, ws).run()

    @api.api_route(
        "/v1/maps/{map_id}", methods=["GET", "DELETE"], include_in_schema=False, name="map-forward"
    )
    @api.api_route(
        "/v1/maps/{map_id}/{rest:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        include_in_schema=False,
        name="forward",
    )
    async def forward(request: Request, map_id: str, rest: str = ""):
        r = router_of(request)
        path = request.url.path
        level = _level(r.levels, path, request.method)
        auth = request.headers.get("authorization", "")
        check_token(
            settings, auth[7:].strip() if auth.lower().startswith("bearer ") else None, write=level != "read"
        )
        if map_id in r.sharded:
            return await _sharded_request(r, r.sharded[map_id], request, rest)
        route = r.route(map_id)
        body = await request.body()
        for attempt in range(2):
            async with route.use() as index:
                resp = await r.send(
                    index,
                    request.method,
                    path,
                    params=list(request.query_params.multi_items()),
                    headers=_forward_headers(request),
                    content=body,
                )
                if resp.status_code == 404 and attempt == 0 and route.worker == index:
                    await resp.aclose()
                    async with r.lock:  # the map may have moved under another ingress: look again
                        await r.refresh()
                    if r.routes.get(map_id) is None:
                        raise NotFound(f"map {map_id!r} not found")
                    route = r.routes[map_id]
                    continue
                if request.method == "DELETE" and resp.status_code == 204 and not rest:
                    r.routes.pop(map_id, None)
                return _response(resp)
        raise NotFound(f"map {map_id!r} not found")

    app.include_router(api)

    def openapi() -> dict:
        """``mapper serve``'s schema (every forwarded route, as it is) plus the cluster's own routes."""
        if app.openapi_schema is None:
            schema = create_app(settings).openapi()
            own = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, item in own.get("paths", {}).items():  # mapper serve's documentation wins
                for method, op in item.items():
                    schema["paths"].setdefault(path, {}).setdefault(method, op)
            for kind, entries in own.get("components", {}).items():
                schema.setdefault("components", {}).setdefault(kind, {}).update(entries)
            schema["info"]["description"] = app.description
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/viewer", status_code=307)

    @app.get("/viewer", include_in_schema=False)
    async def viewer_page():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/viewer/static", StaticFiles(directory=STATIC_DIR), name="viewer-static")
    app.add_middleware(BodyLimit, settings=settings)
    app.add_middleware(AuthGate, settings=settings)
    app.add_middleware(HttpMetrics, metrics=metrics)
    return app


async def _sharded_summaries(r: Router) -> list[dict]:
    out = []
    for sm in list(r.sharded.values()):
        parts = await asyncio.gather(*(shards._summary_of(r, sm, i) for i in range(sm.count)))
        out.append(shards.summary(sm, parts))
    return out


async def _sharded_request(r: Router, sm, request: Request, rest: str):
    """A ``/v1/maps/{id}/...`` request to a sharded map (``mapper.cluster.shards``), through the map's gate
    (closed while one of its shards moves)."""
    if rest == "" and request.method == "DELETE":
        async with r.lock:
            return await shards.delete(r, sm)
    async with sm.gate.use():
        return await _sharded_dispatch(r, sm, request, rest)


def _query_int(request: Request, name: str, lo: int, hi: int, default: int | None) -> int | None:
    """An integer query parameter checked as ``mapper serve`` checks it (422 naming it)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise InvalidArgument(f"query.{name}: Input should be a valid integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise InvalidArgument(f"query.{name}: expected an integer in [{lo}, {hi}], got {v}")
    return v


async def _sharded_dispatch(r: Router, sm, request: Request, rest: str):
    method, body = request.method, await request.body()
    ctype = request.headers.get("content-type", "")
    try:
        if rest == "" and method == "GET":
            return await shards.get_map(r, sm)
        if rest == "frames" and method == "POST":
            status, out = await shards.integrate(r, sm, body, ctype, r.settings)
            return reply(request, out, status_code=status)
        if rest.startswith("query/") and method == "POST" and rest[6:] in ("distance", "tsdf", "occupancy"):
            return reply(request, await shards.query(r, sm, rest[6:], body, ctype, r.settings))
        if rest == "esdf/slice" and method == "GET":
            params = dict(request.query_params)
            fmt = params.get("format", "png")
            out = await shards.slice_(r, sm, params)
            if fmt == "png":
                s = Slice(
                    torch.from_numpy(np.asarray(out["distance"])),
                    tuple(out["origin_xy"]),
                    float(out["resolution_m"]),
                    float(out["z_m"]),
                )
                png = await asyncio.to_thread(
                    render.slice_to_png, s, max_distance_m=sm.config["esdf_max_distance_m"]
                )
                return Response(png, media_type="image/png")
            if fmt == "msgpack":
                return Response(wire.packb(out), media_type=wire.MSGPACK)
            return reply(request, out)
        if rest == "esdf/box" and method == "POST":
            return reply(request, await shards.box(r, sm, body, ctype))
        if rest in ("mesh", "mesh/blocks") and method == "GET":
            fmt = request.query_params.get("format", "ply")
            if rest == "mesh" and fmt not in ("ply", "msgpack"):
                raise InvalidArgument(f"format: expected 'ply' or 'msgpack', got {fmt!r}")
            since = _query_int(request, "since_version", 0, 2**62, None)
            m, map_version = await shards.mesh(r, sm, since)
            headers = {VERSION_HEADER: str(map_version), "X-Mapper-Mesh-Version": str(m.version)}
            if rest == "mesh/blocks":
                out = await asyncio.to_thread(viewer.mesh_to_blocks_bytes, m)
                return Response(out, media_type=viewer.MEDIA_TYPE, headers=headers)
            if fmt == "msgpack":
                out = await asyncio.to_thread(lambda: wire.packb(io.mesh_to_msgpack_dict(m)))
                return Response(out, media_type=wire.MSGPACK, headers=headers)
            out = await asyncio.to_thread(io.mesh_to_ply_bytes, m)
            return Response(out, media_type="application/octet-stream", headers=headers)
        if rest == "status" and method == "GET":
            return await shards.status(r, sm)
        if rest == "occupied" and method == "GET":
            n = _query_int(request, "max_voxels", 1, MAX_OCCUPIED, 200_000)
            return reply(request, await shards.occupied(r, sm, n))
        if rest == "trajectory" and method == "GET":  # shard 0 records every frame's pose
            resp = await r.json(
                sm.workers[0],
                "GET",
                f"/v1/maps/{sm.ids[0]}/trajectory",
                params=list(request.query_params.multi_items()),
                headers=_forward_headers(request),
            )
            return _response(resp, resp.content)
        if rest == "export" and method == "GET":
            return await shards.export(r, sm)
        if rest in ("clear", "decay", "snapshot") and method == "POST":
            return await shards.fan_out(r, sm, method, rest, body, _forward_headers(request))
    except shards._Upstream as e:
        return _response(e.resp, e.resp.content)
    raise InvalidArgument(
        f"{method} /v1/maps/{{id}}/{rest}: not available on a sharded map (README 'Sharded maps')"
    )


async def _sharded_stream(r: Router, sm, ws: WebSocket, settings: Settings) -> None:
    """A WebSocket stream into a sharded map: each binary frame integrated as ``POST .../frames`` is
    (every shard it reaches acks it), its ack or error sent back in order."""
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("bytes")
            if data is None:
                out = {
                    "type": "malformed_message",
                    "detail": "stream: send frames as binary msgpack messages",
                    "status": 400,
                }
            else:
                async with sm.gate.use():
                    status, out = await shards.integrate(r, sm, data, wire.MSGPACK, settings)
                if status != 200:
                    out = {**out, "status": status}
            await ws.send_bytes(wire.packb(out))
    except (WebSocketDisconnect, RuntimeError):
        return
    except (WorkerLost, MapperError) as e:
        with contextlib.suppress(Exception):
            await ws.close(code=1011, reason=str(e)[:120])


def _level(table, path: str, method: str) -> str | None:
    for regex, methods, level in table:
        if regex.match(path) and (not methods or method in methods):
            return level
    return "write"  # a route the single-process app does not have: the strictest


async def _invalid_map_id(request, exc: InvalidMapId) -> JSONResponse:
    return JSONResponse({"type": "validation_error", "detail": str(exc)}, status_code=422)


async def _worker_lost(request, exc: WorkerLost) -> JSONResponse:
    return JSONResponse({"type": "worker_lost", "detail": str(exc)}, status_code=502)


class StreamRelay:
    """One client stream relayed to the owner's stream: frames in order through the map's gate, the
    owner's acks (or error messages, one per frame) back in order."""

    def __init__(self, router: Router, route: Route, map_id: str, ws: WebSocket):
        self.router, self.route, self.map_id, self.ws = router, route, map_id, ws
        self.up = None
        self.up_version = -1
        self.outstanding = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self.pump: asyncio.Task | None = None
        self.client_gone = False
        self.lost: tuple[int, str] | None = None  # (close code, reason) when the upstream ended early

    async def run(self) -> None:
        try:
            while self.lost is None:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    self.client_gone = True
                    break
                data = msg.get("bytes")
                payload = data if data is not None else msg.get("text", "")
                while True:  # through the gate, on an upstream to the current owner (no await after it)
                    await self.route.open()
                    if self.up is not None and self.up_version == self.route.version:
                        break
                    await self._connect()
                    if self.lost is not None:
                        break
                if self.lost is not None:
                    break
                self.route.enter()
                self.outstanding += 1
                self.drained.clear()
                try:
                    await self.up.send(payload)
                except Exception:
                    self._upstream_ended(1011, STREAM_LOST)
                    break
                while self.outstanding >= self.router.settings.ws_max_in_flight and self.lost is None:
                    await asyncio.sleep(0.005)
        except WebSocketDisconnect:
            self.client_gone = True
        finally:
            await self._finish()

    async def _connect(self) -> None:
        """(Re)connect the upstream to the map's owner, after the old one's acks are all relayed."""
        await self._close_upstream()
        index = self.route.worker
        stale = False
        for _ in range(3):
            try:
                url, token = await self.router.resolve(index, stale)
            except MapperError as e:  # the worker did not come back in time
                self._upstream_ended(1013, str(e))
                return
            try:
                self.up = await connect(
                    url.replace("http://", "ws://", 1) + f"/v1/maps/{self.map_id}/stream",
                    additional_headers={"Authorization": f"Bearer {token}"},
                    max_size=self.router.settings.max_body_bytes,
                    open_timeout=30,
                    compression=None,  # no deflate/inflate of every frame (NOTES.md issue 13)
                )
                break
            except OSError:
                stale = True
                await asyncio.sleep(0.2)
            except Exception as e:
                self._upstream_ended(1011, f"map worker refused the stream ({type(e).__name__})")
                return
        else:
            self._upstream_ended(1011, STREAM_LOST)
            return
        self.up_version = self.route.version if self.route.worker == index else -1
        self.pump = asyncio.get_running_loop().create_task(self._relay_acks(self.up))

    async def _relay_acks(self, up) -> None:
        try:
            async for m in up:
                if not self.client_gone:
                    try:
                        if isinstance(m, bytes):
                            await self.ws.send_bytes(m)
                        else:
                            await self.ws.send_text(m)
                    except Exception:
                        self.client_gone = True
                self.outstanding -= 1
                self.route.leave()
                if self.outstanding <= 0:
                    self.drained.set()
        except ConnectionClosed:
            pass
        if up is self.up and self.outstanding > 0:  # the owner went away with frames unanswered
            rcvd = getattr(up, "close_rcvd", None)
            if rcvd is not None and rcvd.code == 1012:
                self._upstream_ended(1012, rcvd.reason or "map worker restarting")
            else:
                self._upstream_ended(1011, STREAM_LOST)

    def _upstream_ended(self, code: int, reason: str) -> None:
        if self.lost is None:
            self.lost = (code, reason)
        self.route.leave(self.outstanding)
        self.outstanding = 0
        self.drained.set()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().create_task(self.ws.close(code=code, reason=reason[:120]))

    async def _close_upstream(self) -> None:
        if self.up is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.drained.wait(), 60)
        up, self.up = self.up, None
        with contextlib.suppress(Exception):
            await up.close()
        if self.pump is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self.pump, 10)
            self.pump = None

    async def _finish(self) -> None:
        await self._close_upstream()
        if self.outstanding:
            self.route.leave(self.outstanding)
            self.outstanding = 0
        if self.lost is None and not self.client_gone:
            with contextlib.suppress(Exception):
                await self.ws.close()

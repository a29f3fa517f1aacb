"""A map worker: the ordinary map service (``mapper.api.create_app``: MapService, WAL, snapshots, writers,
queries) on its own data directory ``<root>/workers/w<index>``, served on an internal port of its node.

Ray runs it as an actor (``mapper.cluster.ray_cluster``); it is a plain class so that it can be read and
tested without Ray. Its HTTP server only accepts the cluster's internal token: users reach it through the
ingress. A worker that Ray restarts (``max_restarts``) runs ``__init__`` again with the same arguments and
so recovers its maps from their snapshots + WAL, exactly as ``mapper serve`` does after a crash.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from pathlib import Path

import torch

from .. import budget
from .._validation import resolve_device
from ..errors import InvalidArgument, NotFound
from ..map import Map
from ..persistence import load_snapshot_bytes

log = logging.getLogger("mapper.cluster.worker")

START_TIMEOUT_S = 300.0


def worker_dir(root: Path | str, index: int) -> Path:
    """The data directory of worker ``index`` under the shared root."""
    return Path(root) / "workers" / f"w{index}"


class MapWorker:
    """Hosts many maps. Methods are called by the ingress (through Ray); they are thread-safe and run
    their map-service work on the server's event loop.

    Args:
        index: the worker's number (0..N-1); fixes its data directory.
        root: the shared data root every worker can reach (``MAPPER_DATA_DIR`` of ``mapper serve --ray``).
        settings: ``Settings.model_dump(mode="json")`` of the service (limits, device, durability).
        token: the cluster's internal bearer token (the only one the worker's HTTP server accepts).
        memory_share: the fraction of its device's memory this worker may budget for maps (several
            workers on one GPU or host share it) when ``memory_budget_bytes`` is not set.
        host: address to bind (default: this node's IP as Ray sees it, else loopback).
    """

    def __init__(
        self,
        index: int,
        root: str,
        settings: dict,
        token: str,
        memory_share: float = 1.0,
        host: str | None = None,
    ):
        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        import uvicorn

        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        from ..api import create_app
        from ..settings import Settings

        self.index = index
        self.root = Path(root)
        self.host = host or _node_ip()
        values = {
            **settings,
            "data_dir": str(worker_dir(root, index)),
            "store_owner": f"w{index}",  # an object store (MAPPER_STORE): the maps this worker owns
            "host": self.host,
            "port": 0,
            "api_tokens": [token],
            "read_tokens": [],
            "metrics_token": None,
        }
        if not values.get("memory_budget_bytes"):
            device = resolve_device(values.get("device", "auto"))
            frac = 0.6 if device.type == "cuda" else 0.5
            values["memory_budget_bytes"] = max(
                1, int(frac * memory_share * budget.device_memory_bytes(device))
            )
        self.settings = Settings(**values)
        self.token = token
        self.app = create_app(self.settings)
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=0,
            log_level="warning",
            ws_max_size=self.settings.max_body_bytes,
            ws_per_message_deflate=self.settings.ws_compression,
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rates: collections.deque = collections.deque(maxlen=16)  # (time, frames integrated)
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name=f"worker-{index}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"map worker {index}: the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self._call(self.service.ready.wait(), START_TIMEOUT_S)  # maps recovered
        log.info("map worker %d on %s:%d (pid %d)", index, self.host, self.port, os.getpid())

    def _run(self) -> None:
        async def serve():
            self.loop = asyncio.get_running_loop()
            sampler = self.loop.create_task(self._sample())
            try:
                await self.server.serve()
            finally:
                sampler.cancel()

        asyncio.run(serve())

    async def _sample(self) -> None:
        """Frames integrated over time, for the frames/s of ``info``."""
        while True:
            try:
                self.rates.append((time.monotonic(), self._frames()))
            except Exception:  # a map being closed: skip this sample
                pass
            await asyncio.sleep(1.0)

    def _frames(self) -> int:
        svc = getattr(self.app.state, "service", None)
        return sum(e.map.frames_integrated for e in list(svc.maps.values())) if svc else 0

    @property
    def service(self):
        return self.app.state.service

    def _call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ------------------------------------------------------------------------------------ actor API
    def address(self) -> tuple[str, str]:
        """``(base URL, internal token)`` of the worker's HTTP server."""
        return f"http://{self.host}:{self.port}", self.token

    def map_ids(self) -> list[str]:
        return sorted(self.service.maps)

    def info(self) -> dict:
        """What ``GET /v1/cluster`` shows for this worker."""
        svc = self.service
        maps = list(svc.maps.values())
        fps = 0.0
        if len(self.rates) >= 2:
            (t0, n0), (t1, n1) = self.rates[0], self.rates[-1]
            fps = max(0.0, (n1 - n0) / (t1 - t0)) if t1 > t0 else 0.0
        return {
            "worker": self.index,
            "node": _node_id(),
            "host": self.host,
            "device": str(svc.device),
            "pid": os.getpid(),
            "maps": sorted(e.id for e in maps),
            "memory": {
                "maps_bytes": int(sum(e.bytes for e in maps)),
                "budget_bytes": int(svc.memory_budget),
                "rss_bytes": int(budget.rss_bytes()),
                "device_allocated_bytes": _device_allocated(svc.device),
            },
            "frames_per_s": round(fps, 3),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def detach(self, map_id: str) -> int | None:
        """Stop serving ``map_id`` and leave it whole on disk: queued frames finish, a snapshot is written
        (the WAL after it is empty, or replayed by the next owner), the WAL is closed. Returns the map's last
        sequence number (None when this worker does not serve it: already detached)."""
        return self._call(self._detach(map_id))

    async def _detach(self, map_id: str) -> int | None:
        svc = self.service
        e = svc.maps.get(map_id)
        if e is None:
            return None
        await e.close(snapshot=True)
        svc.maps.pop(map_id, None)
        svc.metrics.forget_map(map_id)
        svc.metrics.maps.set(len(svc.maps))
        return e.last_seq

    def attach(self, map_id: str, source: str | None = None) -> dict:
        """Serve ``map_id``: move its directory from ``source`` (another worker's map directory on the
        shared root; an atomic rename) into this worker's (in an object store: make this worker its owner),
        then recover it (snapshot + WAL tail) and start its writer. Idempotent: a map already served is
        left as it is. Returns its summary."""
        return self._call(self._attach(map_id, source))

    async def _attach(self, map_id: str, source: str | None) -> dict:
        svc = self.service
        if map_id not in svc.maps:
            await asyncio.to_thread(svc.data.claim, map_id, source)  # a rename, or the owner object
            entry = await asyncio.to_thread(svc._recover, map_id)
            svc.maps[map_id] = entry
            entry.start()
            svc.metrics.maps.set(len(svc.maps))
        return svc.maps[map_id].summary()

    def create_map(self, name: str, config: dict, memory_budget_bytes: int | None = None) -> dict:
        """Create a map from a complete ``Map.config()`` (as ``POST /v1/maps`` does after filling defaults):
        the ingress makes the shards of a sharded map with it (their config carries ``shard``, which the
        public create request does not take). Returns its summary."""

        async def create():
            e = await self.service.create(name, config, memory_budget_bytes)
            return e.summary()

        return self._call(create(), 300.0)

    def esdf_bounds(self, map_id: str) -> tuple[list[float], list[float]] | None:
        """The extent (x, y, z min / max, metres) of a map's ESDF, what its slice defaults to (None while it
        has no ESDF): the ingress takes the union over a sharded map's shards."""

        async def run():
            entry = self.service.maps.get(map_id)
            if entry is None:
                raise NotFound(f"map {map_id!r} not found")

            def bounds(m):
                try:
                    lo, hi = m.esdf_bounds()
                except InvalidArgument:  # no ESDF yet
                    return None
                return lo.tolist(), hi.tolist()

            return await entry.read(bounds, esdf=True)

        return self._call(run())

    def import_shard(self, name: str, snapshot: bytes, shard: dict) -> dict:
        """Serve a new map from one shard's snapshot file of a sharded export (``snapshot``: its bytes) with
        its ``shard`` entry replaced by ``shard`` (the new sharded map's id, name and this shard's index):
        the ingress imports sharded exports with it. The snapshot must be a shard with the same index and
        K. Returns its summary."""

        async def run():
            tensors, meta = await asyncio.to_thread(load_snapshot_bytes, snapshot)
            old = (meta.get("config") or {}).get("shard")
            if not isinstance(old, dict) or (old.get("index"), old.get("count")) != (
                shard["index"],
                shard["count"],
            ):
                i, k = shard["index"], shard["count"]
                raise InvalidArgument(f"import: shard{i}.safetensors is not shard {i} of {k}")
            meta = {**meta, "config": {**meta["config"], "shard": shard}}
            m = await asyncio.to_thread(Map.from_state_dict, tensors, meta, self.service.device)
            state = {key: meta[key] for key in ("config", "frames_integrated", "version") if key in meta}
            entry = await self.service._register(name, m, (tensors, state))
            return entry.summary()

        return self._call(run(), 300.0)

    def map_path(self, map_id: str) -> str:
        return str(self.service.data.map_dir(map_id).root)

    def stop(self) -> None:
        """Snapshot every map and stop the server (a graceful shutdown; Ray kills the process after)."""
        if self.loop is not None and self._thread.is_alive():
            self.server.should_exit = True
            self._thread.join(self.settings.shutdown_grace_s + 60)


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no Ray (tests of the plain class)
        pass
    return "127.0.0.1"


def _node_id() -> str | None:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return None


def _device_allocated(device) -> int | None:
    if device.type == "cuda" and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated(device))
    return None

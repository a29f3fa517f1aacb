"""The map registry and the per-map ingest pipelines (no HTTP here).

One way in for a frame: the route reads the message, ``MapEntry.prepare`` (in a thread, off the event loop
and off the writer) validates it once (``wire.parse_frame``), checks its pose against the map's range,
builds its WAL record and bounds its memory growth; ``MapEntry.submit`` queues it; the map's writer logs it
(``mapper.store`` formats, group commit) and applies it (``store.apply``: the one call that enters the map,
live and on replay).

Concurrency model:
* Each map has one **writer**: a single-thread executor that owns every mutation of the map (frames,
  clear, decay, ESDF updates, snapshot captures); on CUDA it runs on the map's own stream. An asyncio task
  feeds it batches from the map's bounded queue: take a **turn** (``FairTurns``: ``MAPPER_WRITER_SLOTS``
  writers at once, first come first served, so maps share the device round-robin, one batch each),
  append the records to the WAL and fsync them once (group commit) on the map's log thread while the
  writer integrates them (a LiDAR frame without a pose is tracked and integrated in one call, then logged
  with the pose used), update the ESDF once, wait for the fsync, **publish** a read view of the result
  (``Map.read_view``: copy-on-write, it shares the pages the next batches do not touch), give the turn
  back, then resolve the callers' futures (the acks). A WAL failure reloads the map from its directory
  (``MapEntry._wal_failed``): the live map never holds what its replay would not.
* **Reads never wait for writes.** Queries, slices, boxes, meshes and stats run on a shared thread pool on
  the last published view (``MapEntry.view``), with no lock: a read that starts during a batch answers
  for the version before it. Every read reports the ``map_version`` it read; versions of a map only grow,
  and an ack's ``map_version`` is published before the ack is sent (read-your-writes).
* The event loop only awaits: decoding, GPU/CPU work and file I/O run in threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from .. import budget, store, warmup, wire
from .._validation import check_translation, resolve_device
from ..errors import (
    Conflict,
    InsufficientStorage,
    InvalidArgument,
    MapperError,
    NotFound,
    OutOfDeviceMemory,
)
from ..map import Map
from ..map_io import check_state_meta
from ..persistence import MapDir, Snapshot, load_snapshot_bytes
from ..settings import Settings
from ..store import check_name, new_map_id, recover_map
from ..store_backends import open_store
from . import memory
from .errors import Busy, Unavailable
from .metrics import Metrics
from .schemas import MapCreate

log = logging.getLogger("mapper.service")


@dataclass
class Prepared:
    """A frame ready for a map's pipeline (``MapEntry.prepare``, off the event loop and off the writer):
    validated once by ``wire.parse_frame``, its pose inside the map's coordinate range, its WAL record
    built (None for a LiDAR frame without a pose: built once, after tracking) and its growth bound."""

    frame: wire.Frame
    record: bytes | None
    growth: budget.Growth | None


@dataclass
class Op:
    """One unit of work for a map's writer."""

    kind: str  # one of store.DURABLE_OPS
    args: Any  # a wire.Frame or the operation's dict
    record: bytes | None  # the WAL payload (None until a pose-less LiDAR frame is tracked and integrated)
    future: asyncio.Future
    t0: float = field(default_factory=time.perf_counter)
    seq: int = 0
    error: BaseException | None = None  # refused before logging (budget): never written to the WAL
    registration: dict | None = None  # ICP statistics of a frame whose pose the map estimated
    growth: Any = None  # mapper.budget.Growth computed before queueing (MapEntry.prepare), or None


_STOP = object()
SNAPSHOT_RETRY_MAX_S = 60.0  # a failed snapshot is retried after 1, 2, 4, ... s, then every this
STAGE_SAMPLE_S = 2.0  # CUDA: per-stage frame times are read (a device sync) once per this per map


class FairTurns:
    """The writers' turns (``MAPPER_WRITER_SLOTS`` at a time), handed out first come, first served: a
    writer takes a turn per batch, and a map that gives its turn back while another map waits queues
    behind it. Many maps share the device round-robin, one batch (at most ``MAPPER_MAX_BATCH`` operations)
    each: a flooded map delays another map's batch by at most one of its own per slot."""

    def __init__(self, slots: int):
        self.free = slots
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed over as we were cancelled: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # handed over directly: nobody can jump the queue
                return
        self.free += 1


class MapEntry:
    """A served map: the Map, its files, its writer and its lock."""

    def __init__(self, service: MapService, info: dict, m: Map, mdir: MapDir, last_seq: int, snap_seq: int):
        self.service = service
        self.settings = service.settings
        self.metrics = service.metrics
        self.info = info
        self.id: str = info["id"]
        self.name: str = info["name"]
        self.metrics.map_names[self.id] = self.name  # the `name` label of the map's series
        self.map = m  # the writer's map: only the writer thread touches it
        self.view: Map = _make_view(m)  # the last published version: what reads see (swapped per batch)
        # held by the writer while it integrates a batch (after the WAL fsync); holding it from elsewhere
        # pauses the writer there (tests use it to hold a batch open); reads never take it
        self.write_gate = threading.Lock()
        self.dir = mdir
        self.last_seq = last_seq
        self.snapshot_seq = snap_seq
        self.snapshot_version = m.version
        self.snapshot_time = time.monotonic()
        self.last_snapshot: Snapshot | None = None
        self.esdf_dirty = "esdf" in m.layers
        self.queue: asyncio.Queue = asyncio.Queue(self.settings.queue_depth)
        # the map's own CUDA stream: its batches' kernels do not queue behind another map's (None on CPU)
        self.stream = torch.cuda.Stream(m.device) if m.device.type == "cuda" else None
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"map-{self.id}",
            initializer=_writer_thread,
            initargs=(self.settings.writer_nice, self.stream),
        )
        self.wal = mdir.open_wal(last_seq + 1)
        # the map's log thread: the batch's fsync runs there while the writer integrates (group commit)
        self.log_executor = ThreadPoolExecutor(1, thread_name_prefix=f"wal-{self.id}")
        self.broken: str | None = None  # set when the WAL failed and the map could not be reloaded
        self._reserved = 0  # bytes of growth admitted in the writer's current batch
        self._applied = False  # the writer's current batch has entered the map
        self.wal_bytes_since_snapshot = 0
        self.snap_lock = asyncio.Lock()
        self.closed = False
        self.task: asyncio.Task | None = None
        self.stats_time = 0.0
        self.stage_time = -math.inf  # when the per-stage times of a frame were last read (CUDA: a sync)
        self.quarantined: list[dict] = []  # notes of what recovery kept aside (MapDir.quarantined)
        self.snapshot_error: str | None = None  # the last snapshot attempt failed (retried: snapshot_due)
        self.snapshot_retry_at = 0.0  # monotonic time of the next retry after a failed snapshot
        self.snapshot_fails = 0  # consecutive failed snapshot attempts (the retry's backoff)
        self.in_flight = 0  # operations queued or being processed whose future is not resolved yet
        self.budget: int = info.get("memory_budget_bytes") or service.map_budget
        self.bytes = m.nbytes  # refreshed by the writer after each batch (read by other maps' writers)
        self._cow_seen = self.cow_bytes()
        self.metrics.map_memory.labels(self.id).set(self.bytes)
        self.metrics.map_budget.labels(self.id).set(self.budget)
        if m.keep_radius_m is not None:
            self.metrics.keep_radius.labels(self.id).set(m.keep_radius_m)

    # ------------------------------------------------------------------------------ async interface
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"writer-{self.id}")

    def prepare(self, data: bytes | dict) -> Prepared:
        """Any thread but the event loop's and the writer's (the route's decode thread): a frame message
        (msgpack bytes or a decoded dict) -> a ``Prepared`` frame. The one validation of the frame
        (``wire.parse_frame``), the pose's range check against the map, that it adds something
        (``wire.check_usable``), the WAL record (posed frames) and
        the growth bound (``mapper.budget``, on the published view). Raises the library's errors (4xx)."""
        msg = wire.unpackb(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
        frame = wire.parse_frame(msg, self.service.limits)
        view = self.view
        if frame.T_world_sensor is not None:
            check_translation(
                "T_world_sensor",
                frame.T_world_sensor[:3, 3].tolist(),
                view.coordinate_limit_m,
                f"the map's coordinate range: 2^20 voxels of {view.voxel_size_m:g} m",
            )
        wire.check_usable(frame, view.max_range_m, view.coordinate_limit_m)  # 422: nothing to integrate
        if frame.T_world_sensor is None:
            return Prepared(frame, None, None)
        return Prepared(frame, store.encode_record("frame", frame), self.bound(frame))

    async def decode(self, data: bytes | dict) -> Prepared:
        """``prepare(data)`` on the service's decode threads (``MAPPER_DECODE_THREADS``)."""
        return await asyncio.get_running_loop().run_in_executor(self.service.decode_pool, self.prepare, data)

    def bound(self, frame) -> budget.Growth | None:
        """Any thread, before queueing: the growth bound of a posed frame (``mapper.budget``: it depends on
        the frame and the map's configuration only), so that the writer only compares it with the room left
        (``_admit``) instead of computing it between integrations. None for a LiDAR frame without a pose
        (bounded after tracking, on the writer) or when the bound fails (the writer reports it)."""
        if frame.T_world_sensor is None:
            return None
        try:
            used = sum(e.bytes for e in list(self.service.maps.values()))
            room = min(self.budget - self.bytes, self.service.memory_budget - used)
            if isinstance(frame, wire.LidarFrame):
                return budget.lidar_growth(self.view, frame.points, frame.T_world_sensor, room)
            return budget.depth_growth(self.view, frame.depth_m, frame.K, frame.T_world_sensor, room)
        except Exception:
            return None

    async def submit(self, frame: Prepared, *, wait: bool) -> asyncio.Future:
        """The one way in for a frame: queue it for the map's pipeline (WAL append + group fsync, then
        ``store.apply`` on the writer) and return the future of its ack. ``wait``: wait for room in the
        map's queue (WebSocket backpressure); else raise ``Busy`` (HTTP 429) when the queue is full."""
        return await self._queue(
            Op("frame", frame.frame, frame.record, self._future(), growth=frame.growth), wait
        )

    async def maintain(self, kind: str, args: dict) -> asyncio.Future:
        """Queue a maintenance operation (``clear``, ``decay``, ``clear_outside``), waiting for room."""
        if kind not in store.DURABLE_OPS or kind == "frame":
            raise InvalidArgument(f"op: unknown maintenance operation {kind!r}")
        return await self._queue(Op(kind, args, store.encode_record(kind, args), self._future()), True)

    def _future(self) -> asyncio.Future:
        if self.closed:
            raise NotFound(f"map {self.id!r} is being deleted or the service is stopping")
        if self.broken is not None:
            raise Unavailable(f"map {self.id!r}: {self.broken}; it serves reads until the service restarts")
        return asyncio.get_running_loop().create_future()

    async def _queue(self, op: Op, wait: bool) -> asyncio.Future:
        if wait:
            await self.queue.put(op)
        else:
            try:
                self.queue.put_nowait(op)
            except asyncio.QueueFull:
                raise Busy(
                    f"map {self.id!r}: queue full ({self.settings.queue_depth} operations); retry"
                ) from None
        self.in_flight += 1
        self.metrics.queue_depth.labels(self.id).set(self.queue.qsize())
        return op.future

    async def read(self, fn, *, exclusive: bool = False, esdf: bool = False, cost: int | None = None):
        """Run ``fn(view)`` on the query pool on the last published version of the map (a read-only
        ``Map.read_view``; ``view.version`` is the ``map_version`` it answers for). No lock: a batch being
        integrated meanwhile does not delay it. ``esdf``: the read needs the ESDF; with the lazy ESDF
        (``MAPPER_ESDF_UPDATE=lazy``) a stale one is brought up to date on the writer first (that read
        waits for the writer). ``exclusive`` is accepted for older callers and changes nothing. The read
        starts once its working memory (``cost`` bytes, default ``budget.READ_WORKING_BYTES``, plus the
        ESDF update it may run) fits the work budget (``mapper.api.memory.WorkBudget``)."""
        need = budget.READ_WORKING_BYTES if cost is None else cost
        view = self.view
        if esdf and "esdf" in view.layers and view.esdf_dirty:
            need += budget.esdf_update_bytes(view)
        async with self.service.work.hold(need):
            return await self._read(fn, esdf)

    async def _read(self, fn, esdf: bool):
        view = self.view
        if esdf and "esdf" in view.layers and view.esdf_dirty:  # (eager: only after a restart or a failure)
            await asyncio.get_running_loop().run_in_executor(
                self.executor, _no_oom(self._update_esdf_and_publish, f"map {self.id!r}: ESDF update")
            )
            view = self.view

        @_no_oom_deco(f"map {self.id!r}: query")
        def call():
            out = _run_on_view(fn, view)
            self.metrics.version_lag.labels(self.id).observe(max(0, self.view.version - view.version))
            return out

        return await asyncio.get_running_loop().run_in_executor(self.service.query_pool, call)

    async def call_writer(self, fn):
        """Run ``fn()`` on the map's writer thread (between batches)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = False
        while not stop:
            op = await self.queue.get()
            if op is _STOP:
                break
            t = time.perf_counter()
            await self.service.turns.acquire()  # round-robin between maps, one batch per turn
            self.metrics.turn_wait.labels(self.id).observe(time.perf_counter() - t)
            batch = [op]
            while len(batch) < self.settings.max_batch and not self.queue.empty():
                nxt = self.queue.get_nowait()
                if nxt is _STOP:
                    stop = True
                    break
                batch.append(nxt)
            self.metrics.queue_depth.labels(self.id).set(self.queue.qsize())
            try:
                async with self.service.work.hold(self._batch_work_bytes()):
                    results = await loop.run_in_executor(self.executor, self._process, batch)
            except BaseException as e:  # WAL failure: nothing of the batch was acknowledged
                log.exception("map %s: batch failed", self.id)
                results = [e] * len(batch)
                if isinstance(e, asyncio.CancelledError):
                    self.service.turns.release()
                    raise
            self.service.turns.release()
            for o, res in zip(batch, results, strict=True):
                if o.future.done():
                    continue
                if isinstance(res, BaseException):
                    o.future.set_exception(res)
                else:
                    o.future.set_result(res)
            self.in_flight -= len(batch)
        self.metrics.queue_depth.labels(self.id).set(0)

    def _batch_work_bytes(self) -> int:
        """Working memory of a writer batch: one frame's integration at a time (``READ_WORKING_BYTES``)
        plus the eager ESDF update after it (estimated from the last one)."""
        eager = "esdf" in self.map.layers and self.settings.esdf_update == "eager"
        return budget.READ_WORKING_BYTES + (budget.esdf_update_bytes(self.map) if eager else 0)

    # ------------------------------------------------------------------------------- writer thread
    def _process(self, batch: list[Op]) -> list:
        """Writer thread: one batch, in queue order. Group commit overlapped with integration:

        1. admit the posed frames (``_admit``: memory budgets; a refused frame is never logged);
        2. batch of posed operations only (the common case): append their records to the WAL and start the
           fsync on the map's log thread, then integrate them meanwhile (``_apply``, the map's writer);
           a batch with a LiDAR frame without a pose: each operation in order, the pose-less scan tracked
           and integrated in one call (``store.apply``; its estimate's range and budget checks, ``admit``,
           run before the tracker or a layer takes it in) and logged right after with the pose used; the
           fsync starts after the last one;
        3. update the ESDF once (eager), overlapping the fsync too;
        4. wait for the fsync, then publish the new version (readers never see a frame that is not
           durable) and return the acks.

        An ack still means the frame is in the fsync'd WAL. If appending or syncing fails, the live map may
        hold frames the log does not: ``_wal_failed`` drops the batch's records from the log (none was
        acknowledged) and reloads the map from its directory (snapshot + WAL, what a restart would build),
        so the live map never diverges from its replay; if that fails too, the map stops taking writes
        (``broken``, 503) and keeps serving its last published version."""
        self._admit(batch)
        seq0, size0 = self.last_seq, self.wal.size
        pose_less = any(_needs_pose(op) for op in batch)
        self._applied = False
        sync = None
        try:
            if not pose_less:
                self._log(batch)
                sync = self.log_executor.submit(self._sync, batch)
            with self.write_gate:
                results = []
                for op in batch:
                    if op.error is not None:
                        results.append(op.error)
                        continue
                    if pose_less and op.record is not None:
                        self._log([op])  # the log's order is the map's: after the scans before it
                    results.append(self._apply_one(op))
                    if pose_less and op.record is None and not isinstance(results[-1], BaseException):
                        op.record = store.encode_record("frame", op.args)  # with the pose used
                        self._log([op])
                        results[-1]["seq"] = op.seq
                if pose_less:
                    sync = self.log_executor.submit(self._sync, batch)
                if "esdf" in self.map.layers:
                    self.esdf_dirty = True
                    if self.settings.esdf_update == "eager":  # once per batch, before the acks
                        try:
                            self._update_esdf()
                        except Exception:  # the frames are in; the next update retries the region
                            log.exception("map %s: ESDF update failed", self.id)
                sync.result()  # durable: now the version may be published and the frames acknowledged
                self._publish()
        except BaseException as e:
            if sync is not None:
                with contextlib.suppress(BaseException):
                    sync.result()
            self._wal_failed(seq0, size0)
            if isinstance(e, Exception):
                raise Unavailable(
                    f"map {self.id!r}: the write-ahead log failed ({type(e).__name__}: {e}); nothing of this "
                    "batch was stored or acknowledged; retry"
                ) from e
            raise
        self.bytes = self.map.nbytes
        self.metrics.map_memory.labels(self.id).set(self.bytes)
        self.metrics.map_device_memory.labels(self.id, str(self.map.device)).set(self.bytes)
        now = time.monotonic()
        if now - self.stats_time > 2.0:
            self.stats_time = now
            self._refresh_stats()
        self.ack_ms = (time.perf_counter() - batch[-1].t0) * 1e3  # the viewer's "ack latency"
        return results

    def _log(self, ops: list[Op]) -> None:
        """Writer thread: append the records of ``ops`` (not refused) to the WAL under new seqs."""
        for op in ops:
            if op.error is not None or op.record is None:
                continue
            self.last_seq += 1
            op.seq = self.last_seq
            self.wal.append(op.seq, op.record)
            self.wal_bytes_since_snapshot += len(op.record)

    def _sync(self, batch: list[Op]) -> None:
        """The map's log thread: one fsync for the batch's records (group commit), while the writer
        integrates them."""
        t = time.perf_counter()
        self.wal.sync()
        self.metrics.wal_sync.observe(time.perf_counter() - t)
        self.metrics.group_commit.observe(sum(op.seq > 0 for op in batch))
        self.metrics.batch.observe(len(batch))

    def _wal_failed(self, seq0: int, size0: int) -> None:
        """Writer thread, after the WAL failed inside a batch (nothing of it was acknowledged): cut the
        batch's records off the log (its segment back to ``size0`` bytes, seqs back to ``seq0``), and if
        the batch entered the map, reload the map from its directory (snapshot + WAL: what a restart would
        build), so that the live map equals its replay. A failure here leaves the map ``broken``: it
        refuses writes (503) and serves its last published version until the service restarts."""
        log.error("map %s: WAL failed; dropping the batch's records and reloading the map", self.id)
        try:
            self.wal = self.wal.cut(size0, seq0 + 1)  # the batch's records off the log
            self.last_seq = seq0
            if self._applied:
                m, _, _, last, _ = recover_map(self.dir, self.map.device)
                if last != seq0:
                    raise RuntimeError(f"the reloaded log ends at seq {last}, not {seq0}")
                m.version = max(m.version, self.view.version)  # versions never go back
                self.map = m
                self.bytes = m.nbytes
                if "esdf" in m.layers and self.settings.esdf_update == "eager":
                    self._update_esdf()
                self._publish()
                self.metrics.map_reloads.labels(self.id).inc()
        except Exception as e:
            self.broken = f"the write-ahead log failed and the map could not be reloaded ({e})"
            log.exception("map %s: %s; writes are refused until a restart", self.id, self.broken)

    def _admit(self, batch: list[Op]) -> None:
        """Writer thread, before logging: refuse (``InsufficientStorage``, HTTP 507) every posed frame whose
        projected growth (``mapper.budget``: an upper bound on the bricks its rays can allocate in each
        layer and on the ESDF domain and update it can cause) would take the map past its budget or all
        maps past the process budget. A refused frame is never written to the log, so it cannot reach
        replay; the map is untouched. A LiDAR frame without a pose is checked the same way once tracked
        (``_admit_frame`` as ``Map.integrate_lidar``'s ``admit``), before it changes a layer."""
        self._reserved = 0  # bytes admitted in this batch so far
        for op in batch:
            if op.error is None and op.kind == "frame" and op.args.T_world_sensor is not None:
                try:
                    self._admit_frame(op.args, op.args.T_world_sensor, op.growth)
                except MapperError as e:
                    op.error = e

    def _admit_frame(self, f, T_world_sensor, g: budget.Growth | None = None) -> None:
        """Reserve the growth bound of frame ``f`` at pose ``T_world_sensor`` in this batch, or raise
        ``InsufficientStorage``. ``g``: the bound computed before queueing (``bound``), recomputed here
        (on the writer's map, the finer bound) when it is None or does not fit."""
        others = sum(e.bytes for e in list(self.service.maps.values()) if e is not self)
        reserved = self._reserved
        room = min(self.budget - self.bytes, self.service.memory_budget - others - self.bytes) - reserved
        if g is None or g.bytes + g.transient > room:
            if isinstance(f, wire.LidarFrame):
                g = budget.lidar_growth(self.map, f.points, T_world_sensor, room)
            else:
                g = budget.depth_growth(self.map, f.depth_m, f.K, T_world_sensor, room)
        need = self.bytes + reserved + g.bytes + g.transient
        which = None
        if need > self.budget:
            which, limit, used = "map", self.budget, self.bytes + reserved
        elif others + need > self.service.memory_budget:
            which, limit, used = "process", self.service.memory_budget, others + self.bytes + reserved
        if which is None:
            self._reserved += g.bytes
            return
        self.metrics.budget_refusals.labels(self.id, which).inc()
        name = "the map's memory budget" if which == "map" else "the memory budget of all maps"
        raise InsufficientStorage(
            f"frame refused: it could add {g.describe()} to {budget.fmt_bytes(used)} in use, over "
            f"{name} of {limit} bytes ({budget.fmt_bytes(limit)}); the map is unchanged"
            + (" (memory_budget_bytes)" if which == "map" else " (MAPPER_MEMORY_BUDGET_BYTES)")
        )

    def _apply_one(self, op: Op):
        """``_apply(op)`` with its failure as the op's result (the batch goes on)."""
        self._applied = True
        try:
            res = self._apply(op)
            res["map_version"] = self.map.version
            return res
        except MapperError as e:
            return e
        except torch.OutOfMemoryError:
            log.warning("map %s: op %d (%s) ran out of device memory", self.id, op.seq, op.kind)
            _release_cached()
            return OutOfDeviceMemory(
                f"map {self.id!r}: out of device memory integrating op {op.seq}; the map keeps "
                "serving its earlier state (the frame may be partly integrated); retry later"
            )
        except Exception as e:  # a library bug: keep serving, report it as an internal error
            log.exception("map %s: op %d (%s) failed", self.id, op.seq, op.kind)
            return e

    def _apply(self, op: Op) -> dict:
        """Writer thread: ``store.apply`` (the one way into the map) and the frame's ack. A LiDAR frame
        without a pose is tracked and integrated in that one call; its frame gets the pose used."""
        t = time.perf_counter()
        f = op.args
        admit = None
        if _needs_pose(op):
            admit = lambda T: self._admit_frame(f, T)  # noqa: E731  (the budget, once the pose is known)
        res = store.apply(self.map, op.kind, f, admit=admit)
        dt = time.perf_counter() - t
        if op.kind != "frame":
            return {"seq": op.seq, **_jsonable(res)}
        if admit is not None:  # logged with the pose used: replay integrates it there, tracking as now
            f.T_world_sensor = res["T_world_sensor"].numpy().copy()
            f.pose_estimated = True
            op.registration = res.get("registration")
        self._stage_metrics()
        self.metrics.integrate.labels(f.kind).observe(dt)
        self.metrics.frames.labels(self.id, f.kind).inc()
        self.metrics.points.labels(self.id, "used").inc(res["points_used"])
        self.metrics.points.labels(self.id, "dropped").inc(res["points_dropped"])
        self.metrics.frame_done(self.id, op.registration)
        if res.get("bricks_cleared"):
            self.metrics.radius_cleared.labels(self.id).inc(res["bricks_cleared"])
        ack = {
            "seq": op.seq,
            "map_version": 0,
            "points_used": int(res["points_used"]),
            "points_dropped": int(res["points_dropped"]),
            "integrate_ms": dt * 1e3,
        }
        if f.frame_id is not None:
            ack["frame_id"] = f.frame_id
        if "T_world_sensor" in res:  # LiDAR: the pose used, 16 numbers row-major
            ack["T_world_sensor"] = [float(x) for x in res["T_world_sensor"].reshape(-1).tolist()]
        if op.registration is not None:
            ack["registration"] = _jsonable(op.registration)
        return ack

    def _stage_metrics(self) -> None:
        """Per-stage times of the frame just integrated, into ``mapper_stage_seconds``. On CUDA reading them
        synchronises the whole device (``Map.timings_ms``: every map's stream and every read's), so there
        they are sampled: one frame per ``STAGE_SAMPLE_S`` per map; on the CPU every frame."""
        now = time.monotonic()
        if self.map.device.type == "cuda" and now - self.stage_time < STAGE_SAMPLE_S:
            return
        self.stage_time = now
        for stage, ms in self.map.timings_ms().items():
            self.metrics.stage.labels(stage).observe(ms / 1e3)

    def _update_esdf(self) -> None:
        t = time.perf_counter()
        self.map.update_esdf()
        self.metrics.stage.labels("esdf").observe(time.perf_counter() - t)
        self.esdf_dirty = False

    def _update_esdf_and_publish(self) -> None:
        if self.esdf_dirty or self.map.esdf_dirty:
            self._update_esdf()
            self._publish()

    def _publish(self) -> None:
        """Writer thread: make the map as it is now the version every new read sees (one reference swap;
        the previous view lives on while a reader holds it, then its private pages are freed)."""
        t = time.perf_counter()
        before = self.cow_bytes()
        view = _make_view(self.map)
        if view.version < self.view.version:  # cannot happen: versions only grow; never publish backwards
            raise RuntimeError(f"map {self.id!r}: version {view.version} after {self.view.version}")
        self.view = view
        self.metrics.publish.observe(time.perf_counter() - t)
        self.metrics.map_version.labels(self.id).set(view.version)
        # pages copied since the previous publish (by this batch's writes): the price of the versions
        self.metrics.cow_bytes.labels(self.id).inc(max(0, before - self._cow_seen))  # (a pool may be new)
        self._cow_seen = before

    def cow_bytes(self) -> int:
        """Bytes copied so far by the map's copy-on-write pools (the cost of keeping published views)."""
        return sum(la.pool.cow_bytes for la in _layers_of(self.map))

    def _refresh_stats(self) -> None:
        try:
            s = self.map.stats()
            self.metrics.set_layer_stats(self.id, s)
        except Exception:  # metrics must never break ingest
            log.exception("map %s: stats failed", self.id)

    def _capture(self, force: bool = False):
        """Writer thread: the map's state and the WAL position it covers; rotates the WAL."""
        unchanged = self.last_seq == self.snapshot_seq and self.map.version == self.snapshot_version
        if unchanged and not force:
            return None
        tensors, meta = self.map.state_dict()
        seq = self.last_seq
        self.wal.close()
        self.wal = self.dir.open_wal(seq + 1)
        self.wal_bytes_since_snapshot = 0
        return seq, tensors, {**meta, "info": self.info}, self.map.version

    # ----------------------------------------------------------------------------------- snapshots
    async def snapshot(self, force: bool = False) -> Snapshot | None:
        """Write a snapshot if the map changed since the last one (or ``force``); returns the newest."""
        async with self.snap_lock:
            if not force and self.last_snapshot is None:
                force = True  # a map never snapshotted yet (export of a new map)
            cap = await self.call_writer(lambda: self._capture(force))
            if cap is None:
                return self.last_snapshot
            seq, tensors, meta, version = cap
            t = time.perf_counter()
            try:
                snap = await asyncio.to_thread(self.dir.write_snapshot, seq, tensors, meta)
            except Exception as e:
                self._snapshot_failed(e)
                raise
            if self.snapshot_error is not None:
                log.warning(
                    "map %s: snapshot written again (at seq %d) after %d failures",
                    self.id,
                    seq,
                    self.snapshot_fails,
                )
            self.snapshot_error, self.snapshot_fails = None, 0
            self.metrics.map_failed.labels(self.id, "snapshot").set(0)
            try:  # the log is kept from the previous snapshot on; a failed prune is retried next time
                await asyncio.to_thread(self.dir.prune, seq, self.settings.snapshots_kept)
            except Exception as e:
                log.warning(
                    "map %s: pruning after snapshot %d failed (%s: %s)", self.id, seq, type(e).__name__, e
                )
            self.metrics.snapshot.observe(time.perf_counter() - t)
            self.snapshot_seq, self.snapshot_version = seq, version
            self.snapshot_time = time.monotonic()
            self.last_snapshot = snap
            log.info("map %s: snapshot at seq %d (%d bytes)", self.id, seq, snap.path.stat().st_size)
            return snap

    def _snapshot_failed(self, e: BaseException) -> None:
        """A snapshot write failed: the map keeps serving (the WAL since the last snapshot still holds every
        record); marked (``snapshot_error``: ``/readyz`` ``"degraded"``, ``mapper_map_failed{stage=
        "snapshot"}``), one log line, and retried by the snapshot loop (backoff 1 s doubling to 60 s)."""
        self.snapshot_error = f"snapshot failed: {type(e).__name__}: {e}"[:500]
        self.snapshot_fails += 1
        self.snapshot_retry_at = time.monotonic() + min(
            SNAPSHOT_RETRY_MAX_S, 2.0 ** (self.snapshot_fails - 1)
        )
        self.metrics.snapshot_failures.labels(self.id).inc()
        self.metrics.map_failed.labels(self.id, "snapshot").set(1)
        log.error(
            "map %s: %s (attempt %d; the WAL keeps every record; retried)",
            self.id,
            self.snapshot_error,
            self.snapshot_fails,
        )

    def snapshot_due(self) -> bool:
        s = self.settings
        if self.snapshot_error is not None:  # a failed snapshot is retried, whatever the interval
            return time.monotonic() >= self.snapshot_retry_at
        changed = self.last_seq != self.snapshot_seq
        if not changed:
            return False
        if self.wal_bytes_since_snapshot >= s.snapshot_wal_bytes:
            return True
        return s.snapshot_interval_s > 0 and time.monotonic() - self.snapshot_time >= s.snapshot_interval_s

    async def close(self, snapshot: bool = True) -> None:
        """Finish queued work, snapshot (optionally), close the WAL and the writer."""
        self.closed = True
        if self.task is not None and not self.task.done():
            await self.queue.put(_STOP)
            await self.task
        if snapshot:
            try:
                await self.snapshot()
            except Exception:
                log.exception("map %s: final snapshot failed (the WAL still covers it)", self.id)
        await self.call_writer(self.wal.close)
        self.executor.shutdown(wait=True)
        self.log_executor.shutdown(wait=True)

    # ------------------------------------------------------------------------------------- views
    def summary(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "created": self.info.get("created"),
            "config": self.info["config"],
            "frames_integrated": self.view.frames_integrated,
            "version": self.view.version,
            "last_seq": self.last_seq,
            "queue_depth": self.queue.qsize(),
            "memory_bytes": self.bytes,
            "memory_budget_bytes": self.budget,
        }


def _needs_pose(op: Op) -> bool:
    return op.kind == "frame" and isinstance(op.args, wire.LidarFrame) and op.args.T_world_sensor is None


def _make_view(m: Map) -> Map:
    """``m.read_view()``; on CUDA with an event recorded after the writer's work so far, which readers on
    their own streams wait for (on the device, no host sync)."""
    view = m.read_view()
    if m.device.type == "cuda":
        view._published = torch.cuda.Event()
        view._published.record()
    return view


_reader = threading.local()


def _run_on_view(fn, view: Map):
    """Run ``fn(view)`` in a query-pool thread. On CUDA on the thread's own stream, after the view's publish
    event, so that a read's kernels do not queue behind the writer's on the default stream; the stream is
    synchronised before the view (and what it allocated) is let go."""
    ev = getattr(view, "_published", None)
    if ev is None:
        return fn(view)
    streams = _reader.__dict__.setdefault("streams", {})  # this thread's stream per device
    stream = streams.get(view.device)
    if stream is None:
        stream = streams[view.device] = torch.cuda.Stream(view.device)
    stream.wait_event(ev)
    try:
        with torch.cuda.stream(stream):
            return fn(view)
    finally:
        stream.synchronize()


def _writer_thread(nice: int, stream) -> None:
    """Initializer of a map's writer thread: its priority (``_lower_priority``) and, on CUDA, the map's
    stream as the thread's current stream (every kernel of the map's batches, ESDF updates and snapshot
    captures runs on it), after the work queued so far on the default stream (the map was built there)."""
    _lower_priority(nice)
    if stream is not None:
        stream.wait_stream(torch.cuda.default_stream(stream.device))
        torch.cuda.set_stream(stream)


def _lower_priority(nice: int) -> None:
    """Writer threads: run ``nice`` steps below the rest of the process (Linux: per thread), so that reads
    get the cores first when they are short; integration takes what is left (its queue absorbs it)."""
    if nice > 0 and hasattr(os, "setpriority") and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(
                os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice
            )


def _layers_of(m: Map):
    """The brick layers of a map (its pools), the ESDF's included."""
    return [la for _, la in m.brick_layers()]


def _release_cached() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _no_oom_deco(what: str):
    """Decorator: ``torch.OutOfMemoryError`` -> ``OutOfDeviceMemory`` (HTTP 503; the map is only read)."""

    def wrap(fn):
        return _no_oom(fn, what)

    return wrap


def _no_oom(fn, what: str):
    def call(*args, **kw):
        try:
            return fn(*args, **kw)
        except torch.OutOfMemoryError:
            log.warning("%s ran out of device memory", what)
            _release_cached()
            raise OutOfDeviceMemory(
                f"{what}: out of device memory; the map is unchanged; retry later"
            ) from None

    return call


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def check_snapshot_meta(meta: dict) -> str | None:
    """The metadata of an imported snapshot, checked like a create request: the config through
    ``MapCreate`` (types, ranges, layers), every other field's range (``map_io.check_state_meta``:
    version, frames_integrated, wal_seq, trajectory_start, tracking, info.memory_budget_bytes), the stored
    name (if any) through ``check_name``. Returns the stored name. Raises ``InvalidArgument`` naming the
    field."""
    config = meta.get("config")
    try:
        MapCreate.model_validate({**config, "name": None} if isinstance(config, dict) else config)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise InvalidArgument(f"snapshot: config.{loc}: {first.get('msg')}") from None
    if not isinstance(config.get("voxel_size_m"), (int, float)) or not config.get("layers"):
        raise InvalidArgument("snapshot: config needs voxel_size_m and layers")
    check_state_meta(meta)  # version, frames_integrated, wal_seq, trajectory_start, ... in range
    info = meta.get("info")
    if info is None:
        return None
    if not isinstance(info, dict):
        raise InvalidArgument("snapshot: info is not an object")
    name = info.get("name")
    return None if name is None else check_name(name, "snapshot: info.name")


class MapService:
    """All maps of one data directory; created and closed by the app's lifespan."""

    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.device = self._device(settings.device)
        self.data = open_store(settings)  # DataDir (the default) or an object store (MAPPER_STORE)
        self.limits = wire.Limits(
            settings.max_points_per_frame,
            settings.max_image_pixels,
            settings.max_query_points,
            settings.max_pose_translation_m,
        )
        # memory bounds (README "Limits and memory budgets"): unset settings are sized to the machine
        frac = 0.6 if self.device.type == "cuda" else 0.5
        self.memory_budget = settings.memory_budget_bytes or int(
            frac * budget.device_memory_bytes(self.device)
        )
        self.map_budget = settings.map_memory_budget_bytes or self.memory_budget
        self.request_bytes = settings.max_request_bytes or max(64 << 20, budget.total_memory_bytes() // 32)
        metrics.memory_budget.set(self.memory_budget)
        self.maps: dict[str, MapEntry] = {}
        memory.limit_arenas(settings.malloc_arena_max)  # before the service's threads start
        memory.set_mmap_threshold(settings.malloc_mmap_threshold)
        self.work = memory.WorkBudget(
            settings.work_memory_bytes or budget.device_memory_bytes(self.device) // 8
        )
        metrics.registry.register(memory.MemoryCollector(self.work))
        self.query_pool = ThreadPoolExecutor(settings.query_threads, thread_name_prefix="query")
        self.turns = FairTurns(writer_slots(settings.writer_slots, self.device))
        decoders = settings.decode_threads or max(2, min(8, (os.cpu_count() or 2) // 2))
        self.decode_pool = ThreadPoolExecutor(decoders, thread_name_prefix="decode")
        self.ready = asyncio.Event()
        self.stopping = False
        self.draining = asyncio.Event()  # set by drain(): WebSocket streams stop reading, ack and close
        self.streams = 0  # open WebSocket streams (they register themselves)
        self.failed: dict[str, str] = {}
        self._names_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    @staticmethod
    def _device(spec: str) -> torch.device:
        return resolve_device(spec)

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._own_triton_cache = not os.environ.get("TRITON_CACHE_DIR")
        triton_cache_dir(self.settings.data_dir)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._recover_all(), name="recover"))
        self._tasks.append(loop.create_task(self._snapshot_loop(), name="snapshots"))
        if self.settings.malloc_trim_s > 0 and memory.available():
            self._tasks.append(loop.create_task(self._trim_loop(), name="malloc-trim"))

    async def drain(self, grace_s: float) -> bool:
        """The first step of a graceful shutdown (SIGTERM): take no new work and finish the work taken.
        New requests and streams get 503; every open stream stops reading, sends the acks of the frames it
        took and closes (1012); queued operations finish. Returns True when no stream is open and nothing
        is in flight, False when ``grace_s`` ran out first."""
        self.stopping = True
        self.draining.set()
        deadline = time.monotonic() + grace_s
        while self.streams or any(e.in_flight for e in self.maps.values()):
            if time.monotonic() >= deadline:
                log.warning(
                    "shutdown: %.0f s grace over with %d streams open and %d operations in flight",
                    grace_s,
                    self.streams,
                    sum(e.in_flight for e in self.maps.values()),
                )
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self) -> None:
        self.stopping = True
        self.draining.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for e in list(self.maps.values()):
            try:
                await e.close(snapshot=True)
            except Exception:
                log.exception("map %s: close failed", e.id)
        self.maps.clear()
        self.query_pool.shutdown(wait=True)
        self.decode_pool.shutdown(wait=True)
        if getattr(self, "_own_triton_cache", False):  # leave the environment as it was (tests, embedding)
            os.environ.pop("TRITON_CACHE_DIR", None)

    async def _recover_all(self) -> None:
        """Recover every map on its own: a map that fails (``RecoveryError``, an unreadable directory, ...)
        is left on disk, listed in ``failed`` (``/readyz``), ``mapper_map_failed{stage="recovery"}`` and one
        log line; the others are served. A failing post-recovery snapshot only marks its map (served; the
        snapshot is retried). The service becomes ready whatever happens here."""
        try:
            ids = await self._list_maps()
            for map_id in ids:
                try:
                    entry = await asyncio.to_thread(self._recover, map_id)
                except Exception as e:
                    reason = f"{type(e).__name__}: {e}"[:1000]
                    log.error(
                        "map %s: recovery failed; left on disk untouched and not served: %s", map_id, reason
                    )
                    log.debug("map %s: recovery failure", map_id, exc_info=True)
                    self.failed[map_id] = reason
                    self.metrics.map_failed.labels(map_id, "recovery").set(1)
                    continue
                self.maps[map_id] = entry
                entry.start()
                if entry.last_seq != entry.snapshot_seq:
                    with contextlib.suppress(Exception):  # marked, logged and retried by the snapshot loop
                        await entry.snapshot()
            self.metrics.maps.set(len(self.maps))
            await self._warm_up()
        except Exception:
            log.exception("recovery stopped early; serving the %d maps recovered so far", len(self.maps))
        finally:
            self.ready.set()
        log.info("recovered %d maps (%d failed) from %s", len(self.maps), len(self.failed), self.data.root)

    async def _list_maps(self) -> list[str]:
        """The store's map ids; while the store cannot be listed (unreachable, permissions) the service is
        not ready and retries (1 s doubling to 30 s), one log line per attempt."""
        attempt = 0
        while True:
            try:
                return await asyncio.to_thread(self.data.map_ids)
            except Exception as e:
                log.error("listing the maps of %s failed (%s); retrying", self.data.root, e)
                await asyncio.sleep(min(30.0, 2.0**attempt))
                attempt += 1

    async def _warm_up(self) -> None:
        """Compile the kernels of the default map configuration (restored maps compiled theirs when they
        were built) before the service reports ready (``MAPPER_WARMUP``; skipped where no Triton runs)."""
        if not self.settings.warmup or not warmup.needed(self.device):
            return
        s = self.settings
        config = {
            "voxel_size_m": s.default_voxel_size_m,
            "layers": s.default_layers,
            "max_range_m": s.default_max_range_m,
        }
        try:
            cfg = Map(**config, device="cpu", warmup=False).config()  # the full config, as a new map has it
        except Exception:
            log.exception("warm-up: the default map configuration is invalid")
            return
        dt = await asyncio.to_thread(warmup.warm_up, cfg, self.device)
        log.info("warm-up: %.2f s", dt)

    def _recover(self, map_id: str) -> MapEntry:
        mdir = self.data.map_dir(map_id)
        quarantined: list = []
        damage: list = []
        m, info, snap, last, replayed = recover_map(mdir, self.device, quarantined, damage)
        entry = MapEntry(self, info, m, mdir, last, snap.seq if snap else 0)  # registers the map's name
        if quarantined:
            self.metrics.quarantined.labels(map_id).inc(len(quarantined))
        for note in damage:
            self.metrics.storage_damage.labels(map_id, note["kind"]).inc()
        entry.quarantined = mdir.quarantined()
        entry.last_snapshot = snap
        entry.snapshot_version = m.version if (snap is not None and replayed == 0) else -1
        return entry

    async def _snapshot_loop(self) -> None:
        period = min(max(self.settings.snapshot_interval_s / 4, 0.5), 10.0)
        while True:
            await asyncio.sleep(period)
            for e in list(self.maps.values()):
                if e.closed or not e.snapshot_due():
                    continue
                with contextlib.suppress(Exception):  # logged, marked and retried (MapEntry._snapshot_failed)
                    await e.snapshot()
            e = None  # not across the sleep: a deleted map would stay alive (its GPU memory) until then

    def degraded(self) -> dict[str, str]:
        """Served maps whose last snapshot attempt failed (id -> reason); retried by the snapshot loop."""
        return {e.id: e.snapshot_error for e in list(self.maps.values()) if e.snapshot_error is not None}

    def quarantine_report(self, per_map: int = 10) -> dict[str, dict]:
        """Maps with quarantined WAL records: ``{id: {"count", "records": the newest per_map notes}}``."""
        out = {}
        for e in list(self.maps.values()):
            if e.quarantined:
                out[e.id] = {"count": len(e.quarantined), "records": e.quarantined[-per_map:]}
        return out

    async def _trim_loop(self) -> None:
        """Return freed heap pages to the OS now and then (see ``mapper.api.memory``)."""
        while True:
            await asyncio.sleep(self.settings.malloc_trim_s)
            await asyncio.to_thread(memory.trim)

    # ----------------------------------------------------------------------------------------- maps
    def check_ready(self) -> None:
        if self.stopping:
            raise Unavailable("the service is stopping")
        if not self.ready.is_set():
            raise Unavailable("the service is restoring maps; retry shortly")

    def get(self, map_id: str) -> MapEntry:
        self.check_ready()
        e = self.maps.get(map_id)
        if e is None or e.closed:
            raise NotFound(f"map {map_id!r} not found")
        return e

    def list(self) -> list[MapEntry]:
        self.check_ready()
        return sorted(self.maps.values(), key=lambda e: e.info.get("created", ""))

    async def create(
        self, name: str | None, config: dict, memory_budget_bytes: int | None = None
    ) -> MapEntry:
        """A new empty map; ``memory_budget_bytes`` (default ``map_budget``) is stored in its info.json.
        Refused (``RequestTooLarge``, 413) when one surface brick's ESDF would exceed that budget."""
        self.check_ready()
        m = await asyncio.to_thread(Map, **config, device=self.device)  # validates the config
        if "esdf" in m.layers:
            budget.check_esdf_reach(
                m.voxel_size_m, m.esdf_max_distance_m, memory_budget_bytes or self.map_budget
            )
        extra = {"memory_budget_bytes": memory_budget_bytes} if memory_budget_bytes else {}
        return await self._register(name, m, None, extra)

    async def _register(
        self, name: str | None, m: Map, snapshot: tuple | None, extra: dict | None = None
    ) -> MapEntry:
        """Store and serve a new map. All or nothing: the snapshot (if any) is written before ``info.json``
        (which makes the directory a map) and a failure removes the directory again."""
        if name is not None:
            check_name(name)
        if snapshot is not None:  # an imported map arrives whole: it must fit the budgets as it is
            others = sum(e.bytes for e in self.maps.values())
            own = (extra or {}).get("memory_budget_bytes") or self.map_budget
            need, limit = m.nbytes, min(own, self.memory_budget - others)
            if need > limit:
                raise InsufficientStorage(
                    f"import: the map holds {need} bytes ({budget.fmt_bytes(need)}); {limit} bytes are left "
                    f"in the memory budgets (the map's: {own} bytes, its info.memory_budget_bytes or "
                    f"MAPPER_MAP_MEMORY_BUDGET_BYTES={self.map_budget}; "
                    f"MAPPER_MEMORY_BUDGET_BYTES={self.memory_budget})"
                )
        async with self._names_lock:
            if len(self.maps) >= self.settings.max_maps:
                raise Conflict(f"map limit reached ({self.settings.max_maps} maps; MAPPER_MAX_MAPS)")
            map_id = new_map_id()
            name = name or map_id
            if any(e.name == name for e in self.maps.values()):
                raise Conflict(f"name: a map named {name!r} exists")
            info = {
                "id": map_id,
                "name": name,
                "created": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "config": m.config(),
                **(extra or {}),
            }
            mdir = self.data.map_dir(map_id)
            try:
                snap = None
                if snapshot is not None:
                    tensors, meta = snapshot
                    await asyncio.to_thread(mdir.root.mkdir, parents=True, exist_ok=True)
                    snap = await asyncio.to_thread(mdir.write_snapshot, 0, tensors, {**meta, "info": info})
                await asyncio.to_thread(mdir.write_info, info)
                entry = MapEntry(self, info, m, mdir, 0, 0)
            except BaseException:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(mdir.remove)
                raise
            entry.last_snapshot = snap
            self.maps[map_id] = entry
            entry.start()
            self.metrics.maps.set(len(self.maps))
            return entry

    async def import_map(self, data: bytes, name: str | None) -> MapEntry:
        """A map from an exported snapshot file. Its metadata is checked like a create request (stored
        name, config) before anything is written; a refused import leaves nothing behind."""
        self.check_ready()

        def load():
            tensors, meta = load_snapshot_bytes(data)
            stored = check_snapshot_meta(meta)
            try:
                m = Map.from_state_dict(tensors, meta, device=self.device)
            except MapperError:
                raise
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise InvalidArgument(
                    f"snapshot: does not describe a map ({type(e).__name__}: {e})"
                ) from None
            return m, tensors, meta, stored

        m, tensors, meta, stored = await asyncio.to_thread(load)
        if name is None:
            name = stored
            if name is not None and any(e.name == name for e in self.maps.values()):
                name = None
        keys = ("config", "frames_integrated", "version", "trajectory_start", "tracking")
        state_meta = {k: meta[k] for k in keys if k in meta}
        extra = {"imported": True}  # snapshot 0 is its base: recovery never rebuilds it empty
        stored_info = meta.get("info") if isinstance(meta.get("info"), dict) else {}
        if stored_info.get("memory_budget_bytes") is not None:  # range-checked by check_state_meta
            extra["memory_budget_bytes"] = stored_info["memory_budget_bytes"]
        return await self._register(name, m, (tensors, state_meta), extra)

    async def delete(self, map_id: str) -> None:
        e = self.get(map_id)
        e.closed = True
        self.maps.pop(map_id, None)
        try:
            if e.task is not None:
                await e.queue.put(_STOP)
                await e.task
            await e.call_writer(e.wal.close)
            e.executor.shutdown(wait=True)
            e.log_executor.shutdown(wait=True)
        finally:
            await asyncio.to_thread(e.dir.remove)
            self.metrics.forget_map(map_id)
            self.metrics.maps.set(len(self.maps))


def writer_slots(setting: int, device: torch.device) -> int:
    """``MAPPER_WRITER_SLOTS``, 0 resolved: 2 on a GPU, half the cores (at least 1) on the CPU."""
    if setting > 0:
        return setting
    return 2 if device.type == "cuda" else max(1, (os.cpu_count() or 2) // 2)


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def triton_cache_dir(data_dir) -> str:
    """Point Triton's kernel cache at ``<data_dir>/triton-cache`` (created) unless ``TRITON_CACHE_DIR``
    is set already; returns the directory in use. Compiled kernels then survive a restart."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        path = Path(data_dir).resolve() / "triton-cache"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(path)
    return os.environ["TRITON_CACHE_DIR"]


def data_dir_free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize

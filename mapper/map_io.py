"""A map as (CPU tensors, JSON metadata) and back: what snapshots (:mod:`mapper.persistence`) store.

Stored: every stored layer's bricks and fields (compacted, ``BrickLayer.state_tensors`` under the layer's
kind), the LiDAR tracking state, the trajectory, the frame count and version, and ``Map.config()``. The
ESDF is not stored: it is a pure function of the surface, recomputed on the first ``update_esdf`` after
loading (every loaded brick is queued for it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .errors import InvalidArgument, InvalidArgumentType
from .persistence import FORMAT_VERSION

if TYPE_CHECKING:
    from .map import Map


def state_dict(m: Map) -> tuple[dict[str, torch.Tensor], dict]:
    """(CPU tensors, JSON metadata) of the whole map ``m``."""
    tensors = {}
    for layer, _ in m._stores:
        tensors.update(layer.state_tensors(layer.kind))
    meta = {"config": m.config(), "frames_integrated": m.frames_integrated, "version": m.version}
    # LiDAR tracking: the odometry (local map, poses, threshold) or the last posed scan that seeds it
    tracking, tracking_meta = m._tracker.state_dict("tracking.")
    tensors.update(tracking)
    if tracking_meta is not None:
        meta["tracking"] = tracking_meta
    trajectory, start = m._trajectory.state_tensors()
    if start is not None:
        tensors.update(trajectory)
        meta["trajectory_start"] = start
    return {k: t.detach().cpu() for k, t in tensors.items()}, meta


MAX_COUNT = 1 << 53  # counters and sequence numbers (exact in JSON and float64; int64 tensors hold them)
MAX_BUDGET_BYTES = 1 << 50  # a map's memory budget, as POST /v1/maps takes it


def _count(name: str, x, hi: int = MAX_COUNT) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidArgumentType(f"snapshot: {name}: expected an integer, got {type(x).__name__}")
    if not 0 <= x <= hi:
        raise InvalidArgument(f"snapshot: {name}: expected an integer in [0, {hi}], got {str(x)[:40]}")
    return x


def check_state_meta(meta: dict) -> dict:
    """The metadata of a snapshot (:func:`state_dict`, plus ``wal_seq``/``format`` in stored snapshots and
    ``info`` from the service), range-checked before anything is built from it: ``version``,
    ``frames_integrated``, ``wal_seq``, ``trajectory_start``, ``format``, the tracking state's counters and
    ``info.memory_budget_bytes``. The config is checked by ``Map(**config)`` (and by the service like a
    create request). Raises ``InvalidArgument`` naming the field; returns ``meta``."""
    if not isinstance(meta, dict):
        raise InvalidArgument("snapshot: metadata is not an object")
    for key in ("version", "frames_integrated", "wal_seq", "trajectory_start"):
        if key in meta:
            _count(key, meta[key])
    if "format" in meta:
        _count("format", meta["format"], FORMAT_VERSION)
    tracking = meta.get("tracking")
    if tracking is not None:
        if not isinstance(tracking, dict) or not isinstance(tracking.get("config"), dict):
            raise InvalidArgument("snapshot: tracking: expected an object with a config")
        _count("tracking.frames", tracking.get("frames"))
        th = tracking.get("threshold")
        if not isinstance(th, list) or len(th) != 2:
            raise InvalidArgument("snapshot: tracking.threshold: expected [sse, n]")
        sse = th[0]
        if isinstance(sse, bool) or not isinstance(sse, (int, float)) or not math.isfinite(sse) or sse < 0:
            raise InvalidArgument(
                f"snapshot: tracking.threshold[0]: expected a finite value >= 0, got {sse!r}"
            )
        _count("tracking.threshold[1]", th[1])
    info = meta.get("info")
    if isinstance(info, dict) and info.get("memory_budget_bytes") is not None:
        _count("info.memory_budget_bytes", info["memory_budget_bytes"], MAX_BUDGET_BYTES)
        if info["memory_budget_bytes"] == 0:
            raise InvalidArgument("snapshot: info.memory_budget_bytes: expected an integer > 0, got 0")
    return meta


def load_state(m: Map, tensors: dict[str, torch.Tensor], meta: dict) -> Map:
    """Fill the empty map ``m`` (made from ``meta["config"]``) with a :func:`state_dict`; returns ``m``.
    The metadata is range-checked first (``check_state_meta``)."""
    check_state_meta(meta)
    for layer, queue in m._stores:
        if f"{layer.kind}.bricks" not in tensors and layer is m._free:
            continue  # no free record in the snapshot (written before it existed): known after new frames
        layer.load_state_tensors(tensors, layer.kind)
        if queue is not None:
            queue.push_always(layer.brick_table()[0])
    m.frames_integrated = int(meta.get("frames_integrated", 0))
    m.version = int(meta.get("version", 0))
    m._trajectory.load_state_tensors(tensors, meta.get("trajectory_start", 0))
    m._tracker.load_state_dict(tensors, meta.get("tracking"), "tracking.")
    return m

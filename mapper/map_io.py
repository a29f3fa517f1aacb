"""A map as (CPU tensors, JSON metadata) and back: what snapshots (:mod:`mapper.persistence`) store.

Stored: every stored layer's bricks and fields (compacted, ``BrickLayer.state_tensors`` under the layer's
kind), the LiDAR tracking state, the trajectory, the frame count and version, and ``Map.config()``. The
ESDF is not stored: it is a pure function of the surface, recomputed on the first ``update_esdf`` after
loading (every loaded brick is queued for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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


def load_state(m: Map, tensors: dict[str, torch.Tensor], meta: dict) -> Map:
    """Fill the empty map ``m`` (made from ``meta["config"]``) with a :func:`state_dict`; returns ``m``."""
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

"""Log-odds occupancy (OctoMap-style) by ray carving.

Per frame, every voxel a ray crosses before its return is a *miss*, the voxel of the return is a *hit*;
rays reported without a return carve up to ``max_range_m``. A voxel gets at most one update per frame,
and a hit wins over misses (OctoMap's ``insertPointCloud`` key sets). ``log_odds`` is clamped to
``[clamp_min, clamp_max]``. Voxels never observed hold NaN: **unknown**, never free.

Per frame (:func:`integrate_rays`, a brick-segment walk, see :mod:`mapper.kernels.segments`): the bricks
each ray crosses (DDA at brick resolution) plus the bricks of the returns, made unique with each
segment's rank; a frame-local flag per voxel of those bricks (``uint8 [B, 64]``): the walk stores miss = 1
for the voxels each segment crosses, then the returns store hit = 2 (hit wins); the bricks are allocated
and every flagged voxel gets ``l_hit`` or ``l_miss`` (unknown counts as 0) in one pass over whole
bricks (:func:`mapper.kernels.logodds.flags_update`: one Triton launch on the GPU).
``_integrate_rays_reference`` (every crossed voxel materialised, then a sort) is the previous
implementation, kept for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.logodds import flags_update
from ..kernels.segments import MISS, FrameSegments, brick_keys, walk_segments
from ..layer_kinds import OccupancyLayer
from ..layers import BrickLayer, FieldSpec, brick_offsets
from .base import DepthFrame, LidarFrame, no_timer
from .common import dda, in_key_range, keys_to_ijk, max_dda_steps, unique_voxels, voxel_keys
from .tsdf import _slots_of, pixel_rays


@dataclass(frozen=True)
class OccupancyConfig:
    voxel_size_m: float
    l_hit: float = 0.85  # log-odds of p = 0.7
    l_miss: float = -0.4  # p = 0.4
    clamp_min: float = -2.0  # p = 0.12
    clamp_max: float = 3.5  # p = 0.97


def occupancy_fields() -> dict[str, FieldSpec]:
    """Per-voxel storage (:meth:`mapper.layer_kinds.OccupancyLayer.field_specs`)."""
    return OccupancyLayer.field_specs()


def ray_voxels(origin: torch.Tensor, dirs: torch.Tensor, length: torch.Tensor, hit: torch.Tensor, s: float):
    """Voxels crossed by rays from ``origin`` (float64 [3]) along unit ``dirs`` ([R, 3]) up to ``length``
    ([R]). Returns (int64 [M, 3] voxels, bool [M] is_hit): the last cell of a ray with ``hit`` is the hit."""
    out_v, out_h = [], []
    if dirs.shape[0] == 0:
        z = torch.zeros((0, 3), dtype=torch.int64, device=dirs.device)
        return z, torch.zeros(0, dtype=torch.bool, device=dirs.device)
    # rays sorted by length, in chunks whose (rays x steps) stays under a budget: short rays take few
    # steps, and the traversal buffers stay bounded on every device (a 60 m ray at 5 cm is 3600 steps)
    order = torch.argsort(length)
    lengths = length[order].tolist() if dirs.device.type == "cpu" else length[order].cpu().tolist()
    n = dirs.shape[0]
    budget = (1 << 20) if dirs.device.type == "cpu" else (1 << 25)
    start = 0
    while start < n:
        rows = max(1, min(n - start, budget // max_dda_steps(lengths[min(n, start + 1024) - 1], s)))
        while rows > 1 and rows * max_dda_steps(lengths[start + rows - 1], s) > budget:
            rows //= 2
        idx = order[start : start + rows]
        start += rows
        L = length[idx]
        steps = max_dda_steps(lengths[start - 1], s)
        o = origin.expand(idx.numel(), 3)
        cells, tent, valid = dda(o, dirs[idx], torch.zeros_like(L), L, s, steps)
        # the return's cell: the cell containing the end point
        end = torch.floor((origin + dirs[idx] * L[:, None]) / s).to(torch.int64)
        is_end = (cells == end[:, None, :]).all(dim=2) & hit[idx][:, None]
        out_v.append(cells[valid])
        out_h.append(is_end[valid])
        has_end = (is_end & valid).any(dim=1)
        missing = hit[idx] & ~has_end  # end cell not reached by the traversal (rounding): add it
        if bool(missing.any()):
            out_v.append(end[missing])
            out_h.append(torch.ones(int(missing.sum()), dtype=torch.bool, device=dirs.device))
    v = torch.cat(out_v)
    h = torch.cat(out_h)
    ok = in_key_range(v)
    return v[ok], h[ok]


def integrate_rays(
    layer: BrickLayer,
    origin: torch.Tensor,
    dirs: torch.Tensor,
    length: torch.Tensor,
    hit: torch.Tensor,
    cfg: OccupancyConfig,
    timer,
) -> torch.Tensor:
    """Carve rays from ``origin`` (float64 ``[3]``) along unit ``dirs`` (``[R, 3]``) up to ``length``
    (``[R]``); rays with ``hit`` end in an occupied voxel. Returns the bricks updated (int64 ``[B, 3]``)."""
    n = dirs.shape[0]
    if n == 0:
        return torch.zeros((0, 3), dtype=torch.int64, device=dirs.device)
    s = cfg.voxel_size_m
    dev = dirs.device
    with timer("grow"):
        o = origin.to(torch.float64).contiguous().expand(n, 3)  # one origin: stride 0
        zero = torch.zeros_like(length)
        end = torch.floor((origin + dirs * length[:, None]) / s).to(torch.int64)  # the return's voxel
        end_key = torch.where(hit, brick_keys(end >> 2), -1)
        frame = FrameSegments(o, dirs, zero, length, 4 * s, extra_keys=(end_key,))
        bricks, (end_rank,) = frame.bricks, frame.extra_ranks
        u = bricks.shape[0]
        if u == 0:
            return bricks
        flags = torch.zeros(u * 64 + 1, dtype=torch.uint8, device=dev)  # + a sink for rays without a hit
        for seg_ray, seg_rank in frame.segments():
            walk_segments(MISS, o, dirs, zero, length, None, seg_ray, seg_rank, bricks, s, (flags,))
        del frame, seg_ray, seg_rank
        hit_at = torch.where(end_rank >= 0, end_rank.to(torch.int64) * 64 + brick_offsets(end), u * 64)
        flags.scatter_(0, hit_at, 2)  # after the misses: a hit wins (a scalar argument: no host copy)
        flags = flags[: u * 64].view(u, 64)
    with timer("merge"):
        slots = layer.allocate(bricks)
    with timer("update"):
        flags_update(
            layer.pool, "log_odds", slots, flags, cfg.l_hit, cfg.l_miss, cfg.clamp_min, cfg.clamp_max
        )
    return bricks


def _integrate_rays_reference(
    layer: BrickLayer,
    origin: torch.Tensor,
    dirs: torch.Tensor,
    length: torch.Tensor,
    hit: torch.Tensor,
    cfg: OccupancyConfig,
    timer,
) -> int:
    """The previous implementation (every crossed voxel materialised, unique by a sort); the tests'
    reference."""
    with timer("grow"):
        v, h = ray_voxels(origin, dirs, length, hit, cfg.voxel_size_m)
        if v.shape[0] == 0:
            return 0
        keys, inv = torch.unique(voxel_keys(v), return_inverse=True)
        any_hit = torch.zeros(keys.numel(), dtype=torch.bool, device=v.device)
        any_hit[inv[h]] = True
        vox = keys_to_ijk(keys)
        bricks = unique_voxels(vox >> 2)
    with timer("merge"):
        slots = layer.allocate(bricks)
    with timer("update"):
        slot = _slots_of(bricks, slots, vox)
        off = brick_offsets(vox)
        lo = layer.pool.gather("log_odds", slot, off).to(torch.float32)
        lo = torch.nan_to_num(lo, nan=0.0)
        delta = torch.where(any_hit, torch.full_like(lo, cfg.l_hit), torch.full_like(lo, cfg.l_miss))
        layer.pool.scatter("log_odds", slot, (lo + delta).clamp(cfg.clamp_min, cfg.clamp_max), off)
    return int(vox.shape[0])


# ------------------------------------------------------------------------------------------ integrator
class OccupancyIntegrator:
    """The occupancy integrator (the :class:`mapper.integrators.base.Integrator` contract): every ray of
    the frame ends in a return (:func:`integrate_rays`; a depth image's valid pixels, a scan's returns)."""

    def __init__(self, config: OccupancyConfig):
        self.config = config

    def integrate(self, frame: LidarFrame | DepthFrame, layer: BrickLayer, timer=no_timer) -> torch.Tensor:
        """Carve ``frame`` into ``layer``; returns the bricks updated (int64 ``[B, 3]``)."""
        if isinstance(frame, DepthFrame):
            _, origin, dirs, rng = pixel_rays(frame.depth_m, frame.K, frame.T_world_sensor, frame.max_range_m)
        else:
            origin, dirs, rng = frame.rays()
        hit = torch.ones_like(rng, dtype=torch.bool)
        return integrate_rays(layer, origin, dirs, rng, hit, self.config, timer)

"""Log-odds occupancy (OctoMap-style) by ray carving.

Per frame, every voxel a ray crosses before its return is a *miss*, the voxel of the return is a *hit*;
rays reported without a return carve up to ``max_range_m``. A voxel gets at most one update per frame,
and a hit wins over misses (OctoMap's ``insertPointCloud`` key sets). ``log_odds`` is clamped to
``[clamp_min, clamp_max]``. Voxels never observed hold NaN: **unknown**, never free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import BrickLayer, FieldSpec, brick_offsets
from .common import dda, in_key_range, keys_to_ijk, max_dda_steps, unique_voxels, voxel_keys
from .tsdf import _slots_of


@dataclass(frozen=True)
class OccupancyConfig:
    voxel_size_m: float
    l_hit: float = 0.85  # log-odds of p = 0.7
    l_miss: float = -0.4  # p = 0.4
    clamp_min: float = -2.0  # p = 0.12
    clamp_max: float = 3.5  # p = 0.97


def occupancy_fields() -> dict[str, FieldSpec]:
    return {"log_odds": FieldSpec(torch.float16, (), float("nan"))}


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
) -> int:
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

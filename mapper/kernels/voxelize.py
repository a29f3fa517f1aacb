"""Point -> voxel/pillar grouping as PointPillars/OpenPCDet expect (spconv ``PointToVoxel`` semantics).

``voxelize(points, voxel_size_m, range_min, range_max, max_points_per_voxel=32, max_voxels=None)`` returns
``(voxels [V, K, C], coords [V, 3] int32 (z, y, x), counts [V] int32)`` with ``K = max_points_per_voxel``:

* **cell** of a point: ``floor((xyz - range_min) / voxel_size_m)`` per axis, evaluated in float32 (``xyz``
  cast to float32; one rounded subtraction, one IEEE division, floor). **Grid size**:
  ``round((range_max - range_min) / voxel_size_m)`` (float64 from the float32 values, round half to even,
  as ``np.round``). A point is kept iff ``0 <= cell < grid`` on every axis: points left of ``range_min``
  (negative cells, floor binning), non-finite points and cells ``>= grid`` are dropped, so the upper bound is
  exclusive (a point exactly on ``range_max`` is dropped when the range is a whole number of voxels).
  Extra channels (``C > 3``) are copied, not checked.
* **Voxel order**: by the index of the voxel's first point in the input (spconv's CPU order). With
  ``max_voxels`` only the first ``max_voxels`` voxels in that order are kept; points of later voxels are
  dropped. ``None`` keeps every voxel.
* **Points of a voxel**: the first ``K`` in input order (deterministic), at ``voxels[v, :counts[v]]``;
  the rest of the row is zero. ``counts[v] = min(points in the voxel, K)``.
* Pillars: give ``voxel_size_m[2] = range_max[2] - range_min[2]`` (one cell in z).

Two implementations with this signature: :func:`voxelize_torch` (sort-based reference, the CPU path) and
:func:`voxelize_triton` (open-addressing hash table, no global sort; ``triton_voxelize.py``), dispatched by
:func:`voxelize` through ``mapper.kernels.dispatch.kernel``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .._validation import as_tensor
from ..errors import InvalidArgument, InvalidArgumentType
from .dispatch import kernel


class VoxelGrid(NamedTuple):
    """Validated binning parameters (float32 values as Python floats, grid size per axis x, y, z)."""

    voxel_size: tuple[float, float, float]
    range_min: tuple[float, float, float]
    grid: tuple[int, int, int]
    max_points: int
    max_voxels: int | None

    def empty(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The result with no voxel for points ``p`` (``[0, K, C]``, ``[0, 3]``, ``[0]``)."""
        dev = p.device
        return (
            torch.zeros((0, self.max_points, p.shape[1]), dtype=p.dtype, device=dev),
            torch.zeros((0, 3), dtype=torch.int32, device=dev),
            torch.zeros(0, dtype=torch.int32, device=dev),
        )


def _vec3(name: str, v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentType(f"{name}: expected 3 numbers: {e}") from None
    if a.shape != (3,):
        raise InvalidArgument(f"{name}: expected 3 values (x, y, z), got shape {list(a.shape)}")
    if not np.isfinite(a).all():
        raise InvalidArgument(f"{name}: expected finite values, got {a.tolist()}")
    return a.astype(np.float32)


def _int(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise InvalidArgument(f"{name}: expected >= {minimum}, got {v}")
    return int(v)


def prepare(
    points, voxel_size_m, range_min, range_max, max_points_per_voxel, max_voxels
) -> tuple[torch.Tensor, VoxelGrid]:
    """Check the arguments once; returns the points (contiguous, floating) and the binning parameters."""
    p = as_tensor("points", points)
    if not p.is_floating_point():
        raise InvalidArgumentType(f"points: expected a floating dtype, got {p.dtype}")
    if p.dim() != 2 or p.shape[1] < 3:
        raise InvalidArgument(f"points: expected shape [N, C] with C >= 3, got {list(p.shape)}")
    if p.shape[0] >= 1 << 31:
        raise InvalidArgument(f"points: at most 2^31 - 1 points, got {p.shape[0]}")
    vs = _vec3("voxel_size_m", voxel_size_m)
    lo = _vec3("range_min", range_min)
    hi = _vec3("range_max", range_max)
    if not (vs > 0).all():
        raise InvalidArgument(f"voxel_size_m: expected positive sizes, got {vs.tolist()}")
    if not (hi > lo).all():
        raise InvalidArgument(f"range_max: expected range_max > range_min per axis, got {hi.tolist()}")
    grid = np.round((hi.astype(np.float64) - lo.astype(np.float64)) / vs.astype(np.float64))
    if (grid < 1).any():
        raise InvalidArgument(f"voxel_size_m: the range holds less than one voxel on an axis (grid {grid})")
    if np.prod(grid) >= 2.0**62 or (grid >= 2**24).any():
        raise InvalidArgument(f"voxel_size_m: grid {grid.astype(np.int64).tolist()} is too large")
    k = _int("max_points_per_voxel", max_points_per_voxel, 1)
    cap = None if max_voxels is None else _int("max_voxels", max_voxels, 1)
    g = VoxelGrid(
        tuple(float(x) for x in vs),
        tuple(float(x) for x in lo),
        tuple(int(x) for x in grid),
        k,
        cap,
    )
    return p.contiguous(), g


def cells_of(xyz: torch.Tensor, g: VoxelGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[N, 3]`` cells (x, y, z) and bool ``[N]`` kept, from float ``[N, 3]`` coordinates."""
    dev = xyz.device
    lo = torch.tensor(g.range_min, dtype=torch.float32, device=dev)
    vs = torch.tensor(g.voxel_size, dtype=torch.float32, device=dev)
    f = torch.floor((xyz.to(torch.float32) - lo) / vs)
    grid = torch.tensor(g.grid, dtype=torch.float32, device=dev)
    keep = ((f >= 0) & (f < grid)).all(1)  # NaN compares False: non-finite points are dropped
    cells = torch.where(keep[:, None], f, 0.0).to(torch.int64)
    return cells, keep


def voxelize_torch(
    points: torch.Tensor,
    voxel_size_m,
    range_min,
    range_max,
    max_points_per_voxel: int = 32,
    max_voxels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort-based reference (CPU path): stable sort of the kept points by cell key, segments, ranks."""
    p, g = prepare(points, voxel_size_m, range_min, range_max, max_points_per_voxel, max_voxels)
    return _voxelize_torch(p, g)


def _voxelize_torch(p: torch.Tensor, g: VoxelGrid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = g.max_points
    dev = p.device
    cells, keep = cells_of(p[:, :3], g)
    idx = torch.nonzero(keep).squeeze(1)  # increasing: input order
    if idx.numel() == 0:
        return g.empty(p)
    c = cells[idx]
    gx, gy, _ = g.grid
    key = (c[:, 2] * gy + c[:, 1]) * gx + c[:, 0]
    skey, perm = torch.sort(key, stable=True)  # equal keys stay in input order
    n = skey.numel()
    new = torch.ones(n, dtype=torch.bool, device=dev)
    new[1:] = skey[1:] != skey[:-1]
    seg = torch.cumsum(new, 0) - 1  # segment of each sorted point
    starts = torch.nonzero(new).squeeze(1)
    rank = torch.arange(n, device=dev) - starts[seg]
    first = idx[perm[starts]]  # first input index of each segment
    n_seg = starts.numel()
    vid = torch.empty(n_seg, dtype=torch.int64, device=dev)
    vid[torch.argsort(first)] = torch.arange(n_seg, device=dev)  # voxel order = first-point order
    v = n_seg if g.max_voxels is None else min(n_seg, g.max_voxels)
    pv = vid[seg]
    sel = (rank < k) & (pv < v)
    voxels = torch.zeros((v, k, p.shape[1]), dtype=p.dtype, device=dev)
    voxels[pv[sel], rank[sel]] = p[idx[perm[sel]]]
    lens = torch.diff(torch.cat((starts, starts.new_tensor([n]))))
    counts = torch.zeros(v, dtype=torch.int32, device=dev)
    coords = torch.zeros((v, 3), dtype=torch.int32, device=dev)
    segk = vid < v
    counts[vid[segk]] = lens[segk].clamp(max=k).to(torch.int32)
    coords[vid[segk]] = c[perm[starts[segk]]].flip(1).to(torch.int32)  # (z, y, x)
    return voxels, coords, counts


def voxelize_triton(
    points: torch.Tensor,
    voxel_size_m,
    range_min,
    range_max,
    max_points_per_voxel: int = 32,
    max_voxels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hash-based (GPU path): cells inserted into an open-addressing table by CAS, voxel ids by the prefix
    sum of "first point of its voxel" flags, the first K points per voxel by an atomic-min insertion."""
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_voxelize import voxelize_hash

    p, g = prepare(points, voxel_size_m, range_min, range_max, max_points_per_voxel, max_voxels)
    return voxelize_hash(p, g)


def voxelize(
    points: torch.Tensor,
    voxel_size_m,
    range_min,
    range_max,
    max_points_per_voxel: int = 32,
    max_voxels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group points into voxels (pillars when the z size spans the range); see the module docstring.

    Args:
        points: float ``[N, C]``, ``C >= 3``, x, y, z first (CPU or CUDA).
        voxel_size_m, range_min, range_max: 3 values each (x, y, z), in metres.
        max_points_per_voxel: ``K >= 1``, points kept per voxel (the first ones in input order).
        max_voxels: keep only the first ``max_voxels`` voxels (by first point); ``None``: all.

    Returns: ``voxels`` ``[V, K, C]`` (points' dtype, zero padded), ``coords`` int32 ``[V, 3]`` (z, y, x),
    ``counts`` int32 ``[V]``, on the points' device; voxels ordered by their first point's input index.
    """
    p, g = prepare(points, voxel_size_m, range_min, range_max, max_points_per_voxel, max_voxels)
    return kernel(p.device, _voxelize_torch, "triton_voxelize:voxelize_hash")(p, g)

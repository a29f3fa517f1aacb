"""Observed free space at the ESDF's resolution: which voxels the sensors' rays passed through.

Without an occupancy layer, a TSDF knows only its truncation band; planners need the free space between
the sensor and the surface too. The depth and LiDAR integrators therefore also walk each ray (depth:
every ``stride``-th pixel in both directions, chosen so that neighbouring rays are at most half an ESDF
voxel apart at the frame's largest depth) from the sensor to ``range - gap`` through a **free record**:
a brick layer at the ESDF voxel size with one fp16 field ``log_odds`` in the occupancy layer's format
(NaN = never crossed, negative = crossed; each crossing adds ``l_miss`` once per frame, clamped at
``clamp_min``), so the map's decay and clear treat it like an occupancy layer.

``gap = max(tau, sqrt(3) / 2 * S)`` (``tau``: TSDF truncation, ``S``: ESDF voxel): every voxel the
shortened segment crosses has its centre in front of the ray's return (so a voxel of the record is free:
the ESDF gives it a positive sign even where the TSDF's occluded band behind a thin object says inside),
and a voxel whose centre is farther than ``max(tau, 0.37 S)`` in front of a frontal surface is still
crossed (nearer ones lie in the TSDF band). A voxel no ray crossed is never marked.

The walk is the brick-segment walk of :mod:`mapper.kernels.segments` (``MISS`` mode), at the ESDF voxel
size; the layer is small (2 B per voxel, at the ESDF's resolution, not the TSDF's).
"""

from __future__ import annotations

import math

import torch

from ..kernels.logodds import flags_update
from ..kernels.segments import MISS, FrameSegments, walk_segments
from ..layers import BrickLayer, FieldSpec
from .base import DepthFrame, LidarFrame, no_timer
from .occupancy import OccupancyConfig, occupancy_fields
from .tsdf import pixel_rays

FREE_MISS = OccupancyConfig(1.0).l_miss  # log-odds added per frame a ray crosses the voxel
FREE_CLAMP = OccupancyConfig(1.0).clamp_min


def free_fields() -> dict[str, FieldSpec]:
    """The free record's storage: the occupancy layer's ``log_odds`` (fp16, NaN = never crossed)."""
    return occupancy_fields()


def free_gap(tau_m: float, esdf_voxel_m: float) -> float:
    """How far before each return (metres along the ray) the free segment stops."""
    return max(tau_m, math.sqrt(3.0) / 2.0 * esdf_voxel_m)


def depth_stride(max_depth_m: float, focal_px: float, esdf_voxel_m: float) -> int:
    """Pixel stride of the free walk: neighbouring rays at most half an ESDF voxel apart at the largest
    depth."""
    if max_depth_m <= 0:
        return 1
    return max(1, int(math.floor(0.5 * esdf_voxel_m * focal_px / max_depth_m)))


def integrate_free(
    layer: BrickLayer, origin: torch.Tensor, dirs: torch.Tensor, length: torch.Tensor, voxel_size_m: float
) -> torch.Tensor:
    """Mark the voxels crossed by the segments ``origin + t * dirs``, ``t in [0, length]``, as free.

    Args:
        layer: the free record (fields of :func:`free_fields`, voxels of ``voxel_size_m``).
        origin: float64 ``[3]`` sensor position (world, metres).
        dirs: float64 ``[R, 3]`` unit directions; ``length``: float64 ``[R]`` (rays with ``length <= 0``
            are skipped).
    Returns:
        int64 ``[B, 3]`` the bricks in which a voxel became known (crossed for the first time): the only
        change the ESDF needs to see (a known voxel crossed again changes its log-odds, not its state).
    """
    dev = dirs.device
    none = torch.zeros((0, 3), dtype=torch.int64, device=dev)
    n = dirs.shape[0]
    if n == 0:
        return none
    o = origin.to(torch.float64).contiguous().expand(n, 3)
    zero = torch.zeros_like(length)
    # rays with length <= 0 end before they start (t1 < t0): no segment, no compaction (a host sync)
    length = torch.where(length > 0, length, -1.0)
    frame = FrameSegments(o, dirs, zero, length, 4 * voxel_size_m)
    bricks = frame.bricks
    u = bricks.shape[0]
    if u == 0:
        return none
    flags = torch.zeros(u * 64, dtype=torch.uint8, device=dev)
    for seg_ray, seg_rank in frame.segments():
        walk_segments(MISS, o, dirs, zero, length, None, seg_ray, seg_rank, bricks, voxel_size_m, (flags,))
    del frame
    flags = flags.view(u, 64)
    slots = layer.allocate(bricks)
    known = torch.zeros(u, dtype=torch.uint8, device=dev)  # bricks in which a voxel became known
    flags_update(layer.pool, "log_odds", slots, flags, FREE_MISS, FREE_MISS, FREE_CLAMP, math.inf, known)
    return bricks[known.view(torch.bool)]


# ------------------------------------------------------------------------------------------ integrator
class FreeSpaceIntegrator:
    """Observed free-space carving into the free record (the :class:`mapper.integrators.base.Integrator`
    contract): every ray of a LiDAR frame, every ``stride``-th pixel (both directions, see
    :func:`depth_stride`) of a depth frame, walked from the sensor to ``range - gap`` (:func:`free_gap`).

    Args:
        voxel_size_m: the record's voxel (the ESDF's).
        tau_m: the TSDF truncation (0 without a TSDF).
    Returns of :meth:`integrate`: the bricks in which a voxel became known (what the ESDF must see).
    """

    def __init__(self, voxel_size_m: float, tau_m: float):
        self.voxel_size_m = float(voxel_size_m)
        self.gap_m = free_gap(tau_m, self.voxel_size_m)

    def integrate(self, frame: LidarFrame | DepthFrame, layer: BrickLayer, timer=no_timer) -> torch.Tensor:
        with timer("free"):
            if isinstance(frame, DepthFrame):
                origin, dirs, rng = self._depth_rays(frame)
            else:
                origin, dirs, rng = frame.rays()
            return integrate_free(layer, origin, dirs, rng - self.gap_m, self.voxel_size_m)

    def _depth_rays(self, frame: DepthFrame):
        """The rays of every st-th pixel of every st-th row, ``st`` as :func:`depth_stride` computed on the
        device (the same float64 arithmetic; no host sync)."""
        depth, K = frame.depth_m, frame.K
        d = depth.reshape(-1)
        ok = torch.isfinite(d) & (d > 0) & (d <= frame.max_range_m)
        z_max = torch.where(ok, d, torch.zeros_like(d)).max().to(torch.float64)
        f_min = K[:2, :2].diagonal().min()
        st = torch.floor(0.5 * self.voxel_size_m * f_min / z_max).clamp(min=1).to(torch.int64)
        h, w = depth.shape
        rows = torch.arange(h, device=depth.device)[:, None] % st == 0
        sub = rows & (torch.arange(w, device=depth.device)[None, :] % st == 0)
        sparse = torch.where(sub, depth, torch.zeros_like(depth))
        _, origin, dirs, rng = pixel_rays(sparse, K, frame.T_world_sensor, frame.max_range_m)
        return origin, dirs, rng

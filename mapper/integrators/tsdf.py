"""Truncated signed distance integration: projective for depth images, along the ray for LiDAR.

Per frame (both sensors): **grow** — the bricks the observation's truncation band touches; **merge +
inject** — ``BrickLayer.allocate`` (new grid epoch, slot table injected, new bricks filled with
tsdf = 0, weight = 0); **update** — a weighted running average, weight ``obs_weight`` per observation,
capped at ``max_weight``; values in metres, truncated to ``+-tau``, positive in front of the surface.

* LiDAR: every voxel crossed by the segment ``[r - tau, r + tau]`` of a ray (exact traversal) gets
  ``sdf = r - |centre - origin|`` (VDBFusion's definition), kept where ``sdf >= -tau`` and clamped to
  ``tau``; several rays hitting one voxel in a frame count as several observations. The traversal is a
  brick-segment walk (:mod:`mapper.kernels.segments`): the bricks of each band (DDA at brick
  resolution), unique with each segment's rank, then the voxels of each segment added into frame-local
  ``float32 [B, 64]`` sums (no voxel-level arrays, no sort of voxels); bricks that received no sample
  (the band's end beyond ``-tau``) are dropped before allocation. ``_integrate_lidar_reference`` is the
  previous implementation (voxel-resolution DDA over all bands, then a brick scatter), kept for tests.
* Depth: the bricks crossed by each pixel's band are allocated, then every voxel of those bricks is
  projected into the image (nearest pixel) and gets the projective distance ``depth - z``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels.dispatch import kernel
from ..kernels.keys import brick_keys
from ..kernels.normals import ray_band_params, ray_bands, scan_normals
from ..kernels.segments import BAND, FrameSegments, unique_brick_ranks, walk_segments
from ..layer_kinds import TsdfLayer
from ..layers import BrickLayer, FieldSpec, brick_local_coords, brick_offsets
from .base import DepthFrame, LidarFrame, no_timer
from .common import (
    chunked_rays,
    dda,
    in_key_range,
    max_dda_steps,
    unique_voxels,
    voxel_keys,
)

# bricks per chunk of the running-average update (bounded float32 temporaries: 8 B x 64 x chunk each)
UPDATE_BRICKS_CPU = 1 << 13
UPDATE_BRICKS_GPU = 1 << 15


@dataclass(frozen=True)
class TsdfConfig:
    voxel_size_m: float
    truncation_vox: float = 3.0
    obs_weight: float = 1.0
    max_weight: float = 100.0
    with_color: bool = False
    # LiDAR at grazing incidence (see lidar_rays): distances projected on the normals of the scan, found in
    # cells of normal_cell_vox voxels (0 = along the ray, the previous behaviour)
    normal_cell_vox: float = 4.0
    grazing_band_factor: float = 4.0
    grazing_reach_vox: float = 0.75
    min_incidence_weight: float = 1.0  # < 1: weight obs_weight * max(cos, this); 1 = off (see NOTES)

    @property
    def tau(self) -> float:
        return self.truncation_vox * self.voxel_size_m

    @property
    def lidar_normals(self) -> bool:
        return self.normal_cell_vox > 0

    @property
    def lidar_band_m(self) -> float:
        """Longest half band along a LiDAR ray (``tau``, up to ``grazing_band_factor * tau`` at grazing
        incidence)."""
        return self.tau * (max(1.0, self.grazing_band_factor) if self.lidar_normals else 1.0)


def lidar_rays(origin: torch.Tensor, points_w: torch.Tensor, cfg: TsdfConfig):
    """Per return of a LiDAR frame: float64 unit dirs ``[N, 3]``, range ``[N]``, band ``t0``/``t1``
    ``[N]``, and (with ``cfg.lidar_normals``) float64 normals ``[N, 3]`` (zero rows: none) and float32 ray
    weights ``[N]``, else None, None.

    With a normal ``n`` (:func:`mapper.kernels.normals.scan_normals`, towards the sensor) at incidence
    ``cos = -dir . n``, the band along the ray is ``+-clamp(reach / cos, tau, L)`` with ``reach =
    grazing_reach_vox`` voxels: at grazing incidence it still reaches the voxels next to the surface on both
    sides (the along-ray band ``+-tau`` spans only ``+-tau * cos`` across it); ``L = grazing_band_factor *
    tau`` and no longer than the neighbourhood where the plane was verified (``support``: past a box's edge
    the plane does not hold, and a ray that clips the corner would mark free space behind it), and the ray's
    weight is ``obs_weight * max(cos, min_incidence_weight)``. Without one: ``+-tau`` and ``obs_weight``.
    """
    d = points_w.to(torch.float64) - origin
    tau = cfg.tau
    if not cfg.lidar_normals:
        r = torch.linalg.vector_norm(d, dim=1)
        return d / r[:, None], r, (r - tau).clamp(min=0.0), r + tau, None, None
    nrm, support = scan_normals(origin, points_w, cfg.normal_cell_vox * cfg.voxel_size_m)
    k = max(1.0, cfg.grazing_band_factor)
    reach = cfg.grazing_reach_vox * cfg.voxel_size_m
    prm = ray_band_params(d.device, tau, k * tau, reach, cfg.min_incidence_weight, cfg.obs_weight)
    return ray_bands(d, nrm, support, prm)  # one kernel on the GPU


def tsdf_fields(cfg: TsdfConfig) -> dict[str, FieldSpec]:
    """Per-voxel storage of the TSDF layer (:meth:`mapper.layer_kinds.TsdfLayer.field_specs`)."""
    return TsdfLayer.field_specs(cfg.with_color)


def _no_bricks(device: torch.device) -> torch.Tensor:
    return torch.zeros((0, 3), dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------- grow
def lidar_band_samples(origin: torch.Tensor, points_w: torch.Tensor, cfg: TsdfConfig):
    """Voxels in the truncation band of each return: (int64 ``[M, 3]``, float32 sdf ``[M]``, float32
    weight ``[M]``); the distance along the ray, or projected on the return's normal (:func:`lidar_rays`)."""
    s, tau = cfg.voxel_size_m, cfg.tau
    steps = max_dda_steps(2 * cfg.lidar_band_m, s)
    dirs_all, r_all, t0_all, t1_all, nrm_all, w_all = lidar_rays(origin, points_w, cfg)
    out_ijk, out_sdf, out_w = [], [], []
    for sl in chunked_rays(points_w.shape[0], points_w.device, rows=1 << 14):
        dirs, r, t0, t1 = dirs_all[sl], r_all[sl], t0_all[sl], t1_all[sl]
        o = origin.expand(r.shape[0], 3)
        cells, _, valid = dda(o, dirs, t0, t1, s, steps)
        centres = (cells.to(torch.float64) + 0.5) * s
        dist = torch.linalg.vector_norm(centres - origin, dim=2)
        sdf = r[:, None] - dist
        w = torch.full_like(r, cfg.obs_weight, dtype=torch.float32)
        skip = torch.zeros_like(valid)
        if nrm_all is not None:
            nrm, w = nrm_all[sl], w_all[sl]
            hit = origin + dirs * r[:, None]
            proj = ((centres - hit[:, None, :]) * nrm[:, None, :]).sum(dim=2)
            has = (nrm != 0).any(dim=1)[:, None]
            skip = has & (sdf < 0) & (proj > 0)  # behind the return along the ray, in front of its plane
            sdf = torch.where(has, proj, sdf)
        keep = valid & (sdf >= -tau) & ~skip
        out_ijk.append(cells[keep])
        out_sdf.append(sdf[keep].clamp(max=tau).to(torch.float32))
        out_w.append(w[:, None].expand_as(sdf)[keep])
    dev = points_w.device
    ijk = torch.cat(out_ijk) if out_ijk else torch.zeros((0, 3), dtype=torch.int64, device=dev)
    sdf = torch.cat(out_sdf) if out_sdf else torch.zeros(0, dtype=torch.float32, device=dev)
    w = torch.cat(out_w) if out_w else torch.zeros(0, dtype=torch.float32, device=dev)
    ok = in_key_range(ijk)
    return ijk[ok], sdf[ok], w[ok]


def _pixel_dirs(idx: torch.Tensor, w: int, K: torch.Tensor, T: torch.Tensor):
    """World unit directions (float64 ``[P, 3]``) of pixels ``idx`` (row-major, image width ``w``), and the
    length of each pixel's ray per metre of depth (``[P]``)."""
    u = (idx % w).to(torch.float64)
    v = (idx // w).to(torch.float64)
    x = (u - K[0, 2]) / K[0, 0]
    y = (v - K[1, 2]) / K[1, 1]
    n = torch.sqrt(x * x + y * y + 1.0)
    # the rotation written out (no matmul): the same float64 operations in the same order as the grow
    # kernel (mapper.kernels.triton_depth), so both find the same bricks bit for bit
    R = T[:3, :3]
    ux, uy, uz = (x / n)[:, None], (y / n)[:, None], (1.0 / n)[:, None]
    return ux * R[:, 0] + uy * R[:, 1] + uz * R[:, 2], n


def pixel_rays(depth: torch.Tensor, K: torch.Tensor, T: torch.Tensor, max_range_m: float):
    """Valid pixels of a depth image as world rays: (pixel index ``[P]``, origin ``[3]``, unit dirs
    ``[P, 3]``, range along the ray ``[P]``), float64."""
    h, w = depth.shape
    d = depth.reshape(-1)
    ok = torch.isfinite(d) & (d > 0) & (d <= max_range_m)
    idx = ok.nonzero().squeeze(1)
    dirs, n = _pixel_dirs(idx, w, K, T)
    return idx, T[:3, 3], dirs, d[idx].to(torch.float64) * n


def depth_band_bricks(
    depth: torch.Tensor, K: torch.Tensor, T: torch.Tensor, cfg: TsdfConfig, max_range_m: float
):
    """Unique bricks (int64 ``[B, 3]``, brick coordinates, sorted by key) crossed by the valid pixels'
    truncation bands: on CUDA one Triton kernel (``triton_depth.depth_band_bricks_triton``: rays, brick
    DDA and a device hash set; one host read), else :func:`depth_band_bricks_torch` (its reference, the
    CPU path); same result. ``MAPPER_DEPTH_GROW=keyed`` selects the previous CUDA path
    (:func:`depth_band_bricks_keyed`, on any device: for A/B benchmarks and op counts)."""
    if os.environ.get("MAPPER_DEPTH_GROW") == "keyed":
        return depth_band_bricks_keyed(depth, K, T, cfg, max_range_m)
    impl = kernel(depth.device, depth_band_bricks_torch, "triton_depth:depth_band_bricks_triton")
    return impl(depth, K, T, cfg.tau, 4 * cfg.voxel_size_m, max_range_m)


def depth_band_bricks_torch(depth, K, T, tau: float, cell: float, max_range_m: float) -> torch.Tensor:
    """The reference of ``triton_depth.depth_band_bricks_triton`` (same arguments): the bricks (cells of
    size ``cell`` = 4 voxels) crossed by each valid pixel's ``[r - tau, r + tau]``, by compaction (the valid
    pixels, the crossed cells, ``unique_voxels``)."""
    _, origin, dirs, rng = pixel_rays(depth, K, T, max_range_m)
    steps = max_dda_steps(2 * tau, cell)
    parts = []
    for sl in chunked_rays(rng.numel(), depth.device, rows=1 << 15):
        r = rng[sl]
        o = origin.expand(r.numel(), 3)
        cells, _, valid = dda(o, dirs[sl], (r - tau).clamp(min=0.0), r + tau, cell, steps)
        parts.append(cells[valid])
    if not parts:
        return torch.zeros((0, 3), dtype=torch.int64, device=depth.device)
    bricks = torch.cat(parts)
    bricks = bricks[in_key_range(bricks << 2)]
    return unique_voxels(bricks)


def depth_band_bricks_keyed(depth, K, T, cfg: TsdfConfig, max_range_m: float):
    """:func:`depth_band_bricks` without compaction: every pixel is walked (no boolean-mask indexing); an
    invalid pixel walks a dummy ray and its cells get key ``-1``, as do cells outside the key range; the keys
    are de-duplicated by :func:`mapper.kernels.segments.unique_brick_ranks` (a bitmap over the keys' box).
    Host syncs: two size reads there (the box, the brick count); the compacting version has five."""
    h, w = depth.shape
    d = depth.reshape(-1)
    ok = torch.isfinite(d) & (d > 0) & (d <= max_range_m)
    origin = T[:3, 3]
    bs = 4 * cfg.voxel_size_m
    steps = max_dda_steps(2 * cfg.tau, bs)
    keys = []
    for sl in chunked_rays(d.numel(), depth.device, rows=1 << 15):
        idx = torch.arange(sl.start, sl.stop, device=depth.device)
        dirs, n = _pixel_dirs(idx, w, K, T)
        r = torch.where(ok[sl], d[sl].to(torch.float64), 1.0) * n
        o = origin.expand(r.numel(), 3)
        cells, _, valid = dda(o, dirs, (r - cfg.tau).clamp(min=0.0), r + cfg.tau, bs, steps)
        k = brick_keys(cells.reshape(-1, 3)).view(r.numel(), steps)  # -1 outside the key range
        keys.append(torch.where(valid & ok[sl, None], k, -1).reshape(-1))
    # dense up to 2^26 cells whatever the key count (a bitmap beats a sort of the keys, as in unique_voxels)
    bricks, _ = unique_brick_ranks(*keys, dense_slack=1 << 26)
    return bricks


def depth_band_bricks_compact(depth, K, T, cfg: TsdfConfig, max_range_m: float):
    """:func:`depth_band_bricks` by compaction (:func:`depth_band_bricks_torch` with ``cfg``'s tau and
    brick size; five host syncs on CUDA, on the CPU less work than walking every pixel)."""
    return depth_band_bricks_torch(depth, K, T, cfg.tau, 4 * cfg.voxel_size_m, max_range_m)


# -------------------------------------------------------------------------------------------- update
def _slots_of(bricks: torch.Tensor, slots: torch.Tensor, voxels: torch.Tensor) -> torch.Tensor:
    """Slot of each voxel's brick, given the unique bricks (sorted by key) and their slots."""
    bk = voxel_keys(bricks)
    order = torch.argsort(bk)
    pos = torch.searchsorted(bk[order], voxel_keys(voxels >> 2))
    return slots[order[pos]]


def update_running_average(layer: BrickLayer, slot, off, obs_sum, w_sum, cfg: TsdfConfig) -> None:
    """tsdf <- (tsdf * w + obs_sum) / (w + w_sum); w <- min(w + w_sum, max_weight)."""
    t = layer.pool.gather("tsdf", slot, off).to(torch.float32)
    w = layer.pool.gather("weight", slot, off).to(torch.float32)
    wn = w + w_sum
    t_new = (t * w + obs_sum) / wn.clamp(min=1e-12)
    layer.pool.scatter("tsdf", slot, t_new.clamp(-cfg.tau, cfg.tau), off)
    layer.pool.scatter("weight", slot, wn.clamp(max=cfg.max_weight), off)


def brick_accumulate(ijk: torch.Tensor, *values: torch.Tensor):
    """Scatter-add per-sample values into the voxels of the samples' bricks, without a voxel-level sort.

    Returns (unique bricks int64 ``[B, 3]`` sorted by key, and for every value a ``[B, 64]`` sum).
    """
    bricks = unique_voxels(ijk >> 2)
    rank = torch.searchsorted(voxel_keys(bricks), voxel_keys(ijk >> 2))
    local = rank * 64 + brick_offsets(ijk)
    sums = []
    for val in values:
        acc = torch.zeros(bricks.shape[0] * 64, dtype=val.dtype, device=val.device)
        sums.append(acc.index_add_(0, local, val).reshape(-1, 64))
    return bricks, sums


def update_bricks(layer: BrickLayer, slots: torch.Tensor, obs_sum: torch.Tensor, w_sum: torch.Tensor, cfg):
    """Running average on whole bricks ([B, 64] sums; voxels with w_sum == 0 keep their values)."""
    t = layer.pool.gather("tsdf", slots).to(torch.float32)
    w = layer.pool.gather("weight", slots).to(torch.float32)
    wn = w + w_sum
    t_new = torch.where(w_sum > 0, (t * w + obs_sum) / wn.clamp(min=1e-12), t)
    layer.pool.scatter("tsdf", slots, t_new.clamp(-cfg.tau, cfg.tau))
    layer.pool.scatter("weight", slots, wn.clamp(max=cfg.max_weight))


def integrate_lidar(
    layer: BrickLayer, origin: torch.Tensor, points_w: torch.Tensor, cfg: TsdfConfig, timer
) -> torch.Tensor:
    """One LiDAR frame (world points, float64 origin ``[3]``) into a TSDF layer; returns the bricks updated
    (int64 ``[B, 3]``)."""
    n = points_w.shape[0]
    if n == 0:
        return _no_bricks(points_w.device)
    s, tau = cfg.voxel_size_m, cfg.tau
    dev = points_w.device
    if cfg.lidar_normals:
        with timer("normals"):
            dirs, r, t0, t1, nrm, ray_w = lidar_rays(origin, points_w, cfg)
    else:
        dirs, r, t0, t1, nrm, ray_w = lidar_rays(origin, points_w, cfg)
    with timer("grow"):
        o = origin.to(torch.float64).contiguous().expand(n, 3)  # one origin: stride 0
        frame = FrameSegments(o, dirs, t0, t1, 4 * s, max_length=2 * cfg.lidar_band_m)
        bricks = frame.bricks
        u = bricks.shape[0]
        if u == 0:
            return bricks
        sdf_sum = torch.zeros(u * 64, dtype=torch.float32, device=dev)
        w_sum = torch.zeros(u * 64, dtype=torch.float32, device=dev)
        for seg_ray, seg_rank in frame.segments():
            sums = (sdf_sum, w_sum)
            walk_segments(
                BAND, o, dirs, t0, t1, r, seg_ray, seg_rank, bricks, s, sums, tau, cfg.obs_weight, nrm, ray_w
            )
        del frame, seg_ray, seg_rank
        sdf_sum, w_sum = sdf_sum.view(u, 64), w_sum.view(u, 64)
        has_samples = (w_sum > 0).any(dim=1)  # bricks whose band ends beyond -tau got none: not allocated
    with timer("merge"):
        keep, slots = layer.allocate_kept(bricks, has_samples)  # one size read: new leaves, bricks, kept
        if keep.numel() == 0:
            return _no_bricks(dev)
        all_kept = keep.numel() == u
        if not all_kept:
            bricks = bricks[keep]
    with timer("update"):
        step = UPDATE_BRICKS_CPU if dev.type == "cpu" else UPDATE_BRICKS_GPU
        for c0 in range(0, keep.numel(), step):
            sl = slice(c0, c0 + step)
            rows = sl if all_kept else keep[sl]
            update_bricks(layer, slots[sl], sdf_sum[rows], w_sum[rows], cfg)
    return bricks


def _integrate_lidar_reference(layer: BrickLayer, origin, points_w, cfg: TsdfConfig, timer):
    """The previous implementation (voxel-resolution DDA over every band, samples scattered per brick);
    the tests' reference."""
    with timer("grow"):
        ijk, sdf, w = lidar_band_samples(origin, points_w, cfg)
        if ijk.shape[0] == 0:
            return 0
        bricks, (sdf_sum, w_sum) = brick_accumulate(ijk, sdf * w, w)
    with timer("merge"):
        slots = layer.allocate(bricks)
    with timer("update"):
        update_bricks(layer, slots, sdf_sum, w_sum, cfg)
    return int(ijk.shape[0])


def integrate_depth(
    layer: BrickLayer,
    depth: torch.Tensor,
    K: torch.Tensor,
    T: torch.Tensor,
    color: torch.Tensor | None,
    cfg: TsdfConfig,
    max_range_m: float,
    timer,
) -> torch.Tensor:
    """One depth frame (metres, 0 = no return) into a TSDF layer (and its colour fields); returns the bricks
    updated (int64 ``[B, 3]``: those of the pixels' truncation bands)."""
    with timer("grow"):
        bricks = depth_band_bricks(depth, K, T, cfg, max_range_m)
        if bricks.shape[0] == 0:
            return bricks
    with timer("merge"):
        slots = layer.allocate(bricks)
    with timer("update"):
        _project_update(layer, bricks, slots, depth, K, T, color, cfg, max_range_m)
    return bricks


def _project_update(layer, bricks, slots, depth, K, T, color, cfg, max_range_m) -> int | torch.Tensor:
    """Projective update of every voxel of the frame's bricks; returns the voxels updated (an int, or on the
    Triton path a 0-dim device tensor, so the frame needs no host sync for it): one Triton launch on CUDA
    (``mapper.kernels.triton_project``), the torch reference elsewhere."""
    impl = _project_update_torch
    if layer.pool.capacity > 0:
        impl = kernel(depth.device, _project_update_torch, _project_update_triton)
    return impl(layer, bricks, slots, depth, K, T, color, cfg, max_range_m)


def _project_update_triton(layer, bricks, slots, depth, K, T, color, cfg, max_range_m) -> torch.Tensor:
    # lazy: Triton is optional (a CPU install imports this module without it)
    from ..kernels.triton_project import project_update_launch

    tau, s = cfg.tau, cfg.voxel_size_m
    return project_update_launch(
        layer.pool, bricks, slots, depth, K, T, color, tau, s, max_range_m, cfg.obs_weight, cfg.max_weight
    )


def _project_update_torch(layer, bricks, slots, depth, K, T, color, cfg, max_range_m) -> int:
    h, w = depth.shape
    s, tau = cfg.voxel_size_m, cfg.tau
    R, t = T[:3, :3], T[:3, 3]
    local = brick_local_coords(depth.device)
    updated = 0
    for sl in chunked_rays(bricks.shape[0], depth.device, rows=1 << 12):
        vox = (bricks[sl] * 4)[:, None, :] + local[None]  # [B, 64, 3]
        centres = (vox.to(torch.float64) + 0.5) * s
        pc = (centres.reshape(-1, 3) - t) @ R  # world -> camera: R^T (p - t)
        z = pc[:, 2]
        zs = z.clamp(min=1e-9)
        u = torch.floor(K[0, 0] * pc[:, 0] / zs + K[0, 2] + 0.5).to(torch.int64)
        v = torch.floor(K[1, 1] * pc[:, 1] / zs + K[1, 2] + 0.5).to(torch.int64)
        inside = (z > 0) & (u >= 0) & (u < w) & (v >= 0) & (v < h)
        pix = v.clamp(0, h - 1) * w + u.clamp(0, w - 1)
        d = depth.reshape(-1)[pix].to(torch.float64)
        valid = inside & torch.isfinite(d) & (d > 0) & (d <= max_range_m)
        sdf = d - z
        upd = valid & (sdf >= -tau)
        if not bool(upd.any()):
            continue
        idx = upd.nonzero().squeeze(1)
        slot = slots[sl].repeat_interleave(64)[idx]
        off = torch.arange(64, device=depth.device).repeat(vox.shape[0])[idx]
        obs = sdf[idx].clamp(max=tau).to(torch.float32)
        wt = torch.full_like(obs, cfg.obs_weight)
        update_running_average(layer, slot, off, obs * wt, wt, cfg)
        updated += idx.numel()
        if color is not None and "color" in layer.pool.fields:
            near = (sdf[idx].abs() < tau).nonzero().squeeze(1)
            if near.numel():
                cs, co = slot[near], off[near]
                rgb = color.reshape(-1, 3)[pix[idx][near]].to(torch.float32)
                c = layer.pool.gather("color", cs, co).to(torch.float32)
                cw = layer.pool.gather("color_weight", cs, co).to(torch.float32)
                wn = cw + cfg.obs_weight
                c_new = (c * cw[:, None] + rgb * cfg.obs_weight) / wn[:, None]
                layer.pool.scatter("color", cs, c_new.round().clamp(0, 255).to(torch.uint8), co)
                layer.pool.scatter("color_weight", cs, wn.clamp(max=cfg.max_weight), co)
    return updated


# ------------------------------------------------------------------------------------------ integrator
class TsdfIntegrator:
    """The TSDF integrator (the :class:`mapper.integrators.base.Integrator` contract): projective for a
    :class:`DepthFrame` (:func:`integrate_depth`), along the ray / the scan's normals for a
    :class:`LidarFrame` (:func:`integrate_lidar`)."""

    def __init__(self, config: TsdfConfig):
        self.config = config

    def integrate(self, frame: LidarFrame | DepthFrame, layer: BrickLayer, timer=no_timer) -> torch.Tensor:
        """Fuse ``frame`` into ``layer``; returns the bricks updated (int64 ``[B, 3]``)."""
        if isinstance(frame, DepthFrame):
            return integrate_depth(
                layer, frame.depth_m, frame.K, frame.T_world_sensor, frame.color, self.config,
                frame.max_range_m, timer,
            )  # fmt: skip
        return integrate_lidar(layer, frame.origin, frame.points_world, self.config, timer)

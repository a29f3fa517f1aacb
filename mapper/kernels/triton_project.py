"""Projective TSDF (and colour) update of a depth frame in one Triton launch (imported lazily).

Same computation as the torch reference ``mapper.integrators.tsdf._project_update_torch``: every voxel of
the frame's bricks is projected into the image (nearest pixel), gets ``sdf = depth - z`` where the pixel
is valid and ``sdf >= -tau``, and its tsdf/weight (and colour where ``|sdf| < tau``) are updated in place
through the pool's page tables. The bricks are unique, so each voxel is written by one lane: no atomics
(except one counter per program), no host sync, no compaction. Geometry in float64 as the reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_paged import n_iter_frame, page_base, page_of


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((r - x == 0.5) & odd, r - 1.0, r)


@triton.jit(do_not_specialize=["nb", "n_pages"])  # sizes vary per frame: no recompiles
def _project_kernel(
    bricks_ptr, slots_ptr, nb, depth_ptr, color_ptr, H, W, k_ptr, t_ptr, prm_ptr, obs_w, max_w,
    starts_ptr, n_pages, tsdf_ptrs, weight_ptrs, color_ptrs, cw_ptrs, count_ptr,
    HAS_COLOR: tl.constexpr, N_ITER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # float64 parameters from memory (a Python float kernel argument would be float32): K [3, 3] and
    # T [4, 4] as the frame holds them (row-major), voxel size / tau / max range kept on the device
    fx, fy, cx, cy = tl.load(k_ptr + 0), tl.load(k_ptr + 4), tl.load(k_ptr + 2), tl.load(k_ptr + 5)
    r00, r01, r02 = tl.load(t_ptr + 0), tl.load(t_ptr + 1), tl.load(t_ptr + 2)
    r10, r11, r12 = tl.load(t_ptr + 4), tl.load(t_ptr + 5), tl.load(t_ptr + 6)
    r20, r21, r22 = tl.load(t_ptr + 8), tl.load(t_ptr + 9), tl.load(t_ptr + 10)
    tx, ty, tz = tl.load(t_ptr + 3), tl.load(t_ptr + 7), tl.load(t_ptr + 11)
    s, tau, max_range = tl.load(prm_ptr + 0), tl.load(prm_ptr + 1), tl.load(prm_ptr + 2)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < nb * 64
    b = i // 64
    o = i % 64
    vi = tl.load(bricks_ptr + b * 3 + 0, mask=m, other=0) * 4 + (o >> 4)
    vj = tl.load(bricks_ptr + b * 3 + 1, mask=m, other=0) * 4 + ((o >> 2) & 3)
    vk = tl.load(bricks_ptr + b * 3 + 2, mask=m, other=0) * 4 + (o & 3)
    dx = (vi.to(tl.float64) + 0.5) * s - tx
    dy = (vj.to(tl.float64) + 0.5) * s - ty
    dz = (vk.to(tl.float64) + 0.5) * s - tz
    # world -> camera: R^T (p - t)
    px = dx * r00 + dy * r10 + dz * r20
    py = dx * r01 + dy * r11 + dz * r21
    pz = dx * r02 + dy * r12 + dz * r22
    zs = tl.maximum(pz, 1e-9)
    u = tl.floor(fx * px / zs + cx + 0.5).to(tl.int64)
    v = tl.floor(fy * py / zs + cy + 0.5).to(tl.int64)
    inside = m & (pz > 0) & (u >= 0) & (u < W) & (v >= 0) & (v < H)
    pix = tl.minimum(tl.maximum(v, 0), H - 1) * W + tl.minimum(tl.maximum(u, 0), W - 1)
    d = tl.load(depth_ptr + pix, mask=inside, other=0.0).to(tl.float64)
    valid = inside & (d == d) & (d > 0) & (d <= max_range)  # d == d: not NaN; d <= max_range: finite
    sdf = d - pz
    upd = valid & (sdf >= -tau)
    obs = tl.minimum(sdf, tau).to(tl.float32)
    slot = tl.load(slots_ptr + b, mask=m, other=0)
    page, start = page_of(starts_ptr, n_pages, slot, upd, N_ITER)
    local = (slot - start) * 64 + o
    tp = page_base(tsdf_ptrs, page, upd, tl.float16) + local
    wp = page_base(weight_ptrs, page, upd, tl.float16) + local
    t_old = tl.load(tp, mask=upd, other=0.0).to(tl.float32)
    w_old = tl.load(wp, mask=upd, other=0.0).to(tl.float32)
    wn = w_old + obs_w
    t_new = (t_old * w_old + obs * obs_w) / tl.maximum(wn, 1e-12)
    tl.store(tp, tl.minimum(tl.maximum(t_new, -tau), tau).to(tl.float16), mask=upd)
    tl.store(wp, tl.minimum(wn, max_w).to(tl.float16), mask=upd)
    if HAS_COLOR:
        near = upd & (tl.abs(sdf) < tau)
        cp = page_base(color_ptrs, page, near, tl.uint8) + local * 3
        cwp = page_base(cw_ptrs, page, near, tl.float16) + local
        cw = tl.load(cwp, mask=near, other=0.0).to(tl.float32)
        cwn = cw + obs_w
        for c in tl.static_range(3):
            rgb = tl.load(color_ptr + pix * 3 + c, mask=near, other=0).to(tl.float32)
            old = tl.load(cp + c, mask=near, other=0).to(tl.float32)
            new = _round_half_even((old * cw + rgb * obs_w) / cwn)
            tl.store(cp + c, tl.minimum(tl.maximum(new, 0.0), 255.0).to(tl.uint8), mask=near)
        tl.store(cwp, tl.minimum(cwn, max_w).to(tl.float16), mask=near)
    tl.atomic_add(count_ptr, tl.sum(upd.to(tl.int64), axis=0))


@functools.cache
def _scalars(s: float, tau: float, max_range: float, device: torch.device) -> torch.Tensor:
    """float64 ``[3]`` (voxel size, tau, max range) on ``device``, made once per map configuration."""
    return torch.tensor([s, tau, max_range], dtype=torch.float64).to(device)


def project_update_launch(pool, bricks, slots, depth, K, T, color, tau, s, max_range, obs_w, max_w):
    """Launch the kernel over the ``[B]`` bricks (int64 ``[B, 3]``) and their slots; returns the number of
    voxels updated as a 0-dim device tensor (no host sync unless the caller reads it)."""
    nb = bricks.shape[0]
    dev = depth.device
    count = torch.zeros(1, dtype=torch.int64, device=dev)
    if nb == 0:
        return 0
    h, w = depth.shape
    # K and T read where they are (no copy, no assembly: each op a launch); the scalars kept on the device
    k = K.detach().to(dev, torch.float64).contiguous()
    tt = T.detach().to(dev, torch.float64).contiguous()
    prm_t = _scalars(float(s), float(tau), float(max_range), dev)
    has_color = color is not None and "color" in pool.fields
    for name in ("tsdf", "weight", *(("color", "color_weight") if has_color else ())):
        pool.prepare_write(name, slots)  # copy-on-write of pages a published read view holds
    block = 256
    pt = pool.page_table
    n_pages = len(pool.page_starts) - 1
    col = color.contiguous() if has_color else depth
    cpt, cwpt = (pt("color"), pt("color_weight")) if has_color else (pt("tsdf"), pt("tsdf"))
    _project_kernel[(triton.cdiv(nb * 64, block),)](
        bricks.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous(), nb,
        depth.contiguous(), col, h, w, k, tt, prm_t, float(obs_w), float(max_w),
        pool.page_start_table(), n_pages, pt("tsdf"), pt("weight"), cpt, cwpt,
        count, HAS_COLOR=has_color, N_ITER=n_iter_frame(n_pages), BLOCK=block,
    )  # fmt: skip
    return count[0]

"""Triton kernels of ``nn.nearest_in_voxel_map`` and ``nn.icp_system``.

``_nearest_block`` (shared): for a block of queries, loop over the 8 or 27 candidate voxels; each voxel is
found by a binary search of its key in the sorted key array, skipped when its box is farther than the best
distance so far, and its ``K`` points are scanned (coordinates-major ``[C, 3, K]`` rows, so a warp reads
contiguous memory per coordinate).

``_icp_system_kernel`` fuses one whole ICP iteration: rotate + translate the source points (the pose comes
as 12 scalar arguments: no host->device copy), nearest map point, point-to-plane/point residual, robust
weight and the per-point Gauss-Newton terms, reduced per program into a row of 29 partial sums (no atomics:
deterministic). One launch per iteration and no host synchronisation inside it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .keys import VOXEL_KEY_BIAS, key_offsets

BLOCK = 64
ICP_BLOCK = 128
KERNEL_IDS = {"geman_mcclure": 0, "huber": 1, "none": 2}


@triton.jit
def _nearest_block(
    qx,
    qy,
    qz,
    live,
    keys_ptr,
    slots_ptr,
    pts_ptr,
    offk_ptr,
    offi_ptr,
    n_keys,
    voxel_size,
    shift,
    max_d2,
    key_bias,
    K: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    NEIGHBOURS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """(squared distance, ``slot * K + k`` or -1) of the nearest map point within ``max_d2``."""
    # loop bounds are constexprs: a runtime bound trips the interpreter with numpy >= 2.3 (see triton_dda)
    bi = tl.floor(qx / voxel_size - shift).to(tl.int64)
    bj = tl.floor(qy / voxel_size - shift).to(tl.int64)
    bk = tl.floor(qz / voxel_size - shift).to(tl.int64)
    base_key = ((bi + key_bias) << 42) | ((bj + key_bias) << 21) | (bk + key_bias)
    best = tl.zeros([BLOCK], dtype=tl.float32) + max_d2
    arg = tl.zeros([BLOCK], dtype=tl.int64) - 1
    for o in range(NEIGHBOURS):
        key = base_key + tl.load(offk_ptr + o)
        # squared distance from the query to the candidate voxel's box
        lo_x = (bi + tl.load(offi_ptr + 3 * o)).to(tl.float32) * voxel_size
        lo_y = (bj + tl.load(offi_ptr + 3 * o + 1)).to(tl.float32) * voxel_size
        lo_z = (bk + tl.load(offi_ptr + 3 * o + 2)).to(tl.float32) * voxel_size
        rx, ry, rz = qx - lo_x, qy - lo_y, qz - lo_z
        dx = tl.maximum(-rx, 0.0) + tl.maximum(rx - voxel_size, 0.0)
        dy = tl.maximum(-ry, 0.0) + tl.maximum(ry - voxel_size, 0.0)
        dz = tl.maximum(-rz, 0.0) + tl.maximum(rz - voxel_size, 0.0)
        box = dx * dx + dy * dy + dz * dz
        # lower bound of key in the sorted keys
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + n_keys
        for _ in range(SEARCH_STEPS):
            act = lo < hi
            mid = (lo + hi) // 2
            kv = tl.load(keys_ptr + mid, mask=live & act, other=0)
            right = kv < key
            lo = tl.where(act & right, mid + 1, lo)
            hi = tl.where(act & (kv >= key), mid, hi)
        inside = live & (lo < n_keys)
        kv = tl.load(keys_ptr + lo, mask=inside, other=-1)
        found = inside & (kv == key) & (box < best)
        slot = tl.load(slots_ptr + lo, mask=found, other=0)
        row = slot * 3 * K
        for k in range(K):
            px = tl.load(pts_ptr + row + k, mask=found, other=1.0e9)
            py = tl.load(pts_ptr + row + K + k, mask=found, other=1.0e9)
            pz = tl.load(pts_ptr + row + 2 * K + k, mask=found, other=1.0e9)
            ex = px - qx
            ey = py - qy
            ez = pz - qz
            d2 = ex * ex
            d2 += ey * ey
            d2 += ez * ez
            better = found & (d2 < best)
            best = tl.where(better, d2, best)
            arg = tl.where(better, slot * K + k, arg)
    return best, arg


# sizes are not specialised (a divisible-by-16 count would compile another variant mid-stream)
@triton.jit(do_not_specialize=["n_queries", "n_keys"])
def _nearest_kernel(
    q_ptr,
    keys_ptr,
    slots_ptr,
    pts_ptr,
    offk_ptr,
    offi_ptr,
    dist_ptr,
    idx_ptr,
    n_queries,
    n_keys,
    voxel_size,
    shift,
    max_d2,
    key_bias,
    K: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    NEIGHBOURS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < n_queries
    qx = tl.load(q_ptr + 3 * r, mask=live, other=0.0)
    qy = tl.load(q_ptr + 3 * r + 1, mask=live, other=0.0)
    qz = tl.load(q_ptr + 3 * r + 2, mask=live, other=0.0)
    best, arg = _nearest_block(
        qx, qy, qz, live, keys_ptr, slots_ptr, pts_ptr, offk_ptr, offi_ptr, n_keys, voxel_size, shift,
        max_d2, key_bias, K, SEARCH_STEPS, NEIGHBOURS, BLOCK,
    )  # fmt: skip
    hit = arg >= 0
    tl.store(dist_ptr + r, tl.where(hit, tl.sqrt(best), float("inf")), mask=live)
    tl.store(idx_ptr + r, arg, mask=live)


@triton.jit(do_not_specialize=["n_src", "n_keys"])
def _icp_system_kernel(
    src_ptr,  # float32 [N, 3] source points (sensor frame)
    keys_ptr,
    slots_ptr,
    pts_ptr,
    nrm_ptr,  # float32 [C, 3] voxel plane normals
    flat_ptr,  # float32 [C] weight of the point-to-point term
    offk_ptr,
    offi_ptr,
    out_ptr,  # float32 [programs, 29] partial sums
    n_src,
    n_keys,
    r00,
    r01,
    r02,
    r10,
    r11,
    r12,
    r20,
    r21,
    r22,
    tx,
    ty,
    tz,
    voxel_size,
    shift,
    max_d2,
    key_bias,
    scale,
    K: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    NEIGHBOURS: tl.constexpr,
    KERNEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    live = r < n_src
    sx = tl.load(src_ptr + 3 * r, mask=live, other=0.0)
    sy = tl.load(src_ptr + 3 * r + 1, mask=live, other=0.0)
    sz = tl.load(src_ptr + 3 * r + 2, mask=live, other=0.0)
    # local = R s (centred on the sensor: the update rotates about it), query = local + t
    lx = r00 * sx + r01 * sy + r02 * sz
    ly = r10 * sx + r11 * sy + r12 * sz
    lz = r20 * sx + r21 * sy + r22 * sz
    qx = lx + tx
    qy = ly + ty
    qz = lz + tz
    best, arg = _nearest_block(
        qx, qy, qz, live, keys_ptr, slots_ptr, pts_ptr, offk_ptr, offi_ptr, n_keys, voxel_size, shift,
        max_d2, key_bias, K, SEARCH_STEPS, NEIGHBOURS, BLOCK,
    )  # fmt: skip
    hit = live & (arg >= 0)
    a = tl.where(hit, arg, 0)
    slot = a // K
    k = a % K
    ex = qx - tl.load(pts_ptr + slot * 3 * K + k, mask=hit, other=0.0)
    ey = qy - tl.load(pts_ptr + slot * 3 * K + K + k, mask=hit, other=0.0)
    ez = qz - tl.load(pts_ptr + slot * 3 * K + 2 * K + k, mask=hit, other=0.0)
    nx = tl.load(nrm_ptr + slot * 3, mask=hit, other=0.0)
    ny = tl.load(nrm_ptr + slot * 3 + 1, mask=hit, other=0.0)
    nz = tl.load(nrm_ptr + slot * 3 + 2, mask=hit, other=0.0)
    beta = tl.load(flat_ptr + slot, mask=hit, other=0.0)
    rn = ex * nx + ey * ny + ez * nz
    e2 = ex * ex + ey * ey + ez * ez
    r2 = (1.0 - beta) * rn * rn + beta * e2
    if KERNEL == 0:  # Geman-McClure
        s2 = scale * scale
        w = s2 / (s2 + r2)
        w = w * w
    elif KERNEL == 1:  # Huber
        rr = tl.sqrt(r2)
        w = tl.where(rr <= scale, 1.0, scale / tl.maximum(rr, 1e-12))
    else:
        w = tl.zeros([BLOCK], dtype=tl.float32) + 1.0
    w = tl.where(hit, w, 0.0)
    wp = w * (1.0 - beta)  # point-to-plane weight: row j = [n, local x n], residual n.e
    wq = w * beta  # point-to-point weight: J = [I, -[local]x], residual e
    j3 = ly * nz - lz * ny
    j4 = lz * nx - lx * nz
    j5 = lx * ny - ly * nx
    l2 = lx * lx + ly * ly + lz * lz
    out = out_ptr + pid * 29
    # H (upper triangle, row-major: 00 01 02 03 04 05 11 12 13 14 15 22 23 24 25 33 34 35 44 45 55)
    tl.store(out + 0, tl.sum(wp * nx * nx + wq, 0))
    tl.store(out + 1, tl.sum(wp * nx * ny, 0))
    tl.store(out + 2, tl.sum(wp * nx * nz, 0))
    tl.store(out + 3, tl.sum(wp * nx * j3, 0))
    tl.store(out + 4, tl.sum(wp * nx * j4 + wq * lz, 0))
    tl.store(out + 5, tl.sum(wp * nx * j5 - wq * ly, 0))
    tl.store(out + 6, tl.sum(wp * ny * ny + wq, 0))
    tl.store(out + 7, tl.sum(wp * ny * nz, 0))
    tl.store(out + 8, tl.sum(wp * ny * j3 - wq * lz, 0))
    tl.store(out + 9, tl.sum(wp * ny * j4, 0))
    tl.store(out + 10, tl.sum(wp * ny * j5 + wq * lx, 0))
    tl.store(out + 11, tl.sum(wp * nz * nz + wq, 0))
    tl.store(out + 12, tl.sum(wp * nz * j3 + wq * ly, 0))
    tl.store(out + 13, tl.sum(wp * nz * j4 - wq * lx, 0))
    tl.store(out + 14, tl.sum(wp * nz * j5, 0))
    tl.store(out + 15, tl.sum(wp * j3 * j3 + wq * (l2 - lx * lx), 0))
    tl.store(out + 16, tl.sum(wp * j3 * j4 - wq * lx * ly, 0))
    tl.store(out + 17, tl.sum(wp * j3 * j5 - wq * lx * lz, 0))
    tl.store(out + 18, tl.sum(wp * j4 * j4 + wq * (l2 - ly * ly), 0))
    tl.store(out + 19, tl.sum(wp * j4 * j5 - wq * ly * lz, 0))
    tl.store(out + 20, tl.sum(wp * j5 * j5 + wq * (l2 - lz * lz), 0))
    # g = sum w (1 - beta) j (n.e) + w beta J^T e, J^T e = [e, local x e]
    tl.store(out + 21, tl.sum(wp * nx * rn + wq * ex, 0))
    tl.store(out + 22, tl.sum(wp * ny * rn + wq * ey, 0))
    tl.store(out + 23, tl.sum(wp * nz * rn + wq * ez, 0))
    tl.store(out + 24, tl.sum(wp * j3 * rn + wq * (ly * ez - lz * ey), 0))
    tl.store(out + 25, tl.sum(wp * j4 * rn + wq * (lz * ex - lx * ez), 0))
    tl.store(out + 26, tl.sum(wp * j5 * rn + wq * (lx * ey - ly * ex), 0))
    tl.store(out + 27, tl.sum(tl.where(hit, 1.0, 0.0), 0))
    tl.store(out + 28, tl.sum(tl.where(hit, r2, 0.0), 0))


def _search_args(keys: torch.Tensor, neighbourhood: int, device: torch.device):
    """(key offsets, ijk offsets, shift, binary-search steps) shared by both launches."""
    r = (0, 1) if neighbourhood == 8 else (-1, 0, 1)
    offi = torch.tensor([(a, b, c) for a in r for b in r for c in r], dtype=torch.int64, device=device)
    # binary-search steps are a constexpr (see the loop-bound note): rounded up to 8, 16 or 24 so that a
    # growing map triggers at most a couple of compilations (extra steps are masked no-ops)
    steps = 8 * math.ceil((math.ceil(math.log2(keys.shape[0] + 1)) + 1) / 8)
    return key_offsets(neighbourhood, device), offi.reshape(-1), 0.5 if neighbourhood == 8 else 0.0, steps


def nearest_in_voxel_map_kernel_launch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_nearest_kernel` (arguments as ``nn.nearest_in_voxel_map_torch``)."""
    n, dev = queries.shape[0], queries.device
    dist = torch.full((n,), float("inf"), dtype=torch.float32, device=dev)
    index = torch.full((n,), -1, dtype=torch.int64, device=dev)
    V = keys.shape[0]
    if n == 0 or V == 0:
        return dist, index
    offk, offi, shift, steps = _search_args(keys, neighbourhood, dev)
    _nearest_kernel[(triton.cdiv(n, BLOCK),)](
        queries.contiguous(), keys.contiguous(), slots.contiguous(), points.contiguous(), offk, offi,
        dist, index, n, V, float(voxel_size), shift, float(max_distance) ** 2, VOXEL_KEY_BIAS,
        K=points.shape[2], SEARCH_STEPS=steps, NEIGHBOURS=neighbourhood, BLOCK=BLOCK,
    )  # fmt: skip
    return dist, index


def icp_system_kernel_launch(
    source: torch.Tensor,
    pose: tuple[float, ...],
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    normals: torch.Tensor,
    flatness: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int,
    kernel: str,
    scale: float,
) -> torch.Tensor:
    """Launch :func:`_icp_system_kernel` (arguments as ``nn.icp_system_torch``); float64 ``[29]``."""
    n, dev = source.shape[0], source.device
    if n == 0 or keys.shape[0] == 0:
        return torch.zeros(29, dtype=torch.float64, device=dev)
    offk, offi, shift, steps = _search_args(keys, neighbourhood, dev)
    grid = triton.cdiv(n, ICP_BLOCK)
    partial = torch.empty((grid, 29), dtype=torch.float32, device=dev)
    _icp_system_kernel[(grid,)](
        source.contiguous(), keys.contiguous(), slots.contiguous(), points.contiguous(),
        normals.contiguous(), flatness.contiguous(), offk, offi, partial, n, keys.shape[0],
        *(float(x) for x in pose), float(voxel_size), shift, float(max_distance) ** 2, VOXEL_KEY_BIAS,
        float(scale), K=points.shape[2], SEARCH_STEPS=steps, NEIGHBOURS=neighbourhood,
        KERNEL=KERNEL_IDS[kernel], BLOCK=ICP_BLOCK,
    )  # fmt: skip
    return partial.sum(0, dtype=torch.float64)

"""Triton kernels behind :func:`mapper.kernels.segments.brick_segments` and ``walk_segments`` (imported
lazily: triton is optional).

* ``_coarse_kernel`` (one program per ``BLOCK`` rays): the brick-resolution DDA of ``dda_torch``, written
  as CSR: ray ``r`` owns rows ``start[r] .. start[r+1]`` of ``seg_ray``/``seg_key``; its capacity is
  ``sum |b1 - b0| + 4`` (the cells between its start and end bricks, plus one per axis for a rounding
  overshoot); unused rows get ray ``-1`` and key ``-1``. One host sync (the total, to size the output).
  The loop bound is the power-of-two bucket of the largest capacity (a constexpr: few compiled variants,
  and the interpreter needs constant loop bounds); rows past a ray's capacity are not stored.
* ``_walk_kernel`` (one program per ``BLOCK`` segments): up to 10 voxels per segment, unrolled; occupancy
  stores a byte flag (plain stores: every writer writes 1), the TSDF band two float32 ``atomic_add``.
* ``_dense_flat_kernel`` (the dense path of ``unique_brick_ranks``): each key's cell in the bricks' box
  and the box's bitmap, in one pass.

Float scalars reach kernels as fp32 when passed as Python floats, so voxel size, cell and tau travel in a
float64 tensor. Integer arguments that change from frame to frame (counts, the bricks' box) are
``do_not_specialize``: Triton would otherwise compile a variant per residue (``== 1``, ``% 16 == 0``) of
each, mid-stream (seen as compile spikes after the warm-up, see NOTES). Both walk kernels are compiled
with ``enable_fp_fusion=False``: no FMA contraction, the same rounding as the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .keys import BRICK_HI, BRICK_LO
from .keys import VOXEL_KEY_BIAS as KEY_BIAS
from .keys import VOXEL_KEY_BITS as KEY_BITS
from .segments import BAND, MISS, WALK_STEPS
from .triton_dda import _axis_setup, _dda_step  # the voxel traversal's set-up and step

_INF = tl.constexpr(float("inf"))
_BLOCK_COARSE = 128  # 68 registers, no spills
_BLOCK_WALK = 128  # one segment per thread (4 warps): ~90 registers, no spills (ptxas, sm_90)


# sizes vary per frame, the origin is one row expanded (stride 0) or a row per ray (stride 3), and chunks of
# a frame start at any ray (pointers not 16-byte aligned): none of these may make a new variant mid-stream
@triton.jit(do_not_specialize=["n", "o_stride", "o_ptr", "d_ptr", "t0_ptr", "t1_ptr", "start_ptr"])
def _coarse_kernel(
    o_ptr,
    o_stride,
    d_ptr,
    t0_ptr,
    t1_ptr,
    start_ptr,  # int64 [n + 1]: CSR row offsets
    prm_ptr,  # float64 [1]: cell
    seg_ray_ptr,  # int32 [total]
    seg_key_ptr,  # int64 [total]
    n,
    S_BOUND: tl.constexpr,
    BLOCK: tl.constexpr,
    KBITS: tl.constexpr,
    KBIAS: tl.constexpr,
    BLO: tl.constexpr,
    BHI: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    cell = tl.load(prm_ptr)
    ox = tl.load(o_ptr + r * o_stride + 0, mask=m, other=0.0)
    oy = tl.load(o_ptr + r * o_stride + 1, mask=m, other=0.0)
    oz = tl.load(o_ptr + r * o_stride + 2, mask=m, other=0.0)
    dx = tl.load(d_ptr + r * 3 + 0, mask=m, other=1.0)
    dy = tl.load(d_ptr + r * 3 + 1, mask=m, other=0.0)
    dz = tl.load(d_ptr + r * 3 + 2, mask=m, other=0.0)
    t0 = tl.load(t0_ptr + r, mask=m, other=0.0)
    t1 = tl.load(t1_ptr + r, mask=m, other=0.0)
    start = tl.load(start_ptr + r, mask=m, other=0)
    cap = tl.load(start_ptr + r + 1, mask=m, other=0) - start
    vx, tmx, tdx, sx = _axis_setup(ox, dx, t0, cell)
    vy, tmy, tdy, sy = _axis_setup(oy, dy, t0, cell)
    vz, tmz, tdz, sz = _axis_setup(oz, dz, t0, cell)
    first = t0 <= t1
    t = t0
    for k in range(S_BOUND):
        w = m & (k < cap)
        ok = (t < t1) | (first & (k == 0))
        inr = (vx >= BLO) & (vx < BHI) & (vy >= BLO) & (vy < BHI) & (vz >= BLO) & (vz < BHI)
        key = ((vx + KBIAS) << (2 * KBITS)) | ((vy + KBIAS) << KBITS) | (vz + KBIAS)
        key = tl.where(ok & inr, key, -1)
        tl.store(seg_key_ptr + start + k, key, mask=w)
        tl.store(seg_ray_ptr + start + k, tl.where(ok, r, -1).to(tl.int32), mask=w)
        vx, vy, vz, tmx, tmy, tmz, t = _dda_step(vx, vy, vz, tmx, tmy, tmz, sx, sy, sz, tdx, tdy, tdz)


def brick_segments_triton(origins, dirs, t0, t1, cell: float, max_rows: int | None = None):
    """Same contract as :func:`mapper.kernels.segments.brick_segments_torch`; ray ``r`` owns rows
    ``start[r] .. start[r + 1]``, the unused ones padding (None when those rows exceed ``max_rows``)."""
    n = dirs.shape[0]
    dev = dirs.device
    o = origins.to(torch.float64)
    if o.dim() == 1:
        o = o.expand(n, 3)
    if o.stride(1) != 1 or o.stride(0) not in (0, 3):
        o = o.contiguous()
    d = dirs.to(torch.float64).contiguous()
    a = t0.to(torch.float64).contiguous()
    e = t1.to(torch.float64).contiguous()
    # capacity per ray and the bricks' box in one launch (see coarse_caps_torch), then the CSR offsets
    cap, caps = coarse_caps_triton(o, d, a, e, cell)
    start = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(cap, 0, out=start[1:])
    vals = torch.cat((caps[:6], start[-1:], caps[6:])).tolist()  # the one sync: box, total, largest cap
    total, cmax = vals[6], vals[7]
    if max_rows is not None and total > max_rows:
        return None
    seg_ray = torch.empty(total, dtype=torch.int32, device=dev)
    seg_key = torch.empty(total, dtype=torch.int64, device=dev)
    prm = device_params(dev, cell)
    _coarse_kernel[(triton.cdiv(n, _BLOCK_COARSE),)](
        o,
        o.stride(0),
        d,
        a,
        e,
        start,
        prm,
        seg_ray,
        seg_key,
        n,
        S_BOUND=1 << max(4, (int(cmax) - 1).bit_length()),  # >= 16: TSDF bands stay in one variant
        BLOCK=_BLOCK_COARSE,
        KBITS=KEY_BITS,
        KBIAS=KEY_BIAS,
        BLO=BRICK_LO,
        BHI=BRICK_HI,
        enable_fp_fusion=False,
    )
    return seg_ray, seg_key, [vals[0:3], vals[3:6]]


@triton.jit(do_not_specialize=["n", "o_stride", "o_ptr", "d_ptr", "t0_ptr", "t1_ptr"])  # as _coarse_kernel
def _coarse_caps_kernel(
    o_ptr, o_stride, d_ptr, t0_ptr, t1_ptr, prm_ptr, cap_ptr, caps_ptr, n,
    BLO: tl.constexpr, BHI: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    cell = tl.load(prm_ptr)
    a = tl.load(t0_ptr + r, mask=m, other=0.0)
    e = tl.load(t1_ptr + r, mask=m, other=0.0)
    span = tl.zeros([BLOCK], dtype=tl.float64)
    for k in tl.static_range(3):
        o = tl.load(o_ptr + r * o_stride + k, mask=m, other=0.0)
        d = tl.load(d_ptr + r * 3 + k, mask=m, other=0.0)
        b0 = tl.floor((o + d * a) / cell)  # launched without fp fusion: the torch reference's rounding
        b1 = tl.floor((o + d * e) / cell)
        span += tl.abs(b1 - b0)
        lo = tl.minimum(tl.maximum(tl.minimum(b0, b1) - 1, BLO), BHI - 1)
        hi = tl.minimum(tl.maximum(tl.maximum(b0, b1) + 1, BLO), BHI - 1)
        tl.atomic_min(caps_ptr + k, tl.min(tl.where(m, lo, BHI - 1), axis=0).to(tl.int64), sem="relaxed")
        tl.atomic_max(caps_ptr + 3 + k, tl.max(tl.where(m, hi, BLO), axis=0).to(tl.int64), sem="relaxed")
    cap = tl.where(a <= e, span.to(tl.int64) + 4, 1)
    tl.store(cap_ptr + r, cap, mask=m)
    tl.atomic_max(caps_ptr + 6, tl.max(tl.where(m, cap, 0), axis=0), sem="relaxed")


_CAPS_INIT: dict[torch.device, torch.Tensor] = {}


def coarse_caps_triton(origins, dirs, t0, t1, cell: float):
    """Triton version of :func:`mapper.kernels.segments.coarse_caps_torch` (same arguments and result; one
    launch, the box and the largest capacity reduced by atomics)."""
    n = dirs.shape[0]
    dev = dirs.device
    o = origins.to(torch.float64)
    if o.dim() == 1:
        o = o.expand(n, 3)
    if o.stride(1) != 1 or o.stride(0) not in (0, 3):
        o = o.contiguous()
    init = _CAPS_INIT.get(dev)
    if init is None:  # [lo x3 = BRICK_HI - 1, hi x3 = BRICK_LO, largest capacity 0], uploaded once
        init = torch.tensor([BRICK_HI - 1] * 3 + [BRICK_LO] * 3 + [0], dtype=torch.int64).to(dev)
        _CAPS_INIT[dev] = init
    caps = init.clone()
    cap = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        _coarse_caps_kernel[(triton.cdiv(n, _BLOCK_COARSE),)](
            o, o.stride(0), dirs.to(torch.float64).contiguous(), t0.to(torch.float64).contiguous(),
            t1.to(torch.float64).contiguous(), device_params(dev, cell), cap, caps, n,
            BLO=BRICK_LO, BHI=BRICK_HI, BLOCK=_BLOCK_COARSE, enable_fp_fusion=False,
        )  # fmt: skip
    return cap, caps


_PARAMS: dict[tuple, torch.Tensor] = {}


def device_params(dev: torch.device, *values: float) -> torch.Tensor:
    """float64 ``[len(values)]`` on ``dev``, kept between frames (kernels only read it): no per-frame fill
    launches for a map's constant parameters."""
    key = (dev, *(float(x) for x in values))
    t = _PARAMS.get(key)
    if t is None:
        if len(_PARAMS) > 256:  # many maps / voxel sizes: start over (bounded)
            _PARAMS.clear()
        t = torch.tensor([float(x) for x in values], dtype=torch.float64).to(dev)
        _PARAMS[key] = t
    return t


@triton.jit
def _entry_axis(pe, d, s, lo):
    """Per axis at the entry point: floor, and whether it lies exactly on the brick's entry face or on
    an interior voxel boundary."""
    cf = tl.floor(pe / s)
    exact = (d != 0) & (cf * s == pe)
    c = cf.to(tl.int64)
    entry_face = exact & (c == lo + tl.where(d < 0, 4, 0))
    interior = exact & (c > lo) & (c < lo + 4)
    return c, entry_face, interior


@triton.jit(do_not_specialize=["n"])  # sizes vary per frame: no recompiles
def _walk_kernel(
    o_ptr,
    o_stride,
    d_ptr,
    t0_ptr,
    t1_ptr,
    rng_ptr,  # float64 [R] (BAND) or any float64 pointer (MISS)
    ray_ptr,  # int32 [n]
    rank_ptr,  # int32 [n]
    bricks_ptr,  # int32 [U, 3]
    prm_ptr,  # float64 [2]: voxel size, tau
    out_a,  # MISS: uint8 flags; BAND: float32 sdf * w sums
    out_b,  # BAND: float32 w sums
    nrm_ptr,  # PROJ: float64 [R, 3] normals (zero rows: along-ray)
    rw_ptr,  # PROJ: float32 [R] ray weights
    n,
    weight,
    MODE: tl.constexpr,
    PROJ: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    ray = tl.load(ray_ptr + i, mask=m, other=-1)
    rank = tl.load(rank_ptr + i, mask=m, other=-1)
    go = m & (ray >= 0) & (rank >= 0)
    ray = tl.where(go, ray, 0).to(tl.int64)
    rank = tl.where(go, rank, 0).to(tl.int64)
    s = tl.load(prm_ptr)
    tau = tl.load(prm_ptr + 1)
    lox = tl.load(bricks_ptr + rank * 3 + 0, mask=go, other=0).to(tl.int64) * 4
    loy = tl.load(bricks_ptr + rank * 3 + 1, mask=go, other=0).to(tl.int64) * 4
    loz = tl.load(bricks_ptr + rank * 3 + 2, mask=go, other=0).to(tl.int64) * 4
    ox = tl.load(o_ptr + ray * o_stride + 0, mask=go, other=0.0)
    oy = tl.load(o_ptr + ray * o_stride + 1, mask=go, other=0.0)
    oz = tl.load(o_ptr + ray * o_stride + 2, mask=go, other=0.0)
    dx = tl.load(d_ptr + ray * 3 + 0, mask=go, other=1.0)
    dy = tl.load(d_ptr + ray * 3 + 1, mask=go, other=0.0)
    dz = tl.load(d_ptr + ray * 3 + 2, mask=go, other=0.0)
    a = tl.load(t0_ptr + ray, mask=go, other=0.0)
    e = tl.load(t1_ptr + ray, mask=go, other=0.0)
    p0x = ox + dx * a
    p0y = oy + dy * a
    p0z = oz + dz * a
    ix = tl.where(dx != 0, 1.0 / tl.where(dx != 0, dx, 1.0), _INF)
    iy = tl.where(dy != 0, 1.0 / tl.where(dy != 0, dy, 1.0), _INF)
    iz = tl.where(dz != 0, 1.0 / tl.where(dz != 0, dz, 1.0), _INF)
    # entry into the brick: the slab entries of its three axes (faces behind the direction)
    tfx = tl.where(dx != 0, a + ((lox + tl.where(dx < 0, 4, 0)).to(tl.float64) * s - p0x) * ix, -_INF)
    tfy = tl.where(dy != 0, a + ((loy + tl.where(dy < 0, 4, 0)).to(tl.float64) * s - p0y) * iy, -_INF)
    tfz = tl.where(dz != 0, a + ((loz + tl.where(dz < 0, 4, 0)).to(tl.float64) * s - p0z) * iz, -_INF)
    t = tl.maximum(a, tl.maximum(tl.maximum(tfx, tfy), tfz))
    # the brick's first voxel (see segments._entry_voxel): floor at the entry point, clamped into the
    # brick; a tied interior boundary is crossed when a later axis enters (the DDA steps x, y, z)
    entered = t > a
    cx, efx, inx = _entry_axis(ox + dx * t, dx, s, lox)
    cy, efy, iny = _entry_axis(oy + dy * t, dy, s, loy)
    cz, efz, inz = _entry_axis(oz + dz * t, dz, s, loz)
    stx = efy | efz
    vx = tl.minimum(tl.maximum(cx, lox), lox + 3) - (entered & inx & ((dx > 0) ^ stx)).to(tl.int64)
    vy = tl.minimum(tl.maximum(cy, loy), loy + 3) - (entered & iny & ((dy > 0) ^ efz)).to(tl.int64)
    vz = tl.minimum(tl.maximum(cz, loz), loz + 3) - (entered & inz & (dz > 0)).to(tl.int64)
    px = tl.where(dx > 0, 1, 0).to(tl.int64)
    py = tl.where(dy > 0, 1, 0).to(tl.int64)
    pz = tl.where(dz > 0, 1, 0).to(tl.int64)
    sx = tl.where(dx > 0, 1, tl.where(dx < 0, -1, 0)).to(tl.int64)
    sy = tl.where(dy > 0, 1, tl.where(dy < 0, -1, 0)).to(tl.int64)
    sz = tl.where(dz > 0, 1, tl.where(dz < 0, -1, 0)).to(tl.int64)
    # the DDA from the brick's first voxel: crossings t0 + (boundary - p0) / d, then + s / |d| per step
    tdx = s * tl.abs(ix)
    tdy = s * tl.abs(iy)
    tdz = s * tl.abs(iz)
    tmx = tl.where(dx != 0, a + ((vx + px).to(tl.float64) * s - p0x) * ix, _INF)
    tmy = tl.where(dy != 0, a + ((vy + py).to(tl.float64) * s - p0y) * iy, _INF)
    tmz = tl.where(dz != 0, a + ((vz + pz).to(tl.float64) * s - p0z) * iz, _INF)
    if MODE == 1:
        r = tl.load(rng_ptr + ray, mask=go, other=0.0)
        wt = tl.full((BLOCK,), 1.0, tl.float32) * weight
        if PROJ:
            nx = tl.load(nrm_ptr + ray * 3 + 0, mask=go, other=0.0)
            ny = tl.load(nrm_ptr + ray * 3 + 1, mask=go, other=0.0)
            nz = tl.load(nrm_ptr + ray * 3 + 2, mask=go, other=0.0)
            has_n = (nx != 0) | (ny != 0) | (nz != 0)
            q = r * ((dx * nx + dy * ny) + dz * nz)  # plane_offsets' rounding (no fp fusion)
            wt = tl.load(rw_ptr + ray, mask=go, other=0.0)
    for k in tl.static_range(STEPS):
        if k > 0:
            inside = (vx >= lox) & (vx <= lox + 3) & (vy >= loy) & (vy <= loy + 3)
            inside = inside & (vz >= loz) & (vz <= loz + 3)
            go = go & (t < e) & inside
        idx = rank * 64 + (((vx & 3) << 4) | ((vy & 3) << 2) | (vz & 3))
        if MODE == 0:
            tl.store(out_a + idx, tl.full((BLOCK,), 1, tl.uint8), mask=go)
        else:
            cx = (vx.to(tl.float64) + 0.5) * s - ox
            cy = (vy.to(tl.float64) + 0.5) * s - oy
            cz = (vz.to(tl.float64) + 0.5) * s - oz
            sdf = r - tl.sqrt(cx * cx + cy * cy + cz * cz)
            if PROJ:
                pr = (cx * nx + cy * ny + cz * nz) - q
                skip = has_n & (sdf < 0) & (pr > 0)  # behind the return, in front of its plane
                sdf = tl.where(has_n, pr, sdf)
                keep = go & (sdf >= -tau) & (~skip)
            else:
                keep = go & (sdf >= -tau)
            val = tl.minimum(sdf, tau).to(tl.float32)
            tl.atomic_add(out_a + idx, val * wt, mask=keep, sem="relaxed")
            tl.atomic_add(out_b + idx, wt, mask=keep, sem="relaxed")
        if k < STEPS - 1:
            vx, vy, vz, tmx, tmy, tmz, t = _dda_step(vx, vy, vz, tmx, tmy, tmz, sx, sy, sz, tdx, tdy, tdz)


def walk_segments_triton(
    mode,
    origins,
    dirs,
    t0,
    t1,
    rng,
    seg_ray,
    seg_rank,
    bricks,
    voxel_size,
    out,
    tau=0.0,
    weight=1.0,
    normals=None,
    ray_weight=None,
) -> None:
    """Same contract as :func:`mapper.kernels.segments.walk_segments_torch`; one launch."""
    n = seg_ray.numel()
    if n == 0:
        return
    r = dirs.shape[0]
    o = origins.to(torch.float64)
    if o.dim() == 1:
        o = o.expand(r, 3)
    if o.stride(1) != 1 or o.stride(0) not in (0, 3):
        o = o.contiguous()
    d = dirs.to(torch.float64).contiguous()
    a = t0.to(torch.float64).contiguous()
    e = t1.to(torch.float64).contiguous()
    rg = rng.to(torch.float64).contiguous() if mode == BAND else a
    prm = device_params(dirs.device, voxel_size, tau)
    if mode == MISS:
        (flags,) = out
        out_a = out_b = flags
    else:
        out_a, out_b = out
    for x in (out_a, out_b):
        assert x.is_contiguous()
    proj = mode == BAND and normals is not None
    if proj:
        nrm = normals.to(torch.float64).contiguous()
        rw = ray_weight.to(torch.float32).contiguous()
    else:
        nrm = a
        rw = out_b
    _walk_kernel[(triton.cdiv(n, _BLOCK_WALK),)](
        o,
        o.stride(0),
        d,
        a,
        e,
        rg,
        seg_ray.to(torch.int32).contiguous(),
        seg_rank.to(torch.int32).contiguous(),
        bricks.to(torch.int32).contiguous(),
        prm,
        out_a,
        out_b,
        nrm,
        rw,
        n,
        float(weight),
        MODE=int(mode),
        PROJ=proj,
        STEPS=WALK_STEPS,
        BLOCK=_BLOCK_WALK,
        enable_fp_fusion=False,
    )


@triton.jit(
    do_not_specialize=["n", "l0", "l1", "l2", "e0", "e1", "e2", "cells"]
)  # sizes vary per frame: no recompiles
def _dense_flat_kernel(
    key_ptr,  # int64 [n]
    flat_ptr,  # int32 [n]
    seen_ptr,  # uint8 [cells + 1]
    n,
    l0,
    l1,
    l2,
    e0,
    e1,
    e2,
    cells,
    KBITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    k = tl.load(key_ptr + i, mask=m, other=-1)
    mk = (1 << KBITS) - 1
    ci = ((k >> (2 * KBITS)) & mk) - l0
    cj = ((k >> KBITS) & mk) - l1
    ck = (k & mk) - l2
    ok = (k >= 0) & (ci >= 0) & (ci < e0) & (cj >= 0) & (cj < e1) & (ck >= 0) & (ck < e2)
    f = tl.where(ok, (ci * e1 + cj) * e2 + ck, cells)
    tl.store(flat_ptr + i, f.to(tl.int32), mask=m)
    tl.store(seen_ptr + f, tl.full((BLOCK,), 1, tl.uint8), mask=m)


def dense_flat_triton(keys: torch.Tensor, lo, ext, cells: int, seen: torch.Tensor) -> torch.Tensor:
    """int32 row-major index of each key's brick in the box ``lo + [0, ext)`` (``cells`` for ``-1`` keys
    and keys outside the box), and ``seen[index] = 1``: one pass (see ``segments.unique_brick_ranks``)."""
    n = keys.numel()
    flat = torch.empty(n, dtype=torch.int32, device=keys.device)
    if n:
        _dense_flat_kernel[(triton.cdiv(n, 1024),)](
            keys.contiguous(),
            flat,
            seen,
            n,
            int(lo[0]) + KEY_BIAS,
            int(lo[1]) + KEY_BIAS,
            int(lo[2]) + KEY_BIAS,
            int(ext[0]),
            int(ext[1]),
            int(ext[2]),
            int(cells),
            KBITS=KEY_BITS,
            BLOCK=1024,
        )
    return flat

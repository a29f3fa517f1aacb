"""Fused point queries on brick layers: one Triton launch per call (imported lazily).

Per point: the 8 trilinear corner voxels, each looked up in the layer (tile binary search -> leaf ->
brick slot -> page -> value, the same path as ``IndexGrid.ijk_to_leaf`` + ``BrickLayer.voxel_slots`` +
``PagedPool.gather``), then the interpolant and its gradient. The torch references are
``Map.query_distance`` on the CPU path (``mapper.queries``); same semantics: a value
needs all 8 corners observed, else NaN / ``observed = False``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .keys import COORD_LIMIT_VOX, TILE_AXIS_BITS, TILE_BIAS, VOXEL_LIMIT
from .triton_ops import _leaf_in_tile, _n_iter_frame
from .triton_paged import n_iter_frame, page_base, page_of
from .views import LayerView

COORD_LIMIT = tl.constexpr(float(COORD_LIMIT_VOX))  # |voxel coordinate| of a query point (keys.py)


@triton.jit
def _find_tile_loop(tkeys_ptr, n_tiles, key, valid, N_ITER: tl.constexpr):
    """``triton_ops._find_tile`` with a rolled loop (this kernel calls it 24 times: unrolled, the compile
    took over a minute)."""
    lo = tl.zeros(key.shape, tl.int64)
    hi = tl.zeros(key.shape, tl.int64) + n_tiles
    for _ in range(N_ITER):
        mid = (lo + hi) >> 1
        live = lo < hi
        km = tl.load(tkeys_ptr + mid, mask=live & valid, other=0)
        right = km < key
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & (~right), mid, hi)
    kf = tl.load(tkeys_ptr + lo, mask=valid & (lo < n_tiles), other=-1)
    return tl.where(valid & (lo < n_tiles) & (kf == key), lo, -1)


@triton.jit
def _lookup(i, j, k, valid, tkeys, tmask, tstart, n_tiles, slots_ptr, pstarts, n_pages, NT: tl.constexpr,
            NP: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr, AXB: tl.constexpr):  # fmt: skip
    """(present, page, element index in the page) of voxels (i, j, k) in a brick layer."""
    ok = valid & (i >= -LIMIT) & (i < LIMIT) & (j >= -LIMIT) & (j < LIMIT) & (k >= -LIMIT) & (k < LIMIT)
    tkey = (((i >> 5) + BIAS) << (2 * AXB)) | (((j >> 5) + BIAS) << AXB) | ((k >> 5) + BIAS)
    t = _find_tile_loop(tkeys, n_tiles, tkey, ok, NT)
    pos = (((i >> 3) & 3) << 4) | (((j >> 3) & 3) << 2) | ((k >> 3) & 3)
    leaf = _leaf_in_tile(t, pos, tmask, tstart)
    has = leaf >= 0
    b = (((i >> 2) & 1) << 2) | (((j >> 2) & 1) << 1) | ((k >> 2) & 1)
    slot = tl.load(slots_ptr + leaf * 8 + b, mask=has, other=-1).to(tl.int64)
    has = has & (slot >= 0)
    page, start = page_of(pstarts, n_pages, slot, has, NP)
    local = (slot - start) * 64 + ((((i & 3) << 4) | ((j & 3) << 2)) | (k & 3))
    return has, page, local


@triton.jit(do_not_specialize=["n", "nt0", "np0", "nt1", "np1", "nt2", "np2"])  # sizes: no recompiles
def _distance_kernel(
    p_ptr, n, prm_ptr,
    tk0, tm0, ts0, nt0, sl0, ps0, np0, fa0, fb0,
    tk1, tm1, ts1, nt1, sl1, ps1, np1, f1,
    tk2, tm2, ts2, nt2, sl2, ps2, np2, f2,
    val_ptr, grad_ptr, obs_ptr,
    HAS1: tl.constexpr, HAS2: tl.constexpr,
    NT0: tl.constexpr, NP0: tl.constexpr, NT1: tl.constexpr, NP1: tl.constexpr,
    NT2: tl.constexpr, NP2: tl.constexpr,
    LIMIT: tl.constexpr, BIAS: tl.constexpr, AXB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Layer 0 = ESDF (fa0: esdf float32, fb0: observed as bytes); absent corners hold ``fill`` (the max
    distance) and are observed where layer 1 (TSDF: weight > 0) or layer 2 (occupancy: log-odds not NaN)
    saw them. Writes the value over the observed corners (``mapper.queries.observed_trilinear``: NaN when
    none is), the gradient of that interpolant (zeros then) and observed (some corner observed).
    ``prm``: float64 [1 / voxel size, fill]."""
    inv_s = tl.load(prm_ptr + 0)  # torch divides by a Python scalar as a multiply by its reciprocal
    fill = tl.load(prm_ptr + 1).to(tl.float32)
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = q < n
    x = tl.load(p_ptr + q * 3 + 0, mask=m, other=0.0)
    y = tl.load(p_ptr + q * 3 + 1, mask=m, other=0.0)
    z = tl.load(p_ptr + q * 3 + 2, mask=m, other=0.0)
    inf = float("inf")
    fin = (tl.abs(x) < inf) & (tl.abs(y) < inf) & (tl.abs(z) < inf)
    qx = tl.where(fin, x * inv_s - 0.5, 0.0)
    qy = tl.where(fin, y * inv_s - 0.5, 0.0)
    qz = tl.where(fin, z * inv_s - 0.5, 0.0)
    lim = COORD_LIMIT
    ok = m & fin & (tl.abs(qx) < lim) & (tl.abs(qy) < lim) & (tl.abs(qz) < lim)
    qx = tl.where(ok, qx, 0.0)
    qy = tl.where(ok, qy, 0.0)
    qz = tl.where(ok, qz, 0.0)
    bx = tl.floor(qx)
    by = tl.floor(qy)
    bz = tl.floor(qz)
    fx = qx - bx
    fy = qy - by
    fz = qz - bz
    ix = bx.to(tl.int64)
    iy = by.to(tl.int64)
    iz = bz.to(tl.int64)
    val = tl.zeros([BLOCK], tl.float64)
    gx = tl.zeros([BLOCK], tl.float64)
    gy = tl.zeros([BLOCK], tl.float64)
    gz = tl.zeros([BLOCK], tl.float64)
    wsum = tl.zeros([BLOCK], tl.float64)  # the observed corners' weights and their derivatives
    dwx = tl.zeros([BLOCK], tl.float64)
    dwy = tl.zeros([BLOCK], tl.float64)
    dwz = tl.zeros([BLOCK], tl.float64)
    best_d2 = tl.full([BLOCK], float("inf"), tl.float64)  # the nearest observed corner
    best_v = tl.zeros([BLOCK], tl.float64)
    allobs = ok
    known = tl.zeros([BLOCK], tl.int1)
    for c in range(8):  # rolled: one copy of the lookups in the binary (compile time)
        i = ix + ((c >> 2) & 1)
        j = iy + ((c >> 1) & 1)
        k = iz + (c & 1)
        has, page, local = _lookup(i, j, k, m, tk0, tm0, ts0, nt0, sl0, ps0, np0, NT0, NP0, LIMIT, BIAS, AXB)
        d = tl.load(page_base(fa0, page, has, tl.float32) + local, mask=has, other=0.0)
        o = tl.load(page_base(fb0, page, has, tl.uint8) + local, mask=has, other=0) != 0
        d = tl.where(has, d, fill)
        seen = tl.zeros([BLOCK], tl.int1)
        if HAS1:
            h1, pg1, lc1 = _lookup(
                i, j, k, m & ~has, tk1, tm1, ts1, nt1, sl1, ps1, np1, NT1, NP1, LIMIT, BIAS, AXB
            )
            w1 = tl.load(page_base(f1, pg1, h1, tl.float16) + lc1, mask=h1, other=0.0)
            seen = seen | (h1 & (w1.to(tl.float32) > 0))
        if HAS2:
            h2, pg2, lc2 = _lookup(
                i, j, k, m & ~has, tk2, tm2, ts2, nt2, sl2, ps2, np2, NT2, NP2, LIMIT, BIAS, AXB
            )
            lo = tl.load(page_base(f2, pg2, h2, tl.float16) + lc2, mask=h2, other=0.0).to(tl.float32)
            seen = seen | (h2 & (lo == lo))
        oc = ok & tl.where(has, o, seen)
        allobs = allobs & oc
        known = known | oc
        of = tl.where(oc, 1.0, 0.0).to(tl.float64)
        # trilinear weights and their derivatives over the observed corners, in the reference's order
        cx = ((c >> 2) & 1) * 1.0
        cy = ((c >> 1) & 1) * 1.0
        cz = (c & 1) * 1.0
        wx = tl.where(((c >> 2) & 1) == 1, fx, 1.0 - fx)
        wy = tl.where(((c >> 1) & 1) == 1, fy, 1.0 - fy)
        wz = tl.where((c & 1) == 1, fz, 1.0 - fz)
        sx = cx * 2.0 - 1.0
        sy = cy * 2.0 - 1.0
        sz = cz * 2.0 - 1.0
        dv = d.to(tl.float64)
        wo = wx * wy * wz * of
        val += wo * dv
        wsum += wo
        ex = sx * wy * wz * of
        ey = sy * wx * wz * of
        ez = sz * wx * wy * of
        gx += ex * dv
        gy += ey * dv
        gz += ez * dv
        dwx += ex
        dwy += ey
        dwz += ez
        d2 = (cx - fx) * (cx - fx) + (cy - fy) * (cy - fy) + (cz - fz) * (cz - fz)
        closer = oc & (d2 < best_d2)
        best_v = tl.where(closer, dv, best_v)
        best_d2 = tl.where(closer, d2, best_d2)
    # all 8 observed: plain trilinear; some: renormalised (quotient rule); weights summing to 0: nearest
    part = wsum > 0
    safe = tl.where(part, wsum, 1.0)
    out = tl.where(allobs, val, val / safe)
    out = tl.where(part, out, tl.where(known, best_v, float("nan")))
    sq = safe * safe
    gx = tl.where(allobs, gx, (gx * safe - val * dwx) / sq)
    gy = tl.where(allobs, gy, (gy * safe - val * dwy) / sq)
    gz = tl.where(allobs, gz, (gz * safe - val * dwz) / sq)
    tl.store(val_ptr + q, out.to(tl.float32), mask=m)
    tl.store(grad_ptr + q * 3 + 0, tl.where(part, gx * inv_s, 0.0).to(tl.float32), mask=m)
    tl.store(grad_ptr + q * 3 + 1, tl.where(part, gy * inv_s, 0.0).to(tl.float32), mask=m)
    tl.store(grad_ptr + q * 3 + 2, tl.where(part, gz * inv_s, 0.0).to(tl.float32), mask=m)
    tl.store(obs_ptr + q, known.to(tl.int8), mask=m)


def _layer_args(view: LayerView, names):
    """Tile keys/masks/starts, tile count, slot table, page starts, page count, and the fields' page
    tables of a layer view, plus its (tile, page) binary-search depths (one bucket: no compile as maps
    grow)."""
    t = view.tiles
    args = [t.keys, t.masks, t.starts, t.keys.numel(), view.slots, view.page_starts, view.n_pages]
    args += [view.page_tables[nm] for nm in names]
    return args, _n_iter_frame(t.keys.numel()), n_iter_frame(view.n_pages)


def distance_launch(
    points: torch.Tensor,
    s: float,
    fill: float,
    esdf: LayerView,
    tsdf: LayerView | None = None,
    occ: LayerView | None = None,
):
    """ESDF distance at float64 ``[M, 3]`` points (see ``mapper.queries.distance_at``): (distance float32
    [M], gradient float32 [M, 3], observed bool [M]). Views of the ESDF layer (fields ``esdf``,
    ``observed``), and optionally of the TSDF (``weight``) and log-odds (``log_odds``) layers."""
    n = points.shape[0]
    dev = points.device
    val = torch.empty(n, dtype=torch.float32, device=dev)
    grad = torch.empty((n, 3), dtype=torch.float32, device=dev)
    obs = torch.empty(n, dtype=torch.int8, device=dev)
    if n == 0:
        return val, grad, obs.bool()
    a0, nt0, np0 = _layer_args(esdf, ("esdf", "observed"))
    has1, has2 = tsdf is not None, occ is not None
    a1, nt1, np1 = _layer_args(tsdf, ("weight",)) if has1 else (a0[:8], 1, 1)
    a2, nt2, np2 = _layer_args(occ, ("log_odds",)) if has2 else (a0[:8], 1, 1)
    prm = torch.tensor([1.0 / float(s), float(fill)], dtype=torch.float64).to(dev, non_blocking=True)
    block = 128
    _distance_kernel[(triton.cdiv(n, block),)](
        points.contiguous(), n, prm, *a0, *a1, *a2, val, grad, obs,
        HAS1=has1, HAS2=has2, NT0=nt0, NP0=np0, NT1=nt1, NP1=np1, NT2=nt2, NP2=np2,
        LIMIT=VOXEL_LIMIT, BIAS=TILE_BIAS, AXB=TILE_AXIS_BITS, BLOCK=block,
    )  # fmt: skip
    return val, grad, obs.bool()

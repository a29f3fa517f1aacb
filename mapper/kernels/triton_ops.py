"""Triton kernels for the index-grid operators (GPU path; CI runs them under ``TRITON_INTERPRET=1``).

Each ``*_triton`` function has the signature of its torch reference (``*_torch`` in build.py, lookup.py,
setops.py, morphology.py, inject.py) plus the tile index, which replaces binary searches over leaves: a
leaf is found by a binary search over tiles (about 20x fewer than leaves) and one popcount.

Masks are handled as int64 with explicit logical shifts (``_lsr``), mirroring the torch reference; the
popcount is SWAR so that the same code runs in the interpreter.

Dilation, in three kernels and no sort of leaves (see NOTES.md):
1. ``_spill_kernel`` (one program per input tile): for every stencil direction ``d``, the 64-bit set of
   the tile's leaves whose boundary spills into ``leaf + d`` (``S[t, d]``), and which neighbour tiles
   receive spill (``need[t]``).
2. ``_tile_dilate_kernel`` (vectorised over output tiles): the output tile's leaf mask, the same mask
   shift one level up (leaves inside a 4^3 tile), pulling ``S`` from the neighbour tiles.
3. ``_leaf_morph_kernel`` (one program per output tile, 64 leaves x 8 words): the dilated (or eroded) masks
   by the separable bit-shift passes over the 27 neighbour leaves of the input grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bits import popcount64
from .keys import LEAF_POS_BITS, TILE_AXIS_BITS, TILE_BIAS, VOXEL_LIMIT
from .topology import Leaves, Tiles, build_tiles, lookup_leaves

# ---------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _lsr(x, n: tl.constexpr):
    """Logical right shift of int64 by a constant 0 < n < 64."""
    return (x >> n) & ((1 << (64 - n)) - 1)


@triton.jit
def _popc(x):
    x = x - (_lsr(x, 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + (_lsr(x, 2) & 0x3333333333333333)
    x = (x + _lsr(x, 4)) & 0x0F0F0F0F0F0F0F0F
    return _lsr(x * 0x0101010101010101, 56)


@triton.jit
def _low(p):
    """int64 with the bits below position p (int64 tensor, 0..63) set."""
    one = tl.full(p.shape, 1, tl.int64)
    return (one << p) - 1


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _find_tile(tkeys_ptr, n_tiles, key, valid, N_ITER: tl.constexpr):
    """Index of int64 ``key`` in sorted ``tkeys`` (binary search), -1 where absent or not ``valid``."""
    lo = tl.zeros(key.shape, tl.int64)
    hi = tl.zeros(key.shape, tl.int64) + n_tiles
    for _ in tl.static_range(N_ITER):
        mid = (lo + hi) >> 1
        live = lo < hi
        km = tl.load(tkeys_ptr + mid, mask=live & valid, other=0)
        right = km < key
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & (~right), mid, hi)
    kf = tl.load(tkeys_ptr + lo, mask=valid & (lo < n_tiles), other=-1)
    return tl.where(valid & (lo < n_tiles) & (kf == key), lo, -1)


@triton.jit
def _leaf_in_tile(t, pos, tmask_ptr, tstart_ptr):
    """Leaf index of position ``pos`` in tile ``t`` (-1 if ``t`` < 0 or the leaf is absent)."""
    ok = t >= 0
    tm = tl.load(tmask_ptr + t, mask=ok, other=0)
    present = ok & (((tm >> pos) & 1) != 0)
    start = tl.load(tstart_ptr + t, mask=ok, other=0)
    return tl.where(present, start + _popc(tm & _low(pos)), -1)


def _n_iter(n: int) -> int:
    return max(1, int(n).bit_length() + 1)


def _n_iter_frame(n: int) -> int:
    """Binary-search steps of the lookups on the frame path: one bucket up to 2^19 tiles (a bucket per
    power of two compiled a new variant mid-stream each time a growing map crossed one)."""
    return max(20, _n_iter(n))


# ---------------------------------------------------------------------------------------------------
# active voxels per leaf


@triton.jit(do_not_specialize=["n"])  # sizes vary per frame: no recompiles
def _count_kernel(masks_ptr, out_ptr, n, BLOCK: tl.constexpr):
    leaf = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = leaf < n
    w = tl.arange(0, 8)
    m = tl.load(masks_ptr + leaf[:, None] * 8 + w[None, :], mask=inb[:, None], other=0)
    tl.store(out_ptr + leaf, tl.sum(_popc(m), axis=1), mask=inb)


def leaf_counts_triton(masks: torch.Tensor) -> torch.Tensor:
    """int64 [L]: active voxels per leaf of int64 [L, 8] masks (same as ``bits.leaf_counts``)."""
    n = masks.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=masks.device)
    if n:
        block = 128
        _count_kernel[(triton.cdiv(n, block),)](masks.contiguous(), out, n, BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------------------
# voxel -> index


@triton.jit(do_not_specialize=["n", "n_tiles"])  # sizes vary per frame: no recompiles
def _ijk_to_index_kernel(
    ijk_ptr,
    out_ptr,
    n,
    tkeys_ptr,
    tmask_ptr,
    tstart_ptr,
    n_tiles,
    masks_ptr,
    offsets_ptr,
    LIMIT: tl.constexpr,
    BIAS: tl.constexpr,
    AXB: tl.constexpr,
    N_ITER: tl.constexpr,
    BLOCK: tl.constexpr,
    LEAF_ONLY: tl.constexpr = False,
):
    pid = tl.program_id(0)
    q = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = q < n
    i = tl.load(ijk_ptr + q * 3 + 0, mask=inb, other=0)
    j = tl.load(ijk_ptr + q * 3 + 1, mask=inb, other=0)
    k = tl.load(ijk_ptr + q * 3 + 2, mask=inb, other=0)
    ok = inb & (i >= -LIMIT) & (i < LIMIT) & (j >= -LIMIT) & (j < LIMIT) & (k >= -LIMIT) & (k < LIMIT)
    tkey = (((i >> 5) + BIAS) << (2 * AXB)) | (((j >> 5) + BIAS) << AXB) | ((k >> 5) + BIAS)
    t = _find_tile(tkeys_ptr, n_tiles, tkey, ok, N_ITER)
    pos = (((i >> 3) & 3) << 4) | (((j >> 3) & 3) << 2) | ((k >> 3) & 3)
    leaf = _leaf_in_tile(t, pos, tmask_ptr, tstart_ptr)
    if LEAF_ONLY:
        tl.store(out_ptr + q, leaf, mask=inb)
        return
    has = leaf >= 0
    off = ((i & 7) << 6) | ((j & 7) << 3) | (k & 7)
    w = off >> 6
    b = off & 63
    rank = tl.load(offsets_ptr + leaf, mask=has, other=0)
    word = tl.zeros([BLOCK], tl.int64)
    for ww in tl.static_range(8):
        x = tl.load(masks_ptr + leaf * 8 + ww, mask=has, other=0)
        rank += tl.where(w > ww, _popc(x), 0)
        word = tl.where(w == ww, x, word)
    rank += _popc(word & _low(b))
    active = has & (((word >> b) & 1) != 0)
    tl.store(out_ptr + q, tl.where(active, rank, -1), mask=inb)


def ijk_to_index_triton(
    leaves: Leaves, tiles: Tiles, ijk: torch.Tensor, leaf_only: bool = False
) -> torch.Tensor:
    q = ijk.contiguous()
    n = q.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=q.device)
    if n == 0:
        return out
    block = 256
    _ijk_to_index_kernel[(triton.cdiv(n, block),)](
        q,
        out,
        n,
        tiles.keys,
        tiles.masks,
        tiles.starts,
        tiles.keys.numel(),
        leaves.masks,
        leaves.offsets,
        LIMIT=VOXEL_LIMIT,
        BIAS=TILE_BIAS,
        AXB=TILE_AXIS_BITS,
        N_ITER=_n_iter_frame(tiles.keys.numel()),
        BLOCK=block,
        LEAF_ONLY=leaf_only,
    )
    return out


# ---------------------------------------------------------------------------------------------------
# listing voxels, pruning, inject: one program per leaf, 8 words x 64 bits


@triton.jit
def _leaf_bits(masks_ptr, leaf, valid):
    """Bits of one leaf as int32 [16, 32] (row h = the 32-bit half h of the 512-bit mask, i.e. bits
    32h .. 32h+31 = NanoVDB offsets) and the in-leaf rank of every bit; masks_ptr views the masks as int32."""
    h = tl.arange(0, 16)
    b = tl.arange(0, 32)
    halves = tl.load(masks_ptr + leaf * 16 + h, mask=valid, other=0)
    bits = (halves[:, None] >> b[None, :]) & 1
    cnt = tl.sum(bits, axis=1)
    before = tl.cumsum(cnt, axis=0) - cnt
    rank = before[:, None] + tl.cumsum(bits, axis=1) - bits
    return bits, rank


@triton.jit
def _voxel_ijk_kernel(keys_ptr, masks_ptr, offsets_ptr, out_ptr, BIAS: tl.constexpr, AXB: tl.constexpr):
    leaf = tl.program_id(0).to(tl.int64)
    bits, rank = _leaf_bits(masks_ptr, leaf, leaf >= 0)
    key = tl.load(keys_ptr + leaf)
    tile = key >> 6
    li = (((tile >> (2 * AXB)) & ((1 << AXB) - 1)) - BIAS) * 4 + ((key >> 4) & 3)
    lj = (((tile >> AXB) & ((1 << AXB) - 1)) - BIAS) * 4 + ((key >> 2) & 3)
    lk = ((tile & ((1 << AXB) - 1)) - BIAS) * 4 + (key & 3)
    off = tl.arange(0, 16)[:, None] * 32 + tl.arange(0, 32)[None, :]  # NanoVDB offset
    dst = tl.load(offsets_ptr + leaf) + rank
    on = bits != 0
    tl.store(out_ptr + dst * 3 + 0, (li * 8 + (off >> 6)).to(tl.int32), mask=on)
    tl.store(out_ptr + dst * 3 + 1, (lj * 8 + ((off >> 3) & 7)).to(tl.int32), mask=on)
    tl.store(out_ptr + dst * 3 + 2, (lk * 8 + (off & 7)).to(tl.int32), mask=on)


def voxel_ijk_triton(leaves: Leaves) -> torch.Tensor:
    n_vox = int(leaves.offsets[-1])
    out = torch.empty((n_vox, 3), dtype=torch.int32, device=leaves.keys.device)
    if leaves.keys.numel():
        _voxel_ijk_kernel[(leaves.keys.numel(),)](
            leaves.keys,
            leaves.masks.view(torch.int32),
            leaves.offsets,
            out,
            BIAS=TILE_BIAS,
            AXB=TILE_AXIS_BITS,
        )
    return out


@triton.jit
def _prune_kernel(masks_ptr, offsets_ptr, keep_ptr, out_ptr, counts_ptr):
    """One leaf per program, int32 halves: new bit = old bit and keep[offset + rank]."""
    leaf = tl.program_id(0).to(tl.int64)
    bits, rank = _leaf_bits(masks_ptr, leaf, leaf >= 0)
    src = tl.load(offsets_ptr + leaf) + rank
    keep = tl.load(keep_ptr + src, mask=bits != 0, other=0)
    newbit = tl.where(keep != 0, bits, 0)
    b = tl.arange(0, 32)[None, :]
    halves = tl.sum(newbit << b, axis=1)  # distinct bits: sum == or (bit 31 wraps to the sign bit)
    tl.store(out_ptr + leaf * 16 + tl.arange(0, 16), halves)
    tl.store(counts_ptr + leaf, tl.sum(tl.sum(newbit, axis=1), axis=0).to(tl.int64))


def prune_triton(leaves: Leaves, keep: torch.Tensor) -> Leaves:
    n = leaves.keys.numel()
    out = torch.empty_like(leaves.masks)
    counts = torch.empty(n, dtype=torch.int64, device=leaves.keys.device)
    if n:
        _prune_kernel[(n,)](
            leaves.masks.view(torch.int32),
            leaves.offsets,
            keep.contiguous().view(torch.uint8),
            out.view(torch.int32),
            counts,
        )
    return _drop_empty(leaves.keys, out, counts)


@triton.jit(do_not_specialize=["n_tiles"])  # sizes vary per frame: no recompiles
def _inject_kernel(
    dkeys_ptr,
    dmasks_ptr,
    doffsets_ptr,
    tkeys_ptr,
    tmask_ptr,
    tstart_ptr,
    n_tiles,
    smasks_ptr,
    soffsets_ptr,
    out_ptr,
    N_ITER: tl.constexpr,
):
    leaf = tl.program_id(0).to(tl.int64)
    dbits, drank = _leaf_bits(dmasks_ptr, leaf, leaf >= 0)
    key = tl.load(dkeys_ptr + leaf)
    kk = tl.zeros([1], tl.int64) + key
    t = _find_tile(tkeys_ptr, n_tiles, kk >> 6, kk >= 0, N_ITER)
    sl = _leaf_in_tile(t, kk & 63, tmask_ptr, tstart_ptr)
    s = tl.sum(sl, axis=0)  # the single lane as a scalar
    sbits, srank = _leaf_bits(smasks_ptr, s, s >= 0)
    sbase = tl.load(soffsets_ptr + s, mask=s >= 0, other=0)
    val = tl.where((sbits != 0) & (s >= 0), sbase + srank, -1)
    dst = tl.load(doffsets_ptr + leaf) + drank
    tl.store(out_ptr + dst, val, mask=dbits != 0)


def inject_index_triton(src: Leaves, src_tiles: Tiles, dst: Leaves) -> torch.Tensor:
    n_vox = int(dst.offsets[-1])
    out = torch.empty(n_vox, dtype=torch.int64, device=dst.keys.device)
    if dst.keys.numel():
        _inject_kernel[(dst.keys.numel(),)](
            dst.keys,
            dst.masks.view(torch.int32),
            dst.offsets,
            src_tiles.keys,
            src_tiles.masks,
            src_tiles.starts,
            src_tiles.keys.numel(),
            src.masks.view(torch.int32),
            src.offsets,
            out,
            N_ITER=_n_iter_frame(src_tiles.keys.numel()),
        )
    return out


# ---------------------------------------------------------------------------------------------------
# morphology


# tile-level planes (64 leaves, position (a << 4) | (b << 2) | c)
def _s64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


_TZI = tl.constexpr(0xFFFF)  # i == 0
_THI = tl.constexpr(_s64(0xFFFF000000000000))  # i == 3
_TZJ = tl.constexpr(0x000F000F000F000F)  # j == 0
_THJ = tl.constexpr(_s64(0xF000F000F000F000))  # j == 3
_TZK = tl.constexpr(0x1111111111111111)  # k == 0
_THK = tl.constexpr(_s64(0x8888888888888888))  # k == 3
# leaf-level planes (512 voxels as 8 words, bit (j << 3) | k)
_K0 = tl.constexpr(0x0101010101010101)
_NK0 = tl.constexpr(~0x0101010101010101)
_K7 = tl.constexpr(_s64(0x8080808080808080))
_NK7 = tl.constexpr(~_s64(0x8080808080808080))
_J0 = tl.constexpr(0xFF)
_J7 = tl.constexpr(_s64(0xFF00000000000000))


@triton.jit
def _spill_kernel(
    tmask_ptr,
    tstart_ptr,
    masks_ptr,
    s_ptr,
    need_ptr,
    MAXN: tl.constexpr,
):
    """One program per input tile; 2-D over (64 leaf positions, 32 >= 27 directions), two reductions."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, 64).to(tl.int64)
    tm = tl.load(tmask_ptr + t)
    start = tl.load(tstart_ptr + t)
    present = ((tm >> p) & 1) != 0
    leaf = start + _popc(tm & _low(p))
    w0 = tl.load(masks_ptr + leaf * 8, mask=present, other=0)
    w7 = tl.load(masks_ptr + leaf * 8 + 7, mask=present, other=0)
    wor = w0 | w7
    for ww in tl.static_range(1, 7):
        wor = wor | tl.load(masks_ptr + leaf * 8 + ww, mask=present, other=0)
    d = tl.arange(0, 32)
    di = d // 9 - 1
    dj = (d // 3) % 3 - 1
    dk = d % 3 - 1
    nd = di * di + dj * dj + dk * dk
    valid = (d < 27) & (nd > 0) & (nd <= MAXN)
    allb = tl.full([32], -1, tl.int64)
    jsel = tl.where(dj == 1, allb & _J7, tl.where(dj == -1, allb & _J0, allb))
    ksel = tl.where(dk == 1, allb & _K7, tl.where(dk == -1, allb & _K0, allb))
    x = tl.where(di[None, :] == 1, w7[:, None], tl.where(di[None, :] == -1, w0[:, None], wor[:, None]))
    flag = ((x & (jsel & ksel)[None, :]) != 0) & valid[None, :]
    one = tl.full([64], 1, tl.int64)
    sd = tl.sum(tl.where(flag, (one << p)[:, None], 0), axis=0)  # distinct bits per column: sum == or
    tl.store(s_ptr + t * 27 + d, sd, mask=d < 27)
    # which neighbour tiles receive spill: per direction (static loop, element-wise), one reduction
    pi = p >> 4
    pj = (p >> 2) & 3
    pk = p & 3
    need = tl.zeros([64], tl.int32)
    for dd in tl.static_range(27):
        ddi = dd // 9 - 1
        ddj = (dd // 3) % 3 - 1
        ddk = dd % 3 - 1
        nn = ddi * ddi + ddj * ddj + ddk * ddk
        if nn > 0 and nn <= MAXN:
            if ddi == 1:
                y = w7
            elif ddi == -1:
                y = w0
            else:
                y = wor
            if ddj == 1:
                y = y & _J7
            elif ddj == -1:
                y = y & _J0
            if ddk == 1:
                y = y & _K7
            elif ddk == -1:
                y = y & _K0
            qi = pi + ddi
            qj = pj + ddj
            qk = pk + ddk
            ei = tl.where(qi < 0, 0, tl.where(qi > 3, 2, 1))
            ej = tl.where(qj < 0, 0, tl.where(qj > 3, 2, 1))
            ek = tl.where(qk < 0, 0, tl.where(qk > 3, 2, 1))
            e = (ei * 9 + ej * 3 + ek).to(tl.int32)
            need = need | tl.where(y != 0, tl.full([64], 1, tl.int32) << e, 0)
    tl.store(need_ptr + t, tl.reduce(need, 0, _or))


@triton.jit
def _axis_move(x, da: tl.constexpr, cross: tl.constexpr, s: tl.constexpr, z: tl.constexpr, h: tl.constexpr):
    """Move a tile-level leaf set one step ``da`` along an axis of stride ``s``: the bits that stay
    (``cross`` false) or the bits that arrive from the neighbour tile (``cross`` true)."""
    if da == 1:
        if cross:
            x = _lsr(x, 3 * s) & z
        else:
            x = (x << s) & (-1 - z)
    elif da == -1:
        if cross:
            x = (x << (3 * s)) & h
        else:
            x = _lsr(x, s) & (-1 - h)
    return x


@triton.jit(do_not_specialize=["n_out"])  # sizes vary per frame: no recompiles
def _tile_dilate_kernel(
    ug_ptr,
    n_out,
    in_tmask_ptr,
    s_ptr,
    out_tmask_ptr,
    MAXN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = u < n_out
    own = tl.load(ug_ptr + u * 27 + 13, mask=inb, other=-1)
    acc = tl.load(in_tmask_ptr + own, mask=own >= 0, other=0)
    for d in tl.static_range(27):
        di = d // 9 - 1
        dj = (d // 3) % 3 - 1
        dk = d % 3 - 1
        nd = di * di + dj * dj + dk * dk
        if nd > 0 and nd <= MAXN:
            for e in tl.static_range(8):
                ci = (e >> 2) & 1
                cj = (e >> 1) & 1
                ck = e & 1
                if (ci == 0 or di != 0) and (cj == 0 or dj != 0) and (ck == 0 or dk != 0):
                    f = (1 - ci * di) * 9 + (1 - cj * dj) * 3 + (1 - ck * dk)
                    src = tl.load(ug_ptr + u * 27 + f, mask=inb, other=-1)
                    x = tl.load(s_ptr + src * 27 + d, mask=src >= 0, other=0)
                    x = _axis_move(x, di, ci == 1, 16, _TZI, _THI)
                    x = _axis_move(x, dj, cj == 1, 4, _TZJ, _THJ)
                    x = _axis_move(x, dk, ck == 1, 1, _TZK, _THK)
                    acc = acc | x
    tl.store(out_tmask_ptr + u, acc, mask=inb)


@triton.jit
def _nbr(ug_row, pi, pj, pk, di: tl.constexpr, dj: tl.constexpr, dk: tl.constexpr, tmask_ptr, tstart_ptr):
    """Leaf index (input grid) of the neighbour (di, dj, dk) of the leaves at tile positions p, -1 if none."""
    qi = pi + di
    qj = pj + dj
    qk = pk + dk
    ei = tl.where(qi < 0, 0, tl.where(qi > 3, 2, 1))
    ej = tl.where(qj < 0, 0, tl.where(qj > 3, 2, 1))
    ek = tl.where(qk < 0, 0, tl.where(qk > 3, 2, 1))
    t = tl.load(ug_row + ei * 9 + ej * 3 + ek)
    pos = ((qi & 3) << 4) | ((qj & 3) << 2) | (qk & 3)
    return _leaf_in_tile(t, pos, tmask_ptr, tstart_ptr)


@triton.jit
def _full(masks_ptr, leaf):
    w = tl.arange(0, 8)
    return tl.load(masks_ptr + leaf[:, None] * 8 + w[None, :], mask=(leaf >= 0)[:, None], other=0)


@triton.jit
def _word(masks_ptr, leaf, w: tl.constexpr):
    return tl.load(masks_ptr + leaf * 8 + w, mask=leaf >= 0, other=0)


@triton.jit
def _comb(a, b, ERODE: tl.constexpr):
    if ERODE:
        return a & b
    else:
        return a | b


@triton.jit
def _pk(M, Mm, Mp, ERODE: tl.constexpr):
    """1-D dilation/erosion along k (bit step 1); Mm/Mp: the k-1/k+1 neighbour leaves."""
    up = ((M << 1) & _NK0) | (_lsr(Mm, 7) & _K0)
    dn = (_lsr(M, 1) & _NK7) | ((Mp << 7) & _K7)
    return _comb(_comb(M, up, ERODE), dn, ERODE)


@triton.jit
def _pj(M, Mm, Mp, ERODE: tl.constexpr):
    """1-D dilation/erosion along j (bit step 8)."""
    up = (M << 8) | _lsr(Mm, 56)
    dn = _lsr(M, 8) | (Mp << 56)
    return _comb(_comb(M, up, ERODE), dn, ERODE)


@triton.jit
def _fw(m_ptr, lc, lm, lp, dw: tl.constexpr):
    """[B, 8] words ``w + dw`` of the leaves ``lc``; a word index of -1 or 8 reads word 7 of the i-1 leaf
    ``lm`` or word 0 of the i+1 leaf ``lp`` (absent leaves read 0). With it the i-pass needs no shuffle."""
    w = tl.arange(0, 8)[None, :]
    src = w + dw
    leaf = tl.where(src < 0, lm[:, None], tl.where(src > 7, lp[:, None], lc[:, None]))
    word = src & 7
    return tl.load(m_ptr + leaf * 8 + word, mask=leaf >= 0, other=0)


@triton.jit
def _dkcol(m_ptr, c0, cm, cp, m0, mm, mp, p0, pm, pp, dw: tl.constexpr, ERODE: tl.constexpr):
    """Dk of the leaf column (c0 with its k-1/k+1 neighbours cm/cp) at word shift dw; m*/p* are the i-1/i+1
    neighbours of c0/cm/cp."""
    return _pk(_fw(m_ptr, c0, m0, p0, dw), _fw(m_ptr, cm, mm, pm, dw), _fw(m_ptr, cp, mp, pp, dw), ERODE)


@triton.jit
def _out_keys_kernel(out_tkeys_ptr, out_tmask_ptr, out_tstart_ptr, out_keys_ptr, out_tile_ptr):
    """Keys and tile index of the output leaves, one program per output tile."""
    u = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, 64).to(tl.int64)
    tm = tl.load(out_tmask_ptr + u)
    active = ((tm >> p) & 1) != 0
    oidx = tl.load(out_tstart_ptr + u) + _popc(tm & _low(p))
    tl.store(out_keys_ptr + oidx, (tl.load(out_tkeys_ptr + u) << 6) | p, mask=active)
    tl.store(out_tile_ptr + oidx, u + p * 0, mask=active)


@triton.jit(do_not_specialize=["n_out"])  # sizes vary per frame: no recompiles
def _leaf_morph_kernel(
    n_out,
    out_tile_ptr,
    ug_ptr,
    in_tmask_ptr,
    in_tstart_ptr,
    in_masks_ptr,
    out_keys_ptr,
    out_masks_ptr,
    counts_ptr,
    CONN: tl.constexpr,
    ERODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """BLOCK output leaves per program (dense lanes): the dilated/eroded masks from the input leaves."""
    oidx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    active = oidx < n_out
    p = tl.load(out_keys_ptr + oidx, mask=active, other=0) & 63
    u = tl.load(out_tile_ptr + oidx, mask=active, other=0)
    pi = p >> 4
    pj = (p >> 2) & 3
    pk = p & 3
    row = ug_ptr + u * 27
    tm = in_tmask_ptr
    ts = in_tstart_ptr
    # the 3x3 (dj, dk) columns of leaves and their i-1 / i+1 neighbours (18-stencil: no corners)
    c_00 = _nbr(row, pi, pj, pk, 0, 0, 0, tm, ts)
    m_00 = _nbr(row, pi, pj, pk, -1, 0, 0, tm, ts)
    p_00 = _nbr(row, pi, pj, pk, 1, 0, 0, tm, ts)
    c_0m = _nbr(row, pi, pj, pk, 0, 0, -1, tm, ts)
    c_0p = _nbr(row, pi, pj, pk, 0, 0, 1, tm, ts)
    c_m0 = _nbr(row, pi, pj, pk, 0, -1, 0, tm, ts)
    c_p0 = _nbr(row, pi, pj, pk, 0, 1, 0, tm, ts)
    if CONN == 6:
        c = _fw(in_masks_ptr, c_00, m_00, p_00, 0)
        dk = _pk(c, _fw(in_masks_ptr, c_0m, c_0m, c_0m, 0), _fw(in_masks_ptr, c_0p, c_0p, c_0p, 0), ERODE)
        dj = _pj(c, _fw(in_masks_ptr, c_m0, c_m0, c_m0, 0), _fw(in_masks_ptr, c_p0, c_p0, c_p0, 0), ERODE)
        up = _fw(in_masks_ptr, c_00, m_00, p_00, -1)
        dn = _fw(in_masks_ptr, c_00, m_00, p_00, 1)
        out = _comb(_comb(dk, dj, ERODE), _comb(_comb(c, up, ERODE), dn, ERODE), ERODE)
    else:
        m_0m = _nbr(row, pi, pj, pk, -1, 0, -1, tm, ts)
        m_0p = _nbr(row, pi, pj, pk, -1, 0, 1, tm, ts)
        m_m0 = _nbr(row, pi, pj, pk, -1, -1, 0, tm, ts)
        m_p0 = _nbr(row, pi, pj, pk, -1, 1, 0, tm, ts)
        p_0m = _nbr(row, pi, pj, pk, 1, 0, -1, tm, ts)
        p_0p = _nbr(row, pi, pj, pk, 1, 0, 1, tm, ts)
        p_m0 = _nbr(row, pi, pj, pk, 1, -1, 0, tm, ts)
        p_p0 = _nbr(row, pi, pj, pk, 1, 1, 0, tm, ts)
        c_mm = _nbr(row, pi, pj, pk, 0, -1, -1, tm, ts)
        c_mp = _nbr(row, pi, pj, pk, 0, -1, 1, tm, ts)
        c_pm = _nbr(row, pi, pj, pk, 0, 1, -1, tm, ts)
        c_pp = _nbr(row, pi, pj, pk, 0, 1, 1, tm, ts)
        if CONN == 26:
            m_mm = _nbr(row, pi, pj, pk, -1, -1, -1, tm, ts)
            m_mp = _nbr(row, pi, pj, pk, -1, -1, 1, tm, ts)
            m_pm = _nbr(row, pi, pj, pk, -1, 1, -1, tm, ts)
            m_pp = _nbr(row, pi, pj, pk, -1, 1, 1, tm, ts)
            p_mm = _nbr(row, pi, pj, pk, 1, -1, -1, tm, ts)
            p_mp = _nbr(row, pi, pj, pk, 1, -1, 1, tm, ts)
            p_pm = _nbr(row, pi, pj, pk, 1, 1, -1, tm, ts)
            p_pp = _nbr(row, pi, pj, pk, 1, 1, 1, tm, ts)
            out = _pj(
                _dkcol(in_masks_ptr, c_00, c_0m, c_0p, m_00, m_0m, m_0p, p_00, p_0m, p_0p, 0, ERODE),
                _dkcol(in_masks_ptr, c_m0, c_mm, c_mp, m_m0, m_mm, m_mp, p_m0, p_mm, p_mp, 0, ERODE),
                _dkcol(in_masks_ptr, c_p0, c_pm, c_pp, m_p0, m_pm, m_pp, p_p0, p_pm, p_pp, 0, ERODE),
                ERODE,
            )
            for s in tl.static_range(2):
                dw = 2 * s - 1
                y = _pj(
                    _dkcol(in_masks_ptr, c_00, c_0m, c_0p, m_00, m_0m, m_0p, p_00, p_0m, p_0p, dw, ERODE),
                    _dkcol(in_masks_ptr, c_m0, c_mm, c_mp, m_m0, m_mm, m_mp, p_m0, p_mm, p_mp, dw, ERODE),
                    _dkcol(in_masks_ptr, c_p0, c_pm, c_pp, m_p0, m_pm, m_pp, p_p0, p_pm, p_pp, dw, ERODE),
                    ERODE,
                )
                out = _comb(out, y, ERODE)
        else:  # 18: Di(Dk(M) | Dj(M)) | Dj(Dk(M))
            x0 = _dkcol(in_masks_ptr, c_00, c_0m, c_0p, m_00, m_0m, m_0p, p_00, p_0m, p_0p, 0, ERODE)
            xm = _dkcol(in_masks_ptr, c_m0, c_mm, c_mp, c_m0, c_m0, c_m0, c_m0, c_m0, c_m0, 0, ERODE)
            xp = _dkcol(in_masks_ptr, c_p0, c_pm, c_pp, c_p0, c_p0, c_p0, c_p0, c_p0, c_p0, 0, ERODE)
            out = _pj(x0, xm, xp, ERODE)
            for s in tl.static_range(3):
                dw = s - 1
                xs = _dkcol(in_masks_ptr, c_00, c_0m, c_0p, m_00, m_0m, m_0p, p_00, p_0m, p_0p, dw, ERODE)
                ys = _pj(
                    _fw(in_masks_ptr, c_00, m_00, p_00, dw),
                    _fw(in_masks_ptr, c_m0, m_m0, p_m0, dw),
                    _fw(in_masks_ptr, c_p0, m_p0, p_p0, dw),
                    ERODE,
                )
                out = _comb(out, _comb(xs, ys, ERODE), ERODE)
    w = tl.arange(0, 8)
    tl.store(out_masks_ptr + oidx[:, None] * 8 + w[None, :], out, mask=active[:, None])
    tl.store(counts_ptr + oidx, tl.sum(_popc(out), axis=1), mask=active)


_MAXN = {6: 1, 18: 2, 26: 3}
_TILE_OFFSETS: dict[torch.device, torch.Tensor] = {}


def _tile_offset_keys(device: torch.device) -> torch.Tensor:
    """int64 [27]: key deltas of the 27 neighbour tiles (index (a+1)*9 + (b+1)*3 + (c+1))."""
    t = _TILE_OFFSETS.get(device)
    if t is None:
        r = torch.arange(-1, 2, dtype=torch.int64)
        a, b, c = torch.meshgrid(r, r, r, indexing="ij")
        t = ((a << (2 * TILE_AXIS_BITS)) + (b << TILE_AXIS_BITS) + c).reshape(27).to(device)
        _TILE_OFFSETS[device] = t
    return t


def _tile_neighbours(in_keys: torch.Tensor, of_keys: torch.Tensor) -> torch.Tensor:
    """int64 [U, 27]: index in sorted ``in_keys`` of the 27 neighbours of each tile of ``of_keys``."""
    q = of_keys[:, None] + _tile_offset_keys(of_keys.device)[None, :]
    return lookup_leaves(in_keys, q.reshape(-1)).reshape(-1, 27)


def dilate_triton(leaves: Leaves, tiles: Tiles, connectivity: int) -> tuple[Leaves, Tiles]:
    """One-voxel dilation (same result as ``morphology.dilate_torch``), also returning the output tiles."""
    dev = leaves.keys.device
    n_t = tiles.keys.numel()
    s = torch.zeros((n_t, 27), dtype=torch.int64, device=dev)
    need = torch.empty(n_t, dtype=torch.int32, device=dev)
    _spill_kernel[(n_t,)](tiles.masks, tiles.starts, leaves.masks, s, need, MAXN=_MAXN[connectivity])
    # new tiles: neighbours that receive spill and are absent
    tnb = _tile_neighbours(tiles.keys, tiles.keys)
    e = torch.arange(27, device=dev, dtype=torch.int32)
    wanted = (((need[:, None] >> e[None, :]) & 1) != 0) & (tnb < 0)
    cand = (tiles.keys[:, None] + _tile_offset_keys(dev)[None, :])[wanted]
    out_tkeys = torch.unique(torch.cat((tiles.keys, cand))) if cand.numel() else tiles.keys
    n_u = out_tkeys.numel()
    ug = _tile_neighbours(tiles.keys, out_tkeys) if cand.numel() else tnb
    out_tmask = torch.empty(n_u, dtype=torch.int64, device=dev)
    block = 128
    _tile_dilate_kernel[(triton.cdiv(n_u, block),)](
        ug, n_u, tiles.masks, s, out_tmask, MAXN=_MAXN[connectivity], BLOCK=block
    )
    keys, masks, counts, out_tiles = _leaf_pass(
        leaves, tiles, out_tkeys, out_tmask, ug, connectivity, erode=False
    )
    return _with_offsets(keys, masks, counts), out_tiles


def erode_triton(leaves: Leaves, tiles: Tiles, connectivity: int) -> tuple[Leaves, Tiles]:
    """One-voxel erosion (same result as ``morphology.erode_torch``)."""
    ug = _tile_neighbours(tiles.keys, tiles.keys)
    keys, masks, counts, _ = _leaf_pass(leaves, tiles, tiles.keys, tiles.masks, ug, connectivity, erode=True)
    out = _drop_empty(keys, masks, counts)
    return out, build_tiles(out.keys)


def _leaf_pass(leaves, tiles, out_tkeys, out_tmask, ug, connectivity, erode):
    dev = leaves.keys.device
    n_u = out_tkeys.numel()
    starts = torch.zeros(n_u + 1, dtype=torch.int64, device=dev)
    torch.cumsum(popcount64(out_tmask), 0, out=starts[1:])
    n_l = int(starts[-1])
    out_keys = torch.empty(n_l, dtype=torch.int64, device=dev)
    out_masks = torch.empty((n_l, 8), dtype=torch.int64, device=dev)
    counts = torch.empty(n_l, dtype=torch.int64, device=dev)
    out_tile = torch.empty(n_l, dtype=torch.int64, device=dev)
    if n_u:
        _out_keys_kernel[(n_u,)](out_tkeys, out_tmask, starts, out_keys, out_tile)
        block = 64
        _leaf_morph_kernel[(triton.cdiv(n_l, block),)](
            n_l,
            out_tile,
            ug,
            tiles.masks,
            tiles.starts,
            leaves.masks,
            out_keys,
            out_masks,
            counts,
            CONN=connectivity,
            ERODE=erode,
            BLOCK=block,
        )
    return out_keys, out_masks, counts, Tiles(out_tkeys, out_tmask, starts)


def _with_offsets(keys: torch.Tensor, masks: torch.Tensor, counts: torch.Tensor) -> Leaves:
    offsets = torch.zeros(keys.numel() + 1, dtype=torch.int64, device=keys.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Leaves(keys, masks, offsets)


@triton.jit(do_not_specialize=["n"])  # sizes vary per frame: no recompiles
def _compact_kernel(
    keys_ptr, masks_ptr, counts_ptr, pos_ptr, okeys_ptr, omasks_ptr, ooffsets_ptr, n, BLOCK: tl.constexpr
):
    """Copy the non-empty leaves to their compacted positions (``pos`` = inclusive prefix of non-empty)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    c = tl.load(counts_ptr + i, mask=inb, other=0)
    keep = inb & (c > 0)
    dst = tl.load(pos_ptr + i, mask=keep, other=1) - 1
    tl.store(okeys_ptr + dst, tl.load(keys_ptr + i, mask=keep, other=0), mask=keep)
    w = tl.arange(0, 8)[None, :]
    m = tl.load(masks_ptr + i[:, None] * 8 + w, mask=keep[:, None], other=0)
    tl.store(omasks_ptr + dst[:, None] * 8 + w, m, mask=keep[:, None])
    tl.store(ooffsets_ptr + 1 + dst, c, mask=keep)


def _drop_empty(keys: torch.Tensor, masks: torch.Tensor, counts: torch.Tensor) -> Leaves:
    """Remove the leaves whose count is 0 (one kernel; torch's row gather is slow for [L, 8] rows)."""
    n = keys.numel()
    if n == 0:
        return _with_offsets(keys, masks, counts)
    pos = torch.cumsum(counts > 0, 0)
    m = int(pos[-1])
    if m == n:
        return _with_offsets(keys, masks, counts)
    okeys = torch.empty(m, dtype=torch.int64, device=keys.device)
    omasks = torch.empty((m, 8), dtype=torch.int64, device=keys.device)
    offsets = torch.zeros(m + 1, dtype=torch.int64, device=keys.device)
    block = 128
    _compact_kernel[(triton.cdiv(n, block),)](
        keys, masks, counts, pos, okeys, omasks, offsets, n, BLOCK=block
    )
    offsets[1:] = torch.cumsum(offsets[1:], 0)
    return Leaves(okeys, omasks, offsets)


assert LEAF_POS_BITS == 6

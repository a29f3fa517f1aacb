"""Triton twins of :mod:`mapper.kernels.alloc` (same signatures; imported lazily: triton is optional).

A layer's allocation in five launches plus one sort (was ~60 torch ops): the lookup (leaf key, binary search,
current slot, flags) in one pass over the bricks; the three ranks (new leaves in sorted order, missing and
kept bricks in input order) in a two-pass scan (block sums, their prefix, local scans) that also compacts
the new keys and the kept rows and writes the sizes; the re-layout of the leaf tables in one pass over
old + new leaves; the writes (slot, version, an atomic OR of the brick's mask bits) in one pass over the
bricks. No host sync: the caller reads the sizes once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .alloc import KEY_SENTINEL, word_patterns
from .keys import LEAF_POS_BITS, TILE_AXIS_BITS, TILE_BIAS

_SEARCH = 40  # binary-search steps: covers any table (masked steps are cheap; one compiled variant)
_BLOCK = 512


@triton.jit
def _lower_bound(keys_ptr, n, q, m, N_ITER: tl.constexpr):
    """Number of the sorted ``keys[0:n]`` smaller than each ``q`` (int64 lanes)."""
    lo = tl.zeros_like(q)
    hi = tl.zeros_like(q) + n
    for _ in range(N_ITER):
        open_ = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(keys_ptr + mid, mask=m & open_, other=0)
        less = v < q
        lo = tl.where(open_ & less, mid + 1, lo)
        hi = tl.where(open_ & ~less, mid, hi)
    return lo


@triton.jit(do_not_specialize=["m", "n_leaves"])  # sizes vary per frame: no recompiles
def _alloc_lookup_kernel(
    ijk_ptr, keep_ptr, keys_ptr, slots_ptr, in_ptr, cur_ptr, sort_ptr, b_ptr, missing_ptr, kept_ptr, m,
    n_leaves,
    HAS_KEEP: tl.constexpr, TB: tl.constexpr, AX: tl.constexpr, PB: tl.constexpr, SENT: tl.constexpr,
    N_ITER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = i < m
    bi = tl.load(ijk_ptr + i * 3, mask=msk, other=0)
    bj = tl.load(ijk_ptr + i * 3 + 1, mask=msk, other=0)
    bk = tl.load(ijk_ptr + i * 3 + 2, mask=msk, other=0)
    li, lj, lk = bi >> 1, bj >> 1, bk >> 1
    tile = (((li >> 2) + TB) << (2 * AX)) | (((lj >> 2) + TB) << AX) | ((lk >> 2) + TB)
    key = (tile << PB) | ((li & 3) << 4) | ((lj & 3) << 2) | (lk & 3)
    b = ((bi & 1) << 2) | ((bj & 1) << 1) | (bk & 1)
    pos = _lower_bound(keys_ptr, n_leaves, key, msk, N_ITER)
    inb = msk & (pos < n_leaves)
    found = inb & (tl.load(keys_ptr + pos, mask=inb, other=-1) == key)
    cur = tl.load(slots_ptr + pos * 8 + b, mask=found, other=-1).to(tl.int64)
    if HAS_KEEP:
        kept = tl.load(keep_ptr + i, mask=msk, other=0) != 0
    else:
        kept = msk
    missing = kept & (cur < 0)
    tl.store(in_ptr + i, tl.where(found, pos, -1), mask=msk)
    tl.store(cur_ptr + i, cur, mask=msk)
    tl.store(sort_ptr + i, tl.where(missing & ~found, key, SENT), mask=msk)
    tl.store(b_ptr + i, b, mask=msk)
    tl.store(missing_ptr + i, missing, mask=msk)
    tl.store(kept_ptr + i, kept, mask=msk)


def alloc_lookup_triton(brick_ijk, keep, leaf_keys, slots):
    m = brick_ijk.shape[0]
    dev = brick_ijk.device
    in_old = torch.empty(m, dtype=torch.int64, device=dev)
    cur = torch.empty(m, dtype=torch.int64, device=dev)
    sortkey = torch.empty(m, dtype=torch.int64, device=dev)
    b = torch.empty(m, dtype=torch.int64, device=dev)
    missing = torch.empty(m, dtype=torch.bool, device=dev)
    kept = torch.empty(m, dtype=torch.bool, device=dev)
    if m:
        ijk = brick_ijk.to(torch.int64).contiguous()
        kp = ijk if keep is None else keep.to(torch.bool).contiguous()
        _alloc_lookup_kernel[(triton.cdiv(m, _BLOCK),)](
            ijk, kp, leaf_keys.contiguous(), slots.contiguous(), in_old, cur, sortkey, b, missing, kept, m,
            leaf_keys.numel(), HAS_KEEP=keep is not None, TB=TILE_BIAS, AX=TILE_AXIS_BITS,
            PB=LEAF_POS_BITS, SENT=KEY_SENTINEL, N_ITER=_SEARCH, BLOCK=_BLOCK,
        )  # fmt: skip
    return in_old, cur, sortkey, b, missing, kept


@triton.jit
def _rank_flags(sk_ptr, missing_ptr, kept_ptr, i, msk, SENT: tl.constexpr):
    """(first of its run among the sorted new-leaf keys, missing, kept) as int32 lanes."""
    s = tl.load(sk_ptr + i, mask=msk, other=SENT)
    prev = tl.load(sk_ptr + i - 1, mask=msk & (i > 0), other=SENT)
    first = (s != SENT) & ((i == 0) | (s != prev))
    missing = tl.load(missing_ptr + i, mask=msk, other=0).to(tl.int32)
    kept = tl.load(kept_ptr + i, mask=msk, other=0).to(tl.int32)
    return first.to(tl.int32), missing, kept


@triton.jit(do_not_specialize=["m"])
def _alloc_block_sums_kernel(
    sk_ptr, missing_ptr, kept_ptr, sums_ptr, m, SENT: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    msk = i < m
    first, missing, kept = _rank_flags(sk_ptr, missing_ptr, kept_ptr, i, msk, SENT)
    tl.store(sums_ptr + pid * 3, tl.sum(first, axis=0).to(tl.int64))
    tl.store(sums_ptr + pid * 3 + 1, tl.sum(missing, axis=0).to(tl.int64))
    tl.store(sums_ptr + pid * 3 + 2, tl.sum(kept, axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["m", "nb"])
def _alloc_ranks_kernel(
    sk_ptr, order_ptr, missing_ptr, kept_ptr, cum_ptr, sizes_ptr, new_keys_ptr, leaf_rank_ptr,
    brick_rank_ptr, rows_ptr, m, nb, SENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    msk = i < m
    first, missing, kept = _rank_flags(sk_ptr, missing_ptr, kept_ptr, i, msk, SENT)
    has_prev = pid > 0
    p0 = tl.load(cum_ptr + (pid - 1) * 3, mask=has_prev, other=0)
    p1 = tl.load(cum_ptr + (pid - 1) * 3 + 1, mask=has_prev, other=0)
    p2 = tl.load(cum_ptr + (pid - 1) * 3 + 2, mask=has_prev, other=0)
    r_leaf = p0 + tl.cumsum(first, axis=0).to(tl.int64) - 1
    r_brick = p1 + tl.cumsum(missing, axis=0).to(tl.int64) - 1
    r_kept = p2 + tl.cumsum(kept, axis=0).to(tl.int64) - 1
    s = tl.load(sk_ptr + i, mask=msk, other=SENT)
    tl.store(new_keys_ptr + r_leaf, s, mask=msk & (first != 0))
    o = tl.load(order_ptr + i, mask=msk, other=0)
    tl.store(leaf_rank_ptr + o, r_leaf, mask=msk)
    tl.store(brick_rank_ptr + i, r_brick, mask=msk)
    tl.store(rows_ptr + r_kept, i, mask=msk & (kept != 0))
    if pid == 0:
        for c in range(3):
            tl.store(sizes_ptr + c, tl.load(cum_ptr + (nb - 1) * 3 + c))


def alloc_ranks_triton(sk, order, missing, kept):
    m = sk.numel()
    dev = sk.device
    new_keys = torch.empty(m, dtype=torch.int64, device=dev)  # the first sizes[0] are written
    leaf_rank = torch.empty(m, dtype=torch.int64, device=dev)
    brick_rank = torch.empty(m, dtype=torch.int64, device=dev)
    rows = torch.empty(m, dtype=torch.int64, device=dev)  # the first sizes[2] are written
    sizes = torch.empty(3, dtype=torch.int64, device=dev)
    if m == 0:
        sizes.zero_()
        return sizes, new_keys, leaf_rank, brick_rank, rows
    block = 1024
    nb = triton.cdiv(m, block)
    sums = torch.empty((nb, 3), dtype=torch.int64, device=dev)
    sk, missing, kept = sk.contiguous(), missing.contiguous(), kept.contiguous()
    _alloc_block_sums_kernel[(nb,)](sk, missing, kept, sums, m, SENT=KEY_SENTINEL, BLOCK=block)
    cum = torch.cumsum(sums, 0)
    _alloc_ranks_kernel[(nb,)](
        sk, order.contiguous(), missing, kept, cum, sizes, new_keys, leaf_rank, brick_rank, rows, m, nb,
        SENT=KEY_SENTINEL, BLOCK=block,
    )  # fmt: skip
    return sizes, new_keys, leaf_rank, brick_rank, rows


@triton.jit(do_not_specialize=["la", "n", "nb_old"])
def _relayout_kernel(
    old_keys_ptr, new_keys_ptr, slots_ptr, bver_ptr, masks_ptr, keys_out, slots_out, bver_out, masks_out,
    pos_old_ptr, pos_new_ptr, la, n, nb_old, N_ITER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, 8)
    if pid < nb_old:  # an old leaf moves by the number of new keys before it
        r = pid * BLOCK + tl.arange(0, BLOCK)
        msk = r < la
        key = tl.load(old_keys_ptr + r, mask=msk, other=0)
        pos = r + _lower_bound(new_keys_ptr, n, key, msk, N_ITER)
        tl.store(pos_old_ptr + r, pos, mask=msk)
        tl.store(keys_out + pos, key, mask=msk)
        m2 = msk[:, None]
        src = r[:, None] * 8 + w[None, :]
        dst = pos[:, None] * 8 + w[None, :]
        tl.store(slots_out + dst, tl.load(slots_ptr + src, mask=m2), mask=m2)
        tl.store(bver_out + dst, tl.load(bver_ptr + src, mask=m2), mask=m2)
        tl.store(masks_out + dst, tl.load(masks_ptr + src, mask=m2), mask=m2)
    else:  # a new leaf lands at its insertion point among the old keys plus its rank
        r = (pid - nb_old) * BLOCK + tl.arange(0, BLOCK)
        msk = r < n
        key = tl.load(new_keys_ptr + r, mask=msk, other=0)
        pos = r + _lower_bound(old_keys_ptr, la, key, msk, N_ITER)
        tl.store(pos_new_ptr + r, pos, mask=msk)
        tl.store(keys_out + pos, key, mask=msk)
        m2 = msk[:, None]
        dst = pos[:, None] * 8 + w[None, :]
        tl.store(slots_out + dst, tl.full((BLOCK, 8), -1, tl.int32), mask=m2)
        tl.store(bver_out + dst, tl.full((BLOCK, 8), -1, tl.int64), mask=m2)
        tl.store(masks_out + dst, tl.zeros((BLOCK, 8), tl.int64), mask=m2)


def relayout_leaves_triton(old_keys, new_keys, slots, bver, masks):
    dev = old_keys.device
    la, n = old_keys.numel(), new_keys.numel()
    keys = torch.empty(la + n, dtype=torch.int64, device=dev)
    s = torch.empty((la + n, 8), dtype=torch.int32, device=dev)
    v = torch.empty((la + n, 8), dtype=torch.int64, device=dev)
    w = torch.empty((la + n, 8), dtype=torch.int64, device=dev)
    pos_old = torch.empty(la, dtype=torch.int64, device=dev)
    pos_new = torch.empty(n, dtype=torch.int64, device=dev)
    block = 128
    nb_old, nb_new = triton.cdiv(la, block), triton.cdiv(n, block)
    if nb_old + nb_new:
        _relayout_kernel[(nb_old + nb_new,)](
            old_keys.contiguous(), new_keys.contiguous(), slots.contiguous(), bver.contiguous(),
            masks.contiguous(), keys, s, v, w, pos_old, pos_new, la, n, nb_old, N_ITER=_SEARCH, BLOCK=block,
        )  # fmt: skip
    return keys, s, v, w, pos_old, pos_new


@triton.jit(do_not_specialize=["m", "n_fresh", "version"])
def _alloc_write_kernel(
    in_ptr, pos_old_ptr, pos_new_ptr, leaf_rank_ptr, b_ptr, missing_ptr, kept_ptr, cur_ptr, fresh_ptr,
    brick_rank_ptr, slots_ptr, bver_ptr, masks_ptr, pat_ptr, out_ptr, m, n_fresh, version,
    HAS_POS_OLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = i < m
    missing = tl.load(missing_ptr + i, mask=msk, other=0) != 0
    kept = tl.load(kept_ptr + i, mask=msk, other=0) != 0
    b = tl.load(b_ptr + i, mask=msk, other=0)
    in_old = tl.load(in_ptr + i, mask=msk, other=-1)
    has = in_old >= 0
    if HAS_POS_OLD:
        old_leaf = tl.load(pos_old_ptr + in_old, mask=kept & has, other=0)
    else:
        old_leaf = in_old
    rank = tl.load(leaf_rank_ptr + i, mask=kept & ~has, other=0)
    new_leaf = tl.load(pos_new_ptr + rank, mask=kept & ~has, other=0)
    leaf = tl.where(has, old_leaf, new_leaf)
    cur = tl.load(cur_ptr + i, mask=msk, other=-1)
    br = tl.load(brick_rank_ptr + i, mask=missing, other=0)
    fresh = tl.load(fresh_ptr + br, mask=missing & (br < n_fresh), other=-1)
    slot = tl.where(missing, fresh, cur)
    cell = leaf * 8 + b
    tl.store(slots_ptr + cell, slot.to(tl.int32), mask=missing)
    tl.store(bver_ptr + cell, tl.zeros_like(cell) + version, mask=kept)
    pat = tl.load(pat_ptr + (b & 3), mask=missing, other=0)
    word = leaf * 8 + (b >> 2) * 4
    for c in range(4):
        tl.atomic_or(masks_ptr + word + c, pat, mask=missing, sem="relaxed")
    tl.store(out_ptr + i, slot, mask=msk)


def write_bricks_triton(
    in_old, pos_old, pos_new, leaf_rank, b, missing, kept, cur, fresh, brick_rank, version, tables
):
    slots, bver, masks = tables
    m = in_old.numel()
    out = torch.empty(m, dtype=torch.int64, device=in_old.device)
    if m:
        has_pos_old = pos_old is not None and pos_old.numel() > 0
        fr = fresh.to(torch.int64).contiguous() if fresh.numel() else out
        pn = pos_new if pos_new.numel() else out
        _alloc_write_kernel[(triton.cdiv(m, _BLOCK),)](
            in_old, pos_old if has_pos_old else out, pn, leaf_rank, b, missing, kept, cur, fr, brick_rank,
            slots, bver, masks, word_patterns(in_old.device), out, m, fresh.numel(), version,
            HAS_POS_OLD=has_pos_old, BLOCK=_BLOCK,
        )  # fmt: skip
    return out

"""The steps of a layer's brick allocation (``mapper.layers.BrickLayer.allocate_kept``) as operators:
pure-torch references here, Triton twins with the same signatures in :mod:`mapper.kernels.triton_alloc`.

The allocation of a frame's ``M`` bricks into a layer of ``La`` sorted leaves (8 bricks each, a slot table
``int32 [La, 8]``, a version table ``int64 [La, 8]`` and the grid's masks ``int64 [La, 8]``) is:

1. :func:`alloc_lookup`: per brick, its leaf key, binary search in the leaf keys, the current slot, the
   flags kept and missing (kept without a slot) and the sort key of the missing bricks without a leaf;
2. ``torch.sort`` of those keys (the new leaves are their distinct values);
3. :func:`alloc_ranks`: one scan: the rank of each new leaf, of each missing brick, of each kept brick; the
   new leaf keys and the kept rows compacted; the three sizes (read back once by the caller);
4. with new leaves, :func:`relayout_leaves`: the old rows move to their place in the merged sorted keys
   (``pos = i + #new keys before``), the new ones get empty rows; ``O(La + N log)``;
5. :func:`write_bricks`: slot, version and the brick's mask bits (an OR into 4 words) of every kept brick.

Without a new brick nothing is ``O(leaves)``; with new bricks the masks are copied (the grid is immutable)
and the voxel offsets recomputed; with new leaves the tables are re-laid out (one pass).

Brick ``(i, j, k)`` lies in leaf ``(i, j, k) >> 1`` at index ``(i & 1) << 2 | (j & 1) << 1 | (k & 1)``;
its voxels are the 4x4 ``(j, k)`` block ``(j & 1, k & 1)`` of the leaf mask words ``4 (i & 1) .. + 3``.
"""

from __future__ import annotations

import torch

from .dispatch import kernel
from .keys import encode_leaf_keys
from .topology import lookup_leaves

KEY_SENTINEL = torch.iinfo(torch.int64).max  # sorts after every leaf key


def _s64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


# the 4x4 (j, k) block of a brick inside a 64-bit leaf word (bit j*8 + k), for (bj, bk) in {0,1}^2
WORD_PATTERNS = [
    _s64(sum(1 << ((4 * bj + j) * 8 + 4 * bk + k) for j in range(4) for k in range(4)))
    for bj in range(2)
    for bk in range(2)
]
_PATTERNS: dict[torch.device, torch.Tensor] = {}


def word_patterns(device: torch.device) -> torch.Tensor:
    """int64 ``[4]``: :data:`WORD_PATTERNS` on ``device`` (cached)."""
    t = _PATTERNS.get(device)
    if t is None:
        t = torch.tensor(WORD_PATTERNS, dtype=torch.int64, device=device)
        _PATTERNS[device] = t
    return t


def brick_masks(present: torch.Tensor) -> torch.Tensor:
    """Leaf masks int64 ``[L, 8]`` of the voxels of the present bricks (bool ``[L, 8]``, brick index
    ``bi << 2 | bj << 1 | bk``): brick ``bi`` covers words ``4 bi .. 4 bi + 3`` with a fixed 4x4 pattern."""
    p = present.to(torch.int64).reshape(-1, 2, 4)  # [L, bi, (bj, bk)]
    w = (p * word_patterns(present.device)).sum(dim=2)  # disjoint patterns: sum == or
    return w.repeat_interleave(4, dim=1)


# -- 1. lookup ---------------------------------------------------------------------------------------------
def alloc_lookup(brick_ijk, keep, leaf_keys, slots):
    return kernel(brick_ijk.device, alloc_lookup_torch, "triton_alloc:alloc_lookup_triton")(
        brick_ijk, keep, leaf_keys, slots
    )


def alloc_lookup_torch(
    brick_ijk: torch.Tensor, keep: torch.Tensor | None, leaf_keys: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per brick of int64 ``[M, 3]`` ``brick_ijk`` (``keep``: bool ``[M]`` or None = all) in a layer with
    sorted leaf keys int64 ``[La]`` and slot table int32 ``[La, 8]``: (its leaf's index int64 ``[M]``, -1
    without a leaf; its slot int64 ``[M]``, -1 without one; the sort key int64 ``[M]``: the leaf key where
    the brick is missing and has no leaf, else :data:`KEY_SENTINEL`; its index in the leaf int64 ``[M]``;
    missing (kept without a slot) and kept, bool ``[M]``)."""
    m = brick_ijk.shape[0]
    lk = encode_leaf_keys(brick_ijk >> 1)
    b = ((brick_ijk[:, 0] & 1) << 2) | ((brick_ijk[:, 1] & 1) << 1) | (brick_ijk[:, 2] & 1)
    if leaf_keys.numel():
        in_old = lookup_leaves(leaf_keys, lk)
        cur = slots[in_old.clamp(min=0), b].to(torch.int64)
        cur = torch.where(in_old >= 0, cur, -1)
    else:
        in_old = torch.full((m,), -1, dtype=torch.int64, device=brick_ijk.device)
        cur = in_old
    kept = torch.ones(m, dtype=torch.bool, device=brick_ijk.device) if keep is None else keep.to(torch.bool)
    missing = kept & (cur < 0)
    sortkey = torch.where(missing & (in_old < 0), lk, KEY_SENTINEL)
    return in_old, cur, sortkey, b, missing, kept


# -- 3. ranks ----------------------------------------------------------------------------------------------
def alloc_ranks(sk, order, missing, kept):
    return kernel(sk.device, alloc_ranks_torch, "triton_alloc:alloc_ranks_triton")(sk, order, missing, kept)


def alloc_ranks_torch(
    sk: torch.Tensor, order: torch.Tensor, missing: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the sorted keys int64 ``[M]`` ``sk`` (``sort(sortkey)``, ``order`` its permutation, int64
    ``[M]``) and the flags missing / kept (bool ``[M]``) of :func:`alloc_lookup`: (sizes int64 ``[3]`` =
    new leaves, missing bricks, kept bricks; the new leaf keys int64 ``[M]``, sorted, the first ``sizes[0]``
    valid; each brick's new-leaf rank int64 ``[M]`` (input order; valid where the brick is missing without
    a leaf); each brick's rank among the missing ones int64 ``[M]`` (valid where missing); the kept rows
    int64 ``[M]``, ascending, the first ``sizes[2]`` valid)."""
    m = sk.numel()
    dev = sk.device
    first = sk != KEY_SENTINEL
    first[1:] &= sk[1:] != sk[:-1]
    leaf_rank_sorted = torch.cumsum(first, 0) - 1
    brick_rank = torch.cumsum(missing, 0) - 1
    kept_rank = torch.cumsum(kept, 0) - 1
    sizes = torch.stack((leaf_rank_sorted[-1], brick_rank[-1], kept_rank[-1])) + 1
    new_keys = torch.empty(m + 1, dtype=torch.int64, device=dev)
    new_keys[torch.where(first, leaf_rank_sorted, m)] = sk  # the last row collects the rest
    leaf_rank = torch.empty_like(leaf_rank_sorted)
    leaf_rank[order] = leaf_rank_sorted
    rows = torch.empty(m + 1, dtype=torch.int64, device=dev)
    rows[torch.where(kept, kept_rank, m)] = torch.arange(m, dtype=torch.int64, device=dev)
    return sizes, new_keys[:m], leaf_rank, brick_rank, rows[:m]


# -- 4. re-layout ------------------------------------------------------------------------------------------
def relayout_leaves(old_keys, new_keys, slots, bver, masks):
    return kernel(old_keys.device, relayout_leaves_torch, "triton_alloc:relayout_leaves_triton")(
        old_keys, new_keys, slots, bver, masks
    )


def relayout_leaves_torch(
    old_keys: torch.Tensor,
    new_keys: torch.Tensor,
    slots: torch.Tensor,
    bver: torch.Tensor,
    masks: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Splice the sorted unique keys int64 ``[N]`` ``new_keys`` (none in ``old_keys``) into the sorted leaf
    keys int64 ``[La]``, moving the leaf tables (slots int32, versions int64, masks int64, ``[La, 8]``) with
    them; new rows get slots -1, versions -1, masks 0. Returns (keys ``[La + N]``, slots, versions, masks
    ``[La + N, 8]``, where each old leaf landed int64 ``[La]``, where each new key landed int64 ``[N]``)."""
    dev = old_keys.device
    la, n = old_keys.numel(), new_keys.numel()
    pos_old = torch.arange(la, dtype=torch.int64, device=dev) + torch.searchsorted(new_keys, old_keys)
    pos_new = torch.arange(n, dtype=torch.int64, device=dev) + torch.searchsorted(old_keys, new_keys)
    keys = torch.empty(la + n, dtype=torch.int64, device=dev)
    keys[pos_old] = old_keys
    keys[pos_new] = new_keys
    s = torch.full((la + n, 8), -1, dtype=torch.int32, device=dev)
    s[pos_old] = slots
    v = torch.full((la + n, 8), -1, dtype=torch.int64, device=dev)
    v[pos_old] = bver
    w = torch.zeros((la + n, 8), dtype=torch.int64, device=dev)
    w[pos_old] = masks
    return keys, s, v, w, pos_old, pos_new


# -- 5. write ----------------------------------------------------------------------------------------------
def write_bricks(
    in_old, pos_old, pos_new, leaf_rank, b, missing, kept, cur, fresh, brick_rank, version, tables
):
    return kernel(in_old.device, write_bricks_torch, "triton_alloc:write_bricks_triton")(
        in_old, pos_old, pos_new, leaf_rank, b, missing, kept, cur, fresh, brick_rank, version, tables
    )


def write_bricks_torch(
    in_old: torch.Tensor,
    pos_old: torch.Tensor | None,
    pos_new: torch.Tensor,
    leaf_rank: torch.Tensor,
    b: torch.Tensor,
    missing: torch.Tensor,
    kept: torch.Tensor,
    cur: torch.Tensor,
    fresh: torch.Tensor,
    brick_rank: torch.Tensor,
    version: int,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Write every kept brick (at least one) into the (re-laid out) leaf ``tables`` = (slots int32,
    versions int64, masks int64, ``[L, 8]``, in place): its leaf is ``pos_old[in_old]`` (``in_old`` itself
    when ``pos_old`` is None: no new leaf), or ``pos_new[leaf_rank]`` without an old leaf; a missing brick
    takes the slot ``fresh[brick_rank]`` (int64 ``[n_missing]``) and sets its voxels in its leaf's mask, the
    others keep ``cur``; all get ``version``. Returns each brick's slot int64 ``[M]`` (valid where kept)."""
    slots, bver, masks = tables
    m = in_old.numel()
    old_leaf = in_old.clamp(min=0)
    if pos_old is not None and pos_old.numel():
        old_leaf = pos_old[old_leaf]
    if pos_new.numel():
        leaf = torch.where(in_old >= 0, old_leaf, pos_new[leaf_rank.clamp(0, pos_new.numel() - 1)])
    else:
        leaf = old_leaf
    flat = leaf * 8 + b
    slot = cur
    if fresh.numel():
        slot = torch.where(missing, fresh[brick_rank.clamp(0, fresh.numel() - 1)], cur)
        # a row not missing repeats the write of a missing row (same cell, same value; no boolean mask,
        # which would read a size back on a GPU); gathered, not ``x[j]`` (a 0-dim index is read back)
        j = missing.to(torch.uint8).argmax().reshape(1)
        fm = torch.where(missing, flat, flat.index_select(0, j))
        slots.view(-1)[fm] = torch.where(missing, slot, slot.index_select(0, j)).to(torch.int32)
        # the brick's 4x4 pattern into its 4 mask words: the bits of a missing brick are clear and the
        # patterns of the bricks of one word are disjoint, so adding them is OR-ing them
        pat = torch.where(missing, word_patterns(in_old.device)[b & 3], 0)
        masks.view(-1, 4).index_add_(0, leaf * 2 + (b >> 2), pat[:, None].expand(m, 4))
    j = kept.to(torch.uint8).argmax().reshape(1)  # a kept row: the others repeat its write
    bver.view(-1).scatter_(0, torch.where(kept, flat, flat.index_select(0, j)), version)
    return slot

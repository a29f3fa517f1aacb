"""Union, pruning, 2:1 coarsening and 1:2 refinement of leaf sets (torch references / CPU path)."""

from __future__ import annotations

import torch

from .bits import pack_bits, unpack_bits
from .keys import decode_leaf_keys, encode_leaf_keys
from .topology import Leaves, lookup_leaves, make_leaves


def merge_torch(a: Leaves, b: Leaves) -> Leaves:
    """Union of two leaf sets."""
    return merge_with_positions_torch(a, b)[0]


def merge_with_positions_torch(a: Leaves, b: Leaves) -> tuple[Leaves, torch.Tensor, torch.Tensor]:
    """Union of two leaf sets, and where each leaf of ``a`` and of ``b`` landed (int64 ``[La]``, ``[Lb]``).

    A sorted merge, no sort: the leaves of ``b`` missing from ``a`` are found by binary search and
    spliced in, so the cost is ``O(La + Lb log La)`` -- linear in the (small) per-leaf topology of ``a``,
    which is what makes merging a frame's shell into a large map cheap (NOTES.md).
    """
    dev = a.keys.device
    la, lb = a.keys.numel(), b.keys.numel()
    in_a = lookup_leaves(a.keys, b.keys)
    is_new = in_a < 0
    # no boolean-mask indexing (a host sync each on CUDA): every leaf of b gets its place arithmetically,
    # a new one at its insertion point among a's keys plus its rank among the new ones
    rank = torch.cumsum(is_new, 0) - 1
    n_new = int(rank[-1]) + 1 if lb else 0  # the one sync: the result's size
    ins = torch.searchsorted(a.keys, b.keys)  # insertion point of each key among a's keys
    shift = torch.zeros(la + 1, dtype=torch.int64, device=dev)
    shift.scatter_add_(0, ins, is_new.to(torch.int64))
    shift = torch.cumsum(shift, 0)
    pos_a = torch.arange(la, device=dev) + shift[:la]
    old = pos_a[in_a.clamp(min=0)] if la else torch.zeros_like(in_a)
    pos_b = torch.where(is_new, ins + rank, old)
    keys = torch.empty(la + n_new, dtype=torch.int64, device=dev)
    keys[pos_a] = a.keys
    keys[pos_b] = b.keys  # b's leaves already in a write the same key
    masks = torch.zeros((la + n_new, 8), dtype=torch.int64, device=dev)
    masks[pos_a] = a.masks
    masks[pos_b] = masks[pos_b] | b.masks
    return make_leaves(keys, masks), pos_a, pos_b


def prune_torch(leaves: Leaves, keep: torch.Tensor) -> Leaves:
    """Keep the voxels where bool ``keep`` ``[N]`` (voxel-sequential order) is true; drop empty leaves."""
    bits = unpack_bits(leaves.masks)
    new = torch.zeros_like(bits)
    new.masked_scatter_(bits, keep)  # fills the active positions in row-major = voxel order
    return make_leaves(leaves.keys, pack_bits(new), drop_empty=True)


def coarsen_torch(leaves: Leaves) -> Leaves:
    """Voxel (i, j, k) -> (i >> 1, j >> 1, k >> 1): each leaf's 8^3 mask ORs down to a 4^3 octant."""
    n = leaves.keys.numel()
    if n == 0:
        return leaves
    dev = leaves.keys.device
    coarse = unpack_bits(leaves.masks).view(n, 4, 2, 4, 2, 4, 2).any(dim=6).any(dim=4).any(dim=2)
    lc = decode_leaf_keys(leaves.keys)
    keys, inv = torch.unique(encode_leaf_keys(lc >> 1), return_inverse=True)
    o = (lc & 1) * 4  # octant origin inside the parent leaf
    a = torch.arange(4, device=dev)
    ii = (o[:, 0, None, None, None] + a[None, :, None, None]) << 6
    jj = (o[:, 1, None, None, None] + a[None, None, :, None]) << 3
    kk = o[:, 2, None, None, None] + a[None, None, None, :]
    off = (ii | jj | kk).reshape(n, 64)
    bits = torch.zeros((keys.numel(), 512), dtype=torch.bool, device=dev)
    bits[inv[:, None].expand(n, 64), off] = coarse.reshape(n, 64)  # (parent, octant) pairs are unique
    return make_leaves(keys, pack_bits(bits))


def refine_torch(leaves: Leaves) -> Leaves:
    """Each voxel -> its 8 children: each non-empty 4^3 octant of a leaf becomes a full child leaf."""
    n = leaves.keys.numel()
    if n == 0:
        return leaves
    oct_bits = (
        unpack_bits(leaves.masks)
        .view(n, 2, 4, 2, 4, 2, 4)
        .permute(0, 1, 3, 5, 2, 4, 6)
        .reshape(n * 8, 4, 4, 4)
    )
    nonempty = oct_bits.reshape(n * 8, 64).any(dim=1)
    sel = nonempty.nonzero().squeeze(1)
    up = oct_bits[sel]
    up = up.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    parent = decode_leaf_keys(leaves.keys)[sel // 8]
    o = sel % 8
    octant = torch.stack((o >> 2, (o >> 1) & 1, o & 1), dim=1)
    keys = encode_leaf_keys(parent * 2 + octant)
    keys, order = torch.sort(keys)
    return make_leaves(keys, pack_bits(up.reshape(-1, 512)[order]))


def insert_sorted_keys(a: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splice sorted unique keys ``new`` (int64 ``[N]``, none in ``a``) into sorted unique keys ``a`` (int64
    ``[La]``): (int64 ``[La + N]`` sorted keys, where each key of ``a`` landed ``[La]``, where each key of
    ``new`` landed ``[N]``). No sort and no host sync: every key's place is its insertion point plus the
    number of keys of the other set before it, ``O(La + N log La)``."""
    dev = a.device
    la, n = a.numel(), new.numel()
    ins = torch.searchsorted(a, new)  # insertion point of each new key among a's keys
    pos_new = ins + torch.arange(n, dtype=torch.int64, device=dev)
    shift = torch.zeros(la + 1, dtype=torch.int64, device=dev)
    shift.scatter_add_(0, ins, torch.ones_like(ins))
    pos_a = torch.arange(la, dtype=torch.int64, device=dev) + torch.cumsum(shift, 0)[:la]
    keys = torch.empty(la + n, dtype=torch.int64, device=dev)
    keys[pos_a] = a
    keys[pos_new] = new
    return keys, pos_a, pos_new

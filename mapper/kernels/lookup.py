"""Voxel coordinate -> position in the voxel-sequential order."""

from __future__ import annotations

import torch

from .bits import low_bits, popcount64
from .chunks import map_rows
from .keys import encode_leaf_keys, in_range, voxel_offsets
from .topology import Leaves, lookup_leaves

_WORDS = torch.arange(8)


def ijk_to_index_torch(leaves: Leaves, ijk: torch.Tensor) -> torch.Tensor:
    """int64 ``[M]`` index of each voxel of int64 ``[M, 3]`` ``ijk``; -1 where inactive or out of range."""
    m = ijk.shape[0]
    if m == 0 or leaves.keys.numel() == 0:
        return torch.full((m,), -1, dtype=torch.int64, device=ijk.device)
    return map_rows(lambda q: _lookup(leaves, q), ijk)


def _lookup(leaves: Leaves, ijk: torch.Tensor) -> torch.Tensor:
    ok = in_range(ijk)
    safe = torch.where(ok[:, None], ijk, torch.zeros_like(ijk))
    leaf = lookup_leaves(leaves.keys, encode_leaf_keys(safe >> 3))
    found = ok & (leaf >= 0)
    leaf = leaf.clamp(min=0)
    off = voxel_offsets(safe)
    w, b = off >> 6, off & 63
    words = leaves.masks[leaf]  # [M, 8]
    word = words.gather(1, w[:, None]).squeeze(1)
    active = (word >> b) & 1
    before = torch.where(_WORDS.to(ijk.device)[None, :] < w[:, None], popcount64(words), 0).sum(1)
    rank = before + popcount64(word & low_bits(b))
    idx = leaves.offsets[leaf] + rank
    return torch.where(found & (active == 1), idx, torch.full_like(idx, -1))


def ijk_to_leaf_torch(leaves: Leaves, ijk: torch.Tensor) -> torch.Tensor:
    """int64 ``[M]`` index of the leaf holding each voxel of int64 ``[M, 3]`` ``ijk``; -1 where absent."""
    m = ijk.shape[0]
    if m == 0 or leaves.keys.numel() == 0:
        return torch.full((m,), -1, dtype=torch.int64, device=ijk.device)
    return map_rows(lambda q: _leaf_lookup(leaves, q), ijk)


def _leaf_lookup(leaves: Leaves, ijk: torch.Tensor) -> torch.Tensor:
    ok = in_range(ijk)
    safe = torch.where(ok[:, None], ijk, torch.zeros_like(ijk))
    leaf = lookup_leaves(leaves.keys, encode_leaf_keys(safe >> 3))
    return torch.where(ok, leaf, torch.full_like(leaf, -1))

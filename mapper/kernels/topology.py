"""The topology of an index grid as plain tensors, shared by the torch references and Triton kernels.

``Leaves`` is the canonical state: sorted unique leaf keys, their 512-bit masks (no empty leaf) and the
exclusive prefix of active voxels per leaf. ``Tiles`` is the acceleration index over it (derived, cached):
tiles of 4^3 leaves, each with the 64-bit mask of its present leaves and the index of its first leaf, so a
leaf is found by a binary search over tiles and one popcount, with no hash table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .bits import leaf_counts, popcount64
from .keys import LEAF_POS_BITS


class Tiles(NamedTuple):
    keys: torch.Tensor  # int64 [T] sorted unique tile keys
    masks: torch.Tensor  # int64 [T] bit p set <=> leaf (tile << 6 | p) present
    starts: torch.Tensor  # int64 [T + 1] index of the tile's first leaf


class Leaves(NamedTuple):
    keys: torch.Tensor  # int64 [L] sorted unique leaf keys
    masks: torch.Tensor  # int64 [L, 8] active masks, none all-zero
    offsets: torch.Tensor  # int64 [L + 1] exclusive prefix of active voxels


def empty_leaves(device: torch.device) -> Leaves:
    return Leaves(
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros((0, 8), dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    )


def make_leaves(keys: torch.Tensor, masks: torch.Tensor, drop_empty: bool = False) -> Leaves:
    """Leaves from sorted unique keys and masks; computes offsets. ``drop_empty`` removes empty leaves."""
    if drop_empty and keys.numel():
        keep = (masks != 0).any(dim=1)
        keys, masks = keys[keep], masks[keep]
    counts = leaf_counts(masks) if keys.numel() else torch.zeros(0, dtype=torch.int64, device=keys.device)
    offsets = torch.zeros(keys.numel() + 1, dtype=torch.int64, device=keys.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return Leaves(keys.contiguous(), masks.contiguous(), offsets)


def build_tiles(keys: torch.Tensor) -> Tiles:
    """The tile index of sorted unique leaf keys."""
    dev = keys.device
    if keys.numel() == 0:
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        return Tiles(z, z.clone(), torch.zeros(1, dtype=torch.int64, device=dev))
    tkeys, inv, counts = torch.unique_consecutive(
        keys >> LEAF_POS_BITS, return_inverse=True, return_counts=True
    )
    bits = torch.ones_like(keys) << (keys & 63)
    tmasks = torch.zeros_like(tkeys).scatter_add_(0, inv, bits)  # distinct bits: sum == or
    starts = torch.zeros(tkeys.numel() + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=starts[1:])
    return Tiles(tkeys, tmasks, starts)


def lookup_leaves(keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Index of each query key in sorted ``keys``; -1 where absent. int64 ``[M]``."""
    if keys.numel() == 0:
        return torch.full_like(query, -1)
    pos = torch.searchsorted(keys, query).clamp_(max=keys.numel() - 1)
    return torch.where(keys[pos] == query, pos, torch.full_like(pos, -1))


def tile_popcount_check(tiles: Tiles) -> torch.Tensor:
    """Leaves per tile from the tile masks (used by tests to check the index)."""
    return popcount64(tiles.masks)

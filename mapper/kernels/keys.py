"""Packing of leaf and tile coordinates into sortable int64 keys.

Layout (see NOTES.md, "Index grid"):

* a **voxel** ``(i, j, k)`` lies in **leaf** ``(i >> 3, j >> 3, k >> 3)`` (8^3 voxels) at the NanoVDB
  offset ``((i & 7) << 6) | ((j & 7) << 3) | (k & 7)``;
* a leaf ``(a, b, c)`` lies in **tile** ``(a >> 2, b >> 2, c >> 2)`` (4^3 leaves) at the position
  ``((a & 3) << 4) | ((b & 3) << 2) | (c & 3)``;
* a tile key packs the three tile coordinates, biased by ``TILE_BIAS``, in 19 bits each (i major);
* a leaf key is ``tile_key << 6 | position``.

Sorting leaves by leaf key orders them tile by tile, i-major inside a tile; that is the grid's
voxel-sequential order. Valid voxel coordinates lie in ``[-VOXEL_LIMIT, VOXEL_LIMIT)`` per axis; the bias
leaves a margin of one full range on each side, so neighbour arithmetic on keys never overflows.
"""

from __future__ import annotations

import torch

VOXEL_LIMIT = 1 << 22  # valid voxel coordinates: [-2^22, 2^22) per axis
TILE_AXIS_BITS = 19
TILE_BIAS = 1 << 18  # tile coordinates lie in [-2^17, 2^17); biased they sit mid-range of 19 bits
_AXIS_MASK = (1 << TILE_AXIS_BITS) - 1
LEAF_POS_BITS = 6
INVALID_KEY = -1  # no valid key is negative


def encode_leaf_keys(leaf_ijk: torch.Tensor) -> torch.Tensor:
    """Leaf keys of leaf coordinates.

    Args:
        leaf_ijk: int64 ``[N, 3]`` leaf coordinates (voxel coordinates ``>> 3``), any device.
    Returns:
        int64 ``[N]`` keys, same device.
    """
    t = leaf_ijk >> 2
    tile = (
        ((t[:, 0] + TILE_BIAS) << (2 * TILE_AXIS_BITS))
        | ((t[:, 1] + TILE_BIAS) << TILE_AXIS_BITS)
        | (t[:, 2] + TILE_BIAS)
    )
    p = leaf_ijk & 3
    return (tile << LEAF_POS_BITS) | (p[:, 0] << 4) | (p[:, 1] << 2) | p[:, 2]


def decode_leaf_keys(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_leaf_keys`: int64 ``[N]`` keys -> int64 ``[N, 3]`` leaf coordinates."""
    tile = keys >> LEAF_POS_BITS
    ti = ((tile >> (2 * TILE_AXIS_BITS)) & _AXIS_MASK) - TILE_BIAS
    tj = ((tile >> TILE_AXIS_BITS) & _AXIS_MASK) - TILE_BIAS
    tk = (tile & _AXIS_MASK) - TILE_BIAS
    return torch.stack((ti * 4 + ((keys >> 4) & 3), tj * 4 + ((keys >> 2) & 3), tk * 4 + (keys & 3)), dim=1)


def shift_leaf_keys(keys: torch.Tensor, delta: tuple[int, int, int]) -> torch.Tensor:
    """Keys of the leaves at leaf offset ``delta`` from ``keys`` (int64 ``[N]``)."""
    c = decode_leaf_keys(keys)
    c = c + torch.tensor(delta, dtype=torch.int64, device=keys.device)
    return encode_leaf_keys(c)


def voxel_offsets(ijk: torch.Tensor) -> torch.Tensor:
    """NanoVDB in-leaf offsets of int64 ``[N, 3]`` voxel coordinates -> int64 ``[N]`` in ``[0, 512)``."""
    return ((ijk[:, 0] & 7) << 6) | ((ijk[:, 1] & 7) << 3) | (ijk[:, 2] & 7)


def in_range(ijk: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: voxel coordinates inside the representable range."""
    return ((ijk >= -VOXEL_LIMIT) & (ijk < VOXEL_LIMIT)).all(dim=1)

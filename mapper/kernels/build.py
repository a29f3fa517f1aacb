"""Grid construction from voxel coordinates and listing of the active voxels."""

from __future__ import annotations

import torch

from .bits import pack_bits, unpack_bits
from .chunks import map_rows
from .keys import decode_leaf_keys, encode_leaf_keys, voxel_offsets
from .topology import Leaves, empty_leaves, make_leaves


def from_ijk_torch(ijk: torch.Tensor) -> Leaves:
    """Leaves of int64 ``[N, 3]`` in-range voxel coordinates (duplicates allowed)."""
    if ijk.shape[0] == 0:
        return empty_leaves(ijk.device)
    keys, inv = torch.unique(map_rows(lambda c: encode_leaf_keys(c >> 3), ijk), return_inverse=True)
    bits = torch.zeros((keys.numel(), 512), dtype=torch.bool, device=ijk.device)
    bits[inv, map_rows(voxel_offsets, ijk)] = True
    return make_leaves(keys, pack_bits(bits))


def voxel_ijk_torch(leaves: Leaves) -> torch.Tensor:
    """int32 ``[N, 3]`` coordinates of the active voxels in voxel-sequential order."""
    if leaves.keys.numel() == 0:
        return torch.zeros((0, 3), dtype=torch.int32, device=leaves.keys.device)
    return map_rows(_expand, leaves.keys, leaves.masks, cpu_rows=1 << 10)


def _expand(keys: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    bits = unpack_bits(masks)
    leaf, off = bits.nonzero(as_tuple=True)
    base = decode_leaf_keys(keys)[leaf] << 3
    local = torch.stack((off >> 6, (off >> 3) & 7, off & 7), dim=1)
    return (base + local).to(torch.int32)

"""Sortable int64 keys of blocks (bricks) and lattice edges (layouts: :mod:`mapper.kernels.keys`)."""

from __future__ import annotations

import torch

from ..kernels.marching import BLOCK_BIAS, BLOCK_BITS, IJ_BIAS, IJ_BITS, K_BIAS, K_BITS

_BLOCK_BITS, _BLOCK_BIAS = BLOCK_BITS, BLOCK_BIAS
_IJ_BITS, _K_BITS = IJ_BITS, K_BITS  # the edge key layout lives in mapper.kernels.keys
_IJ_BIAS, _K_BIAS = IJ_BIAS, K_BIAS
VOXEL_RANGE_IJ = (-IJ_BIAS, IJ_BIAS)  # lattice points edge keys can hold, per axis: [lo, hi)
VOXEL_RANGE_K = (-K_BIAS, K_BIAS)


def block_keys(blocks: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]`` sortable keys (i major) of int64 ``[B, 3]`` brick coordinates."""
    b = blocks + _BLOCK_BIAS
    return (b[:, 0] << (2 * _BLOCK_BITS)) | (b[:, 1] << _BLOCK_BITS) | b[:, 2]


def decode_block_keys(keys: torch.Tensor) -> torch.Tensor:
    m = (1 << _BLOCK_BITS) - 1
    return (
        torch.stack(((keys >> (2 * _BLOCK_BITS)) & m, (keys >> _BLOCK_BITS) & m, keys & m), 1) - _BLOCK_BIAS
    )


def edge_keys(voxel: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` key of the lattice edge from voxel ``voxel`` (int64 ``[N, 3]``) to ``voxel + e_axis``.

    Layout: signed i in the top 21 bits, then j + 2^20 (21 bits), k + 2^19 (20 bits), axis (2 bits); the
    signed order of the keys is the lexicographic order of (i, j, k, axis)."""
    return (
        (voxel[:, 0] << (_IJ_BITS + _K_BITS + 2))
        | ((voxel[:, 1] + _IJ_BIAS) << (_K_BITS + 2))
        | ((voxel[:, 2] + _K_BIAS) << 2)
        | axis
    )


def decode_edge_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`edge_keys`: (int64 ``[N, 3]`` min voxel, int64 ``[N]`` axis)."""
    i = keys >> (_IJ_BITS + _K_BITS + 2)
    j = ((keys >> (_K_BITS + 2)) & ((1 << _IJ_BITS) - 1)) - _IJ_BIAS
    k = ((keys >> 2) & ((1 << _K_BITS) - 1)) - _K_BIAS
    return torch.stack((i, j, k), 1), keys & 3


def _sorted_unique_blocks(blocks: torch.Tensor) -> torch.Tensor:
    if blocks.shape[0] == 0:
        return blocks.reshape(0, 3)
    return decode_block_keys(torch.unique(block_keys(blocks)))

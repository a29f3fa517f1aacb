"""Index-grid operators with one signature per operator, dispatched once per call (torch reference or Triton).

The Triton twins need the grid's tile index; the torch references do not. So each operator takes the tile
index as a zero-argument callable ``tiles`` (``IndexGrid.tiles`` is built lazily and cached): the Triton
path calls it, the torch path never does, and a CPU grid never builds tiles it does not use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import build, inject, lookup, morphology, setops
from .dispatch import kernel
from .topology import Leaves, Tiles

TilesOf = Callable[[], Tiles]
Morphed = tuple[Leaves, Tiles | None]


def _triton_voxel_ijk(leaves: Leaves) -> torch.Tensor:
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_ops import voxel_ijk_triton

    return voxel_ijk_triton(leaves)


def voxel_ijk(leaves: Leaves) -> torch.Tensor:
    """int32 ``[num_voxels, 3]`` coordinates of ``leaves``' active voxels in voxel-sequential order."""
    if leaves.keys.shape[0] == 0:
        return build.voxel_ijk_torch(leaves)
    return kernel(leaves.keys.device, build.voxel_ijk_torch, _triton_voxel_ijk)(leaves)


def _torch_ijk_to_index(leaves: Leaves, tiles: TilesOf, ijk: torch.Tensor, leaf_only: bool) -> torch.Tensor:
    if leaf_only:
        return lookup.ijk_to_leaf_torch(leaves, ijk)
    return lookup.ijk_to_index_torch(leaves, ijk)


def _triton_ijk_to_index(leaves: Leaves, tiles: TilesOf, ijk: torch.Tensor, leaf_only: bool) -> torch.Tensor:
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_ops import ijk_to_index_triton

    return ijk_to_index_triton(leaves, tiles(), ijk, leaf_only=leaf_only)


def ijk_to_index(leaves: Leaves, tiles: TilesOf, ijk: torch.Tensor, leaf_only: bool = False) -> torch.Tensor:
    """int64 ``[M]``: the voxel index (or with ``leaf_only`` the leaf index) of each row of int32
    ``ijk`` ``[M, 3]`` (same device as ``leaves``), -1 where absent."""
    if leaves.keys.shape[0] == 0 or ijk.shape[0] == 0:
        return _torch_ijk_to_index(leaves, tiles, ijk, leaf_only)
    return kernel(ijk.device, _torch_ijk_to_index, _triton_ijk_to_index)(leaves, tiles, ijk, leaf_only)


def _triton_prune(leaves: Leaves, keep: torch.Tensor) -> Leaves:
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_ops import prune_triton

    return prune_triton(leaves, keep)


def prune(leaves: Leaves, keep: torch.Tensor) -> Leaves:
    """The leaves of the voxels where bool ``keep`` ``[num_voxels]`` is true."""
    return kernel(leaves.keys.device, setops.prune_torch, _triton_prune)(leaves, keep)


def _torch_morph(leaves: Leaves, tiles: TilesOf, connectivity: int, erode: bool) -> Morphed:
    op = morphology.erode_torch if erode else morphology.dilate_torch
    return op(leaves, connectivity), None


def _triton_morph(leaves: Leaves, tiles: TilesOf, connectivity: int, erode: bool) -> Morphed:
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_ops import dilate_triton, erode_triton

    return (erode_triton if erode else dilate_triton)(leaves, tiles(), connectivity)


def morph(leaves: Leaves, tiles: TilesOf, connectivity: int, erode: bool) -> Morphed:
    """One step of dilation (or erosion) with ``connectivity`` 6/18/26: the new leaves and, where the
    operator built it on the way, their tile index (None otherwise)."""
    return kernel(leaves.keys.device, _torch_morph, _triton_morph)(leaves, tiles, connectivity, erode)


def _torch_inject_index(src: Leaves, src_tiles: TilesOf, dst: Leaves) -> torch.Tensor:
    return inject.inject_index_torch(src, dst)


def _triton_inject_index(src: Leaves, src_tiles: TilesOf, dst: Leaves) -> torch.Tensor:
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_ops import inject_index_triton

    return inject_index_triton(src, src_tiles(), dst)


def inject_index(src: Leaves, src_tiles: TilesOf, dst: Leaves) -> torch.Tensor:
    """int64 ``[dst voxels]``: each destination voxel's index in ``src``, -1 where absent."""
    return kernel(src.keys.device, _torch_inject_index, _triton_inject_index)(src, src_tiles, dst)

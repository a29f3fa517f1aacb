"""Incremental meshes: the blocks that may have changed since a layer version, re-meshed (a delta for
:func:`mapper.mesh.apply_delta`)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import InvalidArgument, InvalidArgumentType
from ..kernels.marching import changed_neighbourhood_keys
from ..layers import BrickLayer
from .build import _check_layer, _check_voxel_size, _mesh_blocks, extract_mesh
from .cuda_graphs import _mesh_since_graphed
from .keys import _sorted_unique_blocks, block_keys, decode_block_keys
from .types import Mesh


def affected_blocks(bricks: torch.Tensor) -> torch.Tensor:
    """Blocks whose cells can read a voxel of the given bricks: ``bricks + {-1, 0, 1}^3``, unique, sorted
    by block key (int64 ``[M, 3]`` -> int64 ``[A, 3]``)."""
    if bricks.shape[0] == 0:
        return bricks.reshape(0, 3).to(torch.int64)
    d = _offsets27(bricks.device)
    return _sorted_unique_blocks((bricks[:, None, :].to(torch.int64) + d[None]).reshape(-1, 3))


@functools.cache
def _offsets27(device: torch.device) -> torch.Tensor:
    r = torch.arange(-1, 2)
    return torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3).to(device)


def mesh_since(layer: BrickLayer, voxel_size_m: float, since_version: int) -> Mesh:
    """The blocks that may have changed since layer version ``since_version``, re-meshed.

    Changed = bricks written or removed after that version (``layer.changed_since``) and their 26
    neighbours. Returns a delta (``full=False``, ``since_version`` set; ``removed_blocks`` = re-meshed
    blocks without faces) for :func:`apply_delta`, or a full mesh (``full=True``) when the layer's removal
    log no longer reaches back to ``since_version``.
    """
    _check_layer(layer)
    if isinstance(since_version, bool) or not isinstance(since_version, (int, np.integer)):
        raise InvalidArgumentType(f"since_version: expected an int, got {type(since_version).__name__}")
    since = int(since_version)
    if since < 0 or since > layer.version:
        raise InvalidArgument(f"since_version: expected a version in [0, {layer.version}], got {since}")
    removed = layer.removed_since(since)
    if removed is None:
        return extract_mesh(layer, voxel_size_m)
    s = _check_voxel_size(voxel_size_m)
    with_color = "color" in layer.pool.fields and "color_weight" in layer.pool.fields
    # keys of the changed bricks' 27-neighbourhoods (one kernel), and of the removed bricks'
    changed = (layer.slots >= 0) & (layer.brick_versions > since)
    if removed.shape[0] == 0:  # a CUDA graph for short deltas (mapper.graphs), else the eager path
        mesh = _mesh_since_graphed(layer, s, since, changed, with_color)
        if mesh is not None:
            return mesh
    keys = changed_neighbourhood_keys(changed, layer.grid.leaves.keys)
    if removed.shape[0]:
        keys = torch.cat(
            (keys, block_keys((removed[:, None, :] + _offsets27(removed.device)[None]).reshape(-1, 3)))
        )
    req = decode_block_keys(torch.unique(keys)) if keys.numel() else removed.reshape(0, 3)
    # only bricks that exist now can have cells, and only those or the removed ones can have had faces in
    # the consumer's mesh (a brick absent now and not removed since was absent then): the rest of the
    # neighbourhoods (most of it, around a LiDAR scan's sparse bricks) is neither meshed nor listed
    if req.shape[0]:
        present = layer.voxel_slots(req << 2)[0] >= 0
        if removed.shape[0]:
            present |= torch.isin(block_keys(req), block_keys(removed))
        req = req[present]
    mesh = _mesh_blocks(layer, s, req, with_color, partial=True)
    mesh.since_version = since
    return mesh

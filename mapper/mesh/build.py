"""Extraction: the mesh of a TSDF layer's bricks (the per-brick work is ``mapper.kernels.marching``: a
Triton kernel or its torch reference; short lists replay a CUDA graph, :mod:`mapper.mesh.cuda_graphs`)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import InvalidArgument, InvalidArgumentType
from ..kernels.marching import marching_cubes
from ..kernels.marching import neighbour_slots as nbr_slots_op
from ..layers import BrickLayer
from .cuda_graphs import _mesh_graphed
from .keys import _BLOCK_BIAS, VOXEL_RANGE_IJ, VOXEL_RANGE_K, _sorted_unique_blocks
from .tables import _tables
from .types import Mesh


def neighbour_slots(layer: BrickLayer, bricks: torch.Tensor) -> torch.Tensor:
    """int64 ``[M, 27]``: pool slot of each brick's 27 neighbours (``mapper.kernels.marching`` order), -1
    where absent."""
    g = layer.grid
    tiles = g.tiles if g.num_leaves else None
    return nbr_slots_op(bricks, g.leaves, tiles, layer.slots)


def _check_layer(layer) -> None:
    if not isinstance(layer, BrickLayer):
        raise InvalidArgumentType(f"layer: expected a BrickLayer, got {type(layer).__name__}")
    for f in ("tsdf", "weight"):
        if f not in layer.pool.fields:
            raise InvalidArgument(f"layer: not a TSDF layer (no {f!r} field)")


def _check_voxel_size(voxel_size_m) -> float:
    if isinstance(voxel_size_m, bool) or not isinstance(voxel_size_m, (int, float)):
        raise InvalidArgumentType(f"voxel_size_m: expected a number, got {type(voxel_size_m).__name__}")
    s = float(voxel_size_m)
    if not np.isfinite(s) or s <= 0:
        raise InvalidArgument(f"voxel_size_m: expected a finite value > 0, got {voxel_size_m}")
    return s


@functools.cache
def _range_t(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    limits = (VOXEL_RANGE_IJ, VOXEL_RANGE_IJ, VOXEL_RANGE_K)
    return (
        torch.tensor([mn for mn, _ in limits], device=device),
        torch.tensor([mx for _, mx in limits], device=device),
    )


def _check_key_range(bricks: torch.Tensor, present: torch.Tensor) -> None:
    """Edge keys hold voxel i, j in [-2^20, 2^20) and k in [-2^19, 2^19); cells reach 4 voxels up. Checks
    the present bricks (one read-back)."""
    if bricks.shape[0] == 0:
        return
    limits = (VOXEL_RANGE_IJ, VOXEL_RANGE_IJ, VOXEL_RANGE_K)
    lo, hi = _range_t(bricks.device)
    v = bricks << 2
    bad = (present[:, None] & ((v < lo) | (v + 4 >= hi))).any(0).tolist()
    for axis, (mn, mx) in enumerate(limits):
        if bad[axis]:
            a = int(v[present, axis].min())
            b = int(v[present, axis].max()) + 4
            raise InvalidArgument(
                f"layer: meshing supports voxel coordinates in [{mn}, {mx - 4}) on axis {'ijk'[axis]} "
                f"(edge key range); the layer reaches [{a}, {b - 1}]"
            )


def _assemble(result, bricks, dev, with_color, version, s, partial: bool) -> Mesh:
    """The mesh of a :func:`~mapper.kernels.marching.marching_cubes` result over ``bricks``, with its block
    bookkeeping (one read-back: the number of blocks with faces)."""
    face_counts, keys, pos, nrm, col, faces = result
    has = face_counts > 0
    idx = has.nonzero().squeeze(1)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    if partial:  # requested blocks without faces: the consumer drops what it had there
        n_empty = bricks.shape[0] - idx.numel()
        try:  # no read-back: the size is known
            removed = bricks[torch.nonzero_static(~has, size=n_empty).squeeze(1)]
        except (AttributeError, NotImplementedError, RuntimeError):  # pragma: no cover - older torch
            removed = bricks[~has]
    else:
        removed = torch.zeros((0, 3), dtype=torch.int64, device=dev)
    return Mesh(
        vertices=pos,
        faces=faces.to(torch.int32),
        normals=nrm,
        colors=col,
        vertex_keys=keys,
        blocks=bricks[idx],
        block_face_offsets=torch.cat((zero, torch.cumsum(face_counts, 0)[idx])),
        removed_blocks=removed,
        version=version,
        full=not partial,
        voxel_size_m=s,
    )


def extract_mesh(layer: BrickLayer, voxel_size_m: float, bricks=None) -> Mesh:
    """Marching-cubes mesh of a TSDF layer's zero level set.

    Args:
        layer: a TSDF :class:`~mapper.layers.BrickLayer` (fields ``tsdf``, ``weight``; ``color`` and
            ``color_weight`` give vertex colours).
        voxel_size_m: voxel edge in metres.
        bricks: optional integer ``[M, 3]`` brick coordinates (``voxel >> 2``): mesh only the cells whose
            min corner lies in them (duplicates and absent bricks are fine). None = every allocated brick.
    Returns:
        A :class:`Mesh` on the layer's device. With ``bricks`` the mesh is a patch for those blocks
        (``full=False``; requested bricks without faces are listed in ``removed_blocks``).
    """
    _check_layer(layer)
    s = _check_voxel_size(voxel_size_m)
    dev = layer.device
    with_color = "color" in layer.pool.fields and "color_weight" in layer.pool.fields
    if bricks is None:
        req = _sorted_unique_blocks(layer.brick_table()[0])
    else:
        if not isinstance(bricks, torch.Tensor):
            bricks = torch.as_tensor(np.asarray(bricks))
        if bricks.dtype not in (torch.int32, torch.int64) or bricks.dim() != 2 or bricks.shape[1] != 3:
            raise InvalidArgument(
                f"bricks: expected an integer tensor [M, 3], got {list(bricks.shape)} {bricks.dtype}"
            )
        req = _sorted_unique_blocks(bricks.to(dev, torch.int64))
        lim = _BLOCK_BIAS >> 2
        if req.shape[0] and bool(((req < -lim) | (req >= lim)).any()):
            raise InvalidArgument(f"bricks: coordinates must lie in [-{lim}, {lim})")
    return _mesh_blocks(layer, s, req, with_color, partial=bricks is not None)


def _mesh_blocks(layer: BrickLayer, s: float, req: torch.Tensor, with_color: bool, partial: bool) -> Mesh:
    """The mesh of the cells of ``req`` (int64 ``[M, 3]``, sorted by block key, unique; absent bricks have
    no cells: their min corners are unobserved)."""
    dev = layer.device
    nbr = neighbour_slots(layer, req)
    mesh = _mesh_graphed(layer, s, req, nbr, with_color, partial)
    if mesh is not None:
        return mesh
    _check_key_range(req, nbr[:, 13] >= 0)
    table, count = _tables(dev)
    result = marching_cubes(req, nbr, layer.pool, table, count, s, with_color)
    return _assemble(result, req, dev, with_color, layer.version, s, partial)

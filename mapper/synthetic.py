"""Synthetic inputs shared by tests and benchmarks: narrow-band shells of analytic level sets.

Coordinates are in voxel index space: voxel ``(i, j, k)`` is the point ``(i, j, k)``, as OpenVDB's
``createLevelSetSphere`` samples in index space.
"""

from __future__ import annotations

import math

import torch

from .grid import IndexGrid
from .kernels.bits import pack_bits
from .kernels.keys import encode_leaf_keys


def signed_distance(
    kind: str, p: torch.Tensor, radius: float, minor_radius: float | None = None
) -> torch.Tensor:
    """Signed distance (voxel units) of float ``[..., 3]`` points to a sphere or torus at the origin.

    The torus lies in the ``i, j`` plane, major radius ``radius``, minor radius ``minor_radius``
    (default ``radius / 4``).
    """
    if kind == "sphere":
        return torch.linalg.vector_norm(p, dim=-1) - radius
    if kind == "torus":
        r = radius / 4 if minor_radius is None else minor_radius
        q = torch.linalg.vector_norm(p[..., :2], dim=-1) - radius
        return torch.sqrt(q * q + p[..., 2] ** 2) - r
    raise ValueError(f"kind: expected 'sphere' or 'torus', got {kind!r}")


def narrow_band_shell(
    kind: str,
    radius: float,
    half_width: float = 3.0,
    device: str | torch.device = "cpu",
    center: tuple[float, float, float] = (0.25, -0.5, 0.125),
    minor_radius: float | None = None,
    tile_chunk: int = 1 << 14,
) -> IndexGrid:
    """Grid of the voxels with ``|phi| < half_width`` for a sphere/torus level set ``phi``.

    Built leaf by leaf (no per-voxel coordinate list), so shells of 10^9 voxels fit in memory.
    """
    dev = torch.device(device)
    c = torch.tensor(center, dtype=torch.float64, device=dev)
    ext = radius + (minor_radius if minor_radius is not None else radius / 4 if kind == "torus" else 0)
    ext = ext + half_width + 2
    tmin = [math.floor((-ext + center[a]) / 32) for a in range(3)]
    tmax = [math.floor((ext + center[a]) / 32) for a in range(3)]
    axes = [torch.arange(tmin[a], tmax[a] + 1, device=dev) for a in range(3)]
    tiles = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    # tiles whose bounding sphere reaches the band (distance is 1-Lipschitz)
    tc = tiles.double() * 32 + 15.5 - c
    tiles = tiles[signed_distance(kind, tc, radius, minor_radius).abs() <= half_width + 16 * math.sqrt(3)]
    a4 = torch.arange(4, device=dev)
    lpos = torch.stack(torch.meshgrid(a4, a4, a4, indexing="ij"), dim=-1).reshape(64, 3)
    a8 = torch.arange(8, device=dev)
    vpos = torch.stack(torch.meshgrid(a8, a8, a8, indexing="ij"), dim=-1).reshape(512, 3).double()
    keys_out, masks_out = [], []
    for s in range(0, tiles.shape[0], tile_chunk):
        leaves = (tiles[s : s + tile_chunk, None, :] * 4 + lpos[None]).reshape(-1, 3)
        lc = leaves.double() * 8 + 3.5 - c
        leaves = leaves[
            signed_distance(kind, lc, radius, minor_radius).abs() <= half_width + 4 * math.sqrt(3)
        ]
        for s2 in range(0, leaves.shape[0], tile_chunk):
            lv = leaves[s2 : s2 + tile_chunk]
            p = (lv.double() * 8)[:, None, :] + vpos[None] - c
            bits = signed_distance(kind, p, radius, minor_radius).abs() < half_width
            nz = bits.any(dim=1)
            keys_out.append(encode_leaf_keys(lv[nz]))
            masks_out.append(pack_bits(bits[nz]))
    keys = torch.cat(keys_out)
    masks = torch.cat(masks_out)
    keys, order = torch.sort(keys)  # meshgrid order already sorts tiles; keep it robust
    return IndexGrid._from_leaves(keys, masks[order])


def voxel_phi(kind: str, grid: IndexGrid, radius: float, center=(0.25, -0.5, 0.125), minor_radius=None):
    """float32 ``[num_voxels]`` level-set value of each active voxel, in voxel order."""
    c = torch.tensor(center, dtype=torch.float64, device=grid.device)
    p = grid.ijk.double() - c
    return signed_distance(kind, p, radius, minor_radius).float()

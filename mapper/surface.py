"""Surface samples of a TSDF: the zero crossings along the edges between 6-neighbour voxel centres."""

from __future__ import annotations

import torch

from .grid import IndexGrid


def zero_crossings(
    grid: IndexGrid, tsdf: torch.Tensor, weight: torch.Tensor, voxel_size_m: float, min_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Points where the TSDF changes sign between observed 6-neighbours.

    Args:
        grid, tsdf, weight: a TSDF layer in voxel order (``Map.layer("tsdf")``).
    Returns:
        float64 ``[P, 3]`` points (metres, linear interpolation along the edge between the voxel centres)
        and int64 ``[P]`` index of the positive-side voxel of each crossing.
    """
    ijk = grid.ijk.to(torch.int64)
    obs = weight > min_weight
    pts, src = [], []
    for axis in range(3):
        nb = ijk.clone()
        nb[:, axis] += 1
        j = grid.ijk_to_index(nb)
        ok = obs & (j >= 0)
        ok &= obs[j.clamp(min=0)]
        a = tsdf.to(torch.float64)
        b = a[j.clamp(min=0)]
        cross = ok & (((a > 0) & (b <= 0)) | ((a <= 0) & (b > 0)))
        i = cross.nonzero().squeeze(1)
        ta, tb = a[i], b[i]
        frac = ta / (ta - tb)
        p = (ijk[i].to(torch.float64) + 0.5) * voxel_size_m
        p[:, axis] += frac * voxel_size_m
        pts.append(p)
        src.append(torch.where(ta > 0, i, j[i]))
    return torch.cat(pts), torch.cat(src)

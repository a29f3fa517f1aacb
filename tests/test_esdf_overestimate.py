"""A coarse ESDF never reads farther than the fine surface it covers (issue 25, finding 1).

Scenes a LiDAR sees only in part at the TSDF's voxel: ground at grazing angles, thin poles, wall edges,
integrated through ``Map`` at a 5 cm TSDF with the ESDF at 1x / 2x / 2.5x / 4x that voxel.

Oracle (NumPy / SciPy only, no ESDF code): the fine surface read through ``Map.layer``:
* TSDF: the zero crossings between observed (weight > 0) 6-neighbour fine voxels of opposite sign
  (positive = ``tsdf > 0``), linearly interpolated between the two centres, except those whose positive side
  reads at least 2.5 fine voxels (``FRONT_MAX_VOX``: the sign change between a voxel at the truncation and
  an occluded negative one where views merge, no surface point);
* occupancy: the centres of the occupied (``log_odds > 0``) fine voxels;
``d_true`` = the exact distance (``cKDTree``) from each observed ESDF voxel's centre to that point set.

Asserted for every observed ESDF voxel: ``|esdf| <= min(max, d_true + S / 2 + sqrt(3) / 2 s)`` (never farther
than the surface it covers, beyond half an ESDF voxel plus half a fine diagonal), and ``|esdf| >=
min(d_true, max) - (sqrt(3) S + sqrt(3) s)`` (not absurdly near).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

import mapper
from mapper import sim

FINE = 0.05
MAX_DISTANCE = 0.6
FRONT_MAX_VOX = 2.5  # the ESDF's documented rule (mapper.integrators.esdf.FRONT_MAX_VOX), restated here
RATIOS = [1, 2, 2.5, 4]


def lidar_scene() -> sim.Scene:
    """Ground (z = 0), six thin poles (2.5-4.5 cm radius), a yawed wall and an axis-aligned block."""
    prims = [sim.Plane((0, 0, 0), (0, 0, 1))]
    for k, (x, y) in enumerate([(2.0, 0.7), (3.1, -1.2), (4.3, 0.4), (5.2, 1.9), (-2.6, -0.9), (-3.7, 1.5)]):
        prims.append(sim.Cylinder((x, y), 0.0, 1.2 + 0.3 * k, 0.025 + 0.01 * (k % 3)))
    prims.append(sim.Box.from_yaw((-1.5, 3.2, 0.9), (1.2, 0.1, 0.9), 0.4))
    prims.append(sim.Box.from_bounds((1.0, -4.0, 0.0), (3.5, -3.7, 1.6)))
    return sim.Scene.from_primitives(prims)


def build_map(ratio: float, source: str = "tsdf", device="cpu") -> mapper.Map:
    """Two 16-beam scans (0.9 deg azimuth steps, 6 m range) 1.6 m above the ground, fused; ESDF updated."""
    scene = lidar_scene()
    lidar = sim.SpinningLidar(n_beams=16, n_azimuth=400, fov_up_deg=5.0, fov_down_deg=-25.0, max_range_m=6.0)
    m = mapper.Map(
        FINE,
        layers=(source, "esdf"),
        device=device,
        esdf_voxel_size_m=FINE * ratio,
        esdf_max_distance_m=MAX_DISTANCE,
        warmup=False,
    )
    for x, y in ((0.0, 0.0), (0.6, 0.35)):
        T = torch.eye(4, dtype=torch.float64)
        T[:3, 3] = torch.tensor([x, y, 1.6], dtype=torch.float64)
        m.integrate_lidar(lidar.scan(scene, T), T)
    m.update_esdf()
    return m


def fine_surface(m: mapper.Map, source: str) -> np.ndarray:
    """float64 ``[P, 3]`` world points of the fine surface (module docstring), brute force in NumPy."""
    if source == "occupancy":
        g, d = m.layer("occupancy")
        ijk = g.ijk.cpu().numpy().astype(np.int64)
        return (ijk[d["log_odds"].float().cpu().numpy() > 0] + 0.5) * FINE
    g, d = m.layer("tsdf")
    ijk = g.ijk.cpu().numpy().astype(np.int64)
    t = d["tsdf"].float().cpu().numpy().astype(np.float64)
    obs = d["weight"].float().cpu().numpy() > 0
    lo = ijk.min(axis=0) - 1
    dense = np.full(tuple(ijk.max(axis=0) - lo + 2), -1, dtype=np.int64)
    rel = ijk - lo
    dense[rel[:, 0], rel[:, 1], rel[:, 2]] = np.arange(len(ijk))
    pts = []
    for a in range(3):
        nb = rel.copy()
        nb[:, a] += 1
        j = dense[nb[:, 0], nb[:, 1], nb[:, 2]]
        i = np.nonzero(obs & (j >= 0))[0]
        j = j[i]
        ta, tb = t[i], t[j]
        keep = obs[j] & ((ta > 0) != (tb > 0)) & (np.maximum(ta, tb) < FRONT_MAX_VOX * FINE)
        i, ta, tb = i[keep], ta[keep], tb[keep]
        p = ijk[i].astype(np.float64) + 0.5
        p[:, a] += ta / (ta - tb)
        pts.append(p * FINE)
    return np.concatenate(pts)


def overestimate(m: mapper.Map, source: str):
    """(|esdf| - min(d_true, max), min(d_true, max), |esdf|) in metres over the observed ESDF voxels."""
    surface = fine_surface(m, source)
    g, d = m.layer("esdf")
    obs = d["observed"].cpu().numpy()
    ijk = g.ijk.cpu().numpy().astype(np.int64)[obs]
    esdf = np.abs(d["esdf"].cpu().numpy()[obs].astype(np.float64))
    true, _ = cKDTree(surface).query((ijk + 0.5) * m.esdf_voxel_size_m)
    true = np.minimum(true, m.esdf_max_distance_m)
    return esdf - true, true, esdf


def check_bounds(m: mapper.Map, source: str, ratio: float):
    S = FINE * ratio
    over, true, esdf = overestimate(m, source)
    near = true < MAX_DISTANCE - S
    assert near.sum() > 2000, near.sum()  # enough voxels near the surface to mean something
    bound = S / 2 + math.sqrt(3) / 2 * FINE
    worst = np.argmax(over)
    assert over.max() <= bound + 1e-5, (over.max() / S, bound / S, true[worst], esdf[worst])
    under = -over.min()
    assert under <= math.sqrt(3) * (S + FINE), (under / S, math.sqrt(3) * (S + FINE) / S)
    return over


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("source", ["tsdf", "occupancy"])
def test_coarse_esdf_never_overestimates(ratio, source):
    """TSDF / occupancy source, ESDF 1x / 2x / 2.5x / 4x the 5 cm voxel, on the CPU."""
    check_bounds(build_map(ratio, source), source, ratio)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [2, 2.5, 4])
def test_coarse_esdf_never_overestimates_cuda(ratio):
    """The same bound on CUDA (the site extraction's CUDA path: one chunk, dense brick sets, the Triton
    integrators' TSDF)."""
    check_bounds(build_map(ratio, "tsdf", device="cuda"), "tsdf", ratio)

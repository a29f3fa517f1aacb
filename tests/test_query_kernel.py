"""The fused distance-query kernel (Triton, one launch) against the torch path of ``Map.query_distance``
on a LiDAR map with TSDF, occupancy and ESDF layers spread over many small pages: the same distances,
gradients and observed flags, including points outside the map, non-finite points, points exactly on voxel
centres/faces, and corners absent from the ESDF but observed by the TSDF or the occupancy layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper import Map, sim
from mapper import queries as Q


def _small_pages(m: Map) -> None:
    for layer in (m._tsdf, m._occ, m._esdf.layer):
        layer.pool.first_page_bricks = 64
        layer.pool.page_bricks = 512


@pytest.fixture(scope="module")
def scans():
    scene = sim.outdoor_scene(0, extent_m=60.0)
    lidar = sim.SpinningLidar(n_beams=16, n_azimuth=360, max_range_m=25.0)
    return [(lidar.scan(scene, T), T) for T in sim.driving_trajectory(2, scene=scene)]


def test_distance_kernel_matches_torch(device, backend, scans):
    if backend != "triton":
        pytest.skip("compares the Triton kernel with the torch path")
    m = Map(
        0.25, layers=("tsdf", "occupancy", "esdf"), device=device, esdf_max_distance_m=0.5, max_range_m=25.0
    )
    _small_pages(m)
    with pytest.MonkeyPatch.context() as mp:  # build the map with the torch kernels (fast on the CPU)
        mp.setenv("MAPPER_KERNELS", "torch")
        for pts, T in scans:
            m.integrate_lidar(pts.to(device), T)
        m.update_esdf()
    assert len(m._esdf.layer.pool.page_starts) > 3
    bricks, _ = m._tsdf.brick_table()
    lo = bricks.min(0).values.double().cpu() * 1.0 - 1.0
    hi = (bricks.max(0).values + 1).double().cpu() * 1.0 + 1.0
    g = torch.Generator().manual_seed(0)
    p = lo + torch.rand((800, 3), generator=g, dtype=torch.float64) * (hi - lo)
    centres = (torch.randint(-20, 20, (100, 3), generator=g).double() + 0.5) * 0.25  # exactly on centres
    faces = torch.randint(-20, 20, (100, 3), generator=g).double() * 0.25  # exactly on voxel faces
    # free space around the cameras: carved by the occupancy layer, beyond the ESDF's reach of surfaces
    cams = torch.stack([T[:3, 3] for _, T in scans]).double().cpu()
    jitter = torch.rand((2, 150, 3), generator=g, dtype=torch.float64) - 0.5
    near_cam = (cams[:, None, :] + jitter).reshape(-1, 3)
    bad = torch.tensor([[float("nan"), 0, 0], [0, float("inf"), 0], [1e9, 0, 0], [-1e7, 2, 3]])
    # the API takes points as float32 (check_points); the torch path is handed the same values
    pts = torch.cat((p, centres, faces, near_cam, bad.double())).float().double().to(device)
    d1, g1, o1 = m.query_distance(pts)
    d2, g2, o2 = Q.distance_at_torch(m._esdf.layer, pts, 0.25, 0.5, m._tsdf, m._occ)
    assert torch.equal(o1, o2)
    assert 30 < int(o1.sum()) < o1.numel() - 30  # both known and unknown points
    assert not bool(o1[-4:].any())
    np.testing.assert_allclose(d1.cpu().numpy(), d2.cpu().numpy(), rtol=0, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(g1.cpu().numpy(), g2.cpu().numpy(), rtol=0, atol=1e-5)
    # the TSDF/occupancy fallback was exercised: observed points with an absent ESDF corner
    _, _, _, _, present = __import__("mapper.queries", fromlist=["x"]).gather_corners(
        m._esdf.layer, pts.to(torch.float64), 0.25, ["esdf"], [0.5]
    )
    assert bool((o1 & ~present.all(dim=1)).any())

"""Inputs may live on any device: a CUDA map takes CPU or CUDA poses/intrinsics/points and vice versa,
with identical results (regression: pose validation mixed a CUDA pose with a CPU identity matrix)."""

from __future__ import annotations

import pytest
import torch

from mapper import Map, sim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("map_dev", ["cpu", "cuda"])
def test_lidar_and_depth_inputs_on_either_device(map_dev):
    scene = sim.indoor_scene(0)
    cam = sim.PinholeCamera(80, 60, 60.0, 60.0, 39.5, 29.5)
    T = sim.orbit_trajectory(1, scene=scene)[0]
    depth = cam.render_depth(scene, T, max_range_m=8.0)
    pts = sim.SpinningLidar(n_beams=8, n_azimuth=64).scan(scene, T)
    results = []
    for in_dev in ("cpu", "cuda"):
        m = Map(0.1, layers=("tsdf", "occupancy"), device=map_dev)
        m.integrate_depth(depth.to(in_dev), cam.K.to(in_dev), T.to(in_dev))
        m.integrate_lidar(pts.to(in_dev), T.to(in_dev))
        g, f = m.layer("tsdf")
        results.append((g.ijk.cpu(), f["tsdf"].cpu(), m.layer("occupancy")[1]["log_odds"].cpu()))
    a, b = results
    assert a[0].shape[0] > 0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y) or torch.allclose(x, y, equal_nan=True)

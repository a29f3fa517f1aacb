"""The projective depth update (Triton, one launch through the page tables) against the torch reference
(``tsdf._project_update_torch``) and against a hand-computed voxel, on layers spanning several pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper import sim
from mapper.integrators import tsdf
from mapper.layers import BrickLayer


def _layer(cfg, device):
    # small pages so the frame's bricks spread over many of them
    layer = BrickLayer(tsdf.tsdf_fields(cfg), device, page_bricks=64)
    layer.pool.first_page_bricks = 8
    return layer


def _frame(device, seed=0):
    scene = sim.indoor_scene(seed, device=device)
    cam = sim.PinholeCamera(32, 24, 25.0, 26.0, 15.3, 11.9)
    T = sim.orbit_trajectory(3, scene=scene)[seed % 3]
    depth = cam.render_depth(scene, T.to(device), max_range_m=8.0)
    depth[5:9, 10:20] = float("nan")  # invalid pixels are skipped
    depth[20, 30] = 50.0  # beyond max range
    g = torch.Generator().manual_seed(seed)
    color = torch.randint(0, 256, (24, 32, 3), generator=g, dtype=torch.uint8).to(device)
    return depth, cam.K.to(torch.float64), T.to(torch.float64), color


@pytest.mark.parametrize("with_color", [False, True])
def test_triton_matches_torch_reference(device, backend, with_color):
    if backend != "triton":
        pytest.skip("compares the Triton kernel with the reference")
    cfg = tsdf.TsdfConfig(voxel_size_m=0.1, with_color=with_color, max_weight=1.5)
    maps = []
    for fn in (tsdf._project_update_torch, tsdf._project_update_triton):
        layer = _layer(cfg, device)
        counts = []
        for seed in range(2):  # two frames: running averages over existing values
            depth, K, T, color = _frame(device, seed)
            bricks = tsdf.depth_band_bricks(depth, K.to(device), T.to(device), cfg, 6.0)
            slots = layer.allocate(bricks)
            col = color if with_color else None
            counts.append(int(fn(layer, bricks, slots, depth, K.to(device), T.to(device), col, cfg, 6.0)))
        assert len(layer.pool.page_starts) > 3
        grid, f = layer.voxel_view(list(layer.pool.fields))
        maps.append((counts, grid.ijk.cpu(), {k: v.cpu() for k, v in f.items()}))
    (c1, ijk1, f1), (c2, ijk2, f2) = maps
    assert c1 == c2 and min(c1) > 200
    assert torch.equal(ijk1, ijk2)
    for k in f1:
        a, b = f1[k].float(), f2[k].float()
        tol = 1.0 if k == "color" else 1e-3  # colour: the odd half-way rounding; fp16 fields otherwise
        assert (a - b).abs().max() <= tol, k
        assert (a != b).float().mean() < 1e-3, k


def test_hand_computed_voxel(device, backend):
    """One voxel straight ahead of an identity camera: sdf = depth - z, running average, clamp to tau."""
    cfg = tsdf.TsdfConfig(voxel_size_m=0.1, truncation_vox=3.0)
    layer = BrickLayer(tsdf.tsdf_fields(cfg), device)
    K = torch.tensor([[10.0, 0, 1.5], [0, 10.0, 1.5], [0, 0, 1]], dtype=torch.float64, device=device)
    T = torch.eye(4, dtype=torch.float64, device=device)
    bricks = torch.tensor([[0, 0, 2]], device=device)  # voxels z in [0.8, 1.2)
    slots = layer.allocate(bricks)
    for d in (1.0, 1.2):
        depth = torch.full((3, 3), d, dtype=torch.float32, device=device)
        tsdf._project_update(layer, bricks, slots, depth, K, T, None, cfg, 5.0)
    # voxel (0, 0, 9): centre (0.05, 0.05, 0.95) -> pixel (2, 2): sdf 0.05 then 0.25 (< tau = 0.3)
    slot, off = layer.voxel_slots(torch.tensor([[0, 0, 9]], device=device))
    t = layer.pool.gather("tsdf", slot, off).float().item()
    w = layer.pool.gather("weight", slot, off).float().item()
    np.testing.assert_allclose(t, (0.05 + 0.25) / 2, atol=1e-3)
    assert w == 2.0

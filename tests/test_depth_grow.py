"""The depth TSDF's grow stage: the Triton kernel (rays, brick DDA, device hash set; ``triton_depth``)
against its torch reference (``tsdf.depth_band_bricks_torch``), both against a brute-force NumPy oracle
(a brick is in the set iff a valid pixel's segment ``[max(r - tau, 0), r + tau]`` meets the brick's box);
invalid pixels (0, NaN, +-inf, negative, beyond the range), poses looking along the axes, bricks at the
key range's edge, a hash table that overflows (the retry), and the frame's host reads."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from sync_count import SyncCounter, cuda_syncs

from mapper import Map
from mapper.integrators.tsdf import TsdfConfig, depth_band_bricks, depth_band_bricks_torch
from mapper.kernels.keys import BRICK_HI, BRICK_LO

H, W = 9, 12
K_NP = np.array([[11.0, 0.0, 5.5], [0.0, 10.0, 4.25], [0.0, 0.0, 1.0]])


def rotation(seed: int) -> np.ndarray:
    q = np.random.default_rng(seed).normal(size=4)
    a, b, c, d = q / np.linalg.norm(q)
    return np.array(
        [
            [a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c)],
            [2 * (b * c + a * d), a * a - b * b + c * c - d * d, 2 * (c * d - a * b)],
            [2 * (b * d - a * c), 2 * (c * d + a * b), a * a - b * b - c * c + d * d],
        ]
    )


def pose(R: np.ndarray, t) -> torch.Tensor:
    T = np.eye(4)
    T[:3, :3] = R
    T[:3, 3] = t
    return torch.from_numpy(T)


def bad_depth(seed: int, lo=0.2, hi=3.0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    d = g.uniform(lo, hi, size=(H, W)).astype(np.float32)
    d[0, :3] = 0.0
    d[1, :2] = np.nan
    d[2, :2] = (np.inf, -np.inf)
    d[3, :2] = -1.0
    d[4, :2] = (10.5, 10.0)  # beyond max_range_m (dropped), at it (kept)
    return torch.from_numpy(d)


def brute_bricks(depth: torch.Tensor, K: np.ndarray, T: torch.Tensor, tau: float, cell: float, max_r: float):
    """Every brick (cell ``cell``) whose box a valid pixel's segment meets, inside the key range."""
    d = depth.numpy().astype(np.float64)
    Tn = T.numpy()
    R, o = Tn[:3, :3], Tn[:3, 3]
    out = set()
    for v in range(d.shape[0]):
        for u in range(d.shape[1]):
            z = d[v, u]
            if not (np.isfinite(z) and 0 < z <= max_r):
                continue
            ray = np.linalg.solve(K, np.array([u, v, 1.0]))
            r = z * np.linalg.norm(ray)
            dr = R @ (ray / np.linalg.norm(ray))
            t0, t1 = max(r - tau, 0.0), r + tau
            a, b = o + dr * t0, o + dr * t1
            lo = np.floor(np.minimum(a, b) / cell).astype(int) - 1
            hi = np.floor(np.maximum(a, b) / cell).astype(int) + 1
            for i in range(lo[0], hi[0] + 1):
                for j in range(lo[1], hi[1] + 1):
                    for k in range(lo[2], hi[2] + 1):
                        c = np.array([i, j, k])
                        if not all(BRICK_LO <= x < BRICK_HI for x in c):
                            continue
                        bl, bh = c * cell, (c + 1) * cell
                        with np.errstate(divide="ignore", invalid="ignore"):
                            p = (bl - o) / dr
                            q = (bh - o) / dr
                        inside = (o >= bl) & (o < bh)
                        tn = np.where(dr != 0, np.minimum(p, q), np.where(inside, -np.inf, np.inf))
                        tf = np.where(dr != 0, np.maximum(p, q), np.where(inside, np.inf, -np.inf))
                        if tn.max() <= min(tf.min(), t1) + 1e-9 and tf.min() >= t0 - 1e-9:
                            out.add((i, j, k))
    return out


def triton_device(device) -> None:
    """Skip unless Triton runs on ``device`` (CUDA, or the CPU interpreter)."""
    pytest.importorskip("triton")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("MAPPER_TRITON_SM90") == "1"
    if device.type == "cpu" and not interpreted:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def as_set(b: torch.Tensor) -> set:
    return {tuple(x) for x in b.tolist()}


def check_sorted_unique(b: torch.Tensor) -> None:
    keys = [tuple(x) for x in b.tolist()]
    assert keys == sorted(set(keys))


def test_depth_grow_triton_equals_reference_and_brute_force(backend, device):
    """Random pose and depths with every kind of invalid pixel: the dispatch (Triton under ``backend=triton``)
    equals the torch reference (on the CPU) exactly and the brute-force oracle as a set."""
    cfg = TsdfConfig(0.05)
    K = torch.from_numpy(K_NP)
    for seed in (1, 2):
        T = pose(rotation(seed), (0.3, -1.2, 0.7))
        depth = bad_depth(seed)
        got = depth_band_bricks(depth.to(device), K.to(device), T.to(device), cfg, 10.0)
        assert got.device.type == device.type
        got = got.cpu()
        ref = depth_band_bricks_torch(depth, K, T, cfg.tau, 4 * cfg.voxel_size_m, 10.0)
        assert got.dtype == torch.int64 and got.shape[1] == 3 and got.shape[0] > 20
        assert torch.equal(got, ref)
        check_sorted_unique(got)
        assert as_set(got) == brute_bricks(depth, K_NP, T, cfg.tau, 4 * cfg.voxel_size_m, 10.0)


def test_depth_grow_triton_axis_poses_and_key_limit(backend, device):
    """Cameras looking along +-x, +-y, +-z (rays exactly on brick planes where the pixel is the principal
    point; exact DDA ties) and a camera at the edge of the key range (bricks beyond it are dropped)."""
    cfg = TsdfConfig(0.02)
    cell = 4 * cfg.voxel_size_m
    K = torch.tensor([[10.0, 0.0, 6.0], [0.0, 10.0, 4.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    depth = torch.full((H, W), 1.0)
    depth[::2, ::3] = 0.64  # a multiple of the brick size: band ends on brick planes
    eye = np.eye(3)
    looks = [eye, eye[[1, 2, 0]].T, eye[[2, 0, 1]].T, np.diag([1.0, -1.0, -1.0]), np.diag([-1.0, 1.0, -1.0])]
    for R in looks:
        T = pose(R, (0.0, 0.16, -0.08))
        got = depth_band_bricks(depth.to(device), K.to(device), T.to(device), cfg, 10.0).cpu()
        ref = depth_band_bricks_torch(depth, K, T, cfg.tau, cell, 10.0)
        assert torch.equal(got, ref), R
        check_sorted_unique(got)
    # at the key range's edge: looking along +x from 0.3 brick inside the last valid brick layer
    edge = (BRICK_HI - 0.7) * cell
    T = pose(eye[:, [1, 2, 0]], (edge - 1.0, 0.0, 0.0))  # optical axis +x: bands reach edge + tau
    got = depth_band_bricks(depth.to(device), K.to(device), T.to(device), cfg, 10.0).cpu()
    ref = depth_band_bricks_torch(depth, K, T, cfg.tau, cell, 10.0)
    assert torch.equal(got, ref)
    assert got.shape[0] > 0 and int(got[:, 0].max()) == BRICK_HI - 1  # clipped, not wrapped
    brute = brute_bricks(depth, K.numpy(), T, cfg.tau, cell, 10.0)
    # the oracle also keeps bricks a band only touches at an edge (the DDA's tie order passes one of them)
    assert as_set(got) <= brute and len(brute - as_set(got)) < 0.05 * len(brute)


def test_depth_grow_triton_no_valid_pixel(backend, device):
    cfg = TsdfConfig(0.05)
    K = torch.from_numpy(K_NP).to(device)
    T = pose(np.eye(3), (0.0, 0.0, 0.0)).to(device)
    for fill in (0.0, math.nan, -2.0, 50.0):
        got = depth_band_bricks(torch.full((H, W), fill, device=device), K, T, cfg, 10.0)
        assert got.shape == (0, 3) and got.dtype == torch.int64


def test_depth_grow_triton_table_overflow_retries(monkeypatch, device):
    """A table too small for the frame's bricks (probes run out): the kernel reports it and the frame is
    redone in a table that every key fits; the result is the reference's."""
    triton_device(device)
    from mapper.kernels import triton_depth

    monkeypatch.setattr(triton_depth, "table_size", lambda n: 16)
    monkeypatch.setattr(triton_depth, "_PROBES", 4)
    reads = []
    real = triton_depth._insert

    def spy(*a):
        out = real(*a)
        reads.append(out[2])
        return out

    monkeypatch.setattr(triton_depth, "_insert", spy)
    cfg = TsdfConfig(0.05)
    K = torch.from_numpy(K_NP)
    T = pose(rotation(3), (0.1, 0.2, 0.3))
    depth = bad_depth(3)
    got = triton_depth.depth_band_bricks_triton(
        depth.to(device), K.to(device), T.to(device), cfg.tau, 0.2, 10.0
    )
    got = got.cpu()
    ref = depth_band_bricks_torch(depth, K, T, cfg.tau, 0.2, 10.0)
    assert ref.shape[0] > 16
    assert torch.equal(got, ref)
    assert len(reads) == 2 and reads[0] > 0 and reads[1] == 0


def test_depth_grow_triton_reads_one_size(device):
    """The grow stage on the Triton path makes one host read (the hash set's counts)."""
    triton_device(device)
    from mapper.kernels.triton_depth import depth_band_bricks_triton

    K = torch.from_numpy(K_NP).to(device)
    T = pose(rotation(4), (0.0, 0.0, 0.0)).to(device)
    depth = bad_depth(4).to(device)
    if device.type == "cuda":
        depth_band_bricks_triton(depth, K, T, 0.15, 0.2, 10.0)  # compiled outside the count
        with cuda_syncs() as sites:
            b = depth_band_bricks_triton(depth, K, T, 0.15, 0.2, 10.0)
        assert sum(sites.values()) == 1, sites
    else:
        with SyncCounter() as c:
            b = depth_band_bricks_triton(depth, K, T, 0.15, 0.2, 10.0)
        assert c.total == 1, c.sites
    assert b.shape[0] > 0


def test_integrate_depth_points_used_without_early_read(device):
    """``points_used``/``points_dropped`` count the valid pixels (finite, > 0, <= max range); a frame with
    none integrates nothing and reports them all dropped."""
    m = Map(0.05, layers=("tsdf",), device=device, max_range_m=10.0, warmup=False)
    depth = bad_depth(5)
    d = depth.numpy()
    n_ok = int((np.isfinite(d) & (d > 0) & (d <= 10.0)).sum())
    out = m.integrate_depth(depth, K_NP, np.eye(4))
    assert out == {"points_used": n_ok, "points_dropped": H * W - n_ok}
    bricks = m._tsdf.num_bricks
    out = m.integrate_depth(torch.zeros(H, W), K_NP, np.eye(4))
    assert out == {"points_used": 0, "points_dropped": H * W}
    assert bricks > 0 and m._tsdf.num_bricks == bricks

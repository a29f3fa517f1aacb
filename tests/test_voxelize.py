"""Voxelization against a pure-NumPy, dict-based oracle (no mapper import in the oracle): random clouds with
points on cell boundaries, on range_min and range_max, outside the range and non-finite; real (norlab) and
simulated LiDAR scans; voxels and pillars; the caps. Both paths (sort-based torch, hash-based Triton) must
equal the oracle exactly: same voxels in the same order, same points in the same slots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.errors import InvalidArgument, InvalidArgumentType
from mapper.kernels.voxelize import voxelize, voxelize_torch, voxelize_triton

# PointPillars' KITTI configuration (x, y, z)
PILLAR = dict(voxel_size_m=(0.16, 0.16, 4.0), range_min=(0.0, -39.68, -3.0), range_max=(69.12, 39.68, 1.0))
# SECOND-like voxels
VOXEL = dict(voxel_size_m=(0.05, 0.05, 0.1), range_min=(0.0, -40.0, -3.0), range_max=(70.4, 40.0, 1.0))


def oracle(points, voxel_size_m, range_min, range_max, max_points_per_voxel=32, max_voxels=None):
    """The specification, one point at a time: float32 cells, dict of voxels in first-seen order."""
    p = np.asarray(points)
    vs = np.asarray(voxel_size_m, dtype=np.float32)
    lo = np.asarray(range_min, dtype=np.float32)
    hi = np.asarray(range_max, dtype=np.float32)
    grid = np.round((hi.astype(np.float64) - lo.astype(np.float64)) / vs.astype(np.float64)).astype(np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        f = np.floor((p[:, :3].astype(np.float32) - lo) / vs)  # float32 throughout
    voxels: dict[tuple[int, int, int], list[int]] = {}
    for i in range(p.shape[0]):
        c = f[i]
        if not (np.all(c >= 0) and np.all(c < grid)):  # NaN fails both
            continue
        key = (int(c[0]), int(c[1]), int(c[2]))
        if key not in voxels:
            if max_voxels is not None and len(voxels) >= max_voxels:
                continue
            voxels[key] = []
        if len(voxels[key]) < max_points_per_voxel:
            voxels[key].append(i)
    v = len(voxels)
    out = np.zeros((v, max_points_per_voxel, p.shape[1]), dtype=p.dtype)
    coords = np.zeros((v, 3), dtype=np.int32)
    counts = np.zeros(v, dtype=np.int32)
    for j, (key, ids) in enumerate(voxels.items()):  # dicts keep insertion (first point) order
        out[j, : len(ids)] = p[ids]
        coords[j] = key[::-1]
        counts[j] = len(ids)
    return out, coords, counts


def assert_same(got, want):
    voxels, coords, counts = got
    assert coords.dtype == torch.int32 and counts.dtype == torch.int32
    np.testing.assert_array_equal(counts.cpu().numpy(), want[2])
    np.testing.assert_array_equal(coords.cpu().numpy(), want[1])
    np.testing.assert_array_equal(voxels.cpu().numpy(), want[0])


def boundary_cloud(n: int, seed: int, cfg: dict, channels: int = 4) -> torch.Tensor:
    """Random points in a box a bit larger than the range; a third snapped to cell boundaries (float32
    multiples of the voxel size), some exactly on range_min / range_max, a few NaN / inf."""
    rng = np.random.default_rng(seed)
    lo = np.asarray(cfg["range_min"], dtype=np.float32)
    hi = np.asarray(cfg["range_max"], dtype=np.float32)
    vs = np.asarray(cfg["voxel_size_m"], dtype=np.float32)
    span = hi - lo
    p = np.empty((n, channels), dtype=np.float32)
    p[:, :3] = lo - 0.05 * span + rng.random((n, 3), dtype=np.float32) * 1.1 * span
    p[:, 3:] = rng.random((n, channels - 3), dtype=np.float32)
    snap = rng.random(n) < 0.35
    cells = np.floor((p[snap, :3] - lo) / vs)
    p[snap, :3] = lo + cells.astype(np.float32) * vs
    k = rng.integers(0, 3, size=n)
    on_max = rng.random(n) < 0.03
    p[on_max, k[on_max]] = hi[k[on_max]]
    on_min = rng.random(n) < 0.03
    p[on_min, k[on_min]] = lo[k[on_min]]
    p[rng.random(n) < 0.01, 0] = np.nan
    p[rng.random(n) < 0.01, 1] = np.inf
    p[rng.random(n) < 0.01, 2] = -np.inf
    return torch.from_numpy(p)


def clustered_cloud(n: int, seed: int, cfg: dict) -> torch.Tensor:
    """Few voxels with many points (keep-first-K matters)."""
    rng = np.random.default_rng(seed)
    lo = np.asarray(cfg["range_min"], dtype=np.float32)
    vs = np.asarray(cfg["voxel_size_m"], dtype=np.float32)
    centres = lo + (rng.integers(0, 6, size=(12, 3)) + 0.5).astype(np.float32) * vs
    p = centres[rng.integers(0, 12, size=n)] + (rng.random((n, 3), dtype=np.float32) - 0.5) * 0.9 * vs
    return torch.from_numpy(np.concatenate([p, rng.random((n, 1), dtype=np.float32)], 1))


GRID_CFG = dict(voxel_size_m=(0.5, 0.25, 0.2), range_min=(-2.0, -1.0, -0.6), range_max=(3.0, 1.5, 1.4))


@pytest.mark.parametrize(
    "cfg, k, cap",
    [(GRID_CFG, 5, None), (GRID_CFG, 1, None), (GRID_CFG, 3, 40), (PILLAR, 32, None), (VOXEL, 4, 500)],
)
def test_boundary_cloud_matches_oracle(cfg, k, cap, device, backend):
    n = 3000 if cfg is GRID_CFG else 4000
    p = boundary_cloud(n, 0, cfg)
    want = oracle(p.numpy(), **cfg, max_points_per_voxel=k, max_voxels=cap)
    assert want[0].shape[0] > 0
    got = voxelize(p.to(device), **cfg, max_points_per_voxel=k, max_voxels=cap)
    assert got[0].device == p.to(device).device
    assert_same(got, want)


def test_boundaries_and_upper_bound_by_hand(device, backend):
    cfg = dict(voxel_size_m=(0.5, 0.5, 0.5), range_min=(0.0, 0.0, 0.0), range_max=(2.0, 1.0, 1.0))
    p = torch.tensor(
        [
            [0.0, 0.0, 0.0],  # cell (0, 0, 0): range_min is inside
            [0.5, 0.0, 0.0],  # on a boundary: the right cell
            [0.49999997, 0.0, 0.0],  # just left of it
            [2.0, 0.2, 0.2],  # x == range_max: dropped (exclusive)
            [1.9999999, 0.2, 0.9999999],  # just inside
            [-1e-7, 0.0, 0.0],  # left of range_min: dropped (floor, negatives right)
            [-0.0, 0.0, 0.0],  # -0 is 0
            [float("nan"), 0.0, 0.0],
            [0.0, float("inf"), 0.0],
            [0.7, 0.2, 0.6],
        ],
        device=device,
    )
    voxels, coords, counts = voxelize(p, **cfg, max_points_per_voxel=4)
    # voxels in the order of their first point: 0, 1, 4, 9
    assert coords.tolist() == [[0, 0, 0], [0, 0, 1], [1, 0, 3], [1, 0, 1]]  # (z, y, x)
    assert counts.tolist() == [3, 1, 1, 1]
    assert voxels[0, :3].tolist() == [p[0].tolist(), p[2].tolist(), p[6].tolist()]
    assert voxels[0, 3].tolist() == [0.0, 0.0, 0.0]
    assert voxels[1:, 0].tolist() == [p[1].tolist(), p[4].tolist(), p[9].tolist()]


def test_keep_first_k_in_input_order(device, backend):
    cfg = GRID_CFG
    p = clustered_cloud(2000, 1, cfg)
    for k in (1, 5, 32):
        want = oracle(p.numpy(), **cfg, max_points_per_voxel=k)
        assert want[2].max() == k  # voxels overflow
        assert_same(voxelize(p.to(device), **cfg, max_points_per_voxel=k), want)


def test_float64_points_bin_in_float32(device, backend):
    cfg = dict(voxel_size_m=(0.1, 0.1, 0.1), range_min=(0.0, 0.0, 0.0), range_max=(1.0, 1.0, 1.0))
    rng = np.random.default_rng(3)
    p = np.round(rng.random((800, 3)) * 10) / 10 + rng.choice([-1e-9, 0.0, 1e-9], size=(800, 3))
    want = oracle(p, **cfg, max_points_per_voxel=3)
    got = voxelize(torch.from_numpy(p).to(device), **cfg, max_points_per_voxel=3)
    assert got[0].dtype == torch.float64
    assert_same(got, want)


def test_many_distinct_voxels_exercise_probing(device, backend):
    cfg = dict(voxel_size_m=(0.01, 0.01, 0.01), range_min=(0.0, 0.0, 0.0), range_max=(10.0, 10.0, 10.0))
    g = torch.Generator().manual_seed(4)
    p = torch.rand((3000, 3), generator=g) * 10
    p = torch.cat((p, p[:500]))  # repeats: cells already in the table
    want = oracle(p.numpy(), **cfg, max_points_per_voxel=2)
    assert_same(voxelize(p.to(device), **cfg, max_points_per_voxel=2), want)


def test_empty_and_all_dropped(device, backend):
    cfg = GRID_CFG
    for p in (torch.zeros((0, 5)), torch.full((10, 5), 100.0)):
        voxels, coords, counts = voxelize(p.to(device), **cfg, max_points_per_voxel=7)
        assert voxels.shape == (0, 7, 5) and coords.shape == (0, 3) and counts.shape == (0,)


def test_deterministic(device, backend):
    p = clustered_cloud(1500, 2, GRID_CFG).to(device)
    a = voxelize(p, **GRID_CFG, max_points_per_voxel=6)
    b = voxelize(p, **GRID_CFG, max_points_per_voxel=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------------
# LiDAR clouds


@pytest.fixture(scope="module")
def norlab_scan(request) -> torch.Tensor:
    root = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "norlab_lidar" / "scans"
    files = sorted(root.glob("cloud_*.vtk"))
    if not files:
        pytest.skip(f"no norlab scans under {root}")
    from mapper.datasets import read_vtk_points

    d = read_vtk_points(files[0])
    xyz = d["points"]
    inten = d.get("intensity")
    feat = np.zeros((xyz.shape[0], 1), np.float32) if inten is None else inten[:, None].astype(np.float32)
    return torch.from_numpy(np.concatenate([xyz, feat], 1))


@pytest.fixture(scope="module")
def sim_scan() -> torch.Tensor:
    from mapper import sim

    scene = sim.outdoor_scene(0, 120.0)
    pose = sim.driving_trajectory(1, scene=scene)[0]
    return sim.SpinningLidar(n_beams=16, n_azimuth=512).scan(scene, pose)


def _real_cases():
    return [
        ("pillars", PILLAR, 32, None),
        ("pillars-capped", PILLAR, 20, 1000),
        (
            "voxels",
            dict(voxel_size_m=(0.2, 0.2, 0.2), range_min=(-50, -50, -3), range_max=(50, 50, 5)),
            5,
            None,
        ),
    ]


def test_real_lidar_matches_oracle(norlab_scan, device, backend):
    p = norlab_scan
    if backend == "triton" and device.type == "cpu":  # the interpreter: a slice of the scan
        p = p[::6].contiguous()
    for name, cfg, k, cap in _real_cases():
        want = oracle(p.numpy(), **cfg, max_points_per_voxel=k, max_voxels=cap)
        assert want[0].shape[0] > 100, name
        assert_same(voxelize(p.to(device), **cfg, max_points_per_voxel=k, max_voxels=cap), want)


def test_simulated_lidar_matches_oracle(sim_scan, device, backend):
    cfg = dict(voxel_size_m=(0.16, 0.16, 8.0), range_min=(-40.0, -40.0, -4.0), range_max=(40.0, 40.0, 4.0))
    want = oracle(sim_scan.numpy(), **cfg, max_points_per_voxel=16)
    assert_same(voxelize(sim_scan.to(device), **cfg, max_points_per_voxel=16), want)


def test_torch_and_triton_agree_on_full_scan(norlab_scan):
    """The two implementations called directly (Triton in the interpreter without CUDA)."""
    cfg = PILLAR
    a = voxelize_torch(norlab_scan, **cfg, max_points_per_voxel=32, max_voxels=4000)
    b = voxelize_triton(norlab_scan, **cfg, max_points_per_voxel=32, max_voxels=4000)
    assert a[0].shape[0] == 4000
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------------
# property test (torch path: fast)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 200),
    sizes=st.tuples(*[st.sampled_from([0.1, 0.25, 0.3, 1.0]) for _ in range(3)]),
    k=st.integers(1, 6),
    cap=st.one_of(st.none(), st.integers(1, 30)),
    data=st.data(),
)
def test_property_torch_equals_oracle(n, sizes, k, cap, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    cfg = dict(voxel_size_m=sizes, range_min=(-1.0, -0.5, 0.0), range_max=(1.0, 0.7, 0.9))
    # coordinates on a fine lattice: many points on cell boundaries and on the range bounds
    p = (rng.integers(-12, 13, size=(n, 4)) * 0.1).astype(np.float32)
    want = oracle(p, **cfg, max_points_per_voxel=k, max_voxels=cap)
    assert_same(voxelize_torch(torch.from_numpy(p), **cfg, max_points_per_voxel=k, max_voxels=cap), want)


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(0, 300), k=st.integers(1, 9), cap=st.one_of(st.none(), st.integers(1, 30)), data=st.data()
)
def test_property_triton_equals_oracle(n, k, cap, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    cfg = dict(voxel_size_m=(0.3, 0.25, 0.1), range_min=(-1.0, -0.5, 0.0), range_max=(1.0, 0.7, 0.9))
    p = (rng.integers(-12, 13, size=(n, 3)) * 0.1).astype(np.float32)
    want = oracle(p, **cfg, max_points_per_voxel=k, max_voxels=cap)
    assert_same(voxelize_triton(torch.from_numpy(p), **cfg, max_points_per_voxel=k, max_voxels=cap), want)


def test_triton_large_buffer_path(monkeypatch):
    """When min(N, max_voxels) * K is too large to allocate up front, the voxel count is read first."""
    from mapper.kernels import triton_voxelize

    monkeypatch.setattr(triton_voxelize, "_BUF_LIMIT", 0)
    p = clustered_cloud(1500, 5, GRID_CFG)
    for cap in (None, 7):
        want = oracle(p.numpy(), **GRID_CFG, max_points_per_voxel=4, max_voxels=cap)
        assert_same(voxelize_triton(p, **GRID_CFG, max_points_per_voxel=4, max_voxels=cap), want)


# ---------------------------------------------------------------------------------------------------
# the compiled kernels (the interpreter is not the compiler)

_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from mapper.kernels import triton_voxelize as V

def build(fn, sig, const, **opts):
    src = ASTSource(fn, sig, const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

f32 = {n: "fp32" for n in ("lox", "loy", "loz", "vsx", "vsy", "vsz")}
i32 = {n: "i32" for n in ("stride", "n", "gx", "gy", "gz", "T")}
sig = dict(pts_ptr="*fp32", keys_ptr="*i64", first_ptr="*i32", pslot_ptr="*i32", LOG2T="constexpr",
           BLOCK="constexpr", **f32, **i32)
ptx = build(V._insert_kernel, sig, {"LOG2T": 18, "BLOCK": 256}, enable_fp_fusion=False)
print("div_rn", "div.rn.f32" in ptx, "cas", "cas.b64" in ptx)
build(V._first_kernel, dict(pslot_ptr="*i32", first_ptr="*i32", flag_ptr="*i32", n="i32", BLOCK="constexpr"),
      {"BLOCK": 256})
build(V._topk_kernel, dict(pslot_ptr="*i32", first_ptr="*i32", csum_ptr="*i32", buf_ptr="*i32", n="i32",
      cap="i32", K="constexpr", BLOCK="constexpr"), {"K": 20, "BLOCK": 256})
build(V._meta_kernel, dict(buf_ptr="*i32", pslot_ptr="*i32", keys_ptr="*i64", counts_ptr="*i32",
      coords_ptr="*i32", V="i32", gx="i32", gy="i32", K="constexpr", BLOCK="constexpr"),
      {"K": 20, "BLOCK": 256})
build(V._gather_kernel, dict(buf_ptr="*i32", pts_ptr="*fp32", stride="i32", out_ptr="*fp32", rows="i32",
      C="i32", ROWS="constexpr", CP="constexpr"), {"ROWS": 128, "CP": 4})
print("all compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    """Compile every kernel for an H100/H200 target offline (no GPU needed): the cell division must be the
    IEEE one (``div.rn.f32``, as torch and NumPy), the insertion a 64-bit CAS."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:  # pragma: no cover
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["div_rn True cas True", "all compiled"], r.stdout


# ---------------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize("fn", [voxelize, voxelize_torch, voxelize_triton])
def test_argument_errors(fn):
    p = torch.zeros((5, 4))
    cfg = dict(GRID_CFG)
    with pytest.raises(InvalidArgument, match=r"^points:"):
        fn(torch.zeros((5, 2)), **cfg)
    with pytest.raises(InvalidArgument, match=r"^points:"):
        fn(torch.zeros(5), **cfg)
    with pytest.raises(InvalidArgumentType, match=r"^points:"):
        fn(torch.zeros((5, 3), dtype=torch.int32), **cfg)
    with pytest.raises(InvalidArgument, match=r"^voxel_size_m:"):
        fn(p, **{**cfg, "voxel_size_m": (0.1, 0.0, 0.1)})
    with pytest.raises(InvalidArgument, match=r"^voxel_size_m:"):
        fn(p, **{**cfg, "voxel_size_m": (0.1, 0.1)})
    with pytest.raises(InvalidArgument, match=r"^voxel_size_m:"):
        fn(p, **{**cfg, "voxel_size_m": (10.0, 0.1, 0.1)})  # less than one voxel in x
    with pytest.raises(InvalidArgument, match=r"^voxel_size_m:"):
        fn(p, **{**cfg, "voxel_size_m": (1e-7, 1e-7, 1e-7)})  # grid too large
    with pytest.raises(InvalidArgument, match=r"^range_max:"):
        fn(p, **{**cfg, "range_max": (3.0, -1.0, 1.4)})
    with pytest.raises(InvalidArgument, match=r"^range_min:"):
        fn(p, **{**cfg, "range_min": (float("nan"), 0.0, 0.0)})
    with pytest.raises(InvalidArgumentType, match=r"^range_min:"):
        fn(p, **{**cfg, "range_min": ("a", "b", {})})
    with pytest.raises(InvalidArgument, match=r"^max_points_per_voxel:"):
        fn(p, **cfg, max_points_per_voxel=0)
    with pytest.raises(InvalidArgumentType, match=r"^max_points_per_voxel:"):
        fn(p, **cfg, max_points_per_voxel=2.5)
    with pytest.raises(InvalidArgument, match=r"^max_voxels:"):
        fn(p, **cfg, max_voxels=0)
    with pytest.raises(InvalidArgumentType, match=r"^max_voxels:"):
        fn(p, **cfg, max_voxels=True)

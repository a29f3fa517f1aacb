"""Farthest point sampling: the naive reference against a NumPy oracle (no mapper import), and the pruned
torch and Triton versions against the reference on random, tied and LiDAR-like clouds.

The definition (module docstring of mapper.kernels.fps) fixes the arithmetic (float32, no FMA) and the tie
rule (smallest index), so every implementation must return *identical* indices, ties included."""

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
from mapper.kernels.fps import (
    _check,
    _fps_torch,
    _fps_triton,
    farthest_point_sample,
    farthest_point_sample_naive,
    farthest_point_sample_torch,
    farthest_point_sample_triton,
)

# ---------------------------------------------------------------------------------------------------
# oracle and clouds


def fps_oracle(points: np.ndarray, m: int, start: int = 0) -> np.ndarray:
    """FPS by the definition in NumPy float32 (separately rounded operations; argmax = first maximum)."""
    p = np.asarray(points, dtype=np.float32)
    d = np.full(p.shape[0], np.inf, dtype=np.float32)
    out = [start]
    for _ in range(1, m):
        q = p[out[-1]]
        dx = p[:, 0] - q[0]
        dy = p[:, 1] - q[1]
        dz = p[:, 2] - q[2]
        d = np.minimum(d, (dx * dx + dy * dy) + dz * dz)
        out.append(int(np.argmax(d)))
    return np.asarray(out, dtype=np.int64)


def coverage(points: np.ndarray, idx: np.ndarray) -> float:
    """max over points of the distance to the nearest sample (float64)."""
    p = np.asarray(points, dtype=np.float64)
    d = np.full(p.shape[0], np.inf)
    for i in idx:
        d = np.minimum(d, ((p - p[i]) ** 2).sum(1))
    return float(np.sqrt(d.max()))


def random_cloud(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand((n, 3), generator=g) - 0.5) * torch.tensor([40.0, 30.0, 4.0])


def lattice_cloud(n: int, seed: int) -> torch.Tensor:
    """Integer lattice points with duplicates: many exactly equal distances (ties)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n, 3), generator=g).to(torch.float32)


@pytest.fixture(scope="module")
def lidar_cloud() -> torch.Tensor:
    """A LiDAR-like scan (16 beams x 512 azimuths in a street scene): dense near the sensor, sparse far."""
    from mapper import sim

    scene = sim.outdoor_scene(0, 120.0)
    pose = sim.driving_trajectory(1, scene=scene)[0]
    return sim.SpinningLidar(n_beams=16, n_azimuth=512).scan(scene, pose)


def subsample(p: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return p[torch.randperm(p.shape[0], generator=g)[:n]]


# ---------------------------------------------------------------------------------------------------
# reference


@pytest.mark.parametrize("cloud", ["random", "lattice"])
def test_naive_matches_numpy_oracle(cloud):
    p = random_cloud(500, 0) if cloud == "random" else lattice_cloud(300, 1)
    got = farthest_point_sample_naive(p, 40, start=7)
    np.testing.assert_array_equal(got.numpy(), fps_oracle(p.numpy(), 40, 7))


def test_naive_float64_input_is_computed_in_float32():
    p = random_cloud(300, 2).to(torch.float64)
    got = farthest_point_sample_naive(p, 30)
    np.testing.assert_array_equal(got.numpy(), fps_oracle(p.numpy().astype(np.float32), 30))


def test_samples_are_distinct_and_cover():
    p = random_cloud(2000, 3)
    idx = farthest_point_sample_naive(p, 64).numpy()
    assert len(set(idx.tolist())) == 64
    # FPS is a 2-approximation of the optimal k-center radius: samples are pairwise >= the coverage radius
    r = coverage(p.numpy(), idx[:-1])
    q = p.numpy().astype(np.float64)[idx[:-1]]
    pair = np.sqrt(((q[:, None] - q[None]) ** 2).sum(-1))
    assert pair[~np.eye(len(q), dtype=bool)].min() >= r - 1e-4


# ---------------------------------------------------------------------------------------------------
# pruned vs reference


def _cases(lidar: torch.Tensor, small: bool):
    if small:  # the Triton interpreter: a few hundred points
        return [
            ("random", random_cloud(300, 4), 16, 0),
            ("lattice", lattice_cloud(200, 5), 24, 3),
            ("lidar", subsample(lidar, 600), 16, 11),
        ]
    return [
        ("random", random_cloud(5000, 4), 200, 0),
        ("lattice", lattice_cloud(1500, 5), 150, 3),
        ("lidar", lidar, 300, 11),
    ]


def test_pruned_matches_naive(lidar_cloud, device, backend):
    small = backend == "triton" and device.type == "cpu"
    for name, p, m, start in _cases(lidar_cloud, small):
        p = p.to(device)
        ref = farthest_point_sample_naive(p, m, start)
        got = farthest_point_sample(p, m, start)
        assert got.dtype == torch.int64 and got.device == p.device
        assert torch.equal(got, ref), name
        pn = p.cpu().numpy()
        assert coverage(pn, got.cpu().numpy()) == coverage(pn, ref.cpu().numpy())


def test_all_three_agree_on_small_clouds(lidar_cloud):
    """torch pruned, Triton pruned (interpreter on CPU), Triton unpruned and the NumPy oracle."""
    for name, p, m, start in _cases(lidar_cloud, small=True):
        ref = fps_oracle(p.numpy(), m, start)
        np.testing.assert_array_equal(farthest_point_sample_torch(p, m, start).numpy(), ref, err_msg=name)
        np.testing.assert_array_equal(farthest_point_sample_triton(p, m, start).numpy(), ref, err_msg=name)
        q = _check(p, m, start)
        np.testing.assert_array_equal(_fps_triton(q, m, start, prune=False).numpy(), ref, err_msg=name)
        if name == "lidar":  # other chunk shapes (600 points: the last chunk is partly padding)
            for chunk, per_program in ((4, 32), (32, 1), (128, 2)):
                got = _fps_triton(q, m, start, chunk=chunk, chunks_per_program=per_program)
                np.testing.assert_array_equal(got.numpy(), ref, err_msg=f"{name} {chunk}")


@pytest.mark.parametrize("chunk", [1, 7, 64, 256])
def test_torch_chunk_sizes(chunk, lidar_cloud):
    p = subsample(lidar_cloud, 3000, 1)
    ref = farthest_point_sample_naive(p, 120, 5)
    got, _ = _fps_torch(_check(p, 120, 5), 120, 5, chunk=chunk)
    assert torch.equal(got, ref)


def test_pruning_skips_most_chunks(lidar_cloud):
    m = 300
    chunk = 64
    _, updates = _fps_torch(_check(lidar_cloud, m, 0), m, 0, chunk=chunk)
    n_chunks = -(-lidar_cloud.shape[0] // chunk)
    assert updates < 0.25 * n_chunks * (m - 1)  # about 10 % on this small scan


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 120),
    grid=st.sampled_from([2, 5, 1000]),
    data=st.data(),
)
def test_property_pruned_equals_oracle(n, grid, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, grid, (n, 3), generator=g).to(torch.float32) * 0.37 - 1.0
    m = data.draw(st.integers(0, n))
    start = data.draw(st.integers(0, n - 1))
    chunk = data.draw(st.sampled_from([1, 3, 8, 64]))
    ref = fps_oracle(p.numpy(), m, start)[:m]
    got, _ = _fps_torch(_check(p, m, start), m, start, chunk=chunk)
    np.testing.assert_array_equal(got.numpy(), ref)


def test_edge_sizes(device, backend):
    p = random_cloud(10, 6).to(device)
    assert farthest_point_sample(p, 0).numel() == 0
    assert farthest_point_sample(p, 1, 4).tolist() == [4]
    full = farthest_point_sample(p, 10, 2)
    assert sorted(full.tolist()) == list(range(10))
    assert torch.equal(full, farthest_point_sample_naive(p, 10, 2))
    one = torch.zeros((1, 3), device=device)
    assert farthest_point_sample(one, 1).tolist() == [0]
    assert farthest_point_sample(torch.zeros((0, 3), device=device), 0).numel() == 0
    # duplicates: once every distance is 0 the argmax is index 0, again and again (by the definition)
    same = torch.ones((5, 3), device=device)
    assert farthest_point_sample(same, 5, 3).tolist() == [3, 0, 0, 0, 0]
    pair = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0]], device=device)
    assert farthest_point_sample(pair, 4, 2).tolist() == [2, 1, 0, 0]


@pytest.mark.gpu
def test_cuda_graph_path_matches_naive(lidar_cloud):
    p = lidar_cloud.cuda()
    m = 400  # > 2 graph blocks of 64 iterations, plus a remainder
    ref = farthest_point_sample_naive(p, m, 1)
    q = _check(p, m, 1)
    assert torch.equal(_fps_triton(q, m, 1, graph_iters=64), ref)
    assert torch.equal(_fps_triton(q, m, 1, graph_iters=0), ref)
    assert torch.equal(_fps_triton(q, m, 1, prune=False), ref)


# ---------------------------------------------------------------------------------------------------
# the compiled kernel (the interpreter is not the compiler)

_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from mapper.kernels.triton_fps import _fps_step_kernel

sig = {n: "*fp32" for n in ("p_ptr", "s_ptr", "dist_ptr", "lo_ptr", "hi_ptr")}
sig.update({n: "*i64" for n in ("low_ptr", "ckey_ptr", "best_ptr", "base_ptr")})
sig.update(k="i32", n_chunks="i32", B="constexpr", G="constexpr", PRUNE="constexpr")
for prune in (True, False):
    src = ASTSource(_fps_step_kernel, sig, {"B": 64, "G": 8, "PRUNE": prune})
    opts = {"enable_fp_fusion": False}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    print("fma", "fma.rn.f32" in ptx, "atomic_max_s64", "max.s64" in ptx)
"""


def test_kernel_compiles_for_sm90_without_fma(tmp_path):
    """Compile the step kernel for an H100/H200 target offline (no GPU needed): the PTX must have no fused
    multiply-add (it would change the float32 distances) and an int64 atomic max."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:  # pragma: no cover
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["fma False atomic_max_s64 True"] * 2, r.stdout


# ---------------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize("fn", [farthest_point_sample, farthest_point_sample_naive])
def test_argument_errors(fn):
    p = random_cloud(10, 7)
    with pytest.raises(InvalidArgument, match=r"^points:"):
        fn(torch.zeros((10, 2)), 3)
    with pytest.raises(InvalidArgumentType, match=r"^points:"):
        fn(torch.zeros((10, 3), dtype=torch.int64), 3)
    with pytest.raises(InvalidArgumentType, match=r"^points:"):
        fn("points", 3)
    with pytest.raises(InvalidArgument, match=r"^m:"):
        fn(p, 11)
    with pytest.raises(InvalidArgument, match=r"^m:"):
        fn(p, -1)
    with pytest.raises(InvalidArgumentType, match=r"^m:"):
        fn(p, 2.0)
    with pytest.raises(InvalidArgument, match=r"^start:"):
        fn(p, 3, start=10)
    with pytest.raises(InvalidArgumentType, match=r"^start:"):
        fn(p, 3, start=True)
    bad = p.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(InvalidArgument, match="NaN"):
        fn(bad, 3)


def test_numpy_input_accepted():
    p = random_cloud(50, 8)
    assert torch.equal(farthest_point_sample(p.numpy(), 5), farthest_point_sample_naive(p, 5))

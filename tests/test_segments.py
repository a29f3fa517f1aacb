"""The brick-segment walk (``mapper.kernels.segments``): the torch reference against a brute-force
voxel-resolution DDA per ray, the Triton kernels against the torch reference, and the occupancy / LiDAR
TSDF integrators against their previous implementations (``_reference``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from mapper import sim
from mapper.integrators import occupancy as occ
from mapper.integrators import tsdf
from mapper.kernels import segments as S
from mapper.kernels.dda import dda_torch
from mapper.kernels.dispatch import triton_twin
from mapper.layers import BrickLayer


# ------------------------------------------------------------------------------------------ inputs
def random_rays(n, seed, device="cpu", span=8.0):
    """Unit rays around the origin (negative coordinates included), 1/8 axis-aligned on x, 1/8 in a plane."""
    g = torch.Generator().manual_seed(seed)
    o = (torch.rand((n, 3), generator=g, dtype=torch.float64) - 0.5) * 20
    d = torch.randn((n, 3), generator=g, dtype=torch.float64)
    d[: n // 8, 1:] = 0
    d[n // 8 : n // 4, 2] = 0
    d = d / d.norm(dim=1, keepdim=True)
    t0 = torch.rand(n, generator=g, dtype=torch.float64) * 2
    t1 = t0 + torch.rand(n, generator=g, dtype=torch.float64) * span
    t1[-3:] = t0[-3:]  # zero-length segments
    return tuple(x.to(device) for x in (o, d, t0, t1))


def dyadic_rays(device="cpu"):
    """Exact arithmetic with s = 0.25 (bricks of 1.0): origins on 1/8 (inside voxels) and on voxel/brick
    boundaries, negative ones included, directions with power-of-two components (axis-aligned and
    diagonal, so rays cross edges and corners exactly: DDA ties), segments starting and ending exactly on
    brick boundaries."""
    rows = []
    dirs = [
        (1, 0, 0),
        (-1, 0, 0),
        (0, 1, 0),
        (0, 0, -1),
        (1, 0.5, 0),
        (-0.5, 1, 0.25),
        (1, 1, 1),
        (-1, -1, 0.5),
    ]
    origins = [(0.125, 0.375, -2.625), (-3.0, 1.0, 2.0), (0.0, 0.0, 0.0), (-0.875, -4.125, 0.5)]
    for oi, o in enumerate(origins):
        for di, d in enumerate(dirs):
            a = abs(d[0]) if d[0] else (abs(d[1]) if d[1] else abs(d[2]))
            ax = 0 if d[0] else (1 if d[1] else 2)
            # t such that the end lands on a brick boundary along the first non-zero axis
            target = math.floor(o[ax]) + (3 if d[ax] > 0 else -2) + (oi % 2)
            t_end = abs(target - o[ax]) / a
            for t0 in (0.0, 0.5, t_end / 2):
                rows.append((*o, *d, t0, t_end))
            rows.append((*o, *d, 0.0, t_end + 0.125 * (di % 3)))
    t = torch.tensor(rows, dtype=torch.float64, device=device)
    return t[:, :3].contiguous(), t[:, 3:6].contiguous(), t[:, 6].contiguous(), t[:, 7].contiguous()


# ------------------------------------------------------------------------------------------ helpers
def per_segment_walk(mode, o, d, t0, t1, s, rng=None, tau=0.0, weight=1.0, walk=S.walk_segments_torch):
    """Coarse + fine pass with one accumulator brick per *segment* (rank = segment index), so the result
    identifies (ray, voxel) pairs: {(ray, i, j, k): value}."""
    seg_ray, seg_key, _ = S.brick_segments_torch(o, d, t0, t1, 4 * s)
    ok = seg_key >= 0  # without the padding
    seg_ray, seg_key = seg_ray[ok], seg_key[ok]
    bricks = S.keys_to_bricks(seg_key)
    rank = torch.arange(seg_key.numel(), dtype=torch.int32, device=o.device)
    m = seg_key.numel()
    if mode == S.MISS:
        out = (torch.zeros(m * 64, dtype=torch.uint8, device=o.device),)
    else:
        out = tuple(torch.zeros(m * 64, dtype=torch.float32, device=o.device) for _ in range(2))
    walk(mode, o, d, t0, t1, rng, seg_ray, rank, bricks, s, out, tau, weight)
    nz = out[-1].nonzero().squeeze(1)
    seg = nz // 64
    off = nz % 64
    vox = bricks[seg] * 4 + torch.stack((off >> 4, (off >> 2) & 3, off & 3), dim=1)
    vals = out[0][nz].tolist()
    return {(r, *v): x for r, v, x in zip(seg_ray[seg].tolist(), vox.tolist(), vals, strict=True)}, out


def dda_cells(o, d, t0, t1, cell):
    """Brute force: the voxel-resolution DDA of every ray (``dda_torch``), as {(ray, i, j, k)} in order."""
    steps = 3 * (math.ceil(float((t1 - t0).max()) / cell) + 1) + 1
    cells, _, valid = dda_torch(o, d, t0, t1, cell, steps)
    out = []
    for r in range(o.shape[0]):
        out.extend((r, *c) for c in cells[r][valid[r]].tolist())
    return out


def band_oracle(o, d, t0, t1, rng, s, tau, weight):
    """The LiDAR band semantics on the brute-force cells: sdf = r - |centre - o| >= -tau, clamped."""
    out = {}
    for r, i, j, k in dda_cells(o, d, t0, t1, s):
        c = [(v + 0.5) * s - float(o[r, a]) for a, v in enumerate((i, j, k))]
        sdf = float(rng[r]) - math.sqrt(c[0] * c[0] + c[1] * c[1] + c[2] * c[2])
        if sdf >= -tau:
            val = torch.tensor(min(sdf, tau), dtype=torch.float64).float()
            out[(r, i, j, k)] = float(val * torch.tensor(weight, dtype=torch.float32))
    return out


CASES = [("random", 0.3), ("random", 0.05), ("dyadic", 0.25)]


def case_rays(name, s, device="cpu", n=300):
    if name == "dyadic":
        return dyadic_rays(device)
    return random_rays(n, 7, device, span=min(8.0, 40 * s))


# ---------------------------------------------------------------------------- (a) torch vs brute force
def _segments(seg_ray, seg_key, box):
    """Sorted (ray, brick) rows without the padding (ray -1, key -1); checks the box holds them."""
    pad = seg_ray < 0
    assert bool((seg_key[pad] == -1).all())
    b = S.keys_to_bricks(seg_key[seg_key >= 0])
    lo, hi = (torch.tensor(x, device=b.device) for x in box)
    assert bool(((b >= lo) & (b <= hi)).all())
    ok = ~pad
    return sorted(zip(seg_ray[ok].tolist(), S.keys_to_bricks(seg_key[ok]).tolist(), strict=True))


@pytest.mark.parametrize("name,s", CASES)
@pytest.mark.parametrize("walk", ["suffix", "compact"])
def test_coarse_pass_is_the_brick_resolution_dda(name, s, walk):
    o, d, t0, t1 = case_rays(name, s)
    fn = S.brick_segments_torch if walk == "suffix" else S._brick_segments_compact
    got = _segments(*fn(o, d, t0, t1, 4 * s))
    want = sorted((c[0], list(c[1:])) for c in dda_cells(o, d, t0, t1, 4 * s))
    assert got == want


def test_coarse_pass_in_ray_groups_under_a_fixed_mmap_threshold(monkeypatch):
    """Under a fixed mmap threshold the coarse pass runs in groups of rays (here 1024): the same segments
    (global ray indices) and a box holding them all, as in one pass."""
    from mapper.kernels import chunks

    s = 0.3
    o, d, t0, t1 = random_rays(2500, 11, span=8.0)
    monkeypatch.setattr(chunks, "_BLOCK_BYTES", 0)
    one = _segments(*S.brick_segments_torch(o, d, t0, t1, 4 * s))
    chunks.set_cpu_block_bytes(4096 + 1024 * 8)  # rows: 1024
    assert chunks.cpu_rows(2500, 8) == 1024
    t1_empty = t1.clone()
    t1_empty[1024:2048] = t0[1024:2048] - 1.0  # a group without any segment
    groups = _segments(*S.brick_segments_torch(o, d, t0, t1, 4 * s))
    assert groups == one
    assert _segments(*S.brick_segments_torch(o, d, t0, t1_empty, 4 * s)) == [
        x for x in one if not 1024 <= x[0] < 2048
    ]


@pytest.mark.parametrize("name,s", CASES)
def test_ray_bricks_bbox_holds_every_segment(name, s):
    o, d, t0, t1 = case_rays(name, s)
    seg_ray, seg_key, _ = S.brick_segments_torch(o, d, t0, t1, 4 * s)
    b = S.keys_to_bricks(seg_key[seg_key >= 0])
    lo, hi = S.ray_bricks_bbox(o, d, t0, t1, 4 * s)
    assert bool(((b >= lo) & (b <= hi)).all())


def test_coarse_pass_outside_the_key_range():
    """Cells outside the key range get key -1 (the general walk handles them)."""
    o = torch.tensor([[4.0 * (S.BRICK_HI - 2) - 0.5, 0.5, 0.5]], dtype=torch.float64)
    d = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    seg_ray, seg_key, _ = S.brick_segments_torch(
        o, d, torch.zeros(1, dtype=torch.float64), o[:, 0] * 0 + 9, 4.0
    )
    assert seg_ray.tolist() == [0, 0, 0, 0]
    assert (seg_key >= 0).tolist() == [True, True, True, False]  # bricks HI-5 .. HI-3, then HI


@pytest.mark.parametrize("name,s", CASES)
def test_fine_pass_miss_equals_voxel_dda(name, s):
    o, d, t0, t1 = case_rays(name, s)
    got, _ = per_segment_walk(S.MISS, o, d, t0, t1, s)
    want = dda_cells(o, d, t0, t1, s)
    assert len(want) == len(set(want))
    assert set(got) == set(want)
    assert set(got.values()) == {1}


@pytest.mark.parametrize("name,s", CASES)
def test_fine_pass_band_equals_voxel_dda(name, s):
    o, d, t0, t1 = case_rays(name, s)
    rng = (t0 + t1) / 2 + 0.3 * s
    tau = 2.5 * s
    got, (_, w) = per_segment_walk(S.BAND, o, d, t0, t1, s, rng, tau, 0.7)
    want = band_oracle(o, d, t0, t1, rng, s, tau, 0.7)
    assert set(got) == set(want)
    assert set(w[w != 0].tolist()) == {torch.tensor(0.7, dtype=torch.float32).item()}
    assert got == want  # bit for bit (same float64 formula, float32 products)


@pytest.mark.parametrize("mode", [S.MISS, S.BAND])
def test_fine_pass_in_many_chunks_equals_the_voxel_dda(monkeypatch, mode):
    """The CPU walk cut into chunks of 37 segments (rows dropped and re-gathered per chunk) gives the
    voxel-resolution DDA's voxels and values, as in one chunk."""
    s = 0.3
    o, d, t0, t1 = case_rays("random", s)
    rng = (t0 + t1) / 2 + 0.3 * s
    one, _ = per_segment_walk(mode, o, d, t0, t1, s, rng, 2.5 * s, 0.7)
    monkeypatch.setattr(S, "CPU_SEGMENTS", 37)
    many, _ = per_segment_walk(mode, o, d, t0, t1, s, rng, 2.5 * s, 0.7)
    assert many == one
    if mode == S.BAND:
        assert many == band_oracle(o, d, t0, t1, rng, s, 2.5 * s, 0.7)
    else:
        assert set(many) == set(dda_cells(o, d, t0, t1, s))


def test_cpu_rows_stay_below_a_fixed_mmap_threshold(monkeypatch):
    """Chunk rows: the default under glibc's dynamic threshold; under a fixed one, the most rows whose
    temporaries stay 4 KiB below it, at least 1024 (mapper.kernels.chunks)."""
    from mapper.kernels import chunks

    monkeypatch.setattr(chunks, "_BLOCK_BYTES", 0)
    assert chunks.cpu_rows(1 << 14, 8) == 1 << 14
    chunks.set_cpu_block_bytes(128 * 1024)
    assert chunks.cpu_rows(1 << 14, 8) == 15872  # (131072 - 4096) / 8: float64 rows of 124 KiB
    assert chunks.cpu_rows(1 << 12, 8) == 1 << 12  # never more than the default
    assert chunks.cpu_rows(1 << 14, 1 << 20) == 1024
    chunks.set_cpu_block_bytes(-1)  # nonsense: the dynamic threshold
    assert chunks.cpu_rows(1 << 14, 8) == 1 << 14


def test_end_voxel_on_brick_boundary_by_hand():
    """A +x ray of exactly 3.875 m from x = 0.125 (s = 0.25): its end x = 4.0 is a brick boundary; voxels
    0..15 are crossed (entry < t1), voxel 16 is not."""
    o = torch.tensor([[0.125, 0.375, -2.625]], dtype=torch.float64)
    d = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    t0 = torch.zeros(1, dtype=torch.float64)
    t1 = torch.full((1,), 3.875, dtype=torch.float64)
    got, _ = per_segment_walk(S.MISS, o, d, t0, t1, 0.25)
    assert sorted(k[1] for k in got) == list(range(16))
    assert {k[2:] for k in got} == {(1, -11)}


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("box", [False, True])
def test_unique_brick_ranks(dense, box, backend):
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-40, 40, (500, 3), generator=g)
    b = torch.randint(-40, 40, (70, 3), generator=g)
    b[::7] = S.BRICK_HI + 5  # outside the key range: -1
    ka, kb = S.brick_keys(a), S.brick_keys(b)
    ka[::11] = -1
    bbox = torch.tensor([[-40] * 3, [39] * 3]) if box else None
    bricks, (ra, rb) = S.unique_brick_ranks(ka, kb, bbox=bbox, max_dense_cells=(1 << 26) if dense else 0)
    valid = torch.cat((ka, kb))
    valid = valid[valid >= 0]
    assert torch.equal(S.brick_keys(bricks), torch.unique(valid))
    for k, r in ((ka, ra), (kb, rb)):
        assert r.dtype == torch.int32
        assert torch.equal(r < 0, k < 0)
        assert torch.equal(S.brick_keys(bricks[r[r >= 0].long()]), k[k >= 0])


@pytest.mark.parametrize("dense", [True, False])
def test_unique_brick_ranks_without_invalid_keys(dense):
    """No ``-1`` key at all: every key ranked, the first brick included (the sort path appends a ``-1`` key
    of its own instead of reading whether one was there)."""
    keys = S.brick_keys(torch.tensor([[5, 1, 2], [-3, 0, 0], [5, 1, 2], [0, 0, 7]]))
    bricks, (r,) = S.unique_brick_ranks(keys, max_dense_cells=(1 << 26) if dense else 0)
    assert bricks.tolist() == [[-3, 0, 0], [0, 0, 7], [5, 1, 2]]
    assert r.tolist() == [2, 0, 2, 1]


def test_unique_brick_ranks_empty():
    bricks, (r,) = S.unique_brick_ranks(torch.full((4,), -1, dtype=torch.int64))
    assert bricks.shape == (0, 3) and r.tolist() == [-1] * 4


# ------------------------------------------------------------------------------ (b) Triton vs torch
def _triton_only(backend):
    if backend != "triton":
        pytest.skip("compares the Triton kernels with the reference")


@pytest.mark.parametrize("name,s", CASES)
def test_triton_coarse_matches_torch(name, s, device, backend):
    _triton_only(backend)
    from mapper.kernels.triton_segments import brick_segments_triton

    o, d, t0, t1 = case_rays(name, s, device, n=120)
    got = _segments(*brick_segments_triton(o, d, t0, t1, 4 * s))
    assert got == _segments(*S.brick_segments_torch(o, d, t0, t1, 4 * s))
    # one origin for all rays (an expanded [3] tensor, stride 0)
    oe = o[:1].expand(o.shape[0], 3)
    got = _segments(*brick_segments_triton(oe, d, t0, t1, 4 * s))
    assert got == _segments(*S.brick_segments_torch(oe, d, t0, t1, 4 * s))


def test_coarse_caps_by_hand_and_triton_matches_torch(device, backend):
    # by hand: cell 1, origin 0.5: a ray along +x from 0 to 3.2 (bricks 0..3: 3 crossed + 4), one along -y
    # from 0 to 2 (0 -> -2: 2 + 4), one with t0 > t1 (1); box = end cells -1 / +1 on each axis
    o = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64, device=device).expand(3, 3)
    d = torch.tensor([[1.0, 0, 0], [0, -1, 0], [0, 0, 1]], dtype=torch.float64, device=device)
    t0 = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64, device=device)
    t1 = torch.tensor([3.2, 2.0, 1.0], dtype=torch.float64, device=device)
    cap, caps = S.coarse_caps_torch(o, d, t0, t1, 1.0)
    assert cap.tolist() == [7, 6, 1]
    assert caps.tolist() == [-1, -3, -1, 4, 1, 3, 7]
    empty = S.coarse_caps_torch(o[:0], d[:0], t0[:0], t1[:0], 1.0)
    assert empty[0].numel() == 0 and empty[1].tolist() == [S.BRICK_HI - 1] * 3 + [S.BRICK_LO] * 3 + [0]
    if backend != "triton":
        return
    from mapper.kernels.triton_segments import coarse_caps_triton

    g = coarse_caps_triton(o, d, t0, t1, 1.0)
    assert torch.equal(g[0], cap) and torch.equal(g[1], caps)
    assert torch.equal(coarse_caps_triton(o[:0], d[:0], t0[:0], t1[:0], 1.0)[1], empty[1])
    for name, s in CASES:  # random rays (a row per ray and one expanded origin), clipped far rays
        ro, rd, r0, r1 = case_rays(name, s, device, n=300)
        for oo in (ro, ro[:1].expand(ro.shape[0], 3)):
            want = S.coarse_caps_torch(oo, rd, r0, r1, 4 * s)
            got = coarse_caps_triton(oo, rd, r0, r1, 4 * s)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


@pytest.mark.parametrize("name,s", CASES)
@pytest.mark.parametrize("mode", [S.MISS, S.BAND])
def test_triton_walk_matches_torch(name, s, mode, device, backend):
    _triton_only(backend)
    from mapper.kernels.triton_segments import walk_segments_triton

    o, d, t0, t1 = case_rays(name, s, device, n=120)
    rng = (t0 + t1) / 2 + 0.3 * s
    # per-segment accumulators: one writer per entry, so the sums are bit for bit
    _, out1 = per_segment_walk(mode, o, d, t0, t1, s, rng, 2.5 * s, 0.7)
    _, out2 = per_segment_walk(mode, o, d, t0, t1, s, rng, 2.5 * s, 0.7, walk=walk_segments_triton)
    for a, b in zip(out1, out2, strict=True):
        assert torch.equal(a, b)
    # shared (unique) bricks: flags equal, sums equal to float tolerance (atomics add in any order)
    seg_ray, seg_key, box = S.brick_segments_torch(o, d, t0, t1, 4 * s)
    bricks, (rank,) = S.unique_brick_ranks(seg_key, bbox=box)
    outs = []
    for walk in (S.walk_segments_torch, walk_segments_triton):
        u = bricks.shape[0] * 64
        if mode == S.MISS:
            out = (torch.zeros(u, dtype=torch.uint8, device=device),)
        else:
            out = (torch.zeros(u, device=device), torch.zeros(u, device=device))
        walk(mode, o, d, t0, t1, rng, seg_ray, rank, bricks, s, out, 2.5 * s, 0.7)
        outs.append(out)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from mapper.kernels import triton_segments as T

def build(fn, sig, const):
    src = ASTSource(fn, sig, const)
    opts = {"enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

sig = dict(o_ptr="*fp64", o_stride="i32", d_ptr="*fp64", t0_ptr="*fp64", t1_ptr="*fp64", start_ptr="*i64",
           prm_ptr="*fp64", seg_ray_ptr="*i32", seg_key_ptr="*i64", n="i32", S_BOUND="constexpr",
           BLOCK="constexpr", KBITS="constexpr", KBIAS="constexpr", BLO="constexpr", BHI="constexpr")
c = {"S_BOUND": 16, "BLOCK": 128, "KBITS": 21, "KBIAS": 1 << 20, "BLO": -(1 << 18) + 2, "BHI": (1 << 18) - 2}
ptx = build(T._coarse_kernel, sig, c)
print("coarse", "fma.rn.f64" in ptx, "div.rn.f64" in ptx)
for mode, o in ((0, "*u8"), (1, "*fp32")):
    sig = dict(o_ptr="*fp64", o_stride="i32", d_ptr="*fp64", t0_ptr="*fp64", t1_ptr="*fp64", rng_ptr="*fp64",
               ray_ptr="*i32", rank_ptr="*i32", bricks_ptr="*i32", prm_ptr="*fp64", out_a=o, out_b=o,
               n="i32", weight="fp32", MODE="constexpr", STEPS="constexpr", BLOCK="constexpr")
    ptx = build(T._walk_kernel, sig, {"MODE": mode, "STEPS": 10, "BLOCK": 128})
    print("walk", mode, "fma.rn.f64" in ptx, "sqrt.rn.f64" in ptx, "atom." in ptx)
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The compiled kernels (the interpreter is not the compiler) for an H100/H200 target, offline: no
    FMA contraction in float64 (bit-equal to the torch reference), an IEEE square root, and no atomics
    in the occupancy walk."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MAPPER_TRITON_SM90")}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:  # pragma: no cover
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:3] == [
        "coarse False True",
        "walk 0 False False False",
        "walk 1 False True True",
    ], r.stdout


# ------------------------------------------------------------------- (c) integrators vs the previous ones
@pytest.fixture(scope="module")
def street_frames():
    """Two frames of a 16-beam LiDAR on the simulated street: [(origin float64 [3], world points [N, 3])]."""
    scene = sim.outdoor_scene(0, extent_m=120.0)
    lidar = sim.SpinningLidar(n_beams=16, n_azimuth=300, max_range_m=40.0)
    out = []
    for T in sim.driving_trajectory(2, scene=scene):
        pts = lidar.scan(scene, T).to(torch.float64)
        out.append((T[:3, 3].double(), pts @ T[:3, :3].T.double() + T[:3, 3].double()))
    return out


_REFERENCE: dict = {}
_NO_TIMER = lambda _: nullcontext()  # noqa: E731


def _frames(street_frames, device, backend, s, monkeypatch):
    """The frames on ``device``; in the Triton interpreter a slice of them at the coarser voxel size only,
    with only this module's kernels interpreted (the layer's topology kernels are not under test here)."""
    if backend == "triton" and device.type == "cpu":
        if s < 0.2:
            pytest.skip("the interpreter: kernel equality is tested above; one voxel size is enough here")
        monkeypatch.setenv("MAPPER_KERNELS", "torch")
        monkeypatch.setattr(S, "kernel", lambda _device, _torch, twin: triton_twin(twin))
        step = 29
    else:
        step = 1
    return [(o.to(device), w[::step].to(device)) for o, w in street_frames], step


def _occupancy_rays(origin, world):
    dv = world - origin
    rng = torch.linalg.vector_norm(dv, dim=1)
    hit = torch.ones_like(rng, dtype=torch.bool)
    hit[::5] = False  # rays without a return carve their whole length
    return dv / rng[:, None], rng, hit


def _reference(kind, s, frames, key, monkeypatch):
    """The previous implementation's layer (torch kernels: it is the oracle), cached per case."""
    if key not in _REFERENCE:
        with monkeypatch.context() as mp:
            mp.setenv("MAPPER_KERNELS", "torch")
            dev = frames[0][0].device
            if kind == "occupancy":
                cfg = occ.OccupancyConfig(s)
                ref = BrickLayer(occ.occupancy_fields(), dev)
                for origin, world in frames:
                    rays = _occupancy_rays(origin, world)
                    occ._integrate_rays_reference(ref, origin, *rays, cfg, _NO_TIMER)
                _REFERENCE[key] = ref.voxel_view(["log_odds"])
            else:
                cfg = tsdf.TsdfConfig(s, obs_weight=0.7, max_weight=1.2)
                ref = BrickLayer(tsdf.tsdf_fields(cfg), dev)
                for origin, world in frames:
                    tsdf._integrate_lidar_reference(ref, origin, world, cfg, _NO_TIMER)
                _REFERENCE[key] = ref.voxel_view(["tsdf", "weight"])
    return _REFERENCE[key]


def _budget(chunked, rows, monkeypatch):
    """A small segment budget: the frames are cut into ray chunks (two coarse passes)."""
    if chunked:
        for dev in ("cpu", "cuda"):
            monkeypatch.setitem(S.SEGMENT_BUDGET, dev, rows)


@pytest.mark.parametrize("s", [0.25, 0.12])
@pytest.mark.parametrize("chunked", [False, True])
def test_occupancy_equals_reference(street_frames, s, chunked, device, backend, monkeypatch):
    frames, step = _frames(street_frames, device, backend, s, monkeypatch)
    _budget(chunked, 40000 // step, monkeypatch)
    cfg = occ.OccupancyConfig(s)
    new = BrickLayer(occ.occupancy_fields(), device)
    for origin, world in frames:
        if chunked:
            dirs, rng, _ = _occupancy_rays(origin, world)
            o = origin.expand(rng.numel(), 3)
            assert len(S.FrameSegments(o, dirs, rng * 0, rng, 4 * s).ranges) > 1
        assert occ.integrate_rays(new, origin, *_occupancy_rays(origin, world), cfg, _NO_TIMER).shape[0] > 0
    monkeypatch.setenv("MAPPER_KERNELS", "torch")  # the comparison (voxel views) is not under test
    g1, d1 = new.voxel_view(["log_odds"])
    g2, d2 = _reference("occupancy", s, frames, ("occupancy", s, str(device), step), monkeypatch)
    assert torch.equal(g1.ijk, g2.ijk)
    a, b = d1["log_odds"], d2["log_odds"]
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])  # exact
    assert int((a > 0).sum()) > 100 // step and int((a < 0).sum()) > 5000 // step


@pytest.mark.parametrize("s", [0.2, 0.1])
@pytest.mark.parametrize("chunked", [False, True])
def test_lidar_tsdf_equals_reference(street_frames, s, chunked, device, backend, monkeypatch):
    frames, step = _frames(street_frames, device, backend, s, monkeypatch)
    _budget(chunked, 10000 // step, monkeypatch)
    cfg = tsdf.TsdfConfig(s, obs_weight=0.7, max_weight=1.2)
    new = BrickLayer(tsdf.tsdf_fields(cfg), device)
    for origin, world in frames:
        if chunked:
            r = torch.linalg.vector_norm(world - origin, dim=1)
            o = origin.expand(r.numel(), 3)
            t0, t1 = (r - cfg.tau).clamp(min=0), r + cfg.tau
            frame = S.FrameSegments(o, (world - origin) / r[:, None], t0, t1, 4 * s, max_length=2 * cfg.tau)
            assert len(frame.ranges) > 1
        assert tsdf.integrate_lidar(new, origin, world, cfg, _NO_TIMER).shape[0] > 0
    monkeypatch.setenv("MAPPER_KERNELS", "torch")  # the comparison (voxel views) is not under test
    g1, d1 = new.voxel_view(["tsdf", "weight"])
    g2, d2 = _reference("tsdf", s, frames, ("tsdf", s, str(device), step), monkeypatch)
    assert torch.equal(g1.ijk, g2.ijk)  # the same bricks (none without a sample)
    assert torch.equal(d1["weight"], d2["weight"])
    # the sums' order differs (fp16 storage): one fp16 ulp
    torch.testing.assert_close(d1["tsdf"].float(), d2["tsdf"].float(), rtol=0, atol=2.5e-4)
    assert int((d1["weight"] > 0).sum()) > 5000 // step

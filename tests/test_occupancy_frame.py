"""The occupancy frame path (issue 12): a hand-computed frame, the coarse pass's row bound (``max_rows``:
one size read decides whether the frame is cut into ray chunks) and the host syncs it saves."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from mapper.integrators import occupancy as occ
from mapper.kernels import segments as S
from mapper.layers import BrickLayer

_NO_TIMER = lambda _: nullcontext()  # noqa: E731


def _lo(layer: BrickLayer) -> dict[tuple, float]:
    """{voxel: log-odds} of the observed voxels (a dense NumPy-free oracle: the layer's voxel view)."""
    g, d = layer.voxel_view(["log_odds"])
    v = d["log_odds"].float()
    ok = ~torch.isnan(v)
    return {tuple(x): float(y) for x, y in zip(g.ijk[ok].tolist(), v[ok].tolist(), strict=True)}


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_hand_computed_frame(device, backend):
    """Two rays from (0.05, 0.05, 0.05) at 0.1 m voxels. Along +x, returning at x = 0.95: voxels x = 0..8 are
    misses, 9 the hit. Along (0.6, 0.8, 0) for 0.23 m without a return: it crosses y = 0.1 at t = 1/16
    (voxel (0, 1)), x = 0.1 at t = 1/12 ((1, 1)), y = 0.2 at t = 0.1875 ((1, 2)); x = 0.2 would be at
    t = 0.25, past its end: misses only. A second frame repeats them: the misses and the hit add up."""
    cfg = occ.OccupancyConfig(0.1)
    layer = BrickLayer(occ.occupancy_fields(), device)
    f64 = torch.float64
    origin = torch.tensor([0.05, 0.05, 0.05], dtype=f64, device=device)
    dirs = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0]], dtype=f64, device=device)
    length = torch.tensor([0.9, 0.23], dtype=f64, device=device)
    hit = torch.tensor([True, False], device=device)
    bricks = occ.integrate_rays(layer, origin, dirs, length, hit, cfg, _NO_TIMER)
    assert sorted(map(tuple, bricks.tolist())) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    f16 = lambda x: float(torch.tensor(x, dtype=torch.float32).to(torch.float16))  # noqa: E731
    miss, hit_lo = f16(cfg.l_miss), f16(cfg.l_hit)
    want = {(i, 0, 0): miss for i in range(9)} | {(9, 0, 0): hit_lo}
    want |= {(0, 1, 0): miss, (1, 1, 0): miss, (1, 2, 0): miss}
    assert _lo(layer) == want
    occ.integrate_rays(layer, origin, dirs, length, hit, cfg, _NO_TIMER)
    two_miss = f16(
        float(torch.tensor(miss, dtype=torch.float32) + torch.tensor(cfg.l_miss, dtype=torch.float32))
    )
    two_hit = f16(
        float(torch.tensor(hit_lo, dtype=torch.float32) + torch.tensor(cfg.l_hit, dtype=torch.float32))
    )
    assert _lo(layer) == {k: (two_hit if v == hit_lo else two_miss) for k, v in want.items()}


def _rays(n: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn((n, 3), generator=g, dtype=torch.float64)
    d = d / d.norm(dim=1, keepdim=True)
    length = torch.rand(n, generator=g, dtype=torch.float64) * 20
    o = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)
    return tuple(x.to(device) for x in (o.expand(n, 3), d, torch.zeros(n, dtype=torch.float64), length))


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_max_rows_refuses_exactly_over_the_rows(device, backend):
    o, d, t0, t1 = _rays(40, 1, device)
    cell = 0.4
    full = S.brick_segments(o, d, t0, t1, cell)
    est = int(
        ((torch.floor((o + d * t1[:, None]) / cell) - torch.floor(o / cell)).abs().sum() + 4 * 40).item()
    )
    rows = full[0].numel()
    bound = rows if backend == "triton" else est  # the kernel's exact CSR size; the torch path's estimate
    assert S.brick_segments(o, d, t0, t1, cell, max_rows=bound - 1) is None
    got = S.brick_segments(o, d, t0, t1, cell, max_rows=bound)
    assert (
        got is not None
        and torch.equal(got[0], full[0])
        and torch.equal(got[1], full[1])
        and got[2] == full[2]
    )


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
@pytest.mark.parametrize("budget", [1 << 23, 300])
def test_frame_segments_one_or_many_passes(device, backend, budget, monkeypatch):
    """A frame that fits is one coarse pass and no separate row estimate (one size read less); one that does
    not is cut into chunks; both give the same bricks and segments (as a set of (ray, brick) pairs)."""
    o, d, t0, t1 = _rays(30, 2, device)
    calls = []
    real = S._ray_chunks
    monkeypatch.setattr(S, "_ray_chunks", lambda *a: calls.append(1) or real(*a))
    frame = S.FrameSegments(o, d, t0, t1, 0.4, budget=budget)
    n_estimates = len(calls)
    pairs = set()
    for seg_ray, seg_rank in frame.segments():
        ok = (seg_ray >= 0) & (seg_rank >= 0)
        pairs |= set(zip(seg_ray[ok].tolist(), seg_rank[ok].tolist(), strict=True))
    one = S.FrameSegments(o, d, t0, t1, 0.4, budget=1 << 23)
    ref = set()
    for seg_ray, seg_rank in one.segments():
        ok = (seg_ray >= 0) & (seg_rank >= 0)
        ref |= set(zip(seg_ray[ok].tolist(), seg_rank[ok].tolist(), strict=True))
    assert torch.equal(frame.bricks, one.bricks) and pairs == ref and len(ref) > 30
    if budget > 1000:
        assert len(frame.ranges) == 1
        assert n_estimates == (1 if backend == "torch" else 0)  # the torch path's estimate is its check
    else:
        assert len(frame.ranges) > 1


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_free_walk_skips_rays_without_length(device, backend):
    """Rays of length <= 0 (exactly 0 included) mark nothing: the same free record and returned bricks as
    the frame without them."""
    from mapper.integrators import free

    o, d, _, length = _rays(30, 4, device)
    length = length.clone()
    length[::3] = 0.0
    length[1::7] = -2.5
    keep = length > 0
    a, b = (BrickLayer(free.free_fields(), device) for _ in range(2))
    got = free.integrate_free(a, o[0], d, length, 0.3)
    want = free.integrate_free(b, o[0], d[keep], length[keep], 0.3)
    assert torch.equal(got, want) and got.shape[0] > 3
    assert torch.equal(a.brick_table()[0], b.brick_table()[0])
    ga, gb = a.pool.gather("log_odds", a.brick_table()[1]), b.pool.gather("log_odds", b.brick_table()[1])
    torch.testing.assert_close(ga, gb, rtol=0, atol=0, equal_nan=True)
    assert (
        free.integrate_free(a, o[0], d[:4], torch.zeros(4, dtype=torch.float64, device=device), 0.3).numel()
        == 0
    )

"""The Triton DDA kernel against the torch reference (same signature), and the reference against a
brute-force oracle: a cell is crossed iff the segment intersects the cell's box."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper.kernels.dda import dda_torch, dda_triton


def random_segments(n, seed, device):
    g = torch.Generator().manual_seed(seed)
    o = (torch.rand((n, 3), generator=g, dtype=torch.float64) - 0.5) * 20
    d = torch.randn((n, 3), generator=g, dtype=torch.float64)
    d[: n // 8, 1:] = 0  # axis-aligned rays
    d[n // 8 : n // 4, 2] = 0
    d = d / d.norm(dim=1, keepdim=True)
    t0 = torch.rand(n, generator=g, dtype=torch.float64) * 2
    t1 = t0 + torch.rand(n, generator=g, dtype=torch.float64) * 3
    return o.to(device), d.to(device), t0.to(device), t1.to(device)


def slab_hits(o, d, t0, t1, cells, s):
    """Brute force: does segment [t0, t1] intersect each cell box (with a tiny tolerance)?"""
    lo = cells * s
    hi = lo + s
    with np.errstate(divide="ignore", invalid="ignore"):
        a = (lo - o[:, None]) / d[:, None]
        b = (hi - o[:, None]) / d[:, None]
    tn = np.where(
        d[:, None] != 0, np.minimum(a, b), np.where((o[:, None] >= lo) & (o[:, None] < hi), -np.inf, np.inf)
    )
    tf = np.where(
        d[:, None] != 0, np.maximum(a, b), np.where((o[:, None] >= lo) & (o[:, None] < hi), np.inf, -np.inf)
    )
    enter = tn.max(axis=2)
    leave = tf.min(axis=2)
    return (enter <= np.minimum(leave, t1[:, None]) + 1e-9) & (leave >= t0[:, None] - 1e-9)


def test_dda_reference_matches_brute_force():
    s = 0.7
    o, d, t0, t1 = random_segments(400, 0, "cpu")
    cells, tent, valid = dda_torch(o, d, t0, t1, s, 3 * (int(3 / s) + 2) + 1)
    on = o.numpy()
    dn = d.numpy()
    for r in range(0, 400, 7):
        got = {tuple(c) for c in cells[r][valid[r]].tolist()}
        # candidates: all cells in the segment's bounding box
        a = on[r] + dn[r] * t0[r].item()
        b = on[r] + dn[r] * t1[r].item()
        lo = np.floor(np.minimum(a, b) / s).astype(int) - 1
        hi = np.floor(np.maximum(a, b) / s).astype(int) + 1
        grid = np.stack(
            np.meshgrid(*[np.arange(lo[k], hi[k] + 1) for k in range(3)], indexing="ij"), -1
        ).reshape(-1, 3)
        hit = slab_hits(
            on[r : r + 1], dn[r : r + 1], t0[r : r + 1].numpy(), t1[r : r + 1].numpy(), grid[None], s
        )[0]
        strict = {tuple(c) for c in grid[hit]}
        assert got <= strict, (r, got - strict)  # every visited cell is crossed
        # every cell crossed by more than a hair is visited
        inner = slab_hits(
            on[r : r + 1],
            dn[r : r + 1],
            t0[r : r + 1].numpy() + 1e-6,
            t1[r : r + 1].numpy() - 1e-6,
            grid[None],
            s,
        )[0]
        assert {tuple(c) for c in grid[inner]} <= got, r
        # entry parameters increase along the ray
        te = tent[r][valid[r]]
        assert bool((te[1:] >= te[:-1]).all())


def test_dda_triton_matches_torch(device, backend):
    if backend != "triton":
        pytest.skip("compares the Triton kernel with the reference")
    o, d, t0, t1 = random_segments(300, 1, device)
    for cell, steps in ((0.5, 25), (0.1, 120)):
        c1, te1, v1 = dda_torch(o, d, t0, t1, cell, steps)
        c2, te2, v2 = dda_triton(o, d, t0, t1, cell, steps)
        assert torch.equal(v1, v2)
        assert torch.equal(c1[v1], c2[v2])
        torch.testing.assert_close(te1[v1], te2[v2], rtol=0, atol=1e-9)

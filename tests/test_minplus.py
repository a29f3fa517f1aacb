"""The ESDF's min-plus window pass: Triton kernel and torch reference against a direct NumPy evaluation
of ``g[p] = min(f[p], min_{1<=d<=w, d<=p<n-d} min(f[p-d], f[p+d]) + d^2)`` — bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper.integrators import esdf


def _oracle(f: np.ndarray, w: int) -> np.ndarray:
    n = f.size
    g = f.copy()
    for p in range(n):
        for d in range(1, w + 1):
            if p - d >= 0 and p + d < n:
                g[p] = min(g[p], np.float32(min(f[p - d], f[p + d])) + np.float32(d * d))
    return g


@pytest.mark.parametrize("w", [1, 4, 13])
def test_window_min_matches_oracle(device, backend, w):
    rng = np.random.default_rng(w)
    n = 700
    f = (rng.random(n, dtype=np.float32) * 300).astype(np.float32)
    f[rng.random(n) < 0.3] = np.inf  # empty slots between lines
    f[:w] = np.inf
    got = esdf._window_min(torch.from_numpy(f).to(device), w).cpu().numpy()
    want = _oracle(f, w)
    np.testing.assert_array_equal(got, want)


def test_window_min_short_arrays(device, backend):
    for n in (0, 1, 2, 5):
        f = torch.arange(n, dtype=torch.float32, device=device)
        got = esdf._window_min(f, 3).cpu().numpy()
        np.testing.assert_array_equal(got, _oracle(f.cpu().numpy(), 3))

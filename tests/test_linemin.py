"""The ESDF's line pass (``mapper/kernels/linemin.py``): the torch reference and the Triton kernel against a
NumPy brute force of ``min over crossings c of the line of (p - c)^2`` (float32 terms as documented), bit
for bit, and its argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper.errors import InvalidArgument, InvalidArgumentType
from mapper.kernels.linemin import line_min, line_min_torch


def _oracle(lo, hi, near, start, length):
    """Every crossing of the line, brute force: slot q's crossings at q + lo[q], q + near[q], q + hi[q]; the
    distance of p to a crossing of another slot is formed as the kernel documents (float32)."""
    out = np.full(lo.shape, np.inf, dtype=np.float32)
    for s, n in zip(start.tolist(), length.tolist(), strict=True):
        for p in range(s, s + n):
            best = np.float32(np.inf)
            if not np.isnan(near[p]):
                best = min(best, np.float32(near[p] * near[p]))
            for q in range(s, s + n):
                if q == p or np.isnan(lo[q]):
                    continue
                if q < p:  # its rightmost crossing is the nearest of its crossings
                    d = np.float32(np.float32(p - q) - hi[q])
                else:
                    d = np.float32(np.float32(q - p) + lo[q])
                best = min(best, np.float32(d * d))
            out[p] = best
    return out


def _problem(rng, n_lines, max_len, density):
    length = rng.integers(0, max_len + 1, n_lines).astype(np.int64)
    start = np.cumsum(np.r_[0, length[:-1]]).astype(np.int64)
    total = int(length.sum())
    a = (rng.random(total) - 0.5).astype(np.float32)
    b = (rng.random(total) - 0.5).astype(np.float32)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    near = np.where(np.abs(lo) < np.abs(hi), lo, hi).astype(np.float32)
    none = rng.random(total) >= density
    lo[none] = hi[none] = near[none] = np.nan
    return lo, hi, near, start, length


@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 1.0])
def test_matches_bruteforce(device, backend, density):
    rng = np.random.default_rng(int(density * 100))
    lo, hi, near, start, length = _problem(rng, 40, 24, density)
    args = [torch.from_numpy(x).to(device) for x in (lo, hi, near, start, length)]
    got = line_min(*args).cpu().numpy()
    np.testing.assert_array_equal(got, _oracle(lo, hi, near, start, length))


def test_sixteen_equal_lines_and_one_crossing(device, backend):
    """The ESDF layout's shape (16 lines of one length per brick run) and a hand case: one crossing at
    slot 2 (+0.25) on a line of 6: distances 2.25^2, 1.25^2, 0.25^2, 0.75^2, 1.75^2, 2.75^2."""
    lo = np.full(16 * 6, np.nan, dtype=np.float32)
    lo[2::6] = 0.25
    hi, near = lo.copy(), lo.copy()
    start = np.arange(16, dtype=np.int64) * 6
    length = np.full(16, 6, dtype=np.int64)
    args = [torch.from_numpy(x).to(device) for x in (lo, hi, near, start, length)]
    got = line_min(*args).cpu().numpy().reshape(16, 6)
    want = np.array([2.25, 1.25, 0.25, 0.75, 1.75, 2.75], dtype=np.float32) ** 2
    np.testing.assert_array_equal(got, np.broadcast_to(want, (16, 6)))


def test_reference_equals_kernel_form_on_long_lines():
    """A long line (the CPU reference's prefix scans) against the brute force."""
    rng = np.random.default_rng(7)
    lo, hi, near, start, length = _problem(rng, 3, 300, 0.02)
    got = line_min_torch(*[torch.from_numpy(x) for x in (lo, hi, near, start, length)]).numpy()
    np.testing.assert_array_equal(got, _oracle(lo, hi, near, start, length))


def test_bad_arguments():
    f = torch.zeros(4)
    s = torch.tensor([0])
    n = torch.tensor([4])
    with pytest.raises(InvalidArgumentType, match="lo must be a float32"):
        line_min(f.double(), f, f, s, n)
    with pytest.raises(InvalidArgument, match="near has 3 slots"):
        line_min(f, f, f[:3], s, n)
    with pytest.raises(InvalidArgumentType, match="start must be an integer"):
        line_min(f, f, f, s.float(), n)
    with pytest.raises(InvalidArgument, match="start has 1 lines, length 2"):
        line_min(f, f, f, s, torch.tensor([2, 2]))

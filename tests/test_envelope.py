"""The ESDF's 1-D squared-distance pass (``mapper/kernels/envelope.py``, lower envelope of parabolas): the
torch reference and the Triton kernel against a NumPy brute force of
``g[p] = min_q fl32(f[q] + (p - q)^2)`` over each line, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper.errors import InvalidArgument, InvalidArgumentType
from mapper.kernels.envelope import lower_envelope, lower_envelope_torch


def _oracle(f: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    g = np.full_like(f, np.inf)
    for s, n in zip(start.tolist(), length.tolist(), strict=True):
        if n == 0:
            continue
        seg = f[s : s + n]
        d = np.arange(n)
        d2 = ((d[:, None] - d[None, :]) ** 2).astype(np.float32)
        g[s : s + n] = (seg[None, :] + d2).min(axis=1)  # float32 additions, as the kernel
    return g


def _lines(rng, n_lines, max_len, gap=True):
    length = rng.integers(0, max_len + 1, n_lines)
    sep = rng.integers(0, 3, n_lines) if gap else np.zeros(n_lines, dtype=np.int64)
    start = np.cumsum(np.r_[0, (length + sep)[:-1]])
    return start.astype(np.int64), length.astype(np.int64), int(start[-1] + length[-1] + sep[-1])


def _run(f, start, length, device):
    t = lower_envelope(
        torch.from_numpy(f).to(device),
        torch.from_numpy(start).to(device),
        torch.from_numpy(length).to(device),
    )
    return t.cpu().numpy()


@pytest.mark.parametrize("kind", ["random", "integers", "sparse"])
def test_matches_bruteforce(device, backend, kind):
    rng = np.random.default_rng(len(kind))
    start, length, total = _lines(rng, 60, 48)
    if kind == "random":  # sub-voxel squared distances
        f = (rng.random(total) * 200).astype(np.float32)
        f[rng.random(total) < 0.4] = np.inf
    elif kind == "integers":  # centre sites: many exact ties
        f = rng.integers(0, 6, total).astype(np.float32)
        f[rng.random(total) < 0.6] = np.inf
    else:  # one or two parabolas per line, far apart
        f = np.full(total, np.inf, dtype=np.float32)
        pick = rng.random(total) < 0.04
        f[pick] = (rng.random(pick.sum()) * 3).astype(np.float32)
    np.testing.assert_array_equal(_run(f, start, length, device), _oracle(f, start, length))


def test_long_lines_and_all_ties(device, backend):
    # f[q] + (x0 - q)^2 = x0^2 + 30000 for every q: all parabolas tie exactly at x0
    n, x0 = 160, 80
    q = np.arange(n, dtype=np.int64)
    f = (2 * q * x0 - q * q + 30000).astype(np.float32)
    f2 = (np.random.default_rng(3).random(n) * 4000).astype(np.float32)
    f2[::7] = np.inf
    fa = np.concatenate((f, f2, np.full(5, np.inf, np.float32), np.zeros(1, np.float32)))
    start = np.array([0, n, 2 * n, 2 * n + 5], dtype=np.int64)
    length = np.array([n, n, 5, 1], dtype=np.int64)
    np.testing.assert_array_equal(_run(fa, start, length, device), _oracle(fa, start, length))


def test_same_line_same_bits_anywhere(device, backend):
    """A line's result depends on its contents only (the ESDF's incremental == cold relies on it)."""
    rng = np.random.default_rng(7)
    seg = (rng.random(40) * 50).astype(np.float32)
    seg[rng.random(40) < 0.5] = np.inf
    other = (rng.random(120) * 50).astype(np.float32)
    a = np.concatenate((seg, other))
    b = np.concatenate((other[:73], seg, other[73:]))
    ga = _run(a, np.array([0, 40]), np.array([40, 120]), device)
    gb = _run(b, np.array([0, 73, 113]), np.array([73, 40, 47]), device)
    np.testing.assert_array_equal(ga[:40], gb[73:113])


def test_outside_lines_and_empty(device, backend):
    f = np.arange(10, dtype=np.float32)
    got = _run(f, np.array([2], dtype=np.int64), np.array([3], dtype=np.int64), device)
    np.testing.assert_array_equal(got, [np.inf, np.inf, 2, 3, 4, np.inf, np.inf, np.inf, np.inf, np.inf])
    e = np.zeros(0, dtype=np.int64)
    assert _run(f, e, e, device).tolist() == [np.inf] * 10
    assert _run(np.zeros(0, np.float32), e, e, device).size == 0


def test_hand_computed():
    f = torch.tensor([np.inf, 0.25, np.inf, np.inf, 4.0, np.inf], dtype=torch.float32)
    got = lower_envelope_torch(f, torch.tensor([0]), torch.tensor([6]))
    assert got.tolist() == [1.25, 0.25, 1.25, 4.25, 4.0, 5.0]


def test_argument_errors():
    f = torch.zeros(4)
    s = torch.tensor([0])
    with pytest.raises(InvalidArgumentType, match="f: expected a float32"):
        lower_envelope(f.double(), s, s)
    with pytest.raises(InvalidArgumentType, match="start"):
        lower_envelope(f, s.float(), s)
    with pytest.raises(InvalidArgument, match="differ"):
        lower_envelope(f, s, torch.tensor([1, 2]))


def test_transform_on_needed_bricks_equals_full(device, monkeypatch):
    """``squared_distances(..., out_bricks=W)`` runs the envelope passes only on ``W`` grown along the
    passes still to come; on ``W`` it must give the full transform's bits wherever the value is within
    the margin, and a value beyond the margin where the full one is beyond it. (CUDA runs the passes on
    the whole domain by default, ``SUBSET_PASSES_CUDA``: both settings there.)"""
    from mapper.integrators import esdf as E
    from mapper.integrators.common import voxel_keys
    from mapper.integrators.esdf import squared_distances

    g = torch.Generator().manual_seed(5)
    side, margin = 7, 6
    r = torch.arange(side)
    bricks = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(-1, 3)
    bricks = bricks[torch.rand(bricks.shape[0], generator=g) < 0.8]  # holes: lines of several runs
    bricks = bricks[torch.argsort(voxel_keys(bricks))]
    vox = torch.unique(torch.randint(0, 4 * side, (120, 3), generator=g), dim=0)
    vox = vox[torch.isin(voxel_keys(vox >> 2), voxel_keys(bricks))]
    t = torch.rand((vox.shape[0], 9), generator=g) - 0.5
    t[torch.rand(t.shape, generator=g) < 0.5] = float("nan")
    w = bricks[torch.rand(bricks.shape[0], generator=g) < 0.1]
    bricks, vox, t, w = (x.to(device) for x in (bricks, vox, t, w))
    full = squared_distances(bricks, vox, t, margin)
    for subsets in (False, True) if bricks.device.type == "cuda" else (False,):
        monkeypatch.setattr(E, "SUBSET_PASSES_CUDA", subsets)
        part = squared_distances(bricks, vox, t, margin, out_bricks=w)
        rows = torch.searchsorted(voxel_keys(bricks), voxel_keys(w))
        a, b = full[rows].cpu(), part[rows].cpu()
        cap = (margin - 0.5) ** 2
        near = a <= cap
        assert near.any() and (~near).any()
        assert torch.equal(a[near], b[near])
        assert (b[~near] > cap).all()


def _oracle_window(f: np.ndarray, start: np.ndarray, length: np.ndarray, w: int) -> np.ndarray:
    g = np.full_like(f, np.inf)
    for s, n in zip(start.tolist(), length.tolist(), strict=True):
        d = np.arange(n)
        diff = d[:, None] - d[None, :]
        d2 = np.where(np.abs(diff) <= w, (diff**2).astype(np.float32), np.inf).astype(np.float32)
        if n:
            g[s : s + n] = (f[s : s + n][None, :] + d2).min(axis=1)
    return g


@pytest.mark.parametrize("window", [0, 1, 3, 7, 60])
def test_window_min_matches_bruteforce(window):
    """The CPU's min-plus form: the exact windowed minimum (NumPy brute force), lines with gaps between
    them and slots outside every line reading inf."""
    from mapper.kernels.envelope import window_min_torch

    rng = np.random.default_rng(window)
    start, length, total = _lines(rng, 50, 40)
    f = (rng.random(total) * 30).astype(np.float32)
    f[rng.random(total) < 0.7] = np.inf
    got = window_min_torch(torch.from_numpy(f), torch.from_numpy(start), torch.from_numpy(length), window)
    np.testing.assert_array_equal(got.numpy(), _oracle_window(f, start, length, window))


@pytest.mark.parametrize("window", [1, 4, 30])
def test_window_min_contiguous_blocks(window, monkeypatch):
    """Lines of one length that tile a block of slots (the ESDF layout; read as a ``[lines, n]`` view), in
    shuffled order, next to lines that do not tile (gathered), all-inf lines (skipped), and blocks split
    into batches: equal to the NumPy brute force."""
    from mapper.kernels import envelope as E

    monkeypatch.setattr(E, "BATCH_SLOTS", 64)  # several batches per length
    rng = np.random.default_rng(window)
    start, length, pos = [], [], 0
    for n, cnt in ((8, 20), (1, 5), (12, 9), (32, 6)):  # tiled blocks
        start += [pos + i * n for i in rng.permutation(cnt)]
        length += [n] * cnt
        pos += n * cnt
    start += [pos, pos + 13]  # two lines of length 10 with a gap of 3: not a block (gathered)
    length += [10, 10]
    total = pos + 23 + 2
    f = (rng.random(total) * 40).astype(np.float32)
    f[rng.random(total) < 0.6] = np.inf
    f[8 * 3 : 8 * 5] = np.inf  # whole lines without a finite value
    st, ln = np.array(start, dtype=np.int64), np.array(length, dtype=np.int64)
    got = E.window_min_torch(torch.from_numpy(f), torch.from_numpy(st), torch.from_numpy(ln), window)
    np.testing.assert_array_equal(got.numpy(), _oracle_window(f, st, ln, window))


@pytest.mark.parametrize("window", [2, 5, 50])
def test_distance_pass_equals_envelope_below_window(window):
    """``distance_pass`` (min-plus or envelope by the work) equals the full envelope bit for bit wherever
    either is below ``(window + 1)^2`` and is ``>= (window + 1)^2`` elsewhere: what the ESDF relies on."""
    from mapper.kernels.envelope import distance_pass, window_min_torch

    rng = np.random.default_rng(11 + window)
    start, length, total = _lines(rng, 40, 90)
    f = (rng.random(total) * 2 * window**2).astype(np.float32)
    f[rng.random(total) < 0.8] = np.inf
    args = (torch.from_numpy(f), torch.from_numpy(start), torch.from_numpy(length))
    full = lower_envelope_torch(*args).numpy()
    for got in (distance_pass(*args, window).numpy(), window_min_torch(*args, window).numpy()):
        cap = np.float32((window + 1) ** 2)
        near = (full < cap) | (got < cap)
        assert near.any() and (~near & np.isfinite(full)).any()
        np.testing.assert_array_equal(got[near], full[near])
        assert (got[~near] >= cap).all()


def test_window_min_argument_errors():
    from mapper.kernels.envelope import window_min_torch

    f, s = torch.zeros(4), torch.tensor([0])
    with pytest.raises(InvalidArgument, match="window"):
        window_min_torch(f, s, torch.tensor([4]), -1)
    with pytest.raises(InvalidArgumentType, match="f: expected a float32"):
        window_min_torch(f.double(), s, s, 2)

"""The LiDAR normal fit's kernels (``mapper.kernels.triton_normals``) against their torch references
(``mapper.kernels.normals.cell_normals_torch`` etc.) and both against a brute-force NumPy oracle (each
return's 27 cells gathered by a dictionary, ``numpy.linalg.eigh`` of their covariance), on scans of planes,
lines, blobs and out-of-range returns. Under ``TRITON_INTERPRET=1`` (CPU) the kernel runs in the
interpreter; on a GPU it is compiled."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mapper.kernels import normals as N


def scene_points(seed: int = 0) -> torch.Tensor:
    """A tilted plane, a second plane meeting it (an edge), a line (one LiDAR ring), a Gaussian blob and two
    returns outside the key range: float64 ``[M, 3]``."""
    g = np.random.default_rng(seed)
    n1 = np.array([0.2, -0.1, 1.0]) / np.linalg.norm([0.2, -0.1, 1.0])
    e1 = np.cross(n1, [1.0, 0, 0])
    e1 /= np.linalg.norm(e1)
    e2 = np.cross(n1, e1)
    uv = g.uniform(-2, 2, (700, 2))
    plane = uv[:, :1] * e1 + uv[:, 1:] * e2 + g.normal(0, 1e-3, (700, 1)) * n1
    wall = np.c_[np.full(300, 1.9), g.uniform(-2, 2, 300), g.uniform(0, 1.5, 300)]
    t = g.uniform(-3, 3, 120)
    line = np.c_[t, 0.8 * t + 0.1, np.full(120, 2.5)]
    blob = g.normal([0.5, -1.0, 3.5], 0.3, (200, 3))
    far = np.array([[3.0e5, 0.0, 0.0], [0.0, -3.0e5, 1.0]])  # beyond the key range: no normal
    return torch.from_numpy(np.concatenate([plane, wall, line, blob, far]))


def oracle_normals(points: np.ndarray, origin: np.ndarray, cell_m: float) -> np.ndarray:
    """Unoriented plane normals per return from its 27 cells (zero: not planar), brute force."""
    cells = np.floor(points / cell_m + N.CELL_OFFSET).astype(np.int64)
    lim = (1 << 18) - 2
    inside = np.all((cells >= -lim + 4) & (cells < lim), axis=1)
    members: dict[tuple, list[int]] = {}
    for i, c in enumerate(map(tuple, cells)):
        members.setdefault(c, []).append(i)
    out = np.zeros_like(points)
    x = points - origin
    for i, c in enumerate(map(tuple, cells)):
        if not inside[i]:
            continue
        idx = [j for d in np.ndindex(3, 3, 3) for j in members.get(tuple(np.add(c, d) - 1), [])]
        idx = [j for j in idx if inside[j]]
        if len(idx) < N.MIN_POINTS:
            continue
        lam, vec = np.linalg.eigh(np.cov(x[idx].T, bias=True))
        if lam[0] <= N.PLANE_RATIO * lam[1] and lam[1] >= N.SPREAD_RATIO * lam[2] and lam[2] > 0:
            out[i] = vec[:, 0]
    return out


def _sorted_keys(points, edges, device):
    """int64 ``[S, N]`` sorted cell keys of ``points`` at each cell edge, and the sorting permutation."""
    p = points.to(device)
    inv_cell = torch.tensor([1.0 / e for e in edges], dtype=torch.float64, device=device)
    return torch.sort(N.cell_keys(p, inv_cell), dim=1)


@pytest.mark.parametrize("edges", [(0.25,), (0.6, 0.3, 1.2)])
def test_triton_cell_normals_match_torch_reference(device, backend, edges):
    if backend != "triton":
        pytest.skip("compares the kernels with the reference")
    from mapper.kernels.triton_normals import cell_normals_triton

    pts = scene_points(1)
    origin = torch.tensor([0.3, -0.2, 2.0], dtype=torch.float64)
    x = (pts - origin).to(device)
    sk, order = _sorted_keys(pts, edges, device)
    ref, ref_inv = N.cell_normals_torch(x, sk, order)
    got, got_inv = cell_normals_triton(x, sk, order)
    s, n = len(edges), pts.shape[0]
    assert got.shape == ref.shape == (s, n, 3) and got.dtype == torch.float64
    assert torch.equal(got_inv, ref_inv)  # each return's cell: the first sorted position of its key
    for k in range(s):  # the cell index is the first position of the key; the returns of a key share it
        assert torch.equal(sk[k][ref_inv[k]], sk[k][torch.argsort(order[k])])  # the return's own key
        first = torch.ones(n, dtype=torch.bool, device=sk.device)
        first[1:] = sk[k][1:] != sk[k][:-1]
        assert torch.equal(torch.sort(ref_inv[k].unique()).values, first.nonzero().squeeze(1))
    has_ref, has_got = (ref != 0).any(2), (got != 0).any(2)
    assert torch.equal(has_ref, has_got)
    assert int(has_ref.sum()) > 20  # planes found
    dots = (ref[has_ref] * got[has_got]).sum(1).abs()
    assert float(dots.min()) > 1 - 1e-9  # the same axis (the sign is oriented later)
    torch.testing.assert_close(got.norm(dim=2)[has_got], torch.ones_like(dots))


def test_scan_normals_match_brute_force_oracle(device, backend):
    pts = scene_points(2)
    origin = torch.tensor([0.3, -0.2, 2.0], dtype=torch.float64)
    cell_m = 0.3
    nrm, sup = N.scan_normals(origin.to(device), pts.to(device), cell_m, scales=(1,))
    nrm, sup = nrm.cpu().numpy(), sup.cpu().numpy()
    ref = oracle_normals(pts.numpy(), origin.numpy(), cell_m)
    has = np.any(ref != 0, axis=1)
    np.testing.assert_array_equal(np.any(nrm != 0, axis=1), has)
    assert has[:700].mean() > 0.8 and not has[-2:].any()  # the plane mostly, never the far returns
    assert not has[1000:1120].any()  # the line: no plane
    np.testing.assert_allclose(np.abs((nrm[has] * ref[has]).sum(1)), 1.0, atol=1e-9)
    # oriented towards the sensor, support = the cell edge where planar
    assert np.all((nrm[has] * (pts.numpy()[has] - origin.numpy())).sum(1) <= 0)
    np.testing.assert_array_equal(sup, np.where(has, cell_m, 0.0))


def test_hand_computed_plane_and_degenerate_cells(device, backend):
    # a 5 x 5 grid of returns on z = 0.1 (inside one cell neighbourhood): normal (0, 0, 1) towards a sensor
    # above; 5 returns (< MIN_POINTS) on z = -4: none; 8 returns on a line: none; an empty scan: empty
    g = torch.arange(5, dtype=torch.float64) * 0.1
    plane = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    plane = torch.cat((plane, torch.full((25, 1), 0.1, dtype=torch.float64)), 1)
    few = torch.tensor([[x, 0.05 * x, -4.0] for x in (0.0, 0.1, 0.2, 0.3, 0.5)], dtype=torch.float64)
    line = torch.stack((torch.arange(8.0) * 0.05 + 5, torch.zeros(8), torch.zeros(8)), 1).double()
    pts = torch.cat((plane, few, line)).to(device)
    origin = torch.tensor([0.2, 0.2, 3.0], dtype=torch.float64, device=device)
    nrm, sup = N.scan_normals(origin, pts, 0.5)
    torch.testing.assert_close(nrm[:25].cpu(), torch.tensor([[0.0, 0.0, 1.0]]).double().expand(25, 3))
    assert not nrm[25:].any() and not sup[25:].any()
    assert torch.equal(sup[:25].cpu(), torch.full((25,), 2.0, dtype=torch.float64))  # planar at x1, x2, x4
    e_n, e_s = N.scan_normals(origin, pts[:0], 0.5)
    assert e_n.shape == (0, 3) and e_s.shape == (0,)


def test_cell_moments_are_the_per_cell_sums(device):
    pts = scene_points(3)[:400].to(device)
    x = pts - pts.mean(0)
    sk, order = _sorted_keys(pts, (0.4,), device)
    rank, inv, mom = N.cell_moments(x, sk[0], order[0])
    assert torch.equal(sk[0][inv], sk[0].gather(0, torch.argsort(order[0])))  # a return's own key
    assert torch.equal(sk[0][inv[order[0]]], sk[0])  # sorted: the first position of the key, at or before
    assert bool((inv[order[0]] <= torch.arange(400, device=device)).all())
    cells = torch.floor(pts / 0.4 + N.CELL_OFFSET).to(torch.int64)
    uniq, inv_ref = torch.unique(cells, dim=0, return_inverse=True)  # independent of the key packing
    assert int(rank[-1]) + 1 == uniq.shape[0]
    # same partition: returns share a cell index iff they share a cell
    assert torch.equal(inv[:, None] == inv[None, :], inv_ref[:, None] == inv_ref[None, :])
    c = mom[inv]
    torch.testing.assert_close(c[:, 0], torch.bincount(inv_ref)[inv_ref].double())
    sx = torch.zeros((uniq.shape[0], 3), dtype=torch.float64, device=device).index_add_(0, inv_ref, x)
    torch.testing.assert_close(c[:, 1:4], sx[inv_ref])
    rows = torch.zeros(400, dtype=torch.bool, device=device)
    rows[inv] = True
    assert not mom[~rows].any()  # only the cell indices (first positions) hold moments
    assert math.isclose(float(c[:, 4].sum()), float((x[:, 0] ** 2 * torch.bincount(inv_ref)[inv_ref]).sum()))


def test_triton_cell_keys_and_combine_match_torch_reference(device, backend):
    if backend != "triton":
        pytest.skip("compares the kernels with the references")
    from mapper.kernels.triton_normals import cell_keys_triton, combine_normals_triton

    pts = scene_points(4).to(device)
    pts = torch.cat((pts, -pts[:50], torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64, device=device)))
    inv_cell = torch.tensor([1 / 0.4, 1 / 0.8, 1 / 1.6], dtype=torch.float64, device=device)
    ref = N.cell_keys_torch(pts, inv_cell)
    got = cell_keys_triton(pts, inv_cell)
    assert got.shape == (3, pts.shape[0]) and torch.equal(got, ref)
    for k, edge in enumerate((0.4, 0.8, 1.6)):  # -1 exactly where a cell coordinate leaves [LO, HI)
        c = torch.floor(pts / edge + N.CELL_OFFSET)
        out = ((c < -(1 << 18) + 2) | (c >= (1 << 18) - 2)).any(1)
        assert torch.equal(ref[k] == -1, out)
    assert int((ref == -1).sum()) == 4  # the far returns at 0.4 and 0.8 m (1.6 m cells reach 3e5 m)
    # keys decode to floor(p / edge + offset) (independent of the packing)
    m = (1 << N.KEY_BITS) - 1
    k0 = ref[0][ref[0] >= 0]
    dec = torch.stack(((k0 >> (2 * N.KEY_BITS)) & m, (k0 >> N.KEY_BITS) & m, k0 & m), 1) - (1 << 20)
    assert torch.equal(dec, torch.floor(pts[ref[0] >= 0] / 0.4 + N.CELL_OFFSET).long())
    # combine: random per-cell normals (a third of the cells none), random cell indices
    g = torch.Generator().manual_seed(5)
    n = pts.shape[0]
    tables = torch.randn((3, n, 3), generator=g, dtype=torch.float64)
    tables *= (torch.rand((3, n, 1), generator=g) > 0.33).double()
    inv = torch.randint(0, n, (3, n), generator=g)
    x = torch.randn((n, 3), generator=g, dtype=torch.float64)
    edges = torch.tensor([0.4, 0.8, 1.6], dtype=torch.float64)
    args = [t.to(device) for t in (x, tables, inv, edges)]
    r_n, r_s = N.combine_normals_torch(*args)
    g_n, g_s = combine_normals_triton(*args)
    assert torch.equal(g_n, r_n) and torch.equal(g_s, r_s)
    # by hand: first planar scale, oriented against x, support = the largest planar edge
    t0, t1, t2 = (tables[k][inv[k]] for k in range(3))
    p0, p1, p2 = ((t != 0).any(1) for t in (t0, t1, t2))
    want = torch.where(p0[:, None], t0, torch.where(p1[:, None], t1, t2))
    want = torch.where(((want * x).sum(1) > 0)[:, None], -want, want)
    torch.testing.assert_close(r_n.cpu(), want, rtol=0, atol=0)
    want_s = torch.zeros(n, dtype=torch.float64)
    for planar, edge in ((p0, 0.4), (p1, 0.8), (p2, 1.6)):  # the largest planar edge wins
        want_s[planar] = edge
    assert torch.equal(r_s.cpu(), want_s)


def test_ray_bands_hand_computed_and_triton_matches_reference(device, backend):
    # hand-computed: range 10 straight down onto the ground (normal up, cos 1), a grazing ray (cos 0.1), a
    # normal facing away (dropped), no normal; tau 0.3, longest 1.2, reach 0.075, min weight 0.2, weight 2
    x = torch.tensor(
        [[0.0, 0.0, -10.0], [0.0, math.sqrt(0.99) * 5, -0.5], [0.0, 0.0, 4.0], [3.0, 4.0, 0.0]],
        dtype=torch.float64,
    )
    nrm = torch.tensor([[0.0, 0, 1], [0, 0, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.float64)
    support = torch.tensor([2.0, 0.5, 2.0, 0.0], dtype=torch.float64)
    prm = N.ray_band_params(device, 0.3, 1.2, 0.075, 0.2, 2.0)
    dirs, r, t0, t1, kept, w = N.ray_bands(x.to(device), nrm.to(device), support.to(device), prm)
    torch.testing.assert_close(r.cpu(), torch.tensor([10.0, 5.0, 4.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(dirs.cpu(), x / r.cpu()[:, None])
    # half bands: cos 1 -> max(min(0.075, 1.2), 0.3) = 0.3; cos 0.1 -> min(0.75, clamp(0.5, 0.3, 1.2)) = 0.5;
    # away and none -> tau
    half = torch.tensor([0.3, 0.5, 0.3, 0.3], dtype=torch.float64)
    torch.testing.assert_close(t0.cpu(), r.cpu() - half)
    torch.testing.assert_close(t1.cpu(), r.cpu() + half)
    assert torch.equal(kept.cpu(), nrm * torch.tensor([[1.0], [1.0], [0.0], [0.0]], dtype=torch.float64))
    torch.testing.assert_close(w.cpu(), torch.tensor([2.0, 0.4, 2.0, 2.0]))
    assert w.dtype == torch.float32 and t0.dtype == torch.float64
    if backend != "triton":
        return
    from mapper.kernels.triton_normals import ray_bands_triton

    g = torch.Generator().manual_seed(7)  # random rays, a third without a normal, half facing either way
    n = 3000
    x = torch.randn((n, 3), generator=g, dtype=torch.float64) * 20
    x[:5] *= 1e-3  # returns near the sensor: t0 clamps at 0
    nrm = torch.nn.functional.normalize(torch.randn((n, 3), generator=g, dtype=torch.float64), dim=1)
    nrm *= (torch.rand((n, 1), generator=g) > 0.33).double()
    support = torch.rand(n, generator=g, dtype=torch.float64) * 2
    args = [t.to(device) for t in (x, nrm, support)] + [prm]
    ref = N.ray_bands_torch(*args)
    got = ray_bands_triton(*args)
    assert torch.equal((ref[4] != 0).any(1), (got[4] != 0).any(1))  # the same normals kept
    assert 0.2 * n < int((ref[4] != 0).any(1).sum()) < 0.5 * n
    assert float(ref[2].min()) == 0.0
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)

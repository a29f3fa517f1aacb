"""LiDAR TSDF at grazing incidence (issue 11): scan normals against analytic geometry, the projected band
walk against a brute-force per-voxel oracle and its Triton kernel against the torch reference, and the
integrated TSDF's zero crossings against an analytic ground (5-30 deg incidence) and a scene of objects."""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from test_segments import dda_cells, random_rays

from mapper import sim
from mapper.integrators import tsdf
from mapper.kernels import normals as N
from mapper.kernels import segments as S
from mapper.layers import BrickLayer
from mapper.surface import zero_crossings

_NO_TIMER = lambda _: nullcontext()  # noqa: E731


# -------------------------------------------------------------------------------------- normals
def test_sym_min_eigvec_against_eigh():
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn((200, 3, 3), generator=g, dtype=torch.float64))
    lam = torch.rand((200, 3), generator=g, dtype=torch.float64).sort(dim=1).values * 5
    lam[:, 1] += 0.5  # lambda_0 separated from lambda_1
    lam[:, 2] += 1.0
    lam[:7, 0] = 0.0  # exactly planar
    c = q @ torch.diag_embed(lam) @ q.transpose(1, 2)
    got_l, got_v = N._sym_min_eigvec(c)
    torch.testing.assert_close(got_l, lam, rtol=0, atol=1e-9)
    ref = q[:, :, 0]  # the eigenvector of lambda_0
    assert (got_v * ref).sum(dim=1).abs().min() > 1 - 1e-9
    torch.testing.assert_close(torch.linalg.vector_norm(got_v, dim=1), torch.ones(200, dtype=torch.float64))


def test_scan_normals_plane_edge_line_and_orientation():
    g = torch.Generator().manual_seed(0)
    origin = torch.tensor([0.3, -0.2, 2.0], dtype=torch.float64)
    # a tilted plane through (0, 0, 0): normal (0.2, -0.1, 1) normalised; random points on 4 x 4 m
    n_true = torch.tensor([0.2, -0.1, 1.0], dtype=torch.float64)
    n_true = n_true / n_true.norm()
    uv = (torch.rand((3000, 2), generator=g, dtype=torch.float64) - 0.5) * 4
    e1 = torch.linalg.cross(n_true, torch.tensor([1.0, 0, 0], dtype=torch.float64))
    e1 = e1 / e1.norm()
    e2 = torch.linalg.cross(n_true, e1)
    plane = uv[:, :1] * e1 + uv[:, 1:] * e2
    nrm, sup = N.scan_normals(origin, plane, 0.25)
    has = (nrm != 0).any(dim=1)
    assert float(has.double().mean()) > 0.99
    assert float(sup.median()) == 1.0 and not sup[~has].any()  # planar up to the largest cells (x4)
    # oriented towards the sensor (above the plane): +n_true, within 0.5 deg
    assert (nrm[has] @ n_true).min() > math.cos(math.radians(0.5))
    # seen from below the plane: flipped
    below = N.scan_normals(-origin, plane, 0.25)[0]
    assert (below[has] @ n_true).max() < -math.cos(math.radians(0.5))
    # a line (one ring of a spinning LiDAR far away): no plane, zero normals at every scale
    t = torch.linspace(0, 3, 400, dtype=torch.float64)
    line = torch.stack((t, 0.5 * t, torch.full_like(t, -1.0)), dim=1)
    assert not N.scan_normals(origin, line, 0.25)[0].any()
    # two perpendicular walls (x = 0 and y = 0, x, y >= 0): a normal, where there is one, is a wall's
    a = torch.rand((2000, 2), generator=g, dtype=torch.float64) * 2
    wall_x = torch.stack((torch.zeros(2000, dtype=torch.float64), a[:, 0], a[:, 1]), dim=1)
    wall_y = torch.stack((a[:, 0], torch.zeros(2000, dtype=torch.float64), a[:, 1]), dim=1)
    pts = torch.cat((wall_x, wall_y))
    nrm, sup = N.scan_normals(torch.tensor([3.0, 3.0, 1.0], dtype=torch.float64), pts, 0.2, scales=(1,))
    has = (nrm != 0).any(dim=1)
    assert 0.5 < float(has.double().mean()) < 1.0  # near the edge: none
    true = torch.cat(
        (torch.tensor([[1.0, 0, 0]]).expand(2000, 3), torch.tensor([[0, 1.0, 0]]).expand(2000, 3))
    )
    assert (nrm[has] * true[has].double()).sum(dim=1).min() > math.cos(math.radians(1.0))
    near_edge = pts[:, :2].max(dim=1).values < 0.15  # distance to the edge x = y = 0
    assert not has[near_edge].any()
    assert torch.equal(sup, has.double() * 0.2)  # one scale: its cell
    assert N.scan_normals(origin, torch.zeros((0, 3), dtype=torch.float64), 0.25)[0].shape == (0, 3)


# ----------------------------------------------------------------------------------- band walk
def _rays_with_normals(device, n=150, seed=5):
    o, d, t0, t1 = random_rays(n, seed, span=3.0)
    g = torch.Generator().manual_seed(seed + 1)
    nrm = torch.randn((n, 3), generator=g, dtype=torch.float64)
    nrm = nrm / nrm.norm(dim=1, keepdim=True)
    nrm = torch.where(((nrm * d).sum(dim=1) > 0)[:, None], -nrm, nrm)  # towards the origin
    nrm[::4] = 0.0  # along-ray rows
    w = (torch.rand(n, generator=g) * 0.9 + 0.1).to(torch.float32)
    rng = (t0 + t1) / 2 + 0.1
    return tuple(x.to(device) for x in (o, d, t0, t1, rng, nrm, w))


def _walk_per_segment(walk, o, d, t0, t1, rng, nrm, w, s, tau):
    """The walk with one accumulator brick per segment: {(ray, i, j, k): (sdf * w, w)}."""
    seg_ray, seg_key, _ = S.brick_segments_torch(o, d, t0, t1, 4 * s)
    ok = seg_key >= 0
    seg_ray, seg_key = seg_ray[ok], seg_key[ok]
    bricks = S.keys_to_bricks(seg_key)
    rank = torch.arange(seg_key.numel(), dtype=torch.int32, device=o.device)
    out = tuple(torch.zeros(seg_key.numel() * 64, dtype=torch.float32, device=o.device) for _ in range(2))
    walk(S.BAND, o, d, t0, t1, rng, seg_ray, rank, bricks, s, out, tau, 0.7, nrm, w)
    nz = out[1].nonzero().squeeze(1)
    seg, off = nz // 64, nz % 64
    vox = bricks[seg] * 4 + torch.stack((off >> 4, (off >> 2) & 3, off & 3), dim=1)
    got = {
        (r, *v): (a, b)
        for r, v, a, b in zip(
            seg_ray[seg].tolist(), vox.tolist(), out[0][nz].tolist(), out[1][nz].tolist(), strict=True
        )
    }
    return got, out


def test_projected_walk_against_bruteforce():
    s, tau = 0.2, 0.5
    o, d, t0, t1, rng, nrm, w = _rays_with_normals("cpu")
    got, _ = _walk_per_segment(S.walk_segments_torch, o, d, t0, t1, rng, nrm, w, s, tau)
    want = {}
    for r, i, j, k in dda_cells(o, d, t0, t1, s):
        c = np.array([(v + 0.5) * s for v in (i, j, k)])
        hit = o[r].numpy() + d[r].numpy() * float(rng[r])
        along = float(rng[r]) - float(np.linalg.norm(c - o[r].numpy()))
        sdf = along
        if nrm[r].any():
            sdf = float((c - hit) @ nrm[r].numpy())  # the distance to the return's tangent plane
            if along < 0 and sdf > 0:  # behind the return, in front of its plane: skipped
                continue
        if sdf >= -tau:
            want[(r, i, j, k)] = (min(sdf, tau) * float(w[r]), float(w[r]))
    assert got.keys() == want.keys()
    assert len(want) > 1000
    for key, (a, b) in want.items():
        assert got[key][1] == pytest.approx(b, rel=1e-6)
        assert got[key][0] == pytest.approx(a, abs=1e-6)


def test_projected_walk_triton_matches_torch(device, backend):
    if backend != "triton":
        pytest.skip("compares the Triton kernel with the reference")
    from mapper.kernels.triton_segments import walk_segments_triton

    s, tau = 0.2, 0.5
    args = _rays_with_normals(device)
    ref, out1 = _walk_per_segment(S.walk_segments_torch, *args, s, tau)
    got, out2 = _walk_per_segment(walk_segments_triton, *args, s, tau)
    for a, b in zip(out1, out2, strict=True):
        assert torch.equal(a, b)  # one writer per entry, the same float64 arithmetic: bit for bit
    assert len(ref) > 1000


# ------------------------------------------------------------------------------------ integration
def _integrate(scene, lidar, poses, cfg, device):
    layer = BrickLayer(tsdf.tsdf_fields(cfg), device)
    sc = scene.to(device)
    for T in poses:
        T = T.to(device)
        pts = lidar.scan(sc, T).double()
        tsdf.integrate_lidar(layer, T[:3, 3], pts @ T[:3, :3].T + T[:3, 3], cfg, _NO_TIMER)
    return layer.voxel_view(["tsdf", "weight"])


def _ground_crossings(g, d, s, z0):
    """Zero crossings of the TSDF along vertical lines (between observed voxel centres, linear): error in
    voxels against the plane z = z0, and crossings per observed (i, j) column."""
    ijk = g.ijk.to(torch.int64).cpu()
    t = d["tsdf"].double().cpu()
    obs = (d["weight"] > 0).cpu()
    up = ijk.clone()
    up[:, 2] += 1
    j = g.ijk_to_index(up.to(g.ijk.device)).cpu()
    ok = obs & (j >= 0)
    ok &= obs[j.clamp(min=0)]
    a, b = t, t[j.clamp(min=0)]
    i = (ok & (((a <= 0) & (b > 0)) | ((a > 0) & (b <= 0)))).nonzero().squeeze(1)
    z = (ijk[i, 2].double() + 0.5) * s + a[i] / (a[i] - b[i]) * s
    columns = torch.unique(ijk[obs][:, :2], dim=0).shape[0]
    return ((z - z0).abs() / s).numpy(), i.numel() / max(columns, 1)


def _ground_case(device, el, z0, s, normal_cell_vox):
    scene = sim.Scene.from_primitives((sim.Plane((0.0, 0.0, z0), (0.0, 0.0, 1.0)),))
    lidar = sim.SpinningLidar(
        n_beams=24, n_azimuth=600, fov_up_deg=-el[0], fov_down_deg=-el[1], max_range_m=40
    )
    poses = []
    for f in range(3):
        T = torch.eye(4, dtype=torch.float64)
        T[:3, 3] = torch.tensor([0.53 * f + 0.013, 0.031, 1.73], dtype=torch.float64)
        poses.append(T)
    cfg = tsdf.TsdfConfig(s, normal_cell_vox=normal_cell_vox)
    return _ground_crossings(*_integrate(scene, lidar, poses, cfg, device), s, z0)


@pytest.mark.parametrize("el", [(5, 10), (10, 20), (20, 30)])
def test_grazing_ground_zero_crossings(el, device):
    """A flat ground seen at 5-30 deg incidence (the beams' elevations): the zero crossings on vertical
    lines lie on the plane (mean error <= 0.2 voxel; the projected distance makes them exact up to fp16),
    and most observed columns have one, wherever the plane lies in its voxels."""
    s = 0.1
    for z0 in (0.0, 0.3 * s, 0.5 * s):
        err, coverage = _ground_case(device, el, z0, s, 4.0)
        assert err.mean() <= 0.2 and err.mean() <= 0.01, (el, z0, err.mean())
        assert np.percentile(err, 99) <= 0.05, (el, z0)
        assert coverage >= 0.7, (el, z0, coverage)


def test_grazing_ground_along_ray_before(device):
    """The previous along-ray distance (``normal_cell_vox=0``) on the same ground, as measured for NOTES:
    crossings up to ~half a voxel off (p95 >= 0.1 voxel) and at 5-10 deg with the plane through voxel
    centres almost no column with a crossing, so the grazing test above fails on it."""
    s = 0.1
    err, coverage = _ground_case(device, (5, 10), 0.5 * s, s, 0.0)
    assert coverage < 0.2, coverage
    err, coverage = _ground_case(device, (5, 10), 0.0, s, 0.0)
    assert np.percentile(err, 95) >= 0.1, np.percentile(err, 95)


# Measured before/after on the scene below (CPU, this test's code; NOTES.md): objects' crossings mean
# 0.0775 -> 0.0742 voxel, p95 0.348 -> 0.337; ground 0.239 -> 0.086 (all crossings 0.224 -> 0.085). The
# bounds: the objects no worse than along the ray (up to 0.005 voxel mean, 0.02 voxel p95: noise).
OBJECTS_MEAN_SLACK = 0.005
OBJECTS_P95_SLACK = 0.02


def test_objects_on_ground_not_worse(device):
    s = 0.1
    objects = (
        sim.Sphere((3.0, 0.5, 1.2), 1.0),
        sim.Box.from_yaw((-2.5, 2.0, 1.0), (0.8, 1.2, 1.0), 0.4),
        sim.Sphere((0.5, -3.5, 0.8), 0.6),
        sim.Box.from_bounds((-1.0, -6.0, 0.0), (1.5, -5.0, 2.0)),
    )
    ground = sim.Plane((0.0, 0.0, 0.0), (0.0, 0.0, 1.0))
    scene = sim.Scene.from_primitives((ground, *objects))
    only_objects = sim.Scene.from_primitives(objects)
    only_ground = sim.Scene.from_primitives((ground,))
    lidar = sim.SpinningLidar(n_beams=32, n_azimuth=720, fov_up_deg=15, fov_down_deg=-30, max_range_m=20)
    poses = []
    for f in range(3):
        T = torch.eye(4, dtype=torch.float64)
        T[:3, 3] = torch.tensor([0.3 * f, -0.2 * f, 1.0], dtype=torch.float64)
        poses.append(T)
    stats = {}
    for name, ncv in (("before", 0.0), ("after", 4.0)):
        g, d = _integrate(scene, lidar, poses, tsdf.TsdfConfig(s, normal_cell_vox=ncv), device)
        p, _ = zero_crossings(g, d["tsdf"], d["weight"], s)
        p = p.cpu()
        err = scene.sdf(p).abs().numpy() / s
        on_obj = (only_objects.sdf(p).abs() < only_ground.sdf(p).abs()).numpy()
        stats[name] = (err[on_obj].mean(), np.percentile(err[on_obj], 95), err[~on_obj].mean(), err.mean())
        assert on_obj.sum() > 1500 and (~on_obj).sum() > 15000
    (bm, bp, bg, ball), (am, ap, ag, aall) = stats["before"], stats["after"]
    assert am <= bm + OBJECTS_MEAN_SLACK, stats
    assert ap <= bp + OBJECTS_P95_SLACK, stats
    assert ag <= 0.5 * bg and aall <= 0.5 * ball, stats  # the ground: much better

"""Planner-grade ESDF (issue 11): its own voxel, observed free space, domain = observed space.

Oracles (no library code in them):
* exactness: brute-force nearest site (``scipy.spatial.cKDTree``) over the integrator's own site points,
  for ESDF voxels 1x, 2x, 2.5x and 4x the TSDF voxel;
* accuracy: analytic signed distances (spheres / boxes written into the TSDF, and the simulated room);
* free space: the rays' segments sampled densely in NumPy (every pixel / beam), the voxels that hold a
  sample are the "crossed" ones;
* incremental == cold through ``Map`` (frames, clears, decays) at a coarse ESDF.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

import mapper
from mapper import sim
from mapper.errors import InvalidArgument
from mapper.integrators.esdf import EsdfIntegrator
from mapper.integrators.tsdf import TsdfConfig, tsdf_fields
from mapper.layers import BrickLayer

FINE = 0.05
_OFF = np.arange(64)
LOCAL = np.stack((_OFF >> 4, (_OFF >> 2) & 3, _OFF & 3), axis=1)


def _keys(ijk: np.ndarray) -> np.ndarray:
    b = ijk.astype(np.int64) + (1 << 20)
    return (b[:, 0] << 42) | (b[:, 1] << 21) | b[:, 2]


def lookup(table: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Row of each query voxel in ``table`` (int [N, 3]), -1 where absent."""
    if len(table) == 0:
        return np.full(len(query), -1)
    k = _keys(table)
    order = np.argsort(k)
    ks = k[order]
    q = _keys(query)
    pos = np.minimum(np.searchsorted(ks, q), len(ks) - 1)
    return np.where(ks[pos] == q, order[pos], -1)


def sdf_two(p):
    """A sphere and a box (union), float64 numpy."""
    s = np.linalg.norm(p - np.array([0.07, -0.11, 0.03]), axis=-1) - 0.62
    q = np.abs(p - np.array([0.95, 0.2, -0.1])) - np.array([0.3, 0.45, 0.25])
    b = np.linalg.norm(np.maximum(q, 0), axis=-1) + np.minimum(q.max(axis=-1), 0)
    return np.minimum(s, b)


def fine_tsdf(device, sdf, lo_m, hi_m, tau, band_only=False, seed=None):
    """A TSDF layer (voxel FINE) holding clamp(sdf, +-tau) at the centres of the bricks over the box."""
    layer = BrickLayer(tsdf_fields(TsdfConfig(FINE)), device)
    lo = np.floor(np.asarray(lo_m) / (4 * FINE)).astype(np.int64)
    hi = np.floor(np.asarray(hi_m) / (4 * FINE)).astype(np.int64)
    axes = [np.arange(lo[a], hi[a] + 1) for a in range(3)]
    bricks = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    centres = ((bricks[:, None, :] * 4 + LOCAL[None]) + 0.5) * FINE
    d = sdf(centres)
    if seed is not None:
        d = d + np.random.default_rng(seed).normal(0, 0.2 * FINE, d.shape)
    w = np.where(np.abs(d) < tau, 1.0, 0.0 if band_only else 1.0)
    b = torch.as_tensor(bricks, device=device)
    slots = layer.allocate(b)
    layer.pool.scatter("tsdf", slots, torch.as_tensor(np.clip(d, -tau, tau), device=device).float())
    layer.pool.scatter("weight", slots, torch.as_tensor(w, device=device).float())
    return layer


def esdf_np(integ):
    g, d = integ.view()
    return g.ijk.cpu().numpy().astype(np.int64), d["esdf"].cpu().numpy(), d["observed"].cpu().numpy()


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("ratio", [1, 2, 2.5, 4])
def test_exact_edt_of_its_own_sites(device, ratio):
    """|esdf| == min(max distance, brute-force distance to the integrator's site points) to 1e-4 m, for
    every stored voxel, at ESDF voxels 1x / 2x / 2.5x / 4x the TSDF's."""
    S = FINE * ratio
    maxd = 0.6
    layer = fine_tsdf(
        device, sdf_two, [-1.0, -1.0, -1.0], [1.4, 1.0, 1.0], tau=3 * FINE, band_only=True, seed=1
    )
    integ = EsdfIntegrator(S, maxd, device, source_voxel_size_m=FINE)
    res = integ.recompute(layer, None)
    ijk, esdf, observed = esdf_np(integ)
    pts, _ = integ.sites(layer, None)
    pts = pts.cpu().numpy()
    assert res["sites"] > 100 and len(ijk) > 500 and len(pts) > 100
    dist, _ = cKDTree(pts).query(ijk + 0.5)
    expect = np.minimum(dist * S, np.float32(maxd))
    err = np.abs(np.abs(esdf) - expect)
    assert err.max() <= 1e-4, err.max()
    # the sites lie on the surface: within the TSDF's noise (0.2 fine voxel) + interpolation of it
    true = sdf_two(pts * S)
    assert np.abs(true).mean() < 0.2 * FINE and np.abs(true).max() < 1.5 * FINE


@pytest.mark.parametrize("ratio", [2, 2.5, 4])
@pytest.mark.parametrize("name", ["sphere_box", "plane"])
def test_coarse_esdf_matches_analytic_surface(device, ratio, name):
    """A coarse ESDF over a fully observed block: mean error <= 0.3 ESDF voxel, p99 <= 1 ESDF voxel, no
    wrong sign farther than a TSDF voxel from the surface; clamped at exactly the max distance."""
    S = FINE * ratio
    maxd = 0.5
    if name == "plane":
        n = np.array([0.3, -0.2, 1.0]) / np.linalg.norm([0.3, -0.2, 1.0])

        def sdf(p):
            return (p - np.array([0.0, 0.0, 0.04])) @ n
    else:
        sdf = sdf_two
    layer = fine_tsdf(device, sdf, [-1.3] * 3, [1.3] * 3, tau=3 * FINE)
    integ = EsdfIntegrator(S, maxd, device, source_voxel_size_m=FINE)
    integ.recompute(layer, None)
    ijk, esdf, observed = esdf_np(integ)
    centres = (ijk + 0.5) * S
    true = sdf(centres)
    inner = np.all(np.abs(centres) < 1.3 - S, axis=1) & observed
    if name == "plane":
        inner &= np.all(np.abs(centres) < 1.3 - maxd - 0.2, axis=1)  # away from the patch's edges
    m = inner & (np.abs(true) < maxd - S)
    assert m.sum() > 50
    err = np.abs(esdf[m] - true[m]) / S
    assert err.mean() <= 0.3, err.mean()
    assert np.percentile(err, 99) <= 1.0, np.percentile(err, 99)
    sure = inner & (np.abs(true) > FINE)
    wrong = np.signbit(esdf[sure]) != (true[sure] < 0)
    assert wrong.mean() <= 1e-4, wrong.mean()
    far = inner & (np.abs(true) > maxd + S)
    if far.any():
        np.testing.assert_array_equal(np.abs(esdf[far]), np.float32(maxd))


def test_argument_errors():
    with pytest.raises(InvalidArgument, match="esdf_voxel_size_m"):
        mapper.Map(0.1, esdf_voxel_size_m=0.05)
    with pytest.raises(InvalidArgument, match="esdf_voxel_size_m"):
        mapper.Map(0.1, esdf_voxel_size_m=-1.0)
    with pytest.raises(InvalidArgument, match="esdf_voxel_size_m"):
        EsdfIntegrator(0.05, 1.0, torch.device("cpu"), source_voxel_size_m=0.1)
    assert mapper.Map(0.02).esdf_voxel_size_m == 0.05  # the default: max(voxel, 5 cm)
    assert mapper.Map(0.1).esdf_voxel_size_m == 0.1
    m = mapper.Map(0.02, esdf_voxel_size_m=0.07)
    assert m.config()["esdf_voxel_size_m"] == 0.07 and mapper.Map(**m.config()).esdf_voxel_size_m == 0.07


# ------------------------------------------------------------------------------------- free space
def _cam():
    return sim.PinholeCamera(width=96, height=72, fx=80.0, fy=80.0, cx=47.5, cy=35.5)


def _crossed(origins, dirs, ends, S, step_frac=0.125):
    """Voxels (int [N, 3]) holding a sample of the segments ``origin + t dir``, ``t in [0, end]``."""
    out = []
    for o, d, e in zip(origins, dirs, ends, strict=True):
        if len(e) == 0:
            continue
        n = int(np.ceil(e.max() / (S * step_frac))) + 1
        t = np.linspace(0, 1, n)[None, :] * e[:, None]
        p = o[None, None, :] + t[..., None] * d[:, None, :]
        out.append(np.unique(_keys(np.floor(p.reshape(-1, 3) / S).astype(np.int64))))
    k = np.unique(np.concatenate(out))
    return np.stack(
        ((k >> 42) - (1 << 20), ((k >> 21) & ((1 << 21) - 1)) - (1 << 20), (k & ((1 << 21) - 1)) - (1 << 20)),
        1,
    )


def _depth_rays(depth, K, T):
    h, w = depth.shape
    v, u = np.nonzero(depth > 0)
    x = (u - K[0, 2]) / K[0, 0]
    y = (v - K[1, 2]) / K[1, 1]
    ray = np.stack((x, y, np.ones_like(x)), 1)
    n = np.linalg.norm(ray, axis=1)
    return T[:3, 3], (ray / n[:, None]) @ T[:3, :3].T, depth[v, u] * n


def _observed_np(m: mapper.Map, ijk: np.ndarray) -> np.ndarray:
    """Observed flag of ESDF voxels as the queries see them: the ESDF layer's, else the free record's."""
    g, d = m.layer("esdf")
    e_ijk = g.ijk.cpu().numpy()
    row = lookup(e_ijk, ijk)
    obs = np.where(row >= 0, d["observed"].cpu().numpy()[np.maximum(row, 0)], False)
    fg, fd = m._free.voxel_view(["log_odds"])
    frow = lookup(fg.ijk.cpu().numpy(), ijk)
    known = np.where(frow >= 0, ~np.isnan(fd["log_odds"].float().cpu().numpy()[np.maximum(frow, 0)]), False)
    return obs | ((row < 0) & known)


@pytest.mark.parametrize("sensor", ["depth", "lidar"])
def test_free_space_known_without_occupancy(sensor):
    """A ("tsdf", "esdf") map knows >= 95 % of the free voxels its rays crossed (true distance to the
    surface > truncation); no voxel away from every ray is observed; known free space beyond the max
    distance reads the max distance, observed."""
    scene = sim.indoor_scene(0)
    S, maxd, tau = 0.1, 0.4, 3 * FINE
    m = mapper.Map(FINE, layers=("tsdf", "esdf"), device="cpu", esdf_voxel_size_m=S, esdf_max_distance_m=maxd)
    origins, dirs, free_ends, all_ends = [], [], [], []
    if sensor == "depth":
        cam = _cam()
        K = cam.K.numpy()
        for T in sim.orbit_trajectory(2, scene=scene):
            depth = cam.render_depth(scene, T, 8.0)
            m.integrate_depth(depth, K, T)
            o, d, r = _depth_rays(depth.numpy(), K, T.numpy())
            origins.append(o), dirs.append(d), free_ends.append(r - tau), all_ends.append(r + tau)
    else:
        lidar = sim.SpinningLidar(
            n_beams=16, n_azimuth=360, fov_up_deg=15.0, fov_down_deg=-15.0, max_range_m=8.0
        )
        for x in (-0.8, 0.6):
            T = torch.eye(4, dtype=torch.float64)
            T[:3, 3] = torch.tensor([x, 0.3, 1.3], dtype=torch.float64)
            pts = lidar.scan(scene, T)
            m.integrate_lidar(pts, T)
            p = pts.double().numpy()
            r = np.linalg.norm(p, axis=1)
            origins.append(T[:3, 3].numpy()), dirs.append(p / r[:, None]), free_ends.append(r - tau)
            all_ends.append(r + tau)
    m.update_esdf()
    crossed = _crossed(origins, dirs, free_ends, S)
    true = scene.sdf(torch.as_tensor((crossed + 0.5) * S)).numpy()
    free = crossed[true > tau]
    assert len(free) > 2000
    known = _observed_np(m, free)
    assert known.mean() >= 0.95, known.mean()
    # nothing observed that no ray came near: every observed voxel is within a voxel diagonal (plus a TSDF
    # voxel for the trilinear sign samples) of a sample of a ray's observed segment [0, range + tau]
    g, d = m.layer("esdf")
    obs_ijk = g.ijk.cpu().numpy()[d["observed"].cpu().numpy()]
    fg, fd = m._free.voxel_view(["log_odds"])
    obs_ijk = np.concatenate((obs_ijk, fg.ijk.cpu().numpy()[~np.isnan(fd["log_odds"].float().cpu().numpy())]))
    seen = _crossed(origins, dirs, all_ends, S / 2, step_frac=0.25)
    dist, _ = cKDTree((seen + 0.5) * S / 2).query((obs_ijk + 0.5) * S)
    assert dist.max() <= S * math.sqrt(3) / 2 + FINE * math.sqrt(3) + S * math.sqrt(3) / 4, dist.max()
    # known free space far from every surface: the max distance, observed (not NaN)
    far = free[(true[true > tau] > maxd + 2 * S) & known]
    corners = np.stack(np.meshgrid(*([0, 1],) * 3, indexing="ij"), -1).reshape(-1, 3)
    inner = np.all([_observed_np(m, far + c) for c in corners], axis=0)  # the 8 trilinear corners known
    far = far[inner]
    assert len(far) > 100
    dq, _, oq = m.query_distance(torch.as_tensor((far + 0.75) * S))  # between the centres of far and far + 1
    assert bool(oq.all())
    np.testing.assert_allclose(dq.numpy(), maxd, rtol=1e-6)


def test_accuracy_in_simulated_room():
    """Depth frames of the simulated room at TSDF 5 cm, ESDF 10 cm: against the analytic distance over
    observed voxels whose nearest surface point was observed: mean <= 0.3 ESDF voxel, p99 <= 1 ESDF voxel,
    wrong sign <= 0.01 % (voxels more than a TSDF voxel from the surface; the TSDF's own sign behind thin
    objects, whose far side no frame saw, is not the ESDF's to fix)."""
    scene = sim.indoor_scene(1)
    S, maxd = 0.1, 0.5
    m = mapper.Map(FINE, layers=("tsdf", "esdf"), device="cpu", esdf_voxel_size_m=S, esdf_max_distance_m=maxd)
    cam = _cam()
    for T in sim.orbit_trajectory(4, scene=scene, seed=1):
        m.integrate_depth(cam.render_depth(scene, T, 8.0), cam.K, T)
    m.update_esdf()
    g, d = m.layer("esdf")
    ijk = g.ijk.cpu().numpy()
    esdf, obs = d["esdf"].cpu().numpy(), d["observed"].cpu().numpy()
    c = torch.as_tensor((ijk + 0.5) * S)
    true = scene.sdf(c).numpy()
    eps = 1e-4
    grad = np.stack(
        [
            (
                scene.sdf(c + eps * torch.eye(3, dtype=torch.float64)[a])
                - scene.sdf(c - eps * torch.eye(3, dtype=torch.float64)[a])
            ).numpy()
            / (2 * eps)
            for a in range(3)
        ],
        1,
    )
    foot = (ijk + 0.5) * S - true[:, None] * grad  # nearest surface point (where the field is smooth)
    # the nearest surface point was observed: the TSDF there is observed and has its zero level there (not
    # e.g. the underside of the table top, which no frame saw and the TSDF's occluded band covers)
    t_foot, w_foot = m.query_tsdf(torch.as_tensor(foot))
    seen = (w_foot.numpy() > 0) & (np.abs(t_foot.numpy()) < 0.5 * FINE)
    sel = obs & seen & (np.abs(true) < maxd - S) & (np.linalg.norm(grad, axis=1) > 0.99)
    assert sel.sum() > 1000
    err = np.abs(esdf[sel] - true[sel]) / S
    assert err.mean() <= 0.3, err.mean()
    assert np.percentile(err, 99) <= 1.0, np.percentile(err, 99)
    sure = obs & seen & (np.abs(true) > FINE) & (np.abs(true) < maxd)
    wrong = np.signbit(esdf[sure]) != (true[sure] < 0)
    assert wrong.mean() <= 1e-4, (wrong.mean(), wrong.sum(), sure.sum())


# ----------------------------------------------------------------------------- incremental == cold
def _assert_equals_cold(m: mapper.Map):
    e = m._esdf
    cold = EsdfIntegrator(
        e.voxel_size_m, e.max_distance_m, e.device, source_voxel_size_m=e.source_voxel_size_m
    )
    cold.recompute(m._tsdf, m._occ, m._free)
    ga, da = e.view()
    gb, db = cold.view()
    assert torch.equal(ga.leaves.keys, gb.leaves.keys) and torch.equal(ga.leaves.masks, gb.leaves.masks)
    assert torch.equal(da["esdf"].view(torch.int32), db["esdf"].view(torch.int32))
    assert torch.equal(da["observed"], db["observed"])


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_equals_cold_random_sequence(seed):
    """Random sequences of depth and LiDAR frames, box clears and decays at an ESDF 2.5x the TSDF voxel:
    after each update the layer equals a cold recompute bit for bit."""
    rng = np.random.default_rng(seed)
    scene = sim.indoor_scene(seed)
    m = mapper.Map(
        FINE, layers=("tsdf", "esdf"), device="cpu", esdf_voxel_size_m=2.5 * FINE, esdf_max_distance_m=0.3
    )
    cam = _cam()
    lidar = sim.SpinningLidar(n_beams=8, n_azimuth=180, fov_up_deg=10.0, fov_down_deg=-30.0, max_range_m=6.0)
    poses = sim.orbit_trajectory(6, scene=scene, seed=seed)
    for step in range(5):
        kind = rng.integers(4) if step else 0
        if kind <= 1:
            T = poses[rng.integers(len(poses))]
            m.integrate_depth(cam.render_depth(scene, T, 8.0), cam.K, T)
        elif kind == 2:
            T = torch.eye(4, dtype=torch.float64)
            T[:3, 3] = torch.as_tensor(rng.uniform([-1, -1, 0.8], [1, 1, 1.6]))
            m.integrate_lidar(lidar.scan(scene, T), T)
        elif rng.random() < 0.5:
            c = rng.uniform(-1.5, 1.5, 3)
            m.clear(c - 0.5, c + 0.5)
        else:
            m.decay(factor=0.5, threshold=0.6)
        m.update_esdf()
        _assert_equals_cold(m)


# ------------------------------------------------------------------------------------- snapshots
def test_snapshot_round_trip_and_old_snapshot():
    """The ESDF voxel and the free record survive state_dict; a snapshot without them (written before
    this change) still loads (the ESDF voxel takes its default, free space is known again after frames)."""
    scene = sim.indoor_scene(0)
    m = mapper.Map(
        FINE, layers=("tsdf", "esdf"), device="cpu", esdf_voxel_size_m=0.1, esdf_max_distance_m=0.4
    )
    cam = _cam()
    T = sim.orbit_trajectory(1, scene=scene)[0]
    m.integrate_depth(cam.render_depth(scene, T, 8.0), cam.K, T)
    m.update_esdf()
    tensors, meta = m.state_dict()
    assert "free.bricks" in tensors and meta["config"]["esdf_voxel_size_m"] == 0.1
    m2 = mapper.Map.from_state_dict(tensors, meta, device="cpu")
    m2.update_esdf()
    _assert_equals_cold(m2)
    a, b = m.layer("esdf"), m2.layer("esdf")
    assert torch.equal(a[1]["esdf"], b[1]["esdf"]) and torch.equal(a[1]["observed"], b[1]["observed"])
    old_t = {k: v for k, v in tensors.items() if not k.startswith("free.")}
    old_meta = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "esdf_voxel_size_m"}}
    m3 = mapper.Map.from_state_dict(old_t, old_meta, device="cpu")
    assert m3.esdf_voxel_size_m == 0.05 and m3._free.num_bricks == 0
    m3.update_esdf()
    _assert_equals_cold(m3)
    # free space at (0, 0, 1) +- 0.2 m: known with the free record; without it only next to observed
    # voxels (a query interpolates the observed corners there, issue 30), so it knows fewer points
    g = torch.linspace(-0.2, 0.2, 5, dtype=torch.float64)
    p = torch.stack(torch.meshgrid(g, g, g + 1.0, indexing="ij"), -1).reshape(-1, 3)
    assert torch.isfinite(m.query_distance(p)[0]).all()
    assert int(m3.query_distance(p)[2].sum()) < p.shape[0]

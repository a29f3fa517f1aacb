"""Tests of mapper.sim against independent math: hand-computed intersections, brute-force distances to
densely sampled surfaces, sphere tracing of the SDF, analytic LiDAR ranges over a ground plane, open3d's
BVH ray caster on triangle meshes, and the real Replica office0 depth renderings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from mapper.sim import (
    Box,
    Cylinder,
    PinholeCamera,
    Plane,
    Scene,
    Sphere,
    SpinningLidar,
    depth_sequence,
    driving_trajectory,
    indoor_scene,
    lidar_sequence,
    look_at,
    orbit_trajectory,
    outdoor_scene,
)

F64 = torch.float64


def t64(x):
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def one(prim) -> Scene:
    return Scene.from_primitives([prim])


def cast(scene, o, d, max_range=math.inf) -> np.ndarray:
    return scene.raycast(t64(o), t64(d), max_range).cpu().numpy()


def rot(yaw, pitch, roll) -> np.ndarray:
    """Rz(yaw) Ry(pitch) Rx(roll), written out independently of mapper.sim."""
    cz, sz = math.cos(yaw), math.sin(yaw)
    cy, sy = math.cos(pitch), math.sin(pitch)
    cx, sx = math.cos(roll), math.sin(roll)
    Rz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    Ry = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    Rx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    return Rz @ Ry @ Rx


def sphere_trace(scene: Scene, o, d, max_range, iters=600, tol=1e-9):
    """Oracle for the first hit that uses only ``scene.sdf``: with an exact SDF outside the solids, marching
    by the SDF never skips a surface. Returns (t, decided): t = inf where the march passed max_range;
    ``decided`` is False for rays that neither converged nor left (grazing rays converge slowly)."""
    o, d = t64(o), t64(d)
    d = d / d.norm(dim=1, keepdim=True)
    o = o.expand_as(d)
    t = torch.zeros(d.shape[0], dtype=F64)
    state = torch.zeros(d.shape[0], dtype=torch.int8)  # 0 marching, 1 hit, 2 miss
    for _ in range(iters):
        act = torch.nonzero(state == 0).squeeze(1)
        if act.numel() == 0:
            break
        s = scene.sdf(o[act] + t[act, None] * d[act])
        t[act] += s.clamp_min(0)
        state[act[s < tol]] = 1
        state[act[(s >= tol) & (t[act] > max_range)]] = 2
    t[state == 2] = math.inf
    return t.numpy(), (state > 0).numpy()


# ------------------------------------------------------------------------------------------------------
# ray casting: hand-computed cases


def test_raycast_plane_hand_computed():
    s = one(Plane((0, 0, 1.5), (0, 0, 1)))  # ground at z = 1.5
    o = [[1, 2, 5], [1, 2, 5], [1, 2, 5], [1, 2, 5], [0, 0, 1]]
    d = [[0, 0, -1], [1, 0, -1], [0, 0, 1], [1, 0, 0], [0, 0, 1]]
    t = cast(s, o, d)
    np.testing.assert_allclose(t[:2], [3.5, 3.5 * math.sqrt(2)], rtol=1e-14)
    assert np.isinf(t[2]) and np.isinf(t[3])  # pointing away, parallel
    assert t[4] == pytest.approx(0.5)  # origin inside the half-space: where it leaves it
    assert np.isinf(cast(s, o[:1], d[:1], max_range=3.4)).all()


def test_raycast_sphere_hand_computed():
    c, r = np.array([3.0, -2.0, 1.0]), 0.75
    s = one(Sphere(c, r))
    rng = np.random.default_rng(0)
    dirs = rng.normal(size=(50, 3))
    np.testing.assert_allclose(cast(s, c, dirs), r, rtol=1e-14)  # from the centre: the radius
    o = c + [10.0, 0, 0]
    np.testing.assert_allclose(cast(s, [o, o], [[-1, 0, 0], [-1, 0, 0.0]]), 10 - r, rtol=1e-14)
    assert np.isinf(cast(s, [o], [[1, 0, 0]])).all()  # pointing away
    # tangent-plane offsets: a ray at height y from the centre line enters at 10 - sqrt(r^2 - y^2)
    y = np.array([0.0, 0.3, 0.7, 0.749, 0.76])
    t = cast(s, c + np.stack([np.full(5, 10.0), y, 0 * y], 1), np.tile([-1.0, 0, 0], (5, 1)))
    np.testing.assert_allclose(t[:4], 10 - np.sqrt(r * r - y[:4] ** 2), rtol=1e-12)
    assert np.isinf(t[4])
    # far away: no cancellation in the discriminant
    far = c + [0.0, 1000.0, 0.0]
    assert cast(s, [far], [[0, -1, 0]])[0] == pytest.approx(1000 - r, abs=1e-10)


def test_raycast_box_hand_computed():
    s = one(Box.from_bounds((0, 0, 0), (1, 2, 3)))
    t = cast(
        s,
        [[-2, 0.5, 0.5], [0.5, 5, 0.5], [0.5, 0.5, -1], [0.5, 0.5, 1.0], [-2, 2.5, 0.5]],
        [[1, 0, 0], [0, -1, 0], [0, 0, 1], [0, 0, 1], [1, 0, 0]],
    )
    np.testing.assert_allclose(t[:4], [2, 3, 1, 2], rtol=1e-14)
    assert np.isinf(t[4])
    # rotated 45 degrees about z: a ray along x meets the vertical edge at x = -sqrt(2)
    sr = one(Box.from_yaw((0, 0, 0), (1, 1, 1), math.pi / 4))
    assert cast(sr, [[-5, 0, 0]], [[1, 0, 0]])[0] == pytest.approx(5 - math.sqrt(2), abs=1e-12)
    # and along the face normal (cos 45, sin 45): the face at distance 1
    n = np.array([math.cos(math.pi / 4), math.sin(math.pi / 4), 0])
    assert cast(sr, [-4 * n], [n])[0] == pytest.approx(3.0, abs=1e-12)
    # arbitrary rotation: along the box's own axis from outside
    R = rot(0.3, -0.4, 1.1)
    sb = one(Box((1, 2, 3), (0.5, 0.25, 2.0), R))
    for a, h in enumerate((0.5, 0.25, 2.0)):
        o = np.array([1, 2, 3]) + 7 * R[:, a]
        assert cast(sb, [o], [-R[:, a]])[0] == pytest.approx(7 - h, abs=1e-12)


def test_raycast_cylinder_hand_computed():
    s = one(Cylinder((1.0, 2.0), 0.0, 2.0, 0.5))
    o = [[6, 2, 1], [1.2, 2, 5], [1.2, 2, 5], [6, 2, 2.5], [1.0, 2.0, -3], [6, 2.3, 1], [1.2, 2, 1]]
    d = [[-1, 0, 0], [0, 0, -1], [0, 1e-9, -1], [-1, 0, 0], [0, 0, 1], [-1, 0, 0], [0, 0, 1]]
    t = cast(s, o, d)
    np.testing.assert_allclose(t[:3], [4.5, 3.0, 3.0], rtol=1e-9)  # side; top cap by vertical rays
    assert np.isinf(t[3])  # passes above the top cap
    assert t[4] == pytest.approx(3.0, abs=1e-9)  # bottom cap, vertical ray on the axis
    assert t[5] == pytest.approx(5 - math.sqrt(0.25 - 0.09), abs=1e-12)
    assert t[6] == pytest.approx(1.0, abs=1e-9)  # inside: exits through the top cap
    # diagonal through the rim: from (1 + 0.5 + 1, 2, 3) towards the rim point (1.5, 2, 2)
    o2 = np.array([2.5, 2.0, 3.0])
    assert cast(s, [o2], [[-1, 0, -1]])[0] == pytest.approx(math.sqrt(2), abs=1e-12)


def test_raycast_validation_errors():
    s = one(Sphere((0, 0, 0), 1))
    with pytest.raises(ValueError, match=r"dirs_world: expected shape \[N, 3\]"):
        s.raycast(torch.zeros(3), torch.ones(4, 2))
    with pytest.raises(ValueError, match="zero-length"):
        s.raycast(torch.zeros(3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="origins_world: expected"):
        s.raycast(torch.zeros(3, 3), torch.ones(4, 3))
    with pytest.raises(ValueError, match="NaN or inf"):
        s.raycast(torch.zeros(3), torch.tensor([[1.0, float("nan"), 0]]))
    with pytest.raises(ValueError, match="max_range_m"):
        s.raycast(torch.zeros(3), torch.ones(1, 3), -1.0)
    with pytest.raises(TypeError, match="floating-point"):
        s.raycast(torch.zeros(3, dtype=torch.int64), torch.ones(1, 3))
    with pytest.raises(ValueError, match="radius_m"):
        Sphere((0, 0, 0), 0.0)
    with pytest.raises(ValueError, match="not a rotation"):
        Box((0, 0, 0), (1, 1, 1), np.diag([1.0, 1.0, -1.0]))
    with pytest.raises(ValueError, match="z_max_m"):
        Cylinder((0, 0), 1.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="at least one"):
        Scene.from_primitives([])


# ------------------------------------------------------------------------------------------------------
# ray casting: random scenes against sphere tracing


def random_scene(seed: int, n: int = 24) -> Scene:
    rng = np.random.default_rng(seed)
    prims = [Plane((0, 0, -3.0), (0, 0, 1))]
    for i in range(n):
        c = rng.uniform(-6, 6, size=3)
        kind = i % 3
        if kind == 0:
            prims.append(Sphere(c, rng.uniform(0.2, 1.0)))
        elif kind == 1:
            prims.append(Box(c, rng.uniform(0.1, 1.0, size=3), rot(*rng.uniform(-np.pi, np.pi, size=3))))
        else:
            prims.append(Cylinder(c[:2], c[2] - rng.uniform(0.2, 1.5), c[2] + rng.uniform(0.2, 1.5), 0.5))
    return Scene.from_primitives(prims)


@pytest.mark.parametrize("seed", [0, 1])
def test_raycast_matches_sphere_tracing_random_scene(seed):
    scene = random_scene(seed)
    rng = np.random.default_rng(100 + seed)
    o = rng.uniform(-9, 9, size=(4000, 3))
    o = o[scene.sdf(t64(o)).numpy() > 0.05][:1500]
    d = rng.normal(size=o.shape)
    t = cast(scene, o, d, max_range=25.0)
    t_ref, decided = sphere_trace(scene, o, d, 25.0)
    assert decided.mean() > 0.97
    np.testing.assert_array_equal(np.isinf(t[decided]), np.isinf(t_ref[decided]))
    both = decided & np.isfinite(t_ref)
    assert both.sum() > 300
    np.testing.assert_allclose(t[both], t_ref[both], atol=1e-6)
    # hits lie on the surface
    hit = np.isfinite(t)
    dn = d / np.linalg.norm(d, axis=1, keepdims=True)
    p = o[hit] + t[hit, None] * dn[hit]
    assert scene.sdf(t64(p)).abs().max() < 1e-9
    # float32 origins give float32 distances, consistent with the float64 ones
    t32 = scene.raycast(torch.as_tensor(o, dtype=torch.float32), torch.as_tensor(d), 25.0)
    assert t32.dtype == torch.float32
    same = np.isfinite(t) & np.isfinite(t32.numpy())
    assert (np.isfinite(t) != np.isfinite(t32.numpy())).mean() < 1e-3
    np.testing.assert_allclose(t32.numpy()[same], t[same], atol=1e-4)


def test_raycast_coherent_lidar_rays_match_sphere_tracing():
    """Coherent bundles exercise the range and cone culling: compare a whole scan with the oracle."""
    scene = outdoor_scene(3, extent_m=200)
    T = driving_trajectory(60, scene=scene, seed=3)[50].numpy()
    lidar = SpinningLidar(n_beams=32, n_azimuth=512)
    d = lidar.rays_sensor(dtype=F64).numpy() @ T[:3, :3].T
    t = cast(scene, T[:3, 3], d, lidar.max_range_m)
    sub = np.random.default_rng(0).choice(len(d), 700, replace=False)
    t_ref, decided = sphere_trace(scene, T[:3, 3], d[sub], lidar.max_range_m, iters=300)
    assert decided.mean() > 0.8
    ok = decided
    np.testing.assert_array_equal(np.isinf(t[sub][ok]), np.isinf(t_ref[ok]))
    fin = ok & np.isfinite(t_ref)
    np.testing.assert_allclose(t[sub][fin], t_ref[fin], atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# SDF exactness against brute force over dense surface samples


def box_surface(h, step):
    pts = []
    for a in range(3):
        b, c = [i for i in range(3) if i != a]
        u = np.arange(-h[b], h[b] + step / 2, step)
        v = np.arange(-h[c], h[c] + step / 2, step)
        U, V = np.meshgrid(np.append(u, h[b]), np.append(v, h[c]), indexing="ij")
        for sgn in (-1, 1):
            p = np.zeros((U.size, 3))
            p[:, a], p[:, b], p[:, c] = sgn * h[a], U.ravel(), V.ravel()
            pts.append(p)
    return np.concatenate(pts)


def cylinder_surface(r, z0, z1, step):
    n_th = int(np.ceil(2 * np.pi * r / step))
    th = np.linspace(0, 2 * np.pi, n_th, endpoint=False)
    z = np.append(np.arange(z0, z1, step), z1)
    TH, Z = np.meshgrid(th, z, indexing="ij")
    side = np.stack([r * np.cos(TH.ravel()), r * np.sin(TH.ravel()), Z.ravel()], 1)
    g = np.arange(-r, r + step / 2, step)
    X, Y = np.meshgrid(g, g, indexing="ij")
    m = X**2 + Y**2 <= r * r
    disc = np.stack([X[m], Y[m]], 1)
    caps = [np.concatenate([disc, np.full((len(disc), 1), z)], 1) for z in (z0, z1)]
    return np.concatenate([side, *caps])


def sphere_surface(r, n):
    g = np.random.default_rng(1).normal(size=(n, 3))
    return r * g / np.linalg.norm(g, axis=1, keepdims=True)


STEP = 0.004


@pytest.mark.parametrize(
    "name",
    ["sphere", "box", "rotated_box", "cylinder"],
)
def test_sdf_matches_brute_force(name):
    rng = np.random.default_rng(7)
    c = np.array([0.3, -0.2, 0.5])
    if name == "sphere":
        prim, surf_local, R = Sphere(c, 0.6), sphere_surface(0.6, 600_000), np.eye(3)
        inside = lambda q: np.linalg.norm(q, axis=1) < 0.6  # noqa: E731
    elif name in ("box", "rotated_box"):
        h = np.array([0.5, 0.3, 0.8])
        R = rot(0.4, 0.7, -0.2) if name == "rotated_box" else np.eye(3)
        prim, surf_local = Box(c, h, R if name == "rotated_box" else None), box_surface(h, STEP)
        inside = lambda q: (np.abs(q) < h).all(1)  # noqa: E731
    else:
        R = np.eye(3)
        prim = Cylinder(c[:2], c[2] - 0.5, c[2] + 0.4, 0.45)
        surf_local = cylinder_surface(0.45, -0.5, 0.4, STEP)
        inside = lambda q: (np.hypot(q[:, 0], q[:, 1]) < 0.45) & (q[:, 2] > -0.5) & (q[:, 2] < 0.4)  # noqa: E731
    surf = surf_local @ R.T + c
    q = c + rng.uniform(-1.3, 1.3, size=(3000, 3))
    # extra queries near edges and corners, where the exact SDF is not a plane distance
    q = np.concatenate([q, surf[rng.choice(len(surf), 1000)] + rng.normal(scale=0.05, size=(1000, 3))])
    sd = one(prim).sdf(t64(q)).numpy()
    dist, _ = cKDTree(surf).query(q)
    is_in = inside((q - c) @ R)
    assert is_in.sum() > 200 and (~is_in).sum() > 200
    np.testing.assert_array_equal(sd < 0, is_in)
    # samples are at most STEP apart: the brute force overestimates by less than STEP / sqrt(2) (grids) or
    # ~1.5 mm (600k random points on the sphere), and never underestimates
    tol = 0.0025 if name == "sphere" else STEP / math.sqrt(2) + 1e-9
    assert (dist - np.abs(sd)).min() > -1e-9
    assert (dist - np.abs(sd)).max() < tol


def test_sdf_union_exact_outside_and_plane():
    a, b = Sphere((0, 0, 1.0), 0.5), Box((1.5, 0, 1.0), (0.3, 0.4, 0.5), rot(0.5, 0, 0))
    scene = Scene.from_primitives([a, b, Plane((0, 0, 0), (0, 0, 1))])
    rng = np.random.default_rng(3)
    q = rng.uniform([-1, -1, 0.0], [3, 1, 2.5], size=(3000, 3))
    sd = scene.sdf(t64(q)).numpy()
    out = sd > 0
    surf = np.concatenate(
        [
            sphere_surface(0.5, 300_000) + [0, 0, 1.0],
            box_surface(np.array([0.3, 0.4, 0.5]), STEP) @ rot(0.5, 0, 0).T + [1.5, 0, 1.0],
        ]
    )
    dist = np.minimum(cKDTree(surf).query(q[out])[0], q[out, 2])  # the ground: distance = z
    assert (dist - sd[out]).min() > -1e-9 and (dist - sd[out]).max() < 0.003
    # float32 input -> float32 output, close to float64
    sd32 = scene.sdf(torch.as_tensor(q, dtype=torch.float32))
    assert sd32.dtype == torch.float32
    np.testing.assert_allclose(sd32.numpy(), sd, atol=1e-5)


def test_normals_are_outward_unit_vectors():
    scene = one(Box.from_bounds((0, 0, 0), (1, 1, 1)))
    n = scene.normals(t64([[0.5, 0.5, 1.0], [0.0, 0.3, 0.4], [0.5, 1.2, 0.5]])).numpy()
    np.testing.assert_allclose(n, [[0, 0, 1], [-1, 0, 0], [0, 1, 0]], atol=1e-6)
    ns = one(Sphere((1, 2, 3), 2.0)).normals(t64([[1, 2, 5.0], [3, 2, 3]])).numpy()
    np.testing.assert_allclose(ns, [[0, 0, 1], [1, 0, 0]], atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# camera


def test_camera_presets_and_rays():
    cam = PinholeCamera.replica()
    np.testing.assert_array_equal(cam.K.numpy(), [[600, 0, 599.5], [0, 600, 339.5], [0, 0, 1]])
    assert (cam.width, cam.height) == (1200, 680) and cam.K.dtype == F64
    k = PinholeCamera.kinect()
    np.testing.assert_array_equal(k.K.numpy(), [[570.3422, 0, 320], [0, 570.3422, 240], [0, 0, 1]])
    assert (k.width, k.height) == (640, 480)
    small = PinholeCamera(4, 3, 2.0, 3.0, 1.5, 1.0)
    r = small.rays_sensor(dtype=F64).numpy()
    assert r.shape == (12, 3)
    np.testing.assert_allclose(np.linalg.norm(r, axis=1), 1, rtol=1e-15)
    # pixel (u=3, v=0) at index v * W + u: ray ~ ((3 - 1.5) / 2, (0 - 1) / 3, 1)
    ref = np.array([0.75, -1 / 3, 1.0])
    np.testing.assert_allclose(r[3], ref / np.linalg.norm(ref), rtol=1e-14)
    with pytest.raises(ValueError, match="fx"):
        PinholeCamera(4, 3, -1.0, 1.0, 0, 0)


def test_camera_replica_preset_matches_dataset(shared_data):
    import json

    p = shared_data / "replica_office0" / "cam_params.json"
    if not p.exists():
        pytest.skip("replica_office0 not in shared data")
    c = json.loads(p.read_text())["camera"]
    cam = PinholeCamera.replica()
    assert (cam.width, cam.height, cam.fx, cam.fy, cam.cx, cam.cy) == (
        c["w"],
        c["h"],
        c["fx"],
        c["fy"],
        c["cx"],
        c["cy"],
    )


@pytest.mark.parametrize("pose", [0, 1])
def test_depth_of_fronto_parallel_plane(pose):
    cam = PinholeCamera(64, 48, 50.0, 55.0, 31.5, 24.0)
    eye = np.array([1.0, -2.0, 1.5]) if pose else np.zeros(3)
    target = eye + (np.array([0.3, 0.9, -0.4]) if pose else np.array([1.0, 0, 0]))
    T = look_at(eye, target)
    z_axis = T[:3, 2].numpy()
    for dist in (0.7, 3.0):
        scene = one(Plane(eye + dist * z_axis, -z_axis))
        depth = cam.render_depth(scene, T, max_range_m=10.0)
        assert depth.shape == (48, 64) and depth.dtype == torch.float32
        np.testing.assert_allclose(depth.numpy(), dist, rtol=1e-6)
    assert (cam.render_depth(scene, T, max_range_m=2.0) == 0).all()  # beyond range: no return


def test_depth_backprojects_onto_surface():
    scene = indoor_scene(1)
    cam = PinholeCamera.kinect()
    T = orbit_trajectory(5, scene=scene, seed=1)[2].numpy()
    depth = cam.render_depth(scene, T, 8.0).numpy().astype(np.float64)
    assert (depth > 0).mean() > 0.99 and depth.max() < 8.0  # a closed room: everything returns
    v, u = np.nonzero(depth > 0)
    z = depth[v, u]
    p_cam = np.stack([(u - cam.cx) / cam.fx * z, (v - cam.cy) / cam.fy * z, z], 1)
    p_world = p_cam @ T[:3, :3].T + T[:3, 3]
    sd = scene.sdf(t64(p_world)).numpy()
    assert np.abs(sd).max() < 1e-4
    # the points are visible: the segment from the camera to 99% of each point is in free space
    mid = T[:3, 3] + 0.99 * (p_world[::97] - T[:3, 3])
    assert scene.sdf(t64(mid)).min() > 0


def test_render_depth_rejects_bad_pose():
    scene, cam = indoor_scene(0), PinholeCamera(8, 6, 5.0, 5.0, 3.5, 2.5)
    T = np.eye(4)
    T[:3, :3] *= 2.0
    with pytest.raises(ValueError, match="not a rotation"):
        cam.render_depth(scene, T)
    with pytest.raises(ValueError, match=r"shape \[4, 4\]"):
        cam.render_depth(scene, np.eye(3))
    T = np.eye(4)
    T[3, 0] = 1
    with pytest.raises(ValueError, match="last row"):
        cam.render_depth(scene, T)


# ------------------------------------------------------------------------------------------------------
# LiDAR


def test_lidar_over_ground_plane_matches_analytic_ranges():
    h = 1.73
    lidar = SpinningLidar(n_beams=16, n_azimuth=90, fov_up_deg=2.0, fov_down_deg=-24.8, max_range_m=30.0)
    scene = one(Plane((0, 0, 0), (0, 0, 1)))
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = rot(0.7, 0, 0), [5.0, -3.0, h]  # level sensor, yawed
    pts, miss = lidar.scan(scene, T, return_misses=True)
    pts, miss = pts.numpy().astype(np.float64), miss.numpy()
    el_cfg = np.radians(np.linspace(2.0, -24.8, 16))
    # elevations of returns and misses are the configured ones
    el_all = np.concatenate(
        [np.arctan2(pts[:, 2], np.hypot(pts[:, 0], pts[:, 1])), np.arcsin(np.clip(miss[:, 2], -1, 1))]
    )
    assert np.abs(el_all[:, None] - el_cfg[None]).min(1).max() < 1e-6
    assert el_all.min() == pytest.approx(el_cfg[-1], abs=1e-6) and el_all.max() == pytest.approx(
        el_cfg[0], abs=1e-6
    )
    # a downward beam at elevation e returns at range h / sin(-e) if that is within max range
    expect = h / np.sin(-el_cfg[el_cfg < 0])
    n_expected = (expect <= 30.0).sum() * 90
    assert len(pts) == n_expected and len(pts) + len(miss) == lidar.n_rays
    r = np.linalg.norm(pts, axis=1)
    e = np.arctan2(pts[:, 2], np.hypot(pts[:, 0], pts[:, 1]))
    np.testing.assert_allclose(r, h / np.sin(-e), rtol=1e-5)
    assert r.max() <= 30.0
    # in the world, the points lie on the ground
    pw = pts @ T[:3, :3].T + T[:3, 3]
    assert np.abs(pw[:, 2]).max() < 1e-5


def test_lidar_street_scan():
    scene = outdoor_scene(0)
    lidar = SpinningLidar()
    assert lidar.n_rays == 120_000
    T = driving_trajectory(200, scene=scene)[150]
    pts, miss = lidar.scan(scene, T, return_misses=True)
    assert pts.dtype == torch.float32 and pts.shape[1] == 3
    assert len(pts) + len(miss) == lidar.n_rays
    assert 0.8 * lidar.n_rays < len(pts) < lidar.n_rays  # up-looking beams miss over the road
    r = torch.linalg.vector_norm(pts.double(), dim=1)
    assert float(r.max()) <= 60.0 and float(r.min()) > 1.0
    pw = pts.double() @ T[:3, :3].T + T[:3, 3]
    assert float(scene.sdf(pw).abs().max()) < 1e-4
    # every miss really has nothing within range (checked on a sample, by sphere tracing)
    sub = miss[:: max(1, len(miss) // 300)].double() @ T[:3, :3].T
    t_ref, decided = sphere_trace(scene, T[:3, 3].numpy(), sub.numpy(), 60.0, iters=300)
    assert decided.mean() > 0.9 and np.isinf(t_ref[decided]).all()


def test_lidar_noise_and_dropout():
    scene = one(Plane((0, 0, 0), (0, 0, 1)))
    T = np.eye(4)
    T[2, 3] = 2.0
    clean = SpinningLidar(n_beams=8, n_azimuth=1000, fov_up_deg=-10, fov_down_deg=-30)
    noisy = SpinningLidar(n_beams=8, n_azimuth=1000, fov_up_deg=-10, fov_down_deg=-30, range_noise_std_m=0.02)
    p0 = clean.scan(scene, T).double()
    p1 = noisy.scan(scene, T).double()
    assert p0.shape == p1.shape  # all within range
    dr = (p1.norm(dim=1) - p0.norm(dim=1)).numpy()
    assert abs(dr.std() - 0.02) < 0.002 and abs(dr.mean()) < 0.002
    # noise moves points along their rays
    np.testing.assert_allclose(
        (p1 / p1.norm(dim=1, keepdim=True)).numpy(), (p0 / p0.norm(dim=1, keepdim=True)).numpy(), atol=1e-6
    )
    assert torch.equal(noisy.scan(scene, T), noisy.scan(scene, T))  # seeded
    g = torch.Generator().manual_seed(5)
    a, b = noisy.scan(scene, T, generator=g), noisy.scan(scene, T, generator=g)
    assert not torch.equal(a, b)  # a generator advances across frames
    drop = SpinningLidar(n_beams=8, n_azimuth=1000, fov_up_deg=-10, fov_down_deg=-30, dropout_prob=0.25)
    pts, miss = drop.scan(scene, T, return_misses=True)
    assert abs(len(miss) / drop.n_rays - 0.25) < 0.02
    with pytest.raises(ValueError, match="dropout_prob"):
        SpinningLidar(dropout_prob=1.0)
    with pytest.raises(ValueError, match="fov"):
        SpinningLidar(fov_up_deg=-30, fov_down_deg=2)


# ------------------------------------------------------------------------------------------------------
# scenes and trajectories


def assert_rotations(T: np.ndarray):
    R = T[:, :3, :3]
    np.testing.assert_allclose(
        np.einsum("nji,njk->nik", R, R), np.broadcast_to(np.eye(3), R.shape), atol=1e-12
    )
    np.testing.assert_allclose(np.linalg.det(R), 1.0, atol=1e-12)
    np.testing.assert_array_equal(T[:, 3], np.broadcast_to([0, 0, 0, 1.0], (len(T), 4)))


def test_outdoor_scene_is_deterministic_and_street_like():
    a, b, c = outdoor_scene(4), outdoor_scene(4), outdoor_scene(5)
    assert a.primitives == b.primitives and a.primitives != c.primitives
    assert 150 <= len(a) <= 300
    kinds = {type(p) for p in a.primitives}
    assert kinds == {Plane, Box, Cylinder, Sphere}
    assert a.sdf(t64([[10.0, 0, -0.5]])).item() == pytest.approx(-0.5)  # ground half-space


@pytest.mark.parametrize("seed", [0, 1])
def test_driving_trajectory(seed):
    scene = outdoor_scene(seed)
    T = driving_trajectory(600, scene=scene, speed_mps=10.0, hz=10.0, seed=seed)
    assert T.shape == (600, 4, 4) and T.dtype == F64
    Tn = T.numpy()
    assert_rotations(Tn)
    p = Tn[:, :3, 3]
    step = np.linalg.norm(np.diff(p, axis=0), axis=1)
    np.testing.assert_allclose(step, 1.0, rtol=2e-3)
    assert np.ptp(p[:, 0]) > 550  # a 600 m drive
    np.testing.assert_allclose(p[:, 2], 1.73)
    # sensor x axis points along the motion, z stays near up, curves are gentle
    fwd = np.diff(p, axis=0) / step[:, None]
    assert (np.einsum("ni,ni->n", Tn[:-1, :3, 0], fwd) > 0.999).all()
    assert (Tn[:, 2, 2] > 0.999).all()
    yaw = np.unwrap(np.arctan2(Tn[:, 1, 0], Tn[:, 0, 0]))
    assert np.abs(np.diff(yaw)).max() < 0.02 and np.ptp(yaw) > 0.02  # curves, but gently
    # free space along the path and around the vehicle (a 4.5 x 2 x 1.7 m body below the sensor)
    fine = p[:-1, None] + np.linspace(0, 1, 5)[None, :, None] * np.diff(p, axis=0)[:, None]
    assert scene.sdf(t64(fine.reshape(-1, 3))).min() > 1.0
    offs = np.array([[x, y, z] for x in (-2.5, 0, 2.0) for y in (-1.0, 1.0) for z in (-1.6, -0.5)])
    body = (Tn[:, None, :3, :3] @ offs[None, :, :, None])[..., 0] + p[:, None]
    assert scene.sdf(t64(body.reshape(-1, 3))).min() > 0.05
    assert torch.equal(T, driving_trajectory(600, scene=scene, seed=seed))
    with pytest.raises(ValueError, match="does not fit the road"):
        driving_trajectory(5000, scene=scene)
    with pytest.raises(ValueError, match="Road"):
        driving_trajectory(10, scene=indoor_scene(0))


def test_orbit_trajectory_looks_into_the_room():
    scene = indoor_scene(2)
    T = orbit_trajectory(40, scene=scene, seed=2)
    Tn = T.numpy()
    assert_rotations(Tn)
    eye = Tn[:, :3, 3]
    assert scene.sdf(t64(eye)).min() > 0.3
    target = np.asarray(scene.layout.look_at_m)
    fwd = (target - eye) / np.linalg.norm(target - eye, axis=1, keepdims=True)
    np.testing.assert_allclose(Tn[:, :3, 2], fwd, atol=1e-12)  # OpenCV z forward
    assert (Tn[:, 2, 1] < 0).all()  # OpenCV y points down in the world
    assert np.abs(Tn[:, 2, 0]).max() < 1e-12  # no roll: x stays horizontal
    lo, hi = np.asarray(scene.layout.min_m), np.asarray(scene.layout.max_m)
    assert ((eye > lo + 0.5) & (eye < hi - 0.5)).all()
    with pytest.raises(ValueError, match="Room"):
        orbit_trajectory(4, scene=outdoor_scene(0, extent_m=100))


def test_look_at_builds_opencv_axes():
    T = look_at((0, 0, 1), (5, 0, 1)).numpy()  # looking along +x, z up
    np.testing.assert_allclose(T[:3, :3], [[0, 0, 1], [-1, 0, 0], [0, -1, 0]], atol=1e-15)
    with pytest.raises(ValueError, match="parallel"):
        look_at((0, 0, 0), (0, 0, 5))


# ------------------------------------------------------------------------------------------------------
# sequences, devices


def test_sequences(device):
    lidar = SpinningLidar(n_beams=16, n_azimuth=256, range_noise_std_m=0.01)
    frames = list(lidar_sequence(3, device, seed=1, lidar=lidar, extent_m=100))
    assert len(frames) == 3
    for pts, T in frames:
        assert pts.device.type == device.type and pts.dtype == torch.float32 and pts.shape[1] == 3
        assert T.shape == (4, 4) and T.dtype == F64 and T.device.type == device.type
    assert not torch.equal(frames[0][0][:100], frames[1][0][:100])
    cam = PinholeCamera(32, 24, 20.0, 20.0, 15.5, 11.5)
    for depth, K, T in depth_sequence(2, cam, device, seed=1):
        assert depth.shape == (24, 32) and depth.dtype == torch.float32 and depth.device.type == device.type
        assert K.dtype == F64 and torch.equal(K.cpu(), cam.K) and T.dtype == F64
        assert (depth > 0).all()


def test_scene_on_device_matches_cpu(device):
    scene = outdoor_scene(1, extent_m=150)
    T = driving_trajectory(30, scene=scene, seed=1)[20]
    lidar = SpinningLidar(n_beams=32, n_azimuth=512)
    ref = lidar.scan(scene, T)
    got = lidar.scan(scene.to(device), T.to(device)).cpu()
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    q = torch.rand(1000, 3, dtype=F64) * 50
    torch.testing.assert_close(scene.to(device).sdf(q.to(device)).cpu(), scene.sdf(q), atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------------
# open3d oracles (skipped where open3d is missing)


def test_box_raycast_and_distance_match_open3d():
    from sim_o3d import MeshScene, import_open3d

    o3d = import_open3d()
    size = np.array([1.2, 0.7, 0.9])
    R = rot(0.5, 0.2, -0.3)
    center = np.array([0.4, -0.3, 1.0])
    mesh = o3d.geometry.TriangleMesh.create_box(*size)  # [0, size]
    mesh.translate(-size / 2)
    mesh.rotate(R, center=(0, 0, 0))
    mesh.translate(center)
    ms = MeshScene.from_legacy(mesh)
    scene = one(Box(center, size / 2, R))
    cam = PinholeCamera(80, 60, 60.0, 60.0, 39.5, 29.5)
    T = look_at((3.0, 2.0, 2.5), center)
    ours = cam.render_depth(scene, T, 10.0).numpy()
    ref = ms.render_depth(cam, T.numpy(), 10.0)
    assert (ref > 0).mean() > 0.05
    # silhouettes agree except on pixels whose ray grazes an edge in float32
    assert ((ours > 0) != (ref > 0)).mean() < 0.003
    both = (ours > 0) & (ref > 0)
    assert np.abs(ours - ref)[both].max() < 1e-4
    q = np.random.default_rng(0).uniform(-2, 2, size=(2000, 3)) + center
    sd = scene.sdf(t64(q)).numpy()
    np.testing.assert_allclose(np.abs(sd), ms.unsigned_distance(q), atol=2e-5)


def test_replica_mesh_depth_matches_recorded_frame(shared_data):
    from sim_o3d import MeshScene, import_open3d, read_depth_png, read_replica

    import_open3d()
    root = shared_data / "replica_office0"
    if not (root / "office0_mesh.ply").exists():
        pytest.skip("replica_office0 mesh not in shared data")
    cam, scale, poses = read_replica(root)
    assert cam == PinholeCamera.replica()
    ms = MeshScene.from_ply(root / "office0_mesh.ply")
    ours = ms.render_depth(cam, poses[0], 20.0)
    real = read_depth_png(root / "depth000000.png", scale)
    assert ours.shape == real.shape == (680, 1200)
    valid = (ours > 0) & (real > 0)
    assert valid.mean() > 0.99
    err = np.abs(ours - real)[valid]
    med, p99 = float(np.median(err)), float(np.percentile(err, 99))
    # measured with open3d 0.20: median 1.4 mm, p99 5.8 mm
    assert med < 0.005 and p99 < 0.02, f"median {med * 1e3:.2f} mm, p99 {p99 * 1e3:.2f} mm"
    # The NICE-SLAM renderer puts pixel centres at (u + 0.5, v + 0.5) for the stated (cx, cy): with the
    # principal point moved by -0.5 px the residual drops to the 16-bit quantisation (0.15 mm step).
    shifted = PinholeCamera(cam.width, cam.height, cam.fx, cam.fy, cam.cx - 0.5, cam.cy - 0.5)
    ours2 = ms.render_depth(shifted, poses[0], 20.0)
    valid2 = (ours2 > 0) & (real > 0)
    med2 = float(np.median(np.abs(ours2 - real)[valid2]))
    assert med2 < 0.5e-3 and med2 < med / 3, f"median {med2 * 1e3:.2f} mm with the half-pixel shift"
    # back-projected depth lies on the mesh (our K / T conventions agree with the mesh's frame)
    v, u = np.nonzero(valid)
    z = real[v, u][::50].astype(np.float64)
    u, v = u[::50], v[::50]
    T = poses[0]
    p = np.stack([(u - cam.cx + 0.5) / cam.fx * z, (v - cam.cy + 0.5) / cam.fy * z, z], 1) @ T[:3, :3].T
    dist = ms.unsigned_distance(p + T[:3, 3])
    assert np.median(dist) < 1e-3

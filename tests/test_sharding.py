"""Sharded maps without Ray: the tile -> shard routing against a pure-Python oracle and brute force, the
frame routing and the gathers (queries, mesh, lattices), and K shards fed through the routing equal to one
unsharded map (TSDF voxels and values, ESDF, query answers, mesh faces) — mapper.sharding,
mapper.cluster.shards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_service_helpers import scan

from mapper import Map, sharding, wire
from mapper.cluster import shards
from mapper.errors import InvalidArgument, InvalidArgumentType

M32 = 0xFFFFFFFF


def mix_oracle(bx: int, by: int) -> int:
    """The block hash written out on Python ints (no torch)."""
    h = (bx * 0x9E3779B1 + by * 0x85EBCA77) & M32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & M32
    h ^= h >> 12
    h = (h * 0x297A2D39) & M32
    return h ^ (h >> 15)


def owner_oracle(x: float, y: float, voxel: float, count: int, block_tiles: int) -> int:
    bx = math.floor(x / voxel) // (32 * block_tiles)
    by = math.floor(y / voxel) // (32 * block_tiles)
    return mix_oracle(bx, by) % count


def test_owner_of_points_matches_the_oracle():
    rng = np.random.default_rng(1)
    pts = rng.uniform(-500, 500, (2000, 3))
    pts[:10] = [[0, 0, 0], [-1e-9, 0, 0], [3.2, 3.2, 0], [3.19999, -0.0, 1], [-3.2, -3.2, 5]] * 2
    for voxel, count, tiles in ((0.1, 2, 1), (0.05, 3, 4), (0.25, 5, 2)):
        got = sharding.owner_of_points(pts, voxel, count, tiles).tolist()
        want = [owner_oracle(x, y, voxel, count, tiles) for x, y, _ in pts]
        assert got == want
        assert set(got) == set(range(count))  # every shard owns something over 1 km
    # bricks: the owner of a brick is the owner of its voxels' centres
    bricks = torch.from_numpy(rng.integers(-3000, 3000, (500, 3)))
    centres = (bricks.double() * 4 + 2) * 0.1
    assert torch.equal(sharding.owner_of_bricks(bricks, 3, 2), sharding.owner_of_points(centres, 0.1, 3, 2))


def test_shards_touching_and_keeps_against_brute_force():
    rng = np.random.default_rng(2)
    voxel, count, tiles = 0.1, 3, 1  # blocks of 3.2 m
    for _ in range(40):
        lo = rng.uniform(-20, 20, 2)
        hi = lo + rng.uniform(0, 8, 2)
        xs = np.linspace(lo[0], hi[0], 60)
        ys = np.linspace(lo[1], hi[1], 60)
        g = np.stack(np.meshgrid(xs, ys, indexing="ij"), -1).reshape(-1, 2)
        brute = {owner_oracle(x, y, voxel, count, tiles) for x, y in g}
        assert sharding.shards_touching(lo, hi, voxel, count, tiles) == sorted(brute)
    spec = sharding.ShardSpec(1, count, tiles, halo_m=1.3)
    p = torch.from_numpy(rng.uniform(-15, 15, (300, 2)))
    got = spec.keeps(p, voxel)
    d = np.linspace(-1.3, 1.3, 41)  # 6.5 cm steps: no 3.2 m block is missed
    for (x, y), k in zip(p.tolist(), got.tolist(), strict=True):
        want = any(owner_oracle(x + a, y + b, voxel, count, tiles) == 1 for a in d for b in d)
        assert k == want, (x, y)
    assert 0 < int(got.sum()) < 300


def test_shard_spec_and_create_request_errors():
    with pytest.raises(InvalidArgument, match="index 3 is not in 0..count-1"):
        sharding.ShardSpec.from_dict({"index": 3, "count": 3, "block_tiles": 1, "halo_m": 1.0})
    with pytest.raises(InvalidArgument, match="unknown keys"):
        sharding.ShardSpec.from_dict({"index": 0, "count": 1, "block_tiles": 1, "halo_m": 1, "x": 1})
    with pytest.raises(InvalidArgument, match="halo_m is required"):
        sharding.ShardSpec.from_dict({"index": 0, "count": 1, "block_tiles": 1})
    with pytest.raises(InvalidArgumentType, match="count must be an int"):
        sharding.ShardSpec.from_dict({"index": 0, "count": True, "block_tiles": 1, "halo_m": 1})
    with pytest.raises(InvalidArgument, match="block_tiles must be >= 1"):
        Map(voxel_size_m=0.1, device="cpu", shard={"index": 0, "count": 2, "block_tiles": 0, "halo_m": 1})
    for k, msg in ((0, ">= 1, got 0"), (4, "4 shards need 4 map workers; this cluster has 3"), ("2", "'2'")):
        with pytest.raises(InvalidArgument, match=msg):
            shards.check_shards({"shards": k}, 3)
    with pytest.raises(InvalidArgument, match="keep_radius_m"):
        shards.check_shards({"shards": 2, "keep_radius_m": 5.0}, 3)
    assert shards.check_shards({"shards": 2}, 2) == 2 and shards.check_shards({}, 2) is None


def test_gather_rows_and_cells_by_hand():
    parts = [
        (np.array([1, 3]), {"distance": np.array([1.0, 3.0]), "map_version": 4, "x": "a"}),
        (np.array([0, 2]), {"distance": np.array([0.5, 2.0]), "map_version": 5, "x": "b"}),
    ]
    out = shards.gather_rows(parts, 4)
    assert out["distance"].tolist() == [0.5, 1.0, 2.0, 3.0]
    assert out["map_version"] == 9 and out["x"] == "a"
    owner = np.array([[0, 1], [1, 0]])
    cells = shards.gather_cells(
        {
            0: {"distance": np.zeros((2, 2)), "map_version": 1},
            1: {"distance": np.ones((2, 2)), "map_version": 2},
        },
        owner,
        ("distance",),
    )
    assert cells["distance"].tolist() == [[0, 1], [1, 0]] and cells["map_version"] == 3
    c = shards.lattice_centres((1.0, 2.0), 0.5, (2, 3))
    assert c.shape == (2, 3, 2) and c[1, 2].tolist() == [1.75, 3.25]


CFG = dict(voxel_size_m=0.25, layers=["tsdf", "esdf"], esdf_max_distance_m=1.0)


def frames(n: int, y0: float = 0.0):
    out = []
    for i in range(n):
        pts, T = scan(i, n=900, seed=3)
        T = T.copy()
        T[0, 3] = 4.0 * i  # drive 4 m per frame: the map spans several blocks
        T[1, 3] = y0 - 1.0 * i
        out.append(wire.LidarFrame(pts, T))
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_shards_fed_through_the_routing_equal_one_map(k):
    """K shard maps, each fed only the frames ``frame_shards`` sends it, answer like one map at every point
    they own: TSDF voxels (set and values), TSDF / ESDF queries, and the gathered mesh has the same faces."""
    fr = frames(5)
    full = Map(**CFG, device="cpu")
    cfg = full.config()
    halo = sharding.halo_for(cfg)
    spec = lambda i: sharding.ShardSpec(i, k, 1, halo, "m", "m").to_dict()  # noqa: E731  8 m blocks
    parts = [Map(**{**cfg, "shard": spec(i)}, device="cpu") for i in range(k)]
    sent = [0] * k
    for f in fr:
        full.integrate_lidar(f.points, f.T_world_sensor)
        targets = shards.frame_shards(f, parts[0].config())
        assert targets, "every frame reaches a shard"
        for i in targets:
            parts[i].integrate_lidar(f.points, f.T_world_sensor)
            sent[i] += 1
    assert Map(**parts[1].config(), device="cpu").shard == parts[1].shard  # config round trip
    g, d = full.layer("tsdf")
    own = sharding.owner_of_points((g.ijk.double() + 0.5) * 0.25, 0.25, k, 1)
    assert all(int((own == i).sum()) > 100 for i in range(k)), "each shard owns part of the map"
    for i, m in enumerate(parts):
        mine = own == i
        gi, di = m.layer("tsdf")
        ref = {
            tuple(v): (t, w)
            for v, t, w in zip(
                g.ijk[mine].tolist(), d["tsdf"][mine].tolist(), d["weight"][mine].tolist(), strict=True
            )
        }
        keep = sharding.owner_of_points((gi.ijk.double() + 0.5) * 0.25, 0.25, k, 1) == i
        got = {
            tuple(v): (t, w)
            for v, t, w in zip(
                gi.ijk[keep].tolist(), di["tsdf"][keep].tolist(), di["weight"][keep].tolist(), strict=True
            )
        }
        assert got == ref  # the same voxels, bit-equal values and weights
        assert m.bricks["tsdf"] <= full.bricks["tsdf"]
    assert min(m.bricks["tsdf"] for m in parts) < full.bricks["tsdf"]  # bricks far outside a shard: freed
    # queries routed per point, gathered in order
    rng = np.random.default_rng(5)
    lo, hi = (g.ijk.min(0).values.double() * 0.25).numpy(), (g.ijk.max(0).values.double() * 0.25).numpy()
    pts = rng.uniform(lo, hi, (4000, 3)).astype(np.float32)
    owner = sharding.owner_of_points(pts, 0.25, k, 1).numpy()
    for kind in ("tsdf", "distance"):
        fn = "query_tsdf" if kind == "tsdf" else "query_distance"
        ref = getattr(full, fn)(torch.from_numpy(pts))
        got = shards.gather_rows(
            [
                (
                    np.nonzero(owner == i)[0],
                    {
                        str(j): a.numpy()
                        for j, a in enumerate(getattr(parts[i], fn)(torch.from_numpy(pts[owner == i])))
                    },
                )
                for i in range(k)
            ],
            len(pts),
        )
        for j, a in enumerate(ref):
            np.testing.assert_array_equal(got[str(j)], a.numpy())
    mesh = shards.gather_mesh({i: parts[i].mesh() for i in range(k)}, k, 1)
    ref = full.mesh()

    def faces(m):
        return sorted(map(tuple, torch.sort(m.vertex_keys[m.faces.long()], dim=1).values.tolist()))

    assert ref.num_faces > 100 and faces(mesh) == faces(ref)
    assert torch.equal(mesh.blocks, ref.blocks) and torch.equal(
        mesh.block_face_offsets, ref.block_face_offsets
    )
    i = torch.searchsorted(ref.vertex_keys, mesh.vertex_keys)
    torch.testing.assert_close(mesh.vertices, ref.vertices[i], rtol=0, atol=0)


def test_group_shards_rebuilds_sharded_routes_from_worker_lists():
    """After an ingress restart the routes come from the workers' map lists: shards grouped by their map
    id in index order; a map with a shard missing is not served; ordinary maps are left out."""

    def shard(i, k, mid):
        spec = sharding.ShardSpec(i, k, 2, 1.5, mid, f"name-{mid}").to_dict()
        return {"id": f"x{mid}{i}", "name": f"{mid}.s{i}", "config": {**CFG, "shard": spec}, "created": "t"}

    found = {
        "plain": (0, {"id": "plain", "name": "plain", "config": dict(CFG)}),
        "xa1": (2, shard(1, 2, "a")),
        "xa0": (1, shard(0, 2, "a")),
        "xb0": (0, shard(0, 3, "b")),  # b's shards 1 and 2 are not answering
        "xb2": (1, shard(2, 3, "b")),
    }
    maps, seen = shards.group_shards(found)
    assert set(maps) == {"a"} and seen == {"xa0", "xa1", "xb0", "xb2"}
    a = maps["a"]
    assert a.ids == ["xa0", "xa1"] and a.workers == [1, 2] and a.name == "name-a" and a.count == 2
    s = shards.summary(a, [{"frames_integrated": 3, "version": 4, "memory_bytes": 10}, {"version": 1}])
    assert s["config"]["shards"] == 2 and "shard" not in s["config"] and s["memory_bytes"] == 10
    assert s["frames_integrated"] == 3 and s["version"] == 5 and [p["worker"] for p in s["shards"]] == [1, 2]


def test_a_shard_recovers_from_its_wal_as_it_was(tmp_path):
    """A shard is an ordinary map of a worker's service (created as ``MapWorker.create_map`` does): frames
    posted through the API, then the map rebuilt from its directory alone (what a worker restarted after
    kill -9 does: WAL replay with the prune) has the same TSDF voxels and values as the live shard."""
    from test_service_helpers import client

    from mapper.api.service import recover_map
    from mapper.persistence import DataDir

    with client(tmp_path) as c:
        svc = c.app.state.service
        cfg = Map(**CFG, device="cpu", warmup=False).config()
        spec = sharding.ShardSpec(0, 2, 1, sharding.halo_for(cfg), "m", "m").to_dict()
        entry = c.portal.call(svc.create, "m.s0", {**cfg, "shard": spec}, None)
        for f in frames(4):
            body = wire.packb(wire.lidar_message(f.points, f.T_world_sensor))
            r = c.post(f"/v1/maps/{entry.id}/frames", content=body, headers={"content-type": wire.MSGPACK})
            assert r.status_code == 200, r.text
        live = entry.map
        rebuilt, info, _, last, replayed = recover_map(DataDir(tmp_path / "data").map_dir(entry.id), "cpu")
        assert info["config"]["shard"] == spec and replayed == last == 4
        g1, d1 = live.layer("tsdf")
        g2, d2 = rebuilt.layer("tsdf")
        assert torch.equal(g1.ijk, g2.ijk) and g1.ijk.shape[0] > 0
        assert torch.equal(d1["tsdf"], d2["tsdf"]) and torch.equal(d1["weight"], d2["weight"])
        full = Map(**CFG, device="cpu")
        for f in frames(4):
            full.integrate_lidar(f.points, f.T_world_sensor)
        assert live.bricks["tsdf"] < full.bricks["tsdf"]  # the prune ran, live and in the replay


def test_mapper_serve_without_ray_refuses_shards(tmp_path):
    from test_service_helpers import client

    with client(tmp_path) as c:
        r = c.post("/v1/maps", json={"voxel_size_m": 0.25, "shards": 2})
        assert r.status_code == 422 and "mapper serve --ray" in r.json()["detail"]
        for bad in (0, "2", 1.5, True):
            r = c.post("/v1/maps", json={"voxel_size_m": 0.25, "shards": bad})
            assert r.status_code == 422 and "shards" in r.text, (bad, r.text)
        tar = shards.tar_header("manifest.json", 2) + b"{}" + shards.tar_padding(2) + shards.TAR_END
        r = c.post("/v1/maps/import", content=tar)  # a sharded export: not a snapshot file here
        assert (
            r.status_code == 422 and "snapshot" in r.json()["detail"] and not c.get("/v1/maps").json()["maps"]
        )
        r = c.post("/v1/maps", json={"voxel_size_m": 0.25, "shards": 1})  # one shard: an ordinary map
        assert r.status_code == 201 and "shard" not in r.json()["config"]
        assert c.get("/v1/maps").json()["maps"][0]["id"] == r.json()["id"]


def owned_voxels(m: Map, i: int, k: int, tiles: int) -> dict:
    g, d = m.layer("tsdf")
    s = m.voxel_size_m
    own = sharding.owner_of_points((g.ijk.double() + 0.5) * s, s, k, tiles) == i
    return {
        tuple(v): (t, w)
        for v, t, w in zip(
            g.ijk[own].tolist(), d["tsdf"][own].tolist(), d["weight"][own].tolist(), strict=True
        )
    }


def test_depth_frames_through_the_routing_equal_one_map():
    """Depth frames (a camera looking down at a ground and a box while moving 10 m per frame): the footprint
    of the pixels picks the shards, and every shard's own voxels equal one map's."""
    h, w, f = 48, 64, 40.0
    K = np.array([f, f, w / 2, h / 2])
    v, u = np.mgrid[0:h, 0:w]
    depth = np.full((h, w), 2.5, np.float32)
    depth[10:30, 20:40] = 2.0  # a box on the ground
    cfg = dict(voxel_size_m=0.1, layers=["tsdf"])
    full = Map(**cfg, device="cpu")
    k, tiles = 2, 3  # 9.6 m blocks
    halo = sharding.halo_for(full.config())
    parts = [
        Map(**cfg, shard=sharding.ShardSpec(i, k, tiles, halo).to_dict(), device="cpu") for i in range(k)
    ]
    sent = [0] * k
    for step in range(8):
        T = np.eye(4)
        T[:3, :3] = [[1, 0, 0], [0, -1, 0], [0, 0, -1]]  # looking down (OpenCV axes: z forward)
        T[:3, 3] = [10.0 * step, 0.5 * step, 2.5]
        frame = wire.DepthFrame(depth, K, T)
        full.integrate_depth(depth, K, T)
        for i in shards.frame_shards(frame, parts[0].config()):
            parts[i].integrate_depth(depth, K, T)
            sent[i] += 1
    assert 0 < min(sent) < 8  # a shard skips the frames that cannot reach its blocks
    for i in range(k):
        mine = owned_voxels(parts[i], i, k, tiles)
        assert len(mine) > 500 and mine == owned_voxels(full, i, k, tiles)


# a 4 m range drive 40 m off the x axis over 16 m blocks: half of its frames miss shard 0 (K = 3)
SHORT = {**CFG, "max_range_m": 4.0}
LIMITS = wire.Limits(10**6, 10**7, 10**6, 1e6)


def feed(full: Map, parts: list[Map], f) -> list[int]:
    """One frame into one map and into K shards as the ingress routes it: to the shards its footprint
    reaches, and its pose alone to shard 0 when shard 0 is not one of them. Returns the shards reached."""
    full.integrate_lidar(f.points, f.T_world_sensor)
    targets = shards.frame_shards(f, parts[0].config()) or [0]
    for i in targets:
        parts[i].integrate_lidar(f.points, f.T_world_sensor)
    if 0 not in targets:
        p = wire.parse_frame(wire.unpackb(wire.packb(shards.pose_only_message(f))), LIMITS)
        parts[0].integrate_lidar(p.points, p.T_world_sensor)
    return targets


def routed(k: int, tiles: int, cfg: dict, n: int, y0: float = 40.0):
    """One map and K shards fed ``frames(n, y0)`` through ``feed``. Returns (the map, the shards, the
    shards each frame reached)."""
    full = Map(**cfg, device="cpu")
    halo = sharding.halo_for(full.config())
    parts = [
        Map(**full.config(), shard=sharding.ShardSpec(i, k, tiles, halo).to_dict(), device="cpu")
        for i in range(k)
    ]
    reached = [feed(full, parts, f) for f in frames(n, y0)]
    return full, parts, reached


def test_pose_only_frames_give_shard_0_the_trajectory_and_change_no_voxel():
    """Shard 0 gets every frame (the frame or its pose alone): its trajectory and frame count are one map's;
    a pose-only frame allocates nothing (a map fed only those stays empty)."""
    full, parts, reached = routed(3, 2, SHORT, 8)
    assert sum(0 not in r for r in reached) >= 3, "some frames reach shard 0 as poses only"
    T_ref, _, s_ref = full.trajectory(0)
    T0, _, s0 = parts[0].trajectory(0)
    assert s0 == s_ref == 0 and torch.equal(T0, T_ref) and T0.shape[0] == 8
    assert parts[0].frames_integrated == full.frames_integrated == 8
    empty = Map(**CFG, device="cpu")
    fr = frames(8, 40.0)
    fr[3].frame_id, fr[3].timestamp = "f3", 12.5
    for f in fr:
        p = wire.parse_frame(wire.unpackb(wire.packb(shards.pose_only_message(f))), LIMITS)
        assert (p.timestamp, p.frame_id) == (f.timestamp, f.frame_id)
        assert np.array_equal(p.T_world_sensor, f.T_world_sensor)
        assert shards.frame_footprint(p, empty.config()) is None
        empty.integrate_lidar(p.points, p.T_world_sensor)
    assert sum(empty.bricks.values()) == 0 and empty.trajectory(0)[0].shape[0] == len(fr)


def mesh_equal(a, b) -> None:
    """Two block meshes are the same: blocks, face offsets, faces by vertex key, vertex positions, normals,
    and their viewer block encodings past the version fields."""
    from mapper import viewer

    assert torch.equal(a.blocks, b.blocks) and torch.equal(a.block_face_offsets, b.block_face_offsets)
    assert torch.equal(a.vertex_keys, b.vertex_keys)
    assert torch.equal(a.vertex_keys[a.faces.long()], b.vertex_keys[b.faces.long()])
    assert torch.equal(a.vertices, b.vertices) and torch.equal(a.normals, b.normals)
    ea, eb = viewer.mesh_to_blocks_bytes(a), viewer.mesh_to_blocks_bytes(b)
    assert ea[:8] == eb[:8] and ea[24:] == eb[24:]


@pytest.mark.parametrize("k", [2, 3])
def test_incremental_mesh_of_shards_equals_one_maps_mesh(k):
    """The gathered mesh, then the gathered deltas since its cursor merged into it (``apply_delta``, what the
    viewer does with ``mesh/blocks?since_version=``), equal one map's whole mesh after every step; the
    cursor is the sum of the shards' versions, remembered with them."""
    from mapper.mesh import apply_delta

    full, parts, _ = routed(k, 2, SHORT, 3)
    cursors = shards.MeshCursors()
    first = {i: m.mesh() for i, m in enumerate(parts)}
    shown = shards.gather_mesh(first, k, 2, cursors.issue([m.version for m in first.values()]))
    assert shown.full and shown.version == sum(m.mesh_version for m in parts)
    mesh_equal(shown, full.mesh())
    deltas = 0
    for f in frames(7, 40.0)[3:]:
        feed(full, parts, f)
        vec = cursors.lookup(shown.version)
        assert vec is not None and len(vec) == k
        got = {i: parts[i].mesh(since_version=vec[i]) for i in range(k)}
        assert not any(m.full for m in got.values())
        delta = shards.gather_mesh(got, k, 2, cursors.issue([m.version for m in got.values()]))
        assert not delta.full and delta.num_faces < full.mesh().num_faces
        delta.since_version = shown.version
        deltas += int(delta.blocks.shape[0] + delta.removed_blocks.shape[0])
        shown = apply_delta(shown, delta)
        mesh_equal(shown, full.mesh())
    assert deltas > 0
    assert cursors.lookup(10**9) is None  # an unknown cursor: the ingress sends the whole mesh
    with pytest.raises(InvalidArgument, match="mix of full meshes and deltas"):
        shards.gather_mesh({0: parts[0].mesh(), 1: parts[1].mesh(since_version=0)}, k, 2)


def test_cursors_are_bounded_and_follow_the_newest_versions():
    c = shards.MeshCursors(keep=3)
    assert c.issue([1, 2]) == 3 and c.lookup(3) == (1, 2)
    for v in ([2, 2], [2, 3], [3, 3]):
        c.issue(v)
    assert c.lookup(3) is None and c.lookup(6) == (3, 3) and len(c.table) == 3  # the oldest forgotten


@pytest.mark.parametrize("cap", [None, 97])
def test_occupied_voxels_and_bounds_of_shards_equal_one_maps(cap):
    """The owned occupied voxels of K shards, in one map's grid order and strided as it strides them, equal
    ``Map.occupied_voxels``; the union of the shards' layer bounds and ESDF extents equal one map's (the
    viewer's status and the slice's default bounds), and the slice over that extent is one map's."""
    k = 3
    full, parts, _ = routed(k, 2, {**SHORT, "layers": ["tsdf", "occupancy", "esdf"]}, 8)
    ref, total = full.occupied_voxels(cap)
    replies = {}
    for i, m in enumerate(parts):
        c, n = m.occupied_voxels()
        replies[i] = {"centers": c.numpy(), "total": n, "capped": False, "voxel_size_m": 0.25}
    got = shards.gather_occupied(replies, k, 2, cap or 10**6)
    assert got["total"] == total > 100 and got["capped"] == (cap is not None)
    np.testing.assert_array_equal(got["centers"], ref.numpy())
    for name, (lo, hi) in full.bounds().items():
        have = [m.bounds()[name] for m in parts if name in m.bounds()]
        assert [min(b[0][a] for b in have) for a in range(3)] == lo
        assert [max(b[1][a] for b in have) for a in range(3)] == hi
    ext = [m._esdf_bounds() for m in parts]
    lo = torch.stack([e[0] for e in ext]).min(0).values
    hi = torch.stack([e[1] for e in ext]).max(0).values
    flo, fhi = full._esdf_bounds()
    assert torch.equal(lo, flo) and torch.equal(hi, fhi)
    ref_slice = full.esdf_slice(0.5)
    params = {"x_min": repr(float(lo[0])), "y_min": repr(float(lo[1]))}
    params |= {"x_max": repr(float(hi[0])), "y_max": repr(float(hi[1]))}
    origin, shape, res = shards.slice_lattice(params, full.esdf_voxel_size_m)
    assert shape == tuple(ref_slice.distance.shape) and origin == ref_slice.origin_xy
    owner = sharding.owner_of_points(
        torch.from_numpy(shards.lattice_centres(origin, res, shape[::-1]).reshape(-1, 2)), 0.25, k, 2
    )
    owner = owner.numpy().reshape(shape[1], shape[0]).T
    sl = {
        i: {"distance": m.esdf_slice(0.5, lo[:2].tolist(), hi[:2].tolist()).distance.numpy()}
        for i, m in enumerate(parts)
    }
    got = shards.gather_cells(sl, owner, ("distance",))["distance"]
    np.testing.assert_array_equal(got, ref_slice.distance.numpy())


class FakeWorkers:
    """The ingress's view of two shard workers (``Router.json``): frames are logged (seq + 1) and acked;
    ``die``: the next frame to shard 1 kills its worker after (``logged=True``) or before logging it."""

    def __init__(self, die: bool, logged: bool):
        self.seq = {0: 5, 1: 7}
        self.die, self.logged = die, logged
        self.frames = {0: 0, 1: 0}

    async def json(self, index, method, path, **kw):
        import httpx

        from mapper.cluster.ingress import WorkerLost

        shard = int(path.split("/")[3][-1])
        if method == "GET":
            body = {"last_seq": self.seq[shard], "version": 100 + self.seq[shard]}
            return httpx.Response(200, json=body)
        if shard == 1 and self.die:
            self.die = False
            if self.logged:
                self.seq[1] += 1
                self.frames[1] += 1
            raise WorkerLost("map worker 1 failed during the request")
        self.seq[shard] += 1
        self.frames[shard] += 1
        return httpx.Response(200, json={"seq": self.seq[shard], "map_version": 3, "points_used": 9})


@pytest.mark.parametrize("logged", [True, False])
def test_a_frame_reaches_each_shard_once_when_its_worker_dies(logged):
    """``WorkerLost`` on shard 1 (its worker died holding the frame): once the worker answers again its last
    seq says whether the frame is in its WAL (acked as recovered) or not (sent again); either way shard 1
    holds the frame once and the frame is acked with the ack of a shard that answered it."""
    import asyncio

    w = FakeWorkers(die=True, logged=logged)
    spec = sharding.ShardSpec(0, 2, 2, 4.25, "m", "m").to_dict()
    sm = shards.ShardedMap("m", "m", {**SHORT, "voxel_size_m": 0.25, "shard": spec}, [0, 1], ["m.s0", "m.s1"])
    f = frames(8, 40.0)[0]
    f.frame_id = "x"
    body = wire.packb(wire.lidar_message(f.points, f.T_world_sensor, frame_id="x"))

    class Settings:
        max_points_per_frame, max_image_pixels, max_query_points, max_pose_translation_m = (
            10**6,
            10**7,
            10**6,
            1e6,
        )

    async def run():
        return await shards.integrate(w, sm, body, wire.MSGPACK, Settings)

    status, ack = asyncio.run(run())
    assert status == 200 and ack["frame_id"] == "x", ack
    assert w.frames[1] == 1 and w.seq[1] == 8 and ack["shards"]["1"]["seq"] == 8
    assert w.frames[0] == 1 and sm.seqs == {0: 6, 1: 8}
    assert "recovered" not in ack and ack["points_used"] == 9


def test_sharded_export_format_round_trip_and_errors():
    """The export tar as ``shards.export`` streams it (headers, padding, end) reads back with Python's
    tarfile and ``read_export``: the manifest and each shard's bytes; broken archives are refused naming
    what is wrong, and a snapshot file is not taken for a sharded export."""
    import io
    import json
    import tarfile

    spec = sharding.ShardSpec(0, 2, 3, 1.5, "sabc", "site").to_dict()
    sm = shards.ShardedMap("sabc", "site", {**CFG, "shard": spec}, [1, 0], ["a", "b"])
    blobs = [b"x" * 1000, bytes(range(256)) * 3]
    man = shards.export_manifest(sm, [len(b) for b in blobs])
    assert man["config"] == CFG and man["shards"] == 2 and (man["block_tiles"], man["halo_m"]) == (3, 1.5)

    def archive(manifest: dict, files: list[bytes], names=None) -> bytes:
        m = json.dumps(manifest).encode()
        out = shards.tar_header("manifest.json", len(m)) + m + shards.tar_padding(len(m))
        for i, b in enumerate(files):
            name = (names or [f"shard{j}.safetensors" for j in range(len(files))])[i]
            out += shards.tar_header(name, len(b)) + b + shards.tar_padding(len(b))
        return out + shards.TAR_END

    data = archive(man, blobs)
    assert len(data) % 512 == 0 and shards.is_sharded_export(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["manifest.json", "shard0.safetensors", "shard1.safetensors"]
        assert tar.extractfile("shard1.safetensors").read() == blobs[1]
    got, files = shards.read_export(data)
    assert got == man and files == blobs
    for bad, msg in (
        (archive({**man, "format": "other"}, blobs), "format 'other'"),
        (archive(man, blobs[:1]), "shard 1's file shard1.safetensors is missing"),
        (archive({**man, "shards": 1, "files": man["files"][:1]}, blobs[:1]), "shards \\(an int >= 2\\)"),
        (archive({k: v for k, v in man.items() if k != "halo_m"}, blobs), "no halo_m"),
        (archive(man, blobs, ["shard0.safetensors", "other"]), "shard1.safetensors is missing"),
        (data[:1024] + b"\0" * 10, "not a readable sharded export|shard0"),
    ):
        with pytest.raises(InvalidArgument, match=msg):
            shards.read_export(bad)
    m = json.dumps(man).encode()
    no_manifest = shards.tar_header("x.json", len(m)) + m + shards.tar_padding(len(m)) + shards.TAR_END
    with pytest.raises(InvalidArgument, match="without manifest.json"):
        shards.read_export(no_manifest)
    from safetensors.torch import save

    snap = save({"a": torch.zeros(300)}, metadata={"k": "v" * 600})  # a snapshot file: not a tar
    assert len(snap) > 1024 and not shards.is_sharded_export(snap)

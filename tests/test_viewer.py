"""The viewer's API side (no browser): the block mesh format against the mesh it encodes, incremental
replay of deltas against a full extraction, the trajectory / occupied / status routes against oracles built
here, the page and static files, auth and bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from test_service_helpers import READ_TOKEN, TOKEN, client, frame_bytes, scan

from mapper import Map, wire
from mapper.viewer import blocks_from_bytes, mesh_to_blocks_bytes


def lidar_map(frames=(0, 1), layers=("tsdf", "color", "occupancy"), voxel=0.25) -> Map:
    m = Map(voxel, layers=layers, device="cpu")
    for i in frames:
        m.integrate_lidar(*scan(i))
    return m


def triangles_by_block(mesh) -> dict[tuple, np.ndarray]:
    """Oracle: block -> its triangles as sorted rows of 9 coordinates, straight from the Mesh arrays."""
    v, f = mesh.vertices.numpy(), mesh.faces.numpy().astype(np.int64)
    off = mesh.block_face_offsets.numpy()
    out = {}
    for b, key in enumerate(map(tuple, mesh.blocks.numpy().tolist())):
        tri = v[f[off[b] : off[b + 1]]].reshape(-1, 9)
        out[key] = tri[np.lexsort(tri.T[::-1])]
    return out


def decoded_by_block(d: dict) -> dict[tuple, np.ndarray]:
    out = {}
    for b, key in enumerate(map(tuple, d["blocks"].tolist())):
        v0, v1 = d["vertex_offsets"][b], d["vertex_offsets"][b + 1]
        f0, f1 = d["face_offsets"][b], d["face_offsets"][b + 1]
        local = d["faces"][f0:f1]
        assert local.size == 0 or local.max() < v1 - v0  # indices stay inside the block
        tri = d["positions"][v0:v1][local].reshape(-1, 9)
        out[key] = tri[np.lexsort(tri.T[::-1])]
    return out


def test_block_format_encodes_every_triangle_of_every_block():
    m = lidar_map()
    mesh = m.mesh()
    assert mesh.num_faces > 1000
    d = blocks_from_bytes(mesh_to_blocks_bytes(mesh))
    assert d["full"] and d["since_version"] is None and d["version"] == mesh.version
    assert d["voxel_size_m"] == 0.25 and d["faces"].shape[0] == mesh.num_faces
    ref, got = triangles_by_block(mesh), decoded_by_block(d)
    assert ref.keys() == got.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])
    # normals and colours travel with their vertices (normals quantised to 1/127)
    pos = {tuple(p): i for i, p in enumerate(mesh.vertices.numpy().tolist())}
    idx = np.array([pos[tuple(p)] for p in d["positions"].tolist()])
    np.testing.assert_allclose(d["normals"], mesh.normals.numpy()[idx], atol=0.5 / 127 + 1e-6)
    np.testing.assert_array_equal(d["colors"], mesh.colors.numpy()[idx])


def test_block_format_empty_and_without_colour():
    m = Map(0.25, layers=("tsdf",), device="cpu")
    d = blocks_from_bytes(mesh_to_blocks_bytes(m.mesh()))
    assert d["blocks"].shape == (0, 3) and d["faces"].shape == (0, 3) and d["colors"] is None
    m.integrate_lidar(*scan(0))
    d = blocks_from_bytes(mesh_to_blocks_bytes(m.mesh()))
    assert d["colors"] is None and d["faces"].shape[0] == m.mesh().num_faces
    with pytest.raises(ValueError, match="magic"):
        blocks_from_bytes(b"XXXX" + bytes(44))


def test_deltas_replayed_per_block_equal_the_full_mesh():
    """A viewer that keeps blocks and replaces them from deltas ends with the full mesh's triangles."""
    m = lidar_map(frames=(0,))
    first = m.mesh()
    store = decoded_by_block(blocks_from_bytes(mesh_to_blocks_bytes(first)))
    version = first.version
    for i in (3, 6):  # the pose moves along x: blocks change, appear and vanish
        m.integrate_lidar(*scan(i, seed=i))
        m.clear(aabb_min=[-7, -7, -2], aabb_max=[-4, 7, 3]) if i == 6 else None
        d = blocks_from_bytes(mesh_to_blocks_bytes(m.mesh(since_version=version)))
        assert not d["full"] and d["since_version"] == version
        assert d["blocks"].shape[0] < first.blocks.shape[0] + 10_000
        for k in map(tuple, d["removed_blocks"].tolist()):
            store.pop(k, None)
        store.update(decoded_by_block(d))
        version = d["version"]
    ref = triangles_by_block(m.mesh())
    store = {k: t for k, t in store.items() if t.shape[0]}
    assert store.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(store[k], ref[k])


def test_trajectory_kept_capped_and_saved(monkeypatch):
    import mapper.map as map_module

    m = Map(0.25, layers=("tsdf", "occupancy"), device="cpu")
    poses = []
    for i in range(5):
        pts, T = scan(i, n=200)  # the poses matter here, not the points
        m.integrate_lidar(pts, T)
        poses.append(T)
    T, versions, first = m.trajectory()
    assert first == 0 and T.dtype == torch.float64
    np.testing.assert_array_equal(T.numpy(), np.stack(poses))
    assert versions.tolist() == [1, 2, 3, 4, 5]
    T2, v2, first2 = m.trajectory(3)
    assert first2 == 3 and v2.tolist() == [4, 5] and torch.equal(T2, T[3:])
    assert m.trajectory(99)[0].shape == (0, 4, 4)
    with pytest.raises(ValueError, match="start"):
        m.trajectory(-1)
    tensors, meta = m.state_dict()
    m2 = Map.from_state_dict(tensors, meta, device="cpu")
    assert torch.equal(m2.trajectory()[0], T) and m2.trajectory()[1].tolist() == versions.tolist()
    # past the cap the oldest half goes; indices stay those of the frames
    monkeypatch.setattr(map_module, "MAX_TRAJECTORY", 4)
    m.integrate_lidar(*scan(5, n=200))
    T3, v3, first3 = m.trajectory()
    assert first3 == 4 and v3.tolist() == [5, 6] and m.layer_sizes()["trajectory_length"] == 6
    # depth frames record their pose too
    md = Map(0.1, layers=("tsdf",), device="cpu")
    K = np.array([[50.0, 0, 32], [0, 50, 24], [0, 0, 1]])
    pose = np.eye(4)
    pose[:3, 3] = [1, 2, 3]
    md.integrate_depth(np.full((48, 64), 2.0, np.float32), K, pose)
    np.testing.assert_array_equal(md.trajectory()[0][0].numpy(), pose)


def occupied_oracle(m: Map) -> np.ndarray:
    g, d = m.layer("occupancy")
    lo = d["log_odds"].numpy()
    ijk = g.ijk.numpy()[np.nan_to_num(lo, nan=-1.0) > 0]
    return (ijk + 0.5) * m.voxel_size_m


def sorted_rows(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort(a.T[::-1])]


def test_routes_trajectory_occupied_status(tmp_path):
    with client(tmp_path) as c:
        mid = c.post(
            "/v1/maps", json={"name": "v", "voxel_size_m": 0.25, "layers": ["tsdf", "occupancy", "esdf"]}
        ).json()["id"]
        oracle = Map(0.25, layers=("tsdf", "occupancy"), device="cpu")
        for i in range(3):
            r = c.post(
                f"/v1/maps/{mid}/frames", content=frame_bytes(i), headers={"content-type": wire.MSGPACK}
            )
            assert r.status_code == 200
            oracle.integrate_lidar(*scan(i))
        t = c.get(f"/v1/maps/{mid}/trajectory").json()
        assert t["start"] == 0 and t["count"] == 3
        np.testing.assert_array_equal(np.array(t["T_world_sensor"]), np.stack([scan(i)[1] for i in range(3)]))
        assert t["positions"] == [[0.1 * i, 0.0, 0.0] for i in range(3)] and t["versions"] == [1, 2, 3]
        assert c.get(f"/v1/maps/{mid}/trajectory?start=2").json()["positions"] == [[0.2, 0.0, 0.0]]
        # occupied voxels: all of them, then capped to an evenly strided subset
        want = occupied_oracle(oracle)
        r = c.get(f"/v1/maps/{mid}/occupied?max_voxels=1000000", headers={"accept": wire.MSGPACK})
        body = wire.unpackb(r.content)
        got = wire.decode_array(body["centers"], "centers")
        assert body["total"] == len(want) and not body["capped"]
        np.testing.assert_allclose(sorted_rows(got), sorted_rows(want), atol=1e-6)
        capped = c.get(f"/v1/maps/{mid}/occupied?max_voxels=10").json()
        assert capped["capped"] and capped["total"] == len(want) and len(capped["centers"]) == 10
        assert {tuple(p) for p in capped["centers"]} <= {tuple(p) for p in got.tolist()}
        # the cheap status
        s = c.get(f"/v1/maps/{mid}/status").json()
        stats = c.get(f"/v1/maps/{mid}").json()["stats"]
        assert s["frames_integrated"] == 3 and s["version"] == 3 and s["trajectory_length"] == 3
        assert s["mesh_version"] == oracle.mesh().version and s["ack_ms"] > 0
        for name in ("tsdf", "occupancy"):
            assert s["layers"][name]["voxels"] == stats["layers"][name]["voxels"]
            assert s["layers"][name]["bytes"] == stats["layers"][name]["bytes"]
        bricks = oracle.layer("tsdf")[0].ijk.numpy() // 4
        np.testing.assert_allclose(s["bounds"]["tsdf"]["min"], bricks.min(0) * 1.0)
        np.testing.assert_allclose(s["bounds"]["tsdf"]["max"], (bricks.max(0) + 1) * 1.0)
        # mesh blocks: the full mesh, then an empty delta when nothing changed
        r = c.get(f"/v1/maps/{mid}/mesh/blocks")
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-mapper-blocks"
        d = blocks_from_bytes(r.content)
        assert r.headers["X-Mapper-Mesh-Version"] == str(d["version"])
        assert r.headers["X-Map-Version"] == "3"  # the map version shown (3 frames): the page's latency
        assert d["faces"].shape[0] == oracle.mesh().num_faces
        r_idle = c.get(f"/v1/maps/{mid}/mesh/blocks?since_version={d['version']}")
        assert r_idle.headers["X-Map-Version"] == "3"
        e = blocks_from_bytes(r_idle.content)
        assert not e["full"] and e["blocks"].shape[0] == 0 and e["version"] == d["version"]
        # the whole mesh again: the cached reply; after a frame, the cache patched by a delta = extraction
        assert c.get(f"/v1/maps/{mid}/mesh/blocks").content == r.content
        c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(5), headers={"content-type": wire.MSGPACK})
        oracle.integrate_lidar(*scan(5))
        r2 = c.get(f"/v1/maps/{mid}/mesh/blocks")
        assert r2.headers["X-Map-Version"] == "4"
        d2 = blocks_from_bytes(r2.content)
        assert d2["full"] and d2["version"] == oracle.mesh().version > d["version"]
        want = triangles_by_block(oracle.mesh())
        got = decoded_by_block(d2)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_viewer_page_static_files_and_openapi(tmp_path):
    with client(tmp_path) as c:
        r = c.get("/", follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/viewer"
        page = c.get("/viewer")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert '<script type="module" src="/viewer/static/viewer.js">' in page.text
        for f in (
            "viewer.js",
            "blocks.js",
            "msgpack.js",
            "viewer.css",
            "vendor/three/three.module.min.js",
            "vendor/three/OrbitControls.js",
            "vendor/three/LICENSE",
        ):
            assert c.get(f"/viewer/static/{f}").status_code == 200, f
        assert "MIT" in c.get("/viewer/static/vendor/three/LICENSE").text
        assert c.get("/viewer/static/../../api/app.py").status_code == 404
        paths = c.get("/openapi.json").json()["paths"]
        for p in ("mesh/blocks", "trajectory", "occupied", "status"):
            assert f"/v1/maps/{{map_id}}/{p}" in paths
        assert "/viewer" not in paths


def test_viewer_routes_auth_and_bad_input(tmp_path):
    with client(tmp_path, api_tokens=[TOKEN], read_tokens=[READ_TOKEN]) as c:
        full = {"authorization": f"Bearer {TOKEN}"}
        read = {"authorization": f"Bearer {READ_TOKEN}"}
        mid = c.post("/v1/maps", json={"name": "o", "layers": ["occupancy"]}, headers=full).json()["id"]
        assert c.get("/viewer").status_code == 200  # the page itself needs no token
        for p in ("mesh/blocks", "trajectory", "occupied", "status"):
            assert c.get(f"/v1/maps/{mid}/{p}").status_code == 401
            assert c.get(f"/v1/maps/{mid}/{p}", headers={"authorization": "Bearer nope"}).status_code == 401
            r = c.get(f"/v1/maps/nosuchmap/{p}", headers=read)
            assert r.status_code == 404 and "nosuchmap" in r.json()["detail"]
        r = c.get(f"/v1/maps/{mid}/mesh/blocks", headers=read)  # occupancy only: no mesh, said so
        assert r.status_code == 404 and "tsdf" in r.json()["detail"]
        assert c.get(f"/v1/maps/{mid}/status", headers=read).json()["mesh_version"] is None
        assert c.get(f"/v1/maps/{mid}/occupied", headers=read).json()["total"] == 0
        for q in (
            "occupied?max_voxels=0",
            "occupied?max_voxels=2000000",
            "trajectory?start=-1",
            "mesh/blocks?since_version=-3",
        ):
            r = c.get(f"/v1/maps/{mid}/{q}", headers=read)
            assert r.status_code == 422, (q, r.text)


def test_mesh_blocks_not_modified_until_the_mesh_changes(tmp_path):
    """The conditional poll: the ETag names the mesh version; If-None-Match on it gives 304 without a body
    (with or without since_version) until a frame changes the mesh, then 200 with the delta."""
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "etag", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={"content-type": wire.MSGPACK})
        r = c.get(f"/v1/maps/{mid}/mesh/blocks")
        v = blocks_from_bytes(r.content)["version"]
        assert r.headers["ETag"] == f'"mesh-{v}"' and r.headers["Cache-Control"] == "no-cache"
        for q in ("", f"?since_version={v}", "?since_version=0"):
            nm = c.get(f"/v1/maps/{mid}/mesh/blocks{q}", headers={"If-None-Match": r.headers["ETag"]})
            assert nm.status_code == 304 and nm.content == b"", q
            assert nm.headers["ETag"] == r.headers["ETag"] and nm.headers["X-Mapper-Mesh-Version"] == str(v)
        # a list of tags, a weak tag: the same; another version's tag: the body
        tags = f'"mesh-{v + 7}", W/"mesh-{v}"'
        assert c.get(f"/v1/maps/{mid}/mesh/blocks", headers={"If-None-Match": tags}).status_code == 304
        other = c.get(f"/v1/maps/{mid}/mesh/blocks?since_version={v}", headers={"If-None-Match": '"mesh-0"'})
        assert other.status_code == 200 and blocks_from_bytes(other.content)["version"] == v
        c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(4), headers={"content-type": wire.MSGPACK})
        r2 = c.get(
            f"/v1/maps/{mid}/mesh/blocks?since_version={v}", headers={"If-None-Match": r.headers["ETag"]}
        )
        assert r2.status_code == 200
        d2 = blocks_from_bytes(r2.content)
        assert (
            d2["version"] > v
            and d2["blocks"].shape[0] > 0
            and r2.headers["ETag"] == f'"mesh-{d2["version"]}"'
        )
        # a map without a TSDF: no conditional answer, the 404 that says why
        occ = c.post("/v1/maps", json={"name": "o", "voxel_size_m": 0.25, "layers": ["occupancy"]}).json()[
            "id"
        ]
        r = c.get(f"/v1/maps/{occ}/mesh/blocks", headers={"If-None-Match": '"mesh-0"'})
        assert r.status_code == 404


def test_viewer_page_defaults_mesh_first():
    """The page opens on the mesh: the ESDF slice is off (a checkbox, unchecked), unknown slice cells are
    drawn transparent, axes and a ground grid are in the scene, and the mesh poll is conditional."""
    from mapper.viewer import STATIC_DIR

    html = (STATIC_DIR / "index.html").read_text()
    assert re.search(r'<input id="show-mesh" type="checkbox" checked>', html)
    assert re.search(r'<input id="show-slice" type="checkbox">', html)  # not checked
    assert re.search(r'<input id="show-grid" type="checkbox" checked>', html)
    js = (STATIC_DIR / "viewer.js").read_text()
    assert "new THREE.AxesHelper" in js and "new THREE.GridHelper" in js
    assert "UNKNOWN_ALPHA = 0" in js
    assert "'If-None-Match'" in js and "status === 304" in js

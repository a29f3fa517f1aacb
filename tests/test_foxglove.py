"""Foxglove output: the WebSocket bridge (``mapper serve --foxglove-port``) seen by a plain WebSocket client
speaking foxglove.websocket.v1, and the MCAP export read back with the mcap package. Messages are decoded
with protobuf from the schemas the server advertises, and compared with a map built here."""

from __future__ import annotations

import base64
import json
import struct
import time

import numpy as np
import pytest
from test_service_helpers import READ_TOKEN, TOKEN, Server, frame_bytes, free_port, scan

from mapper import Map, wire

pytest.importorskip("foxglove", reason="foxglove-sdk is not installed")
pytest.importorskip("google.protobuf", reason="protobuf is not installed (test extra)")


def message_class(schema_b64_or_bytes, name: str):
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    data = schema_b64_or_bytes
    if isinstance(data, str):
        data = base64.b64decode(data)
    fds = descriptor_pb2.FileDescriptorSet.FromString(data)
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def sorted_rows(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort(a.T[::-1])] if len(a) else a


def mesh_triangles_by_block(mesh) -> dict[str, np.ndarray]:
    """Oracle: ``block/i_j_k`` -> sorted triangles (9 coordinates each) from the Mesh arrays."""
    v, f = mesh.vertices.numpy().astype(np.float64), mesh.faces.numpy().astype(np.int64)
    off = mesh.block_face_offsets.numpy()
    return {
        "block/{}_{}_{}".format(*b): sorted_rows(v[f[off[k] : off[k + 1]]].reshape(-1, 9))
        for k, b in enumerate(mesh.blocks.numpy().tolist())
    }


def scene_triangles_by_entity(update) -> dict[str, np.ndarray]:
    out = {}
    for e in update.entities:
        (tri,) = e.triangles
        p = np.array([[q.x, q.y, q.z] for q in tri.points])
        out[e.id] = sorted_rows(p[np.array(tri.indices, dtype=np.int64)].reshape(-1, 9))
    return out


def test_foxglove_websocket_advertises_and_sends_the_mesh(tmp_path):
    from websockets.sync.client import connect

    port = free_port()
    oracle = Map(0.25, layers=("tsdf",), device="cpu")  # the mesh oracle needs no ESDF
    with Server(tmp_path / "data", tmp_path / "server.log", MAPPER_FOXGLOVE_PORT=port) as srv:
        import httpx

        http = httpx.Client(base_url=srv.url, timeout=300)
        body = {"name": "fox", "voxel_size_m": 0.25, "esdf_max_distance_m": 0.5}  # a small ESDF: fast
        mid = http.post("/v1/maps", json=body).json()["id"]
        for i in range(2):
            r = http.post(
                f"/v1/maps/{mid}/frames",
                content=frame_bytes(i),
                headers={"content-type": wire.MSGPACK},
            )
            assert r.status_code == 200, r.text
            oracle.integrate_lidar(*scan(i))
        # foxglove-sdk speaks the ws-protocol as "foxglove.sdk.v1" (the successor of foxglove.websocket.v1:
        # same serverInfo / advertise / subscribe ops and binary message frames); offer both
        url = f"ws://127.0.0.1:{port}"
        with connect(url, subprotocols=["foxglove.websocket.v1", "foxglove.sdk.v1"], open_timeout=30) as ws:
            assert ws.subprotocol in ("foxglove.websocket.v1", "foxglove.sdk.v1")
            channels, deadline = {}, time.monotonic() + 30
            while not {"/maps/fox/mesh", "/maps/fox/tf", "/maps/fox/esdf_slice"} <= set(channels):
                assert time.monotonic() < deadline, f"not advertised: {sorted(channels)}"
                msg = ws.recv(timeout=30)
                if isinstance(msg, str) and json.loads(msg)["op"] == "advertise":
                    for ch in json.loads(msg)["channels"]:
                        channels[ch["topic"]] = ch
            mesh_ch, tf_ch = channels["/maps/fox/mesh"], channels["/maps/fox/tf"]
            assert mesh_ch["encoding"] == "protobuf" and mesh_ch["schemaName"] == "foxglove.SceneUpdate"
            ws.send(
                json.dumps(
                    {
                        "op": "subscribe",
                        "subscriptions": [
                            {"id": 1, "channelId": mesh_ch["id"]},
                            {"id": 2, "channelId": tf_ch["id"]},
                        ],
                    }
                )
            )
            SceneUpdate = message_class(mesh_ch["schema"], "foxglove.SceneUpdate")
            FrameTransform = message_class(tf_ch["schema"], "foxglove.FrameTransform")
            update, poses = None, []
            deadline = time.monotonic() + 60
            while update is None or len(poses) < 2:
                assert time.monotonic() < deadline, "no SceneUpdate / FrameTransforms arrived"
                msg = ws.recv(timeout=60)
                if isinstance(msg, str):
                    continue
                assert msg[0] == 0x01  # MessageData: opcode, subscription id, log time, payload
                sub, _ = struct.unpack_from("<IQ", msg, 1)
                payload = msg[13:]
                if sub == 1:
                    u = SceneUpdate.FromString(payload)
                    if any(d.type == 1 for d in u.deletions):  # the full mesh starts with a delete-all
                        update = u
                elif sub == 2:
                    poses.append(FrameTransform.FromString(payload))
    want = mesh_triangles_by_block(oracle.mesh())
    got = scene_triangles_by_entity(update)
    assert got.keys() == want.keys() and len(want) > 50
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    assert all(e.frame_id == "world" for e in update.entities)
    tr = [(p.translation.x, p.translation.y, p.translation.z) for p in poses[:2]]
    assert tr == [tuple(scan(i)[1][:3, 3]) for i in range(2)]
    assert poses[0].child_frame_id == "fox/sensor" and poses[0].rotation.w == pytest.approx(1.0)


def test_mcap_export_reads_back(tmp_path):
    from mcap.reader import make_reader

    from mapper.foxglove import export_map

    m = Map(0.25, layers=("tsdf", "esdf"), device="cpu", esdf_max_distance_m=0.5)
    for i in range(3):
        m.integrate_lidar(*scan(i))
    path = export_map(m, "lab", tmp_path / "lab.mcap", z_m=0.5)
    seen: dict[str, list] = {}
    with open(path, "rb") as f:
        for schema, channel, message in make_reader(f).iter_messages():
            if schema.encoding != "protobuf":  # the ROS 2 costmap: tests/test_costmap.py
                seen.setdefault(channel.topic, []).append(message.data)
                continue
            cls = message_class(schema.data, schema.name)
            seen.setdefault(channel.topic, []).append(cls.FromString(message.data))
    assert set(seen) == {"/maps/lab/mesh", "/maps/lab/tf", "/maps/lab/esdf_slice", "/maps/lab/costmap"}
    (update,) = seen["/maps/lab/mesh"]
    want = mesh_triangles_by_block(m.mesh())
    got = scene_triangles_by_entity(update)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    tfs = seen["/maps/lab/tf"]
    assert [(t.translation.x, t.translation.y) for t in tfs] == [(0.1 * i, 0.0) for i in range(3)]
    (grid,) = seen["/maps/lab/esdf_slice"]
    s = m.esdf_slice(0.5)
    d = np.frombuffer(grid.data, dtype="<f4").reshape(-1, grid.column_count)
    np.testing.assert_array_equal(d, s.distance.numpy().astype(np.float32))
    assert grid.cell_size.x == 0.25 and grid.pose.position.z == 0.5
    assert (grid.pose.position.x, grid.pose.position.y) == tuple(s.origin_xy)


def test_quaternion_matches_rotation():
    from scipy.spatial.transform import Rotation

    from mapper.foxglove import quaternion

    for R in list(Rotation.random(20, random_state=1).as_matrix()) + [np.diag([1.0, -1, -1]), np.eye(3)]:
        q = np.array(quaternion(R))
        ref = Rotation.from_matrix(R).as_quat()  # x, y, z, w
        assert np.allclose(q, ref, atol=1e-9) or np.allclose(q, -ref, atol=1e-9)


def test_cli_export_mcap_offline_and_serve_flag(tmp_path):
    from mcap.reader import make_reader

    from mapper.cli import build_parser, main
    from mapper.persistence import DataDir
    from mapper.store import save_new_map

    m = Map(0.25, layers=("tsdf",), device="cpu")
    for i in range(2):
        m.integrate_lidar(*scan(i))
    save_new_map(DataDir(tmp_path / "data"), m, name="lab")
    out = tmp_path / "lab.mcap"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "export",
                "--data-dir",
                str(tmp_path / "data"),
                "--map",
                "lab",
                "--mcap",
                str(out),
                "--device",
                "cpu",
            ]
        )
    assert e.value.code == 0
    with open(out, "rb") as f:
        msgs = [(c.topic, s, x) for s, c, x in make_reader(f).iter_messages()]
    assert [t for t, _, _ in msgs].count("/maps/lab/tf") == 2
    (mesh_msg,) = [(s, x) for t, s, x in msgs if t == "/maps/lab/mesh"]
    update = message_class(mesh_msg[0].data, mesh_msg[0].name).FromString(mesh_msg[1].data)
    assert sum(len(e.triangles[0].indices) // 3 for e in update.entities) == m.mesh().num_faces
    assert not any(t == "/maps/lab/esdf_slice" for t, _, _ in msgs)  # no ESDF layer: no slice
    assert build_parser().parse_args(["serve", "--foxglove-port", "8765"]).foxglove_port == 8765


def test_foxglove_port_needs_a_token_and_speaks_both_subprotocols(tmp_path):
    """With tokens set, the Foxglove port refuses a handshake without a valid one (401, before any map name
    is sent) and accepts a read token (``?token=`` or ``Authorization``); both subprotocol names work,
    each answered as offered; a handshake offering neither is refused (400)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    port = free_port()
    env = dict(MAPPER_FOXGLOVE_PORT=port, MAPPER_API_TOKENS=TOKEN, MAPPER_READ_TOKENS=READ_TOKEN)
    with Server(tmp_path / "data", tmp_path / "server.log", **env) as srv:
        import httpx

        auth = {"authorization": f"Bearer {TOKEN}"}
        r = httpx.post(srv.url + "/v1/maps", json={"name": "secret-lab", "voxel_size_m": 0.25}, headers=auth)
        assert r.status_code == 201, r.text
        url = f"ws://127.0.0.1:{port}"

        def refused(status: int, **kw) -> None:
            with pytest.raises(InvalidStatus) as e:
                with connect(kw.pop("u", url), open_timeout=30, **kw):
                    pass
            assert e.value.response.status_code == status, e.value.response
            assert b"secret-lab" not in (e.value.response.body or b"")

        refused(401, subprotocols=["foxglove.sdk.v1"])
        refused(401, u=url + "/?token=wrong", subprotocols=["foxglove.sdk.v1"])
        refused(401, subprotocols=["foxglove.websocket.v1"], additional_headers={"Authorization": "Bearer x"})
        refused(400, u=f"{url}/?token={READ_TOKEN}", subprotocols=["foxglove.v0"])

        def topics(ws) -> set[str]:
            seen, deadline = set(), time.monotonic() + 30
            while "/maps/secret-lab/mesh" not in seen:
                assert time.monotonic() < deadline, f"not advertised: {sorted(seen)}"
                msg = ws.recv(timeout=30)
                if isinstance(msg, str) and json.loads(msg)["op"] == "advertise":
                    seen |= {ch["topic"] for ch in json.loads(msg)["channels"]}
            return seen

        for proto, kw in (
            ("foxglove.websocket.v1", {"uri": f"{url}/?token={READ_TOKEN}"}),
            ("foxglove.sdk.v1", {"uri": url, "additional_headers": {"Authorization": f"Bearer {TOKEN}"}}),
        ):
            with connect(kw.pop("uri"), subprotocols=[proto], open_timeout=30, **kw) as ws:
                assert ws.subprotocol == proto
                first = json.loads(ws.recv(timeout=30))
                assert first["op"] == "serverInfo"
                assert "/maps/secret-lab/mesh" in topics(ws)

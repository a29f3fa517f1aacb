"""LiDAR frames without a pose through the service: HTTP and WebSocket acks carry the estimated pose, the
client sends without one, and a restart (snapshot + write-ahead log, clean or crashed) reproduces the map and
continues tracking exactly (the log stores each estimated pose with its frame)."""

from __future__ import annotations

import math
import shutil

import msgpack
import numpy as np
from test_service_helpers import MSGPACK_HEADERS, client

from mapper import Map, wire
from mapper.client import MapperClient, ack_pose
from mapper.persistence import read_wal

REGISTRATION = {"voxel_size_m": 0.5, "max_range_m": 30.0}


def room_pose(i: int) -> np.ndarray:
    """Ground truth: a sensor driving and turning slowly through the room (frame 0 = identity)."""
    yaw = 0.02 * i
    T = np.eye(4)
    T[:3, :3] = [[math.cos(yaw), -math.sin(yaw), 0.0], [math.sin(yaw), math.cos(yaw), 0.0], [0.0, 0.0, 1.0]]
    T[:3, 3] = [0.15 * i, 0.05 * i, 0.01 * i]
    return T


def room_scan(i: int, n: int = 4000) -> np.ndarray:
    """A scan (sensor frame) of a fixed box room [-5, 9] x [-4, 6] x [-1.2, 3] seen from ``room_pose(i)``:
    analytic ray casting, 5 mm range noise. The room's three wall orientations constrain all six DoF."""
    rng = np.random.default_rng(100 + i)
    az = rng.uniform(-np.pi, np.pi, n)
    el = rng.uniform(-0.6, 0.4, n)
    d = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], 1)
    T = room_pose(i)
    dw, o = d @ T[:3, :3].T, T[:3, 3]
    lo, hi = np.array([-5.0, -4.0, -1.2]), np.array([9.0, 6.0, 3.0])
    with np.errstate(divide="ignore"):
        t = np.where(dw > 0, (hi - o) / dw, (lo - o) / dw)
    r = np.where(np.isfinite(t) & (t > 0), t, np.inf).min(1) + 0.005 * rng.normal(size=n)
    return (d * r[:, None]).astype(np.float32)


def assert_pose_close(T, i: int, t_tol: float = 0.02, deg_tol: float = 0.2) -> None:
    E = np.linalg.inv(room_pose(i)) @ np.asarray(T, dtype=np.float64).reshape(4, 4)
    ang = math.degrees(math.acos(np.clip((np.trace(E[:3, :3]) - 1) / 2, -1, 1)))
    assert np.linalg.norm(E[:3, 3]) < t_tol and ang < deg_tol, (i, E)


def new_map(c, name="reg", **kw) -> str:
    body = {"name": name, "voxel_size_m": 0.25, "layers": ["tsdf"], "registration": REGISTRATION}
    r = c.post("/v1/maps", json={**body, **kw})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def post(c, mid, i, pose=None, frame_id=None) -> dict:
    msg = wire.lidar_message(room_scan(i), pose, float(i), frame_id)
    r = c.post(f"/v1/maps/{mid}/frames", content=wire.packb(msg), headers=MSGPACK_HEADERS)
    assert r.status_code == 200, r.text
    return msgpack.unpackb(r.content)


def test_http_frames_without_pose_are_registered(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        assert c.get(f"/v1/maps/{mid}").json()["config"]["registration"] == REGISTRATION
        acks = [post(c, mid, i, frame_id=f"f{i}") for i in range(6)]
        assert [a["seq"] for a in acks] == list(range(1, 7)) and acks[2]["frame_id"] == "f2"
        assert len(acks[0]["T_world_sensor"]) == 16
        np.testing.assert_array_equal(ack_pose(acks[0]), np.eye(4))  # the first scan defines the world
        for i, a in enumerate(acks):
            assert_pose_close(a["T_world_sensor"], i)
            assert i == 0 or (a["registration"]["converged"] and a["registration"]["fitness"] > 0.3)
        # a posed frame: the ack echoes the pose, no registration; JSON works without a pose too
        posed = post(c, mid, 6, room_pose(6))
        np.testing.assert_array_equal(ack_pose(posed), room_pose(6))
        assert posed.get("registration") is None
        r = c.post(f"/v1/maps/{mid}/frames", json={"kind": "lidar", "points": room_scan(7, 500).tolist()})
        assert r.status_code == 200, r.text
        assert_pose_close(r.json()["T_world_sensor"], 7)
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 8


def test_ws_stream_mixed_poses(tmp_path):
    """Posed frames first (their world frame), then frames without a pose, over one WebSocket."""
    with client(tmp_path) as c:
        mid = new_map(c)
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            for i in range(6):
                msg = wire.lidar_message(room_scan(i), room_pose(i) if i < 2 else None, float(i), f"w{i}")
                ws.send_bytes(wire.packb(msg))
            acks = [msgpack.unpackb(ws.receive_bytes()) for _ in range(6)]
        assert [a["frame_id"] for a in acks] == [f"w{i}" for i in range(6)]
        for i, a in enumerate(acks):
            assert_pose_close(a["T_world_sensor"], i)
            assert ("registration" in a) == (i >= 2)


def test_client_sends_without_pose(tmp_path):
    with client(tmp_path) as tc, MapperClient() as c:
        c._http.close()
        c._http = tc  # the app in-process (TestClient is an httpx.Client)
        mid = c.create_map(name="c", voxel_size_m=0.25, layers=["tsdf"], registration=REGISTRATION)["id"]
        acks = [c.send_lidar(mid, room_scan(i)) for i in range(3)]
        for i, a in enumerate(acks):
            assert_pose_close(ack_pose(a), i)


def test_restart_replays_estimated_poses(tmp_path):
    """Snapshot after 3 frames, 2 more in the log only. The crash image (data dir copied while serving:
    snapshot + log replay) has the same map and tracks the next frame to the same pose, bit for bit, as the
    service that went on; after a clean shutdown the restored map continues as an in-process Map does."""
    surface = [[8.9, 0.0, 0.0], [0.0, 5.9, 0.0], [2.0, 1.0, -1.1]]
    with client(tmp_path) as c:
        mid = new_map(c)
        config = c.get(f"/v1/maps/{mid}").json()["config"]
        acks = [post(c, mid, i) for i in range(3)]
        assert c.post(f"/v1/maps/{mid}/snapshot").status_code == 200
        acks += [post(c, mid, i) for i in range(3, 5)]
        before = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": surface}).json()
        shutil.copytree(tmp_path / "data", tmp_path / "crash" / "data")  # as if killed now
        nxt = post(c, mid, 5)
    # the log holds each estimated pose with its frame
    logged = {}
    for seg in sorted((tmp_path / "crash" / "data" / "maps" / mid).glob("wal-*.log")):
        for seq, payload in read_wal(seg):
            rec = msgpack.unpackb(payload)
            T = wire.decode_array(rec["frame"]["T_world_sensor"], "T")
            logged[seq] = (rec.get("pose_estimated"), T.reshape(-1).tolist())
    for a in acks[3:]:
        assert logged[a["seq"]] == (True, a["T_world_sensor"])
    with client(tmp_path / "crash") as c:
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 5
        assert c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": surface}).json() == before
        again = post(c, mid, 5)
        assert again["T_world_sensor"] == nxt["T_world_sensor"] and again["seq"] == nxt["seq"]
    with client(tmp_path) as c:
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 6
        last = post(c, mid, 6)
    ref = Map(**config, device="cpu")
    poses = [ref.integrate_lidar(room_scan(i))["T_world_sensor"].numpy() for i in range(7)]
    np.testing.assert_array_equal(ack_pose(last), poses[6])
    assert_pose_close(last["T_world_sensor"], 6)

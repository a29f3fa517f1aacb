"""A frame that would add nothing to the map is refused with a 422 that says why, over HTTP and WebSocket,
for LiDAR and depth, and never reaches the write-ahead log (the next good frame gets the next seq, and a
restart replays only the good ones)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from test_service_helpers import client, frame_bytes, scan

from mapper import wire

CT = {"content-type": wire.MSGPACK}
MAX_RANGE_M = 20.0
VOXEL_M = 0.25
COORD_LIMIT_M = (1 << 20) * VOXEL_M  # the key range: the map's limit is a few voxels inside it


def lidar(points, T=None) -> bytes:
    return wire.packb(wire.lidar_message(np.asarray(points, np.float32), np.eye(4) if T is None else T, 0.0))


def depth_u16(raw, scale: float) -> bytes:
    return wire.packb(wire.depth_message(raw, [10, 10, 4, 4], np.eye(4), depth_scale=scale))


def far_pose() -> np.ndarray:
    """A sensor inside the key range whose in-range returns (+x, 15 m) all land outside it."""
    T = np.eye(4)
    T[0, 3] = COORD_LIMIT_M - 10.0  # inside the map's range; x + 15 m is beyond even 2^20 voxels
    return T


def useless_frames() -> list[tuple[str, bytes, str]]:
    """(what, frame, a word its 422 must name). Each is well-formed: the decoder alone accepts it."""
    n = 200
    far = np.full((n, 3), 1e30, np.float32)
    beyond = np.tile([[MAX_RANGE_M + 5.0, 0.0, 0.0]], (n, 1))
    mixed = np.concatenate([far, beyond, np.full((n, 3), np.nan), np.zeros((n, 3))])
    outside = np.tile([[15.0, 0.0, 0.0]], (n, 1))
    raw = np.full((8, 8), 1000, np.uint16)
    return [
        ("lidar at 1e30", lidar(far), "max_range_m"),
        ("lidar beyond max range", lidar(beyond), "max_range_m"),
        ("lidar all filtered (far, NaN, at the sensor)", lidar(mixed), "max_range_m"),
        ("lidar beyond the key range", lidar(outside, far_pose()), "coordinate range"),
        ("uint16 depth, scale -> every pixel inf", depth_u16(raw, 1e-300), "depth_scale"),
        ("uint16 depth, scale -> beyond max range", depth_u16(raw, 1.0), "max_range_m"),
    ]


@pytest.fixture
def c(tmp_path):
    with client(tmp_path) as c:
        body = {"name": "m", "voxel_size_m": VOXEL_M, "layers": ["tsdf"], "max_range_m": MAX_RANGE_M}
        r = c.post("/v1/maps", json=body)
        assert r.status_code == 201, r.text
        c.map_id = r.json()["id"]
        yield c


def test_decoder_alone_accepts_them():
    """The refusals come from the map-aware check, not from the decoder (which has no map)."""
    for _, data, _ in useless_frames():
        wire.parse_frame(wire.unpackb(data))  # raises if the decoder already refused it
    # and the check itself, against the numbers it is given
    f = wire.parse_frame(wire.unpackb(lidar([[MAX_RANGE_M - 1, 0, 0], [1e30, 0, 0]])))
    wire.check_usable(f, MAX_RANGE_M, COORD_LIMIT_M)  # one usable point is enough
    with pytest.raises(wire.InvalidArgument, match="max_range_m"):
        wire.check_usable(f, MAX_RANGE_M - 2, COORD_LIMIT_M)


def test_http_refuses_frames_that_add_nothing(c):
    url = f"/v1/maps/{c.map_id}/frames"
    for what, data, word in useless_frames():
        r = c.post(url, content=data, headers=CT)
        assert r.status_code == 422, (what, r.text)
        body = r.json()
        assert body["type"] == "invalid_argument" and word in body["detail"], (what, body)
        assert "nothing would be integrated" in body["detail"]
    # nothing was logged: the first good frame takes seq 1, and a partly usable frame is accepted
    pts, T = scan(0, 500)
    pts[:400] = 1e30
    r = c.post(url, content=lidar(pts, T), headers=CT)
    assert r.status_code == 200, r.text
    assert r.json()["seq"] == 1 and r.json()["points_used"] == 100 and r.json()["points_dropped"] == 400
    assert c.get(f"/v1/maps/{c.map_id}").json()["frames_integrated"] == 1


def test_websocket_refuses_them_in_place_of_acks(c):
    bad = useless_frames()
    with c.websocket_connect(f"/v1/maps/{c.map_id}/stream") as ws:
        for _, data, _ in bad:
            ws.send_bytes(data)
        ws.send_bytes(frame_bytes(0, n=500, frame_id="good"))
        replies = [msgpack.unpackb(ws.receive_bytes()) for _ in range(len(bad) + 1)]
    for (what, _, word), rep in zip(bad, replies[:-1], strict=True):
        assert rep["status"] == 422 and rep["type"] == "invalid_argument", (what, rep)
        assert word in rep["detail"], (what, rep)
        assert "seq" not in rep
    assert replies[-1]["seq"] == 1 and replies[-1]["frame_id"] == "good"
    assert c.get(f"/v1/maps/{c.map_id}").json()["frames_integrated"] == 1


def test_refused_frames_are_not_in_the_wal(tmp_path):
    """After a restart the map replays exactly the one good frame."""
    with client(tmp_path) as c:
        body = {"name": "m", "voxel_size_m": VOXEL_M, "layers": ["tsdf"], "max_range_m": MAX_RANGE_M}
        mid = c.post("/v1/maps", json=body).json()["id"]
        for _, data, _ in useless_frames():
            assert c.post(f"/v1/maps/{mid}/frames", content=data, headers=CT).status_code == 422
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0, n=500), headers=CT).json()["seq"] == 1
    with client(tmp_path) as c:
        info = c.get(f"/v1/maps/{mid}").json()
        assert info["frames_integrated"] == 1
        r = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(1, n=500), headers=CT)
        assert r.json()["seq"] == 2

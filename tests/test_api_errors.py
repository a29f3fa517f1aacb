"""Bad input gets a clear 4xx ({"type", "detail"}) and the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from starlette.testclient import WebSocketDenialResponse
from test_service_helpers import READ_TOKEN, TOKEN, client, frame_bytes, scan

from mapper import wire

CT = {"content-type": wire.MSGPACK}


def check_error(r, status: int, type_: str | None = None, match: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "detail"} and body["detail"], body
    if type_:
        assert body["type"] == type_, body
    if match:
        assert match in body["detail"], body
    return body


@pytest.fixture
def c(tmp_path):
    with client(tmp_path, max_body_bytes=1 << 20, max_points_per_frame=20_000, max_query_points=1000) as c:
        c.map_id = c.post("/v1/maps", json={"name": "m", "voxel_size_m": 0.25}).json()["id"]
        yield c


def frame(**override) -> bytes:
    pts, T = scan(0, 500)
    msg = wire.lidar_message(pts, T, 0.0)
    msg.update(override)
    return wire.packb(msg)


def test_malformed_msgpack(c):
    for body in (b"\xc1", b"\x92\x01", frame()[:-10], b""):
        check_error(c.post(f"/v1/maps/{c.map_id}/frames", content=body, headers=CT), 400, "malformed_message")
    check_error(c.post(f"/v1/maps/{c.map_id}/frames", content=wire.packb([1, 2]), headers=CT), 400)
    check_error(c.post(f"/v1/maps/{c.map_id}/frames", content=b"{not json"), 400, "malformed_message")
    check_error(
        c.post(f"/v1/maps/{c.map_id}/frames", content=b"x", headers={"content-type": "text/csv"}), 400
    )


@pytest.mark.parametrize(
    "override, status, match",
    [
        ({"points": wire.encode_array(np.zeros((10, 3), np.int32))}, 422, "dtype"),
        ({"points": wire.encode_array(np.zeros((10, 3), np.uint8))}, 422, "dtype"),
        ({"points": {"dtype": "float16", "shape": [1, 3], "data": b"\0" * 6}}, 422, "dtype"),
        ({"points": wire.encode_array(np.zeros((10, 5), np.float32))}, 422, "shape"),
        ({"points": wire.encode_array(np.zeros((30,), np.float32))}, 422, "shape"),
        ({"points": {"dtype": "float32", "shape": [10, 3], "data": b"\0" * 7}}, 422, "bytes"),
        ({"points": wire.encode_array(np.zeros((0, 3), np.float32))}, 422, "empty"),
        ({"points": wire.encode_array(np.full((10, 3), np.nan, np.float32))}, 422, "finite"),
        ({"points": wire.encode_array(np.array([[1, 2, np.inf]] * 3, np.float32))}, 422, "Inf"),
        ({"T_world_sensor": [float("nan")] * 16}, 422, "NaN"),
        ({"T_world_sensor": [2.0] * 16}, 422, "rotation"),
        ({"kind": "sonar"}, 422, "kind"),
        ({"timestamp": "yesterday"}, 422, "timestamp"),
        ({"points": wire.encode_array(np.zeros((20_001, 3), np.float32))}, 413, "limit"),
    ],
)
def test_bad_frames(c, override, status, match):
    check_error(
        c.post(f"/v1/maps/{c.map_id}/frames", content=frame(**override), headers=CT), status, match=match
    )
    assert c.get("/healthz").status_code == 200


def test_bad_depth_frames(c):
    good = dict(depth=np.ones((8, 8), np.float32), K=[10, 10, 4, 4], T_world_sensor=np.eye(4))
    cases = [
        ({"depth": np.zeros((8, 8), np.float32)}, "empty"),
        ({"depth": np.full((8, 8), np.inf, np.float32)}, "Inf"),
        ({"K": [-1, 10, 4, 4]}, "focal"),
        ({"color": np.zeros((4, 4, 3), np.uint8)}, "color"),
    ]
    for change, match in cases:
        args = {**good, **change}
        msg = wire.depth_message(args["depth"], args["K"], args["T_world_sensor"], color=args.get("color"))
        check_error(
            c.post(f"/v1/maps/{c.map_id}/frames", content=wire.packb(msg), headers=CT), 422, match=match
        )
    msg = wire.depth_message(np.ones((8, 8), np.uint16), [10, 10, 4, 4], np.eye(4))
    check_error(
        c.post(f"/v1/maps/{c.map_id}/frames", content=wire.packb(msg), headers=CT), 422, match="depth_scale"
    )


def test_nan_rows_are_dropped_not_rejected(c):
    pts, T = scan(0, 500)
    pts[:100] = np.nan
    r = c.post(f"/v1/maps/{c.map_id}/frames", content=wire.packb(wire.lidar_message(pts, T)), headers=CT)
    assert r.status_code == 200 and r.json()["points_dropped"] == 100


def test_oversized_bodies(c):
    big = b"\0" * ((1 << 20) + 1)
    check_error(c.post(f"/v1/maps/{c.map_id}/frames", content=big, headers=CT), 413, "payload_too_large")

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(20):
            yield b"\0" * 65536

    check_error(c.post(f"/v1/maps/{c.map_id}/frames", content=chunks(), headers=CT), 413)
    pts = {"points": [[0.0, 0.0, 0.0]] * 1001}
    check_error(c.post(f"/v1/maps/{c.map_id}/query/distance", json=pts), 413, match="limit")


def test_bad_queries(c):
    url = f"/v1/maps/{c.map_id}/query/distance"
    check_error(c.post(url, content=b'{"points": [[0, 0, NaN]]}'), 422, match="NaN")
    check_error(c.post(url, content=b'{"points": [[0, 0, Infinity]]}'), 422, match="Inf")
    check_error(c.post(url, json={"points": [[0, 0]]}), 422, match="shape")
    check_error(c.post(url, json={"points": []}), 422)
    check_error(c.post(url, json={"pts": [[0, 0, 0]]}), 422, match="required")
    check_error(c.post(url, json={"points": [["a", "b", "c"]]}), 422)
    check_error(c.post(url, json=[1, 2, 3]), 400)
    check_error(
        c.post(f"/v1/maps/{c.map_id}/query/occupancy", json={"points": [[0, 0, 0]]}), 404, "not_found"
    )
    s = f"/v1/maps/{c.map_id}/esdf/slice"
    check_error(c.get(s), 422)
    check_error(c.get(s, params={"z": "nan"}), 422)
    check_error(c.get(s, params={"z": 0, "format": "gif"}), 422)
    check_error(c.get(s, params={"z": 0, "x_min": 0}), 422, match="all four")
    check_error(c.get(s, params={"z": 0, "x_min": 0, "y_min": 0, "x_max": 1e5, "y_max": 1e5}), 413)
    b = f"/v1/maps/{c.map_id}/esdf/box"
    check_error(c.post(b, json={"aabb_min": [0, 0, 0], "aabb_max": [0, 1, 1]}), 422)
    check_error(c.post(b, json={"aabb_min": [-1e3] * 3, "aabb_max": [1e3] * 3}), 413)
    check_error(c.get(f"/v1/maps/{c.map_id}/mesh", params={"since_version": -1}), 422)


def test_unknown_maps(c):
    for method, path in [
        ("get", ""),
        ("delete", ""),
        ("post", "/frames"),
        ("post", "/query/tsdf"),
        ("get", "/esdf/slice?z=0"),
        ("post", "/snapshot"),
        ("get", "/export"),
        ("post", "/decay"),
    ]:
        kw = {"content": frame(), "headers": CT} if path == "/frames" else {}
        if path == "/query/tsdf":
            kw = {"json": {"points": [[0, 0, 0]]}}
        check_error(getattr(c, method)(f"/v1/maps/nope{path}", **kw), 404, "not_found")
    check_error(c.get("/v1/maps/bad%20id!"), 422)
    check_error(c.get("/v1/nothing-here"), 404)
    with pytest.raises(WebSocketDenialResponse):
        with c.websocket_connect("/v1/maps/nope/stream"):
            pass


def test_bad_map_parameters_and_operations(c):
    for body in (
        {"voxel_size_m": -1},
        {"voxel_size_m": 0},
        {"layers": ["lidar"]},
        {"layers": ["color"]},
        {"layers": ["esdf"]},
        {"name": "has space"},
        {"unknown": 1},
        {"max_range_m": "far"},
        {"occupancy": {"l_hit": -1}},
        {"truncation_vox": 1e9},
    ):
        check_error(c.post("/v1/maps", json=body), 422)
    check_error(c.post("/v1/maps", content=b"{", headers={"content-type": "application/json"}), 422)
    m = f"/v1/maps/{c.map_id}"
    check_error(c.post(m + "/decay", json={"factor": 2}), 422)
    check_error(c.post(m + "/clear", json={"aabb_min": [1, 1, 1]}), 422)
    check_error(c.post(m + "/clear", json={"aabb_min": [1, 1, 1], "aabb_max": [0, 0, 0]}), 422)
    check_error(c.post("/v1/maps/import", content=b"not a snapshot"), 422, match="snapshot")
    check_error(c.post("/v1/maps/import", content=b""), 422)
    assert c.get("/readyz").status_code == 200


@pytest.fixture
def auth(tmp_path):
    with client(tmp_path, api_tokens=[TOKEN], read_tokens=[READ_TOKEN]) as c:
        yield c


def test_tokens(auth):
    c = auth
    full = {"Authorization": f"Bearer {TOKEN}"}
    read = {"Authorization": f"Bearer {READ_TOKEN}"}
    body = check_error(c.get("/v1/maps"), 401, "unauthorized")
    assert "missing" in body["detail"]
    assert c.get("/v1/maps").headers["www-authenticate"] == "Bearer"
    check_error(c.get("/v1/maps", headers={"Authorization": "Bearer wrong"}), 401, match="invalid")
    check_error(c.get("/v1/maps", headers={"Authorization": f"Basic {TOKEN}"}), 401)
    check_error(c.post("/v1/maps", json={}, headers=read), 403, "forbidden")
    mid = c.post("/v1/maps", json={}, headers=full).json()["id"]
    assert c.get("/v1/maps", headers=read).status_code == 200
    check_error(c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0, 200), headers=CT), 401)
    check_error(c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0, 200), headers={**CT, **read}), 403)
    assert (
        c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0, 200), headers={**CT, **full}).status_code
        == 200
    )
    check_error(c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [[0, 0, 0]]}), 401)
    assert c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [[0, 0, 0]]}, headers=read).status_code == 200
    check_error(c.delete(f"/v1/maps/{mid}", headers=read), 403)
    for path in ("/healthz", "/readyz"):  # probes need no token
        assert c.get(path).status_code == 200
    check_error(c.get("/metrics"), 401)  # the series name maps: a token once tokens are configured
    assert c.get("/metrics", headers=read).status_code == 200
    for kw in ({}, {"headers": {"Authorization": "Bearer wrong"}}, {"headers": read}):
        with pytest.raises(WebSocketDenialResponse):
            with c.websocket_connect(f"/v1/maps/{mid}/stream", **kw):
                pass
    with c.websocket_connect(f"/v1/maps/{mid}/stream?token={TOKEN}") as ws:
        ws.send_bytes(frame_bytes(1, 200))
        assert "seq" in wire.unpackb(ws.receive_bytes())
    with c.websocket_connect(f"/v1/maps/{mid}/stream", headers=full) as ws:
        ws.send_bytes(frame_bytes(2, 200))
        assert wire.unpackb(ws.receive_bytes())["seq"] == 3

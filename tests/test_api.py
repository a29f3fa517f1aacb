"""The HTTP/WebSocket API through TestClient (lifespan running): maps, frames, queries, durability."""

from __future__ import annotations

import shutil
import threading
import time

import msgpack
import numpy as np
import pytest
from test_service_helpers import MSGPACK_HEADERS, client, frame_bytes, scan, wait_ready

from mapper import Map, wire
from mapper.client import decode_arrays


def observed_points(frames=(0,), voxel=0.25, min_x=5.0, k=8) -> list[list[float]]:
    """Points where a map built here (the oracle) from the same frames has TSDF data (near the x wall)."""
    m = Map(voxel, layers=("tsdf",), device="cpu")
    for i in frames:
        m.integrate_lidar(*scan(i))
    g, side = m.layer("tsdf")
    centres = (g.ijk[side["weight"] > 0].double() + 0.5) * voxel
    centres = centres[centres[:, 0] > min_x]
    _, w = m.query_tsdf(centres)
    return centres[w > 0][:k].tolist()


WALL = observed_points()


def new_map(c, name="m", voxel=0.25, layers=("tsdf", "esdf"), **kw) -> str:
    r = c.post("/v1/maps", json={"name": name, "voxel_size_m": voxel, "layers": list(layers), **kw})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def post_frame(c, map_id, i=0, **kw):
    r = c.post(
        f"/v1/maps/{map_id}/frames", content=frame_bytes(i, **kw), headers={"content-type": wire.MSGPACK}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_maps_crud(tmp_path):
    with client(tmp_path) as c:
        r = c.post("/v1/maps", json={"name": "lab", "voxel_size_m": 0.1, "layers": ["tsdf", "occupancy"]})
        assert r.status_code == 201
        m = r.json()
        assert m["id"].replace("-", "").replace("_", "").isalnum() and m["name"] == "lab"
        assert m["config"]["voxel_size_m"] == 0.1 and m["config"]["layers"] == ["tsdf", "occupancy"]
        assert c.post("/v1/maps", json={"name": "lab"}).status_code == 409
        other = c.post("/v1/maps", json={}).json()  # all defaults; name = id
        assert other["name"] == other["id"] and other["config"]["layers"] == ["tsdf", "esdf"]
        assert {x["id"] for x in c.get("/v1/maps").json()["maps"]} == {m["id"], other["id"]}
        d = c.get(f"/v1/maps/{m['id']}").json()
        assert d["stats"]["frames_integrated"] == 0 and "tsdf" in d["stats"]["layers"]
        assert c.delete(f"/v1/maps/{m['id']}").status_code == 204
        assert c.get(f"/v1/maps/{m['id']}").status_code == 404
        assert not (tmp_path / "data" / "maps" / m["id"]).exists()


def test_frame_ack_then_query_sees_it(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        ack = post_frame(c, mid, 0, frame_id="a")
        assert ack["seq"] == 1 and ack["map_version"] >= 1 and ack["points_used"] == 3000
        assert ack["points_dropped"] == 0 and ack["integrate_ms"] > 0 and ack["frame_id"] == "a"
        r = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": WALL})
        assert r.status_code == 200, r.text
        assert all(w > 0 for w in r.json()["weight"])
        r = c.post(f"/v1/maps/{mid}/query/distance", json={"points": WALL})
        body = r.json()
        assert (
            len(body["distance"]) == len(WALL)
            and len(body["gradient"][0]) == 3
            and body["map_version"] == ack["map_version"]
        )
        assert post_frame(c, mid, 1)["seq"] == 2


def test_ack_and_queries_in_msgpack(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        r = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers=MSGPACK_HEADERS)
        assert r.headers["content-type"] == wire.MSGPACK
        assert msgpack.unpackb(r.content)["seq"] == 1
        pts = np.array(WALL * 50, np.float32)[:100]
        body = wire.packb({"points": wire.encode_array(pts)})
        r = c.post(f"/v1/maps/{mid}/query/distance", content=body, headers=MSGPACK_HEADERS)
        out = decode_arrays(msgpack.unpackb(r.content))
        assert out["distance"].shape == (100,) and out["gradient"].shape == (100, 3)
        assert out["observed"].dtype == np.uint8


def test_json_frame(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        pts, T = scan(0, 200)
        msg = {
            "kind": "lidar",
            "points": pts.tolist(),
            "T_world_sensor": T.ravel().tolist(),
            "timestamp": 1.0,
        }
        r = c.post(f"/v1/maps/{mid}/frames", json=msg)
        assert r.status_code == 200 and r.json()["points_used"] == 200


def test_depth_frame_with_color(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, voxel=0.05, layers=("tsdf", "color", "esdf"))
        depth = np.full((48, 64), 2.0, np.float32)
        depth[0, :] = 0.0  # no return
        color = np.full((48, 64, 3), 200, np.uint8)
        msg = wire.depth_message(depth, [50.0, 50.0, 32.0, 24.0], np.eye(4), color=color, timestamp=0.0)
        r = c.post(f"/v1/maps/{mid}/frames", content=wire.packb(msg), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 200, r.text
        assert r.json()["points_used"] == 47 * 64 and r.json()["points_dropped"] == 64
        u16 = wire.depth_message(
            (depth * 1000).astype(np.uint16), [50, 50, 32, 24], np.eye(4), depth_scale=1000
        )
        r = c.post(f"/v1/maps/{mid}/frames", content=wire.packb(u16), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 200
        t = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [[0.0, 0.0, 1.98]]}).json()
        assert t["weight"][0] > 0 and abs(t["tsdf"][0] - 0.02) < 0.03


def test_ws_stream_acks_in_order_and_bad_frames_do_not_kill_it(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            for i in range(4):
                ws.send_bytes(frame_bytes(i, frame_id=f"f{i}"))
            ws.send_bytes(b"\xc1 not msgpack")
            ws.send_text("text is not a frame")
            ws.send_bytes(frame_bytes(4, frame_id="f4"))
            replies = [msgpack.unpackb(ws.receive_bytes()) for _ in range(7)]
        assert [r.get("frame_id") for r in replies[:4]] == ["f0", "f1", "f2", "f3"]
        assert [r["seq"] for r in replies[:4]] == [1, 2, 3, 4]
        assert replies[4]["type"] == "malformed_message" and replies[4]["status"] == 400
        assert replies[5]["type"] == "malformed_message"
        assert replies[6]["seq"] == 5 and replies[6]["frame_id"] == "f4"
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 5


def test_ws_backpressure_never_drops(tmp_path):
    with client(tmp_path, queue_depth=1, max_batch=1, ws_max_in_flight=2) as c:
        mid = new_map(c, layers=("tsdf",))
        n = 12
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            got = []
            for i in range(n):
                ws.send_bytes(frame_bytes(i, n=500))
            for _ in range(n):
                got.append(msgpack.unpackb(ws.receive_bytes()))
        assert [a["seq"] for a in got] == list(range(1, n + 1))
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == n


def test_http_ingest_queue_full_is_429(tmp_path):
    with client(tmp_path, queue_depth=1, max_batch=1) as c:
        mid = new_map(c, layers=("tsdf",))
        entry = c.app.state.service.maps[mid]
        results = []

        def post(i):
            results.append(
                c.post(
                    f"/v1/maps/{mid}/frames",
                    content=frame_bytes(i, n=200),
                    headers={"content-type": wire.MSGPACK},
                ).status_code
            )

        def wait_for(cond):
            deadline = time.monotonic() + 30
            while not cond():
                assert time.monotonic() < deadline
                time.sleep(0.01)

        with entry.write_gate:  # the writer blocks inside its first batch; the queue fills behind it
            threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
            threads[0].start()
            wait_for(lambda: entry.last_seq == 1)  # the first frame is in the writer (WAL written)
            threads[1].start()
            wait_for(lambda: entry.queue.qsize() == 1)  # the second waits in the full queue
            r = c.post(
                f"/v1/maps/{mid}/frames",
                content=frame_bytes(9, n=200),
                headers={"content-type": wire.MSGPACK},
            )
            assert r.status_code == 429 and r.json()["type"] == "busy" and r.headers["retry-after"]
        for t in threads:
            t.join(30)
        assert results == [200, 200]


def test_queries_slices_and_boxes(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, layers=("tsdf", "occupancy", "esdf"))
        for i in range(2):
            post_frame(c, mid, i)
        occ = c.post(
            f"/v1/maps/{mid}/query/occupancy", json={"points": [[0.5, 0.0, 0.0], [100.0, 0, 0]]}
        ).json()
        assert occ["state"][1] == -1 and occ["state"][0] in (0, 1) and len(occ["probability"]) == 2
        png = c.get(f"/v1/maps/{mid}/esdf/slice", params={"z": 0.0})
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert png.content[:8] == b"\x89PNG\r\n\x1a\n"
        s = c.get(
            f"/v1/maps/{mid}/esdf/slice",
            params={
                "z": 0.0,
                "format": "msgpack",
                "x_min": -2,
                "y_min": -1,
                "x_max": 2,
                "y_max": 1,
                "resolution_m": 0.5,
            },
        )
        sl = decode_arrays(msgpack.unpackb(s.content))
        assert (
            sl["distance"].shape == (4, 8) and sl["origin_xy"] == [-2.0, -1.0] and sl["resolution_m"] == 0.5
        )
        js = c.get(f"/v1/maps/{mid}/esdf/slice", params={"z": 0.0, "format": "json"}).json()
        assert isinstance(js["distance"], list)
        b = c.post(
            f"/v1/maps/{mid}/esdf/box",
            json={"aabb_min": [0, 0, 0], "aabb_max": [1, 1, 0.5]},
            headers={"accept": wire.MSGPACK},
        )
        box = decode_arrays(msgpack.unpackb(b.content))
        assert box["distance"].shape == (4, 4, 2) and box["gradient"].shape == (4, 4, 2, 3)
        assert box["observed"].shape == (4, 4, 2)


@pytest.mark.skipif(not hasattr(Map, "mesh"), reason="Map.mesh has not landed yet")
def test_mesh_ply_and_incremental_msgpack(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, layers=("tsdf",))
        v1 = post_frame(c, mid, 0)["map_version"]
        ply = c.get(f"/v1/maps/{mid}/mesh")
        assert ply.status_code == 200 and ply.content.startswith(b"ply")
        full = decode_arrays(
            msgpack.unpackb(c.get(f"/v1/maps/{mid}/mesh", params={"format": "msgpack"}).content)
        )
        assert len(full["faces"]["data"] if isinstance(full["faces"], dict) else full["faces"]) > 0
        post_frame(c, mid, 1)
        delta = c.get(f"/v1/maps/{mid}/mesh", params={"format": "msgpack", "since_version": v1})
        assert delta.status_code == 200


def test_clear_and_decay(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        post_frame(c, mid, 0)
        r = c.post(f"/v1/maps/{mid}/clear", json={"aabb_min": [5, -7, -2], "aabb_max": [7, 7, 2]})
        assert r.status_code == 200 and r.json()["seq"] == 2
        t = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [WALL[0]]}).json()
        assert t["weight"][0] == 0
        r = c.post(f"/v1/maps/{mid}/clear", json={"keep_center_m": [0, 0, 0], "keep_radius_m": 3.0})
        assert r.status_code == 200
        r = c.post(f"/v1/maps/{mid}/decay", json={"factor": 0.5, "threshold": 1000.0})
        assert r.status_code == 200 and r.json()["bricks_freed"]["tsdf"] > 0
        assert c.post(f"/v1/maps/{mid}/clear").status_code == 200
        assert c.get(f"/v1/maps/{mid}").json()["stats"]["layers"]["tsdf"]["voxels"] == 0


def test_snapshot_export_import(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, name="orig")
        for i in range(3):
            post_frame(c, mid, i)
        snap = c.post(f"/v1/maps/{mid}/snapshot").json()
        assert snap["seq"] == 3 and snap["bytes"] > 0
        exp = c.get(f"/v1/maps/{mid}/export")
        assert exp.status_code == 200 and exp.headers["x-mapper-seq"] == "3"
        r = c.post(
            "/v1/maps/import", content=exp.content, headers={"content-type": "application/octet-stream"}
        )
        assert r.status_code == 201, r.text
        new = r.json()
        assert new["id"] != mid and new["name"] != "orig" and new["frames_integrated"] == 3
        r2 = c.post("/v1/maps/import", params={"name": "copy"}, content=exp.content)
        assert r2.json()["name"] == "copy"
        pts = {"points": WALL}
        a = c.post(f"/v1/maps/{mid}/query/tsdf", json=pts).json()
        b = c.post(f"/v1/maps/{new['id']}/query/tsdf", json=pts).json()
        assert a["tsdf"] == b["tsdf"] and a["weight"] == b["weight"]


def test_restart_restores_snapshot_and_wal(tmp_path):
    """Clean shutdown (snapshot) and a crash image (data dir copied while serving: WAL only)."""
    with client(tmp_path) as c:
        mid = new_map(c, name="keep")
        for i in range(3):
            post_frame(c, mid, i)
        c.post(f"/v1/maps/{mid}/snapshot")
        post_frame(c, mid, 3)
        post_frame(c, mid, 4)
        before = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": WALL}).json()
        shutil.copytree(tmp_path / "data", tmp_path / "crash" / "data")  # as if killed now
    for root in (tmp_path, tmp_path / "crash"):
        with client(root) as c:
            d = c.get(f"/v1/maps/{mid}").json()
            assert d["name"] == "keep" and d["frames_integrated"] == 5 and d["last_seq"] == 5
            assert (
                c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": WALL}).json()["tsdf"] == before["tsdf"]
            )
            assert post_frame(c, mid, 5)["seq"] == 6


def test_metrics_health_and_docs(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        post_frame(c, mid, 0)
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            ws.send_bytes(frame_bytes(1))
            ws.receive_bytes()
        c.post(f"/v1/maps/{mid}/query/distance", json={"points": WALL})
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json()["status"] == "ready"
        text = c.get("/metrics").text
        assert f'mapper_frames_total{{kind="lidar",map="{mid}",name="m"}} 2.0' in text
        for needle in (
            'mapper_stage_seconds_count{stage="grow"}',
            'mapper_stage_seconds_count{stage="esdf"}',
            "mapper_active_voxels{",
            "mapper_layer_bytes{",
            "mapper_queue_depth{",
            'mapper_ack_seconds_count{transport="ws"}',
            'mapper_query_seconds_count{kind="distance"}',
            'route="/v1/maps/{map_id}/frames"',
            "mapper_wal_fsync_seconds_count",
        ):
            assert needle in text, needle
        spec = c.get("/openapi.json").json()
        assert "/v1/maps/{map_id}/query/distance" in spec["paths"] and c.get("/docs").status_code == 200


def test_concurrent_queries_during_ingest(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c)
        post_frame(c, mid, 0)
        stop = threading.Event()
        errors = []

        def query():
            while not stop.is_set():
                r = c.post(f"/v1/maps/{mid}/query/distance", json={"points": WALL})
                if r.status_code != 200:
                    errors.append(r.text)

        qs = [threading.Thread(target=query) for _ in range(2)]
        for t in qs:
            t.start()
        for i in range(1, 5):
            post_frame(c, mid, i)
        stop.set()
        for t in qs:
            t.join(30)
        assert not errors
        wait_ready(c)

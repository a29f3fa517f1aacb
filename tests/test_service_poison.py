"""No request may take down the service or lose a map (issue 10, part B), black box over HTTP/WS:
poison frames are refused before the write-ahead log, a record that fails on replay is quarantined,
imports are checked like create requests, and the low findings (metrics token, auth before the body,
pose shape and translation bound, booleans as numbers, loopback-only without tokens)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import zlib

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from test_service_helpers import READ_TOKEN, TOKEN, client, free_port, scan, settings

from mapper import Map, wire
from mapper.api import create_app
from mapper.api.deps import attachment
from mapper.persistence import DataDir
from mapper.store import encode_record

CT = {"content-type": wire.MSGPACK}
POINTS = [[5.9, 0.0, 0.0], [0.0, 5.9, 0.0], [3.0, -5.9, 0.0], [-5.9, 2.0, -0.5]]


def check_error(r, status: int, match: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "detail"}, body
    if match:
        assert match in body["detail"], body
    return body


def depth_msg(K, T=None) -> dict:
    depth = np.full((24, 32), 2.0, np.float32)
    return wire.depth_message(depth, np.asarray(K, np.float64), np.eye(4) if T is None else T)


def lidar_json(i: int = 0, n: int = 300, **override) -> dict:
    pts, T = scan(i, n)
    msg = {"kind": "lidar", "points": pts.tolist(), "T_world_sensor": T.reshape(-1).tolist()}
    msg.update(override)
    return msg


def post_lidar(c, mid, i: int, n: int = 500):
    r = c.post(f"/v1/maps/{mid}/frames", content=wire.packb(wire.lidar_message(*scan(i, n))), headers=CT)
    assert r.status_code == 200, r.text
    return r.json()


def reference(frames: list[int], n: int = 500) -> Map:
    """The map the good frames alone make (the library, no service)."""
    m = Map(voxel_size_m=0.25, layers=("tsdf",), device="cpu")
    for i in frames:
        m.integrate_lidar(*scan(i, n))
    return m


def query_tsdf(c, mid) -> np.ndarray:
    r = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": POINTS})
    assert r.status_code == 200, r.text
    return np.array([np.nan if v is None else v for v in r.json()["tsdf"]], dtype=np.float64)


# ------------------------------------------------------------------------------ poison frames (finding 2)
def test_poison_frame_is_refused_and_the_map_survives_a_restart(tmp_path):
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "lab", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        post_lidar(c, mid, 0)
        post_lidar(c, mid, 1)
        # the finding: K = [1e-30, 1e-30, 320, 240] passed, was logged, failed with an IndexError (500)
        body = wire.packb(depth_msg([1e-30, 1e-30, 16, 12]))
        check_error(c.post(f"/v1/maps/{mid}/frames", content=body, headers=CT), 422, "K: fx=1e-30")
        assert c.get(f"/v1/maps/{mid}").json()["last_seq"] == 2  # never reached the log
        before = query_tsdf(c, mid)
    with client(tmp_path) as c:
        ready = c.get("/readyz").json()
        assert ready["failed"] == {} and ready["quarantined"] == {}
        m = c.get(f"/v1/maps/{mid}").json()
        assert m["frames_integrated"] == 2 and m["name"] == "lab"
        np.testing.assert_array_equal(query_tsdf(c, mid), before)
        ref = reference([0, 1])
        np.testing.assert_allclose(before, ref.query_tsdf(torch.tensor(POINTS))[0].double().numpy())


@pytest.mark.parametrize(
    "K, match",
    [
        ([1e-3, 1e-3, 16, 12], "more than 85 deg"),  # ~180 deg field of view (ran for minutes before)
        ([1.3, 500.0, 16, 12], "fx=1.3"),  # 16 / 1.3 = 12.3 > tan(85 deg) = 11.43
        ([1e7, 1e7, 16, 12], "field of view"),  # 0.0002 deg
        ([30.0, 30.0, 1e9, 12], "principal point cx"),
        ([30.0, 30.0, 16, -100], "principal point cy"),
        ([[30.0, 1.0, 16], [0, 30.0, 12], [0, 0, 1]], "skew"),
        ([[30.0, 0, 16], [0, 30.0, 12], [0, 0, 2]], "skew"),
        ([0.0, 30.0, 16, 12], "positive"),
    ],
)
def test_intrinsics_outside_a_sane_field_of_view_are_refused(tmp_path, K, match):
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf", "occupancy"]}).json()["id"]
        msg = depth_msg([30.0, 30.0, 16, 12])
        msg["K"] = K
        check_error(c.post(f"/v1/maps/{mid}/frames", content=wire.packb(msg), headers=CT), 422, match)
        ok = depth_msg([30.0, 30.0, 16, 12])  # 56 x 43 deg: fine
        assert c.post(f"/v1/maps/{mid}/frames", content=wire.packb(ok), headers=CT).status_code == 200
        assert c.get(f"/v1/maps/{mid}").json()["last_seq"] == 1


def test_library_refuses_the_same_intrinsics_and_poses():
    m = Map(voxel_size_m=0.25, layers=("tsdf",), device="cpu")
    depth = np.full((24, 32), 2.0, np.float32)
    with pytest.raises(ValueError, match="more than 85 deg"):
        m.integrate_depth(depth, [1e-30, 1e-30, 16, 12], np.eye(4))
    T = np.eye(4)
    T[0, 3] = 1e12
    with pytest.raises(ValueError, match="coordinate range"):
        m.integrate_lidar(scan(0, 100)[0], T)
    # 2^20 voxels of 0.25 m = 262 km: the edge of the range, by hand
    T[0, 3] = (2**20 - 8) * 0.25 + 1.0
    with pytest.raises(ValueError, match="coordinate range"):
        m.integrate_depth(depth, [30.0, 30.0, 16, 12], T)
    T[0, 3] = (2**20 - 8) * 0.25 - 1.0
    m.integrate_depth(depth, [30.0, 30.0, 16, 12], T)
    with pytest.raises(ValueError, match="85 deg"):
        m.raycast(np.eye(4), [1e-3, 1e-3, 16, 12], 32, 24)


# ------------------------------------------------------------------------- quarantine on replay (finding 2)
def test_a_failing_record_is_quarantined_and_replay_goes_on(tmp_path):
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        post_lidar(c, mid, 0)
        post_lidar(c, mid, 1)
    # by hand, bypassing validation: seq 3 the poison depth frame, 5 a record without "op" (KeyError),
    # 7 not even a map (AttributeError); good frames in between
    mdir = DataDir(tmp_path / "data").map_dir(mid)
    wal = mdir.open_wal(3)
    poison = {"op": "frame", "frame": depth_msg([1e-30, 1e-30, 16, 12])}
    good = [encode_record("frame", wire.parse_frame(wire.lidar_message(*scan(i, 500)))) for i in (2, 3, 4)]
    records = [wire.packb(poison), good[0], wire.packb({"frame": 1}), good[1], wire.packb([1]), good[2]]
    for seq, rec in enumerate(records, start=3):
        wal.append(seq, rec)
    wal.close()
    with client(tmp_path) as c:
        ready = c.get("/readyz").json()
        assert ready["failed"] == {}
        q = ready["quarantined"][mid]
        assert q["count"] == 3 and [r["seq"] for r in q["records"]] == [3, 5, 7]
        assert "K: fx=1e-30" in q["records"][0]["error"] and "KeyError" in q["records"][1]["error"]
        m = c.get(f"/v1/maps/{mid}").json()
        assert m["frames_integrated"] == 5 and m["last_seq"] == 8
        metrics = c.get("/metrics").text
        assert f'mapper_wal_quarantined_records_total{{map="{mid}",name="{mid}"}} 3.0' in metrics
        got = query_tsdf(c, mid)
    ref = reference([0, 1, 2, 3, 4]).query_tsdf(torch.tensor(POINTS))[0].double().numpy()
    np.testing.assert_allclose(got, ref)
    qdir = mdir.root / "quarantine"
    assert (qdir / f"{3:016d}.msgpack").read_bytes() == wire.packb(poison)
    assert json.loads((qdir / f"{5:016d}.json").read_text())["seq"] == 5
    with client(tmp_path) as c:  # covered by the post-recovery snapshot: nothing replays twice
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 5
        assert c.get("/readyz").json()["quarantined"][mid]["count"] == 3  # still listed (from disk)
        assert "mapper_wal_quarantined_records_total{" not in c.get("/metrics").text


# ------------------------------------------------------------------------------------- imports (finding 3)
def _with_meta(data: bytes, edit) -> bytes:
    tensors = st_load(data)
    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["mapper"])
    edit(meta)
    return st_save(tensors, metadata={"mapper": json.dumps(meta)})


def _set(path: str, value):
    def edit(meta):
        *head, last = path.split(".")
        d = meta
        for k in head:
            d = d[k]
        d[last] = value

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set("info.name", 12345), "expected a string"),
        (_set("info.name", "../../etc/passwd"), "does not match"),
        (_set("info.name", "lab\r\nX-Evil: 1"), "does not match"),
        (_set("info", "lab"), "info is not an object"),
        (_set("config.layers", ["color"]), "'color' needs 'tsdf'"),
        (_set("config.layers", ["walls"]), "config.layers"),
        (_set("config.voxel_size_m", True), "config.voxel_size_m"),
        (_set("config.voxel_size_m", -1.0), "config.voxel_size_m"),
        (_set("config.occupancy", {"l_hit": "x"}), "config.occupancy"),
        (_set("config", [1, 2]), "config"),
        # every other field range-checked like create (issue 29, finding 4), the field named
        (_set("version", 2**70), "version: expected an integer in [0, 9007199254740992]"),
        (_set("version", -1), "version"),
        (_set("version", 1.5), "version: expected an integer"),
        (_set("frames_integrated", -5), "frames_integrated"),
        (_set("wal_seq", -3), "wal_seq"),
        (_set("wal_seq", 2**70), "wal_seq"),
        (_set("trajectory_start", 2**70), "trajectory_start"),
        (_set("trajectory_start", "0"), "trajectory_start: expected an integer"),
        (_set("format", 99), "format"),
        (_set("info.memory_budget_bytes", -1), "info.memory_budget_bytes"),
        (_set("info.memory_budget_bytes", 0), "info.memory_budget_bytes"),
        (_set("info.memory_budget_bytes", 1e30), "info.memory_budget_bytes: expected an integer"),
        (_set("info.memory_budget_bytes", 2**51), "info.memory_budget_bytes"),
        (_set("info.memory_budget_bytes", True), "info.memory_budget_bytes"),
        (_set("config.esdf_voxel_size_m", 1e9), "config.esdf_voxel_size_m"),
    ],
)
def test_bad_import_is_refused_and_leaves_nothing_behind(tmp_path, edit, match):
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "lab", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        post_lidar(c, mid, 0, 300)
        data = c.get(f"/v1/maps/{mid}/export").content
        bad = _with_meta(data, edit)
        r = c.post("/v1/maps/import", content=bad, headers={"content-type": "application/octet-stream"})
        assert 400 <= r.status_code < 500, r.text
        assert match in r.json()["detail"], r.json()
        listed = c.get("/v1/maps")
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["maps"]] == [mid]
        ok = c.post("/v1/maps/import", content=data, params={"name": "copy"})  # the original imports
        assert ok.status_code == 201, ok.text
    assert sorted(p.name for p in (tmp_path / "data" / "maps").iterdir()) == sorted([mid, ok.json()["id"]])
    with client(tmp_path) as c:
        listed = c.get("/v1/maps")
        assert listed.status_code == 200 and {m["name"] for m in listed.json()["maps"]} == {"lab", "copy"}


def test_import_keeps_a_valid_stored_budget_and_refuses_a_map_over_it(tmp_path):
    """``info.memory_budget_bytes`` of an import is the map's budget (range-checked); a map larger than it
    is refused (507) before anything is written."""
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "lab", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        post_lidar(c, mid, 0, 300)
        data = c.get(f"/v1/maps/{mid}/export").content
        ok = c.post("/v1/maps/import", content=_with_meta(data, _set("info.memory_budget_bytes", 1 << 30)))
        assert ok.status_code == 201, ok.text
        assert ok.json()["memory_budget_bytes"] == 1 << 30
        small = c.post("/v1/maps/import", content=_with_meta(data, _set("info.memory_budget_bytes", 1)))
        assert small.status_code == 507 and "the map's: 1 bytes" in small.json()["detail"]
        assert len(c.get("/v1/maps").json()["maps"]) == 2
    with client(tmp_path) as c:  # the budget is stored: it survives a restart
        assert c.get(f"/v1/maps/{ok.json()['id']}").json()["memory_budget_bytes"] == 1 << 30


def test_an_old_import_with_absurd_metadata_fails_that_map_only(tmp_path):
    """Issue 29, finding 1: a map imported before imports were range-checked (``version`` 2^70, one frame
    logged after it) used to kill the restore task on restart (every map 503 "restoring" forever). Now
    that map fails alone (its snapshot 0 is its base: it is not rebuilt empty) and the others serve."""
    from mapper.persistence import manifest_bytes

    with client(tmp_path) as c:
        good = c.post("/v1/maps", json={"name": "good", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()[
            "id"
        ]
        post_lidar(c, good, 0, 300)
        data = c.get(f"/v1/maps/{good}/export").content
        old = c.post("/v1/maps/import", content=data, params={"name": "old"}).json()["id"]
        post_lidar(c, old, 1, 300)
    mdir = tmp_path / "data" / "maps" / old
    for f in mdir.glob(f"snapshot-{1:016d}.*"):  # as after a kill -9: snapshot 0 + the frame in the WAL
        f.unlink()
    info = json.loads((mdir / "info.json").read_text())
    del info["imported"]  # as written before the flag existed
    (mdir / "info.json").write_text(json.dumps(info))
    snap = mdir / f"snapshot-{0:016d}.safetensors"
    tensors = st_load(snap.read_bytes())
    header_len = int.from_bytes(snap.read_bytes()[:8], "little")
    meta = json.loads(json.loads(snap.read_bytes()[8 : 8 + header_len])["__metadata__"]["mapper"])
    meta["version"] = 2**70
    snap.write_bytes(st_save(tensors, metadata={"mapper": json.dumps(meta)}))
    crc = zlib.crc32(snap.read_bytes())  # a consistent snapshot: only its metadata is absurd
    (mdir / f"snapshot-{0:016d}.json").write_bytes(manifest_bytes(0, meta, snap.stat().st_size, crc))
    for _ in range(2):  # and again: nothing of the failed map was changed by the first try
        with client(tmp_path) as c:
            ready = c.get("/readyz")
            assert ready.status_code == 200
            assert "snapshot 0 (the map's base) is damaged" in ready.json()["failed"][old]
            assert [m["name"] for m in c.get("/v1/maps").json()["maps"]] == ["good"]
            assert c.get(f"/v1/maps/{old}").status_code == 404
            post_lidar(c, good, 2, 300)
        assert snap.exists() and not (mdir / "quarantine").exists()


def test_a_bad_stored_name_fails_that_map_only(tmp_path):
    with client(tmp_path) as c:
        good = c.post("/v1/maps", json={"name": "good", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()
        bad = c.post("/v1/maps", json={"name": "bad", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()
    for name, err in ((12345, "expected a string"), ("a\r\nb", "does not match")):
        path = tmp_path / "data" / "maps" / bad["id"] / "info.json"
        info = json.loads(path.read_text())
        info["name"] = name
        path.write_text(json.dumps(info))
        with client(tmp_path) as c:
            listed = c.get("/v1/maps")
            assert listed.status_code == 200 and [m["name"] for m in listed.json()["maps"]] == ["good"]
            assert err in c.get("/readyz").json()["failed"][bad["id"]]
            assert c.get(f"/v1/maps/{good['id']}/export").status_code == 200


def test_offline_save_refuses_a_bad_name(tmp_path):
    from mapper.store import save_new_map

    m = Map(voxel_size_m=0.25, layers=("tsdf",), device="cpu")
    for name in ("../../etc/passwd", "a\r\nb", 12345):
        with pytest.raises((ValueError, TypeError)):
            save_new_map(DataDir(tmp_path), m, name)  # type: ignore[arg-type]
    assert list((tmp_path / "maps").iterdir()) == []


@pytest.mark.parametrize("name", ["lab", "a\r\nb", 'x"; filename="evil', "../../etc/passwd", "Ω-map", ""])
def test_attachment_header_is_safe_for_any_name(name):
    import h11

    value = attachment(f"{name}-3.safetensors")
    assert "\r" not in value and "\n" not in value and value.count('"') == 2
    h11.Response(status_code=200, headers=[("content-disposition", value)])  # h11 accepts it
    from urllib.parse import unquote

    assert unquote(value.split("filename*=UTF-8''")[1]) == f"{name}-3.safetensors"


def test_export_and_mesh_carry_a_safe_file_name(tmp_path):
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "lab.v2", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()[
            "id"
        ]
        post_lidar(c, mid, 0, 300)
        r = c.get(f"/v1/maps/{mid}/export")
        assert r.headers["content-disposition"].startswith('attachment; filename="lab.v2-1.safetensors"')
        r = c.get(f"/v1/maps/{mid}/mesh", params={"format": "ply"})
        assert r.status_code == 200 and 'filename="lab.v2.ply"' in r.headers["content-disposition"]


# --------------------------------------------------------------------------------------- low findings (6)
def test_metrics_token(tmp_path):
    with client(tmp_path, metrics_token="scrape-1") as c:  # no API tokens: /v1 open, /metrics not
        check_error(c.get("/metrics"), 401)
        check_error(c.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/metrics", headers={"Authorization": "Bearer scrape-1"}).status_code == 200
        assert c.get("/v1/maps").status_code == 200
    with client(tmp_path / "b", api_tokens=TOKEN, read_tokens=READ_TOKEN, metrics_token="scrape-1") as c:
        for tok in ("scrape-1", TOKEN, READ_TOKEN):
            assert c.get("/metrics", headers={"Authorization": f"Bearer {tok}"}).status_code == 200
        check_error(c.get("/metrics"), 401)
        check_error(c.get("/v1/maps", headers={"Authorization": "Bearer scrape-1"}), 401)  # metrics only
    with client(tmp_path / "c") as c:  # nothing configured: open (loopback only, see below)
        assert c.get("/metrics").status_code == 200


def test_auth_comes_before_the_body(tmp_path):
    with client(tmp_path, api_tokens=TOKEN, read_tokens=READ_TOKEN) as c:
        full = {"Authorization": f"Bearer {TOKEN}"}
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25}, headers=full).json()["id"]
        writes = ["/v1/maps", f"/v1/maps/{mid}/frames", f"/v1/maps/{mid}/clear", f"/v1/maps/{mid}/decay"]
        writes.append("/v1/maps/import")
        reads = [f"/v1/maps/{mid}/esdf/box", f"/v1/maps/{mid}/query/distance", f"/v1/maps/{mid}/query/tsdf"]
        json_ct = {"content-type": "application/json"}
        for path in writes + reads:
            for headers in (json_ct, {**json_ct, "Authorization": "Bearer wrong"}):
                check_error(c.post(path, content=b"{not json", headers=headers), 401)
        read = {**json_ct, "Authorization": f"Bearer {READ_TOKEN}"}
        for path in writes:  # a read token on a write: 403, whatever the body
            check_error(c.post(path, content=b"{not json", headers=read), 403)
        for path in reads:  # a read: now the body's turn (400 malformed / 422 invalid JSON)
            assert c.post(path, content=b"{not json", headers=read).status_code in (400, 422)
        check_error(c.post("/v1/maps", content=b"{not json", headers={**json_ct, **full}), 422)


def test_pose_shape_and_translation(tmp_path):
    with client(tmp_path, max_pose_translation_m=100.0) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        url = f"/v1/maps/{mid}/frames"
        T = np.eye(4)
        T[0, 3] = 1e12  # the finding: acknowledged with points_used=1000 while every point was dropped
        check_error(c.post(url, json=lidar_json(T_world_sensor=T.reshape(-1).tolist())), 422, "translation")
        T[0, 3] = 150.0
        check_error(
            c.post(url, json=lidar_json(T_world_sensor=T.reshape(-1).tolist())),
            422,
            "MAPPER_MAX_POSE_TRANSLATION_M",
        )
        check_error(
            c.post(url, json=lidar_json(T_world_sensor=np.eye(4).reshape(2, 8).tolist())), 422, "shape"
        )
        check_error(
            c.post(url, json=lidar_json(T_world_sensor=np.eye(4).reshape(1, 16).tolist())), 422, "shape"
        )
        R = np.eye(4)
        R[0, 1] = 0.5
        check_error(c.post(url, json=lidar_json(T_world_sensor=R.reshape(-1).tolist())), 422, "rotation")
        T[0, 3] = 99.0
        assert c.post(url, json=lidar_json(T_world_sensor=T.reshape(-1).tolist())).status_code == 200
        assert c.get(f"/v1/maps/{mid}").json()["last_seq"] == 1
    with client(tmp_path / "b") as c:  # the map's own range: 2^20 voxels of 5 mm = 5.2 km
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.005, "layers": ["tsdf"]}).json()["id"]
        T = np.eye(4)
        T[1, 3] = -6000.0
        body = wire.packb(wire.lidar_message(scan(0, 300)[0], T))
        check_error(c.post(f"/v1/maps/{mid}/frames", content=body, headers=CT), 422, "coordinate range")
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            ws.send_bytes(body)
            ack = wire.unpackb(ws.receive_bytes())
            assert ack["status"] == 422 and "coordinate range" in ack["detail"]
        assert c.get(f"/v1/maps/{mid}").json()["last_seq"] == 0


def test_booleans_are_not_numbers(tmp_path):
    with client(tmp_path) as c:
        check_error(c.post("/v1/maps", json={"voxel_size_m": True}), 422, "voxel_size_m")
        check_error(
            c.post("/v1/maps", json={"registration": {"max_iterations": True}}), 422, "max_iterations"
        )
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        check_error(c.post(f"/v1/maps/{mid}/decay", json={"factor": True}), 422, "factor")
        check_error(
            c.post(f"/v1/maps/{mid}/clear", json={"aabb_min": [True, 0, 0], "aabb_max": [1, 1, 1]}), 422
        )
        url = f"/v1/maps/{mid}/frames"
        msg = lidar_json()
        msg["points"][3][1] = True
        check_error(c.post(url, json=msg), 422, "boolean")
        T = np.eye(4).reshape(-1).tolist()
        T[15] = True
        check_error(c.post(url, json=lidar_json(T_world_sensor=T)), 422, "boolean")
        check_error(c.post(url, json=lidar_json(timestamp=True)), 422, "timestamp")
        d = {"kind": "depth", "depth": np.full((24, 32), 2.0).tolist(), "T_world_sensor": np.eye(4).tolist()}
        check_error(c.post(url, json={**d, "K": [30.0, 30.0, 16, True]}), 422, "boolean")
        assert c.post(url, json={**d, "K": [30.0, 30.0, 16, 12]}).status_code == 200
        check_error(c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [[0, True, 0]]}), 422, "boolean")
        assert c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [[0, 1, 0]]}).status_code == 200


def test_no_tokens_serves_loopback_clients_only(tmp_path):
    app = create_app(settings(tmp_path))
    with TestClient(app, client=("192.0.2.7", 40000)) as c:
        body = check_error(c.get("/healthz"), 403, "only loopback clients")
        assert "192.0.2.7" in body["detail"]
        check_error(c.post("/v1/maps", json={}), 403)
        with pytest.raises(Exception):  # noqa: B017
            with c.websocket_connect("/v1/maps/x/stream"):
                pass
    for host in ("127.0.0.1", "::1"):
        with TestClient(create_app(settings(tmp_path)), client=(host, 40000)) as c:
            assert c.get("/healthz").status_code == 200
    with TestClient(create_app(settings(tmp_path, api_tokens=TOKEN)), client=("192.0.2.7", 1)) as c:
        check_error(c.get("/v1/maps"), 401)  # tokens configured: any client, with a token
        assert c.get("/v1/maps", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def _lan_address() -> str | None:
    """An address of this machine that is not loopback (to connect from), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_plain_uvicorn_factory_on_a_public_address_refuses_remote_clients(tmp_path):
    lan = _lan_address()
    if lan is None:
        pytest.skip("no non-loopback address on this machine")
    port = free_port()
    env = {**os.environ, "MAPPER_DATA_DIR": str(tmp_path), "MAPPER_DEVICE": "cpu"}
    env.pop("MAPPER_HOST", None)
    env.pop("MAPPER_API_TOKENS", None)
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "mapper.api:create_app", "--host", "0.0.0.0"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/maps", timeout=10).status_code == 200  # loopback
        r = httpx.get(f"http://{lan}:{port}/v1/maps", timeout=10)  # the same machine, another address
        assert r.status_code == 403 and "only loopback clients" in r.json()["detail"]
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_store_that_cannot_be_listed_is_retried_until_it_can(tmp_path, monkeypatch):
    """Recovery never dies silently: while the maps cannot be listed the service is not ready (retrying,
    one log line each time), then it recovers them."""
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "lab", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
    calls = []
    real = DataDir.map_ids

    def flaky(self):
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise OSError("the store is not mounted yet")
        return real(self)

    monkeypatch.setattr(DataDir, "map_ids", flaky)
    app = create_app(settings(tmp_path))
    with TestClient(app) as c:
        assert c.get("/readyz").status_code == 503
        deadline = time.monotonic() + 30
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [m["id"] for m in c.get("/v1/maps").json()["maps"]] == [mid]
    assert len(calls) == 3 and calls[2] - calls[0] >= 2.5  # waited 1 s, then 2 s

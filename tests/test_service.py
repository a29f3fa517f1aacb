"""A real ``mapper serve`` (uvicorn subprocess on a free loopback port) driven by MapperClient over HTTP
and WebSocket; restart; refusing to bind a public address without a token."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from test_service_helpers import TOKEN, Server, scan

from mapper.client import ApiError, MapperClient


@pytest.fixture
def server(tmp_path):
    with Server(tmp_path / "data", tmp_path / "server.log", MAPPER_API_TOKENS=TOKEN) as s:
        yield s


def test_client_end_to_end(server, tmp_path):
    with MapperClient(server.url, token=TOKEN) as c:
        assert c.health() == {"status": "ok"}
        m = c.create_map(name="robot", voxel_size_m=0.25, layers=["tsdf", "occupancy", "esdf"])
        mid = m["id"]
        assert c.find_map("robot")["id"] == mid and [x["id"] for x in c.list_maps()] == [mid]
        pts, T = scan(0)
        ack = c.send_lidar(mid, pts, T, timestamp=0.0, frame_id="h0")
        assert ack["seq"] == 1 and ack["points_used"] == len(pts) and ack["frame_id"] == "h0"
        with c.stream(mid, window=4) as s:
            for i in range(1, 9):
                s.send_lidar(*scan(i), timestamp=float(i), frame_id=f"w{i}")
        assert [a["seq"] for a in s.acks] == list(range(2, 10))
        assert [a["frame_id"] for a in s.acks] == [f"w{i}" for i in range(1, 9)]
        depth = np.full((30, 40), 3.0, np.float32)
        ack = c.send_depth(mid, depth, [40.0, 40.0, 20.0, 15.0], np.eye(4))
        assert ack["points_used"] == 1200
        q = np.array([[5.9, 0.0, 0.0], [0.0, 0.0, 0.0], [50.0, 50.0, 50.0]])
        d, g, obs = c.query_distance(mid, q)
        assert d.shape == (3,) and g.shape == (3, 3) and obs.dtype == bool and not obs[2]
        state, p = c.query_occupancy(mid, q)
        assert state.dtype == np.int8 and state[2] == -1 and p.shape == (3,)
        t, w = c.query_tsdf(mid, q)
        assert t.shape == w.shape == (3,)
        sl = c.esdf_slice(mid, 0.0, bounds=((-2, -2), (2, 2)), resolution_m=0.25)
        assert sl.distance.shape == (16, 16) and sl.origin_xy == (-2.0, -2.0)
        assert c.esdf_slice_png(mid, 0.0).startswith(b"\x89PNG")
        box = c.esdf_box(mid, [0, 0, 0], [1, 1, 1])
        assert box["distance"].shape == (4, 4, 4) and box["observed"].dtype == bool
        assert c.decay(mid, 0.9, 0.0)["seq"] == 11
        c.export(mid, tmp_path / "robot.safetensors")
        copy = c.import_map(tmp_path / "robot.safetensors", name="robot-copy")
        assert copy["frames_integrated"] == 10
        text = c.metrics()
        assert f'mapper_frames_total{{kind="lidar",map="{mid}",name="robot"}} 9.0' in text
        assert f'mapper_frames_total{{kind="depth",map="{mid}",name="robot"}} 1.0' in text
        with pytest.raises(ApiError) as e:
            c.get_map("nope")
        assert e.value.status == 404 and e.value.type == "not_found"
    with MapperClient(server.url) as anon, pytest.raises(ApiError) as e:
        anon.list_maps()
    assert e.value.status == 401
    with MapperClient(server.url, token="wrong") as bad, pytest.raises(Exception):  # noqa: B017
        bad.stream(mid)


def test_restart_keeps_maps(tmp_path):
    data = tmp_path / "data"
    with Server(data, tmp_path / "a.log") as s, MapperClient(s.url) as c:
        mid = c.create_map(name="keep", voxel_size_m=0.25, layers=["tsdf"])["id"]
        with c.stream(mid) as st:
            for i in range(5):
                st.send_lidar(*scan(i))
        before = c.query_tsdf(mid, [[5.9, 0.0, 0.0], [0.0, 5.9, 0.0]])
    assert any(p.name.endswith(".safetensors") for p in (data / "maps" / mid).iterdir())  # shutdown snapshot
    with Server(data, tmp_path / "b.log") as s, MapperClient(s.url) as c:
        m = c.get_map(mid)
        assert m["frames_integrated"] == 5 and m["last_seq"] == 5
        after = c.query_tsdf(mid, [[5.9, 0.0, 0.0], [0.0, 5.9, 0.0]])
        np.testing.assert_array_equal(before[0], after[0])


def test_public_bind_without_token_is_refused(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mapper",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "1",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert r.returncode == 2 and "refusing to bind" in r.stderr

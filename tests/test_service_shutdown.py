"""Graceful shutdown keeps the ack promise: on SIGTERM the streams stop reading, acknowledge every frame
they took and close with 1012; after a restart the map holds exactly the acknowledged frames."""

from __future__ import annotations

import signal
import sys
import threading
import time

import msgpack
import pytest
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect
from test_service_helpers import Server, client, frame_bytes, scan
from websockets.exceptions import ConnectionClosed

from mapper.api.routes.frames import SHUTDOWN_REASON
from mapper.client import MapperClient

GRACE_S = 15.0
WINDOW = 8


UVICORN = [sys.executable, "-m", "uvicorn", "--factory", "mapper.api:create_app", "--port", "{port}"]


@pytest.mark.parametrize("cmd", [None, UVICORN], ids=["mapper-serve", "uvicorn-factory"])
def test_sigterm_acks_every_frame_it_took(tmp_path, cmd):
    data = tmp_path / "data"
    server = Server(data, tmp_path / "a.log", cmd, MAPPER_SHUTDOWN_GRACE_S=GRACE_S).start()
    streams: list = []  # the FrameStream: it keeps every message received, even those a cut send() lost
    closed: list[BaseException] = []
    try:
        with MapperClient(server.url) as c:
            mid = c.create_map(name="term", voxel_size_m=0.25, layers=["tsdf"])["id"]

        def stream():
            try:
                with MapperClient(server.url) as c2, c2.stream(mid, window=WINDOW) as s:
                    streams.append(s)
                    for i in range(10_000):
                        s.send_lidar(*scan(i % 20), timestamp=float(i), frame_id=f"f{i}")
            except BaseException as e:  # the shutdown closes the stream
                closed.append(e)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 120
        while not (streams and len(streams[0].acks) >= 10) and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.01)
        assert streams and len(streams[0].acks) >= 10, server.log()
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        n_before = len(streams[0].acks)
        server.proc.wait(GRACE_S + 60)
        shutdown_s = time.monotonic() - t_term
        t.join(30)
    finally:
        server.stop()
    print(f"SIGTERM -> exit: {shutdown_s:.2f} s")
    assert shutdown_s < GRACE_S, f"shutdown took {shutdown_s:.1f} s: {server.log()}"
    assert "grace over" not in server.log()  # the drain finished in time (no warning)
    # the client saw a 1012 close with the reason, after the acks of the frames in flight at the signal
    assert len(closed) == 1 and isinstance(closed[0], ConnectionClosed), closed
    assert closed[0].rcvd is not None and closed[0].rcvd.code == 1012
    assert closed[0].rcvd.reason == SHUTDOWN_REASON
    acks = streams[0].acks
    n = len(acks)
    assert n > n_before  # the frames in flight at the SIGTERM were acknowledged after it
    assert [a["frame_id"] for a in acks] == [f"f{i}" for i in range(n)]
    assert [a["seq"] for a in acks] == list(range(1, n + 1))

    with Server(data, tmp_path / "b.log") as s2, MapperClient(s2.url) as c:
        m = c.get_map(mid)
        # every frame the map holds was acknowledged, every acknowledged frame is in the map
        assert m["last_seq"] == m["frames_integrated"] == n
        assert c.send_lidar(mid, *scan(0))["seq"] == n + 1


def test_drain_acks_then_closes_and_refuses_new_work(tmp_path):
    """In process: drain() while a stream has frames in flight; a frame sent after the drain began is not
    taken; new requests and streams get 503."""
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        service = c.app.state.service
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            for i in range(3):
                ws.send_bytes(frame_bytes(i, frame_id=f"f{i}"))
            first = msgpack.unpackb(ws.receive_bytes())
            c.portal.start_task_soon(service.drain, 30.0)
            deadline = time.monotonic() + 10
            while not service.draining.is_set():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            ws.send_bytes(frame_bytes(3, frame_id="f3"))  # after the drain began: not read
            rest = [msgpack.unpackb(ws.receive_bytes()) for _ in range(2)]
            with pytest.raises(WebSocketDisconnect) as e:
                ws.receive_bytes()
            assert e.value.code == 1012 and e.value.reason == SHUTDOWN_REASON
        assert [a["frame_id"] for a in [first, *rest]] == ["f0", "f1", "f2"]
        assert service.maps[mid].map.frames_integrated == 3 and service.maps[mid].last_seq == 3
        assert service.streams == 0
        r = c.post(
            f"/v1/maps/{mid}/frames", content=frame_bytes(4), headers={"content-type": "application/msgpack"}
        )
        assert r.status_code == 503 and r.json()["type"] == "unavailable"
        assert c.get("/readyz").status_code == 503
        with pytest.raises(WebSocketDenialResponse) as e2, c.websocket_connect(f"/v1/maps/{mid}/stream"):
            pass
        assert e2.value.status_code == 503 and e2.value.json()["detail"] == "the service is stopping"


def test_drain_gives_up_after_the_grace(tmp_path):
    """An operation that never finishes cannot hold the shutdown: drain() returns False after the grace."""
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        service = c.app.state.service
        service.maps[mid].in_flight += 1  # as if a frame were stuck in the writer
        t = time.monotonic()
        assert c.portal.call(service.drain, 0.3) is False
        assert 0.3 <= time.monotonic() - t < 5
        service.maps[mid].in_flight -= 1
        assert c.portal.call(service.drain, 5.0) is True


def test_drain_with_a_full_ack_queue_still_acks_everything(tmp_path):
    """ws_max_in_flight=1: when the stream stops, its ack queue may be full; the end marker must wait for
    room instead of being dropped (which left the last ack unsent until a 60 s timeout)."""
    with client(tmp_path, ws_max_in_flight=1) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        service = c.app.state.service
        with c.websocket_connect(f"/v1/maps/{mid}/stream") as ws:
            for i in range(4):
                ws.send_bytes(frame_bytes(i, frame_id=f"f{i}"))
            first = msgpack.unpackb(ws.receive_bytes())
            t = time.monotonic()
            c.portal.start_task_soon(service.drain, 30.0)
            acks = [first]
            with pytest.raises(WebSocketDisconnect) as e:
                while True:
                    acks.append(msgpack.unpackb(ws.receive_bytes()))
            assert e.value.code == 1012 and time.monotonic() - t < 10
        taken = service.maps[mid].last_seq
        assert [a["frame_id"] for a in acks] == [f"f{i}" for i in range(taken)]
        assert 1 <= taken <= 4 and service.maps[mid].map.frames_integrated == taken

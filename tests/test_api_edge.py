"""The connection edge of `mapper serve` (mapper.api.edge) over real sockets against a server subprocess:
half-sent headers and slow bodies are closed after their timeouts, connections beyond the per-client and
total caps are refused at once while other clients are served; a client that disconnects mid-upload is a
499 (one log line, no traceback); a snapshot on a full disk is 507."""

from __future__ import annotations

import contextlib
import errno
import re
import socket
import time

import httpx
import pytest
from test_service_helpers import Server, client, frame_bytes

from mapper import wire

HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
MIN_RATE = 2000  # bytes/s
PER_CLIENT = 4
TOTAL = 7


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge")
    env = dict(
        MAPPER_HEADER_TIMEOUT_S=HEADER_TIMEOUT_S,
        MAPPER_BODY_TIMEOUT_S=BODY_TIMEOUT_S,
        MAPPER_MIN_BODY_BYTES_PER_S=MIN_RATE,
        MAPPER_MAX_CONNECTIONS=TOTAL,
        MAPPER_MAX_CONNECTIONS_PER_CLIENT=PER_CLIENT,
        MAPPER_LOG_LEVEL="info",
        MAPPER_WARMUP="false",
    )
    with Server(tmp / "data", tmp / "server.log", **env) as s:
        with httpx.Client(base_url=s.url, timeout=60) as http:
            r = http.post("/v1/maps", json={"name": "m", "voxel_size_m": 0.25, "layers": ["tsdf"]})
            assert r.status_code == 201, r.text
            s.map_id = r.json()["id"]
        yield s


def connect(srv, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30, source_address=(source, 0))
    return sock


def read_until_closed(sock: socket.socket, limit_s: float = 30) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that happened."""
    t0, out = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out, time.monotonic() - t0


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", timeout=30).text


def test_half_sent_headers_are_closed_with_408(srv):
    sock = connect(srv)
    sock.sendall(b"POST /v1/maps HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    out, dt = read_until_closed(sock)
    assert out.startswith(b"HTTP/1.1 408"), out
    assert b"MAPPER_HEADER_TIMEOUT_S" in out
    assert HEADER_TIMEOUT_S * 0.8 <= dt <= HEADER_TIMEOUT_S + 5, dt
    # a trickle (a header byte every 0.2 s) does not extend the deadline
    sock = connect(srv)
    t0 = time.monotonic()
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    try:
        for b in b"X-Slow: " + b"a" * 100:
            sock.sendall(bytes([b]))
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    out, _ = read_until_closed(sock)
    assert out.startswith(b"HTTP/1.1 408"), out
    assert time.monotonic() - t0 <= HEADER_TIMEOUT_S + 5
    # a connection that sends nothing at all
    sock = connect(srv)
    out, dt = read_until_closed(sock)
    assert out.startswith(b"HTTP/1.1 408") and dt <= HEADER_TIMEOUT_S + 5
    assert metric(metrics(srv), "mapper_connections_closed_total", reason="header_timeout") >= 3


def post_head(srv, length: int) -> bytes:
    return (
        f"POST /v1/maps/{srv.map_id}/frames HTTP/1.1\r\nHost: x\r\nContent-Type: {wire.MSGPACK}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_stalled_and_slow_bodies_are_closed(srv):
    before = metric(metrics(srv), "mapper_http_request_duration_seconds_count", status="408")
    # stalled: headers and 100 bytes of 100 000, then nothing
    sock = connect(srv)
    sock.sendall(post_head(srv, 100_000) + b"\0" * 100)
    out, dt = read_until_closed(sock)
    assert out == b"" and BODY_TIMEOUT_S * 0.8 <= dt <= BODY_TIMEOUT_S + 5, (out, dt)
    # a trickle: 100 bytes every 0.2 s = 500 B/s, under the floor of MIN_RATE; never a pause > the timeout
    sock = connect(srv)
    sock.sendall(post_head(srv, 100_000))
    t0, closed = time.monotonic(), False
    while time.monotonic() - t0 < 20:
        try:
            sock.sendall(b"\0" * 100)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.2)
    assert closed, "a 500 B/s body was still being read after 20 s"
    # the rule: closed once BODY_TIMEOUT_S + bytes / MIN_RATE have passed (here ~1.5 + 0.3 s)
    assert time.monotonic() - t0 <= BODY_TIMEOUT_S + 6
    text = metrics(srv)
    assert metric(text, "mapper_connections_closed_total", reason="body_timeout") >= 2
    after = metric(text, "mapper_http_request_duration_seconds_count", status="408")
    assert after - before == 2  # the routes saw the disconnects as the server's 408, not as a 5xx
    assert metric(text, "mapper_http_request_duration_seconds_count", status="500") == 0
    # a normal upload and a WebSocket stream that lives longer than the header timeout still work
    url = f"{srv.url}/v1/maps/{srv.map_id}/frames"
    r = httpx.post(url, content=frame_bytes(0, n=500), headers={"content-type": wire.MSGPACK})
    assert r.status_code == 200, r.text
    from websockets.sync.client import connect as ws_connect

    with ws_connect(f"ws://127.0.0.1:{srv.port}/v1/maps/{srv.map_id}/stream", open_timeout=30) as ws:
        time.sleep(HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 0.5)
        ws.send(frame_bytes(1, n=500))
        ack = wire.unpackb(ws.recv(timeout=60))
        assert ack["seq"] >= 2, ack


def hold(srv, source: str):
    """An open WebSocket stream from ``source``: a connection the header timeout does not close."""
    from websockets.sync.client import connect as ws_connect

    url = f"ws://127.0.0.1:{srv.port}/v1/maps/{srv.map_id}/stream"
    return ws_connect(url, sock=connect(srv, source), open_timeout=30)


def test_connection_caps(srv):
    with contextlib.ExitStack() as held:
        for _ in range(PER_CLIENT):
            held.enter_context(hold(srv, "127.0.0.1"))
        time.sleep(0.3)
        extra = connect(srv)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        out, dt = read_until_closed(extra)
        assert out.startswith(b"HTTP/1.1 429") and b"MAPPER_MAX_CONNECTIONS_PER_CLIENT" in out, out
        assert dt < 3.0  # refused at once (it lingers half a second for its request), no read timeout
        # another client is still served
        other = connect(srv, "127.0.0.2")
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out, _ = read_until_closed(other)
        assert out.startswith(b"HTTP/1.1 200") and b'"ok"' in out, out
        # the total cap: 4 + 2 held, the 7th is served, the 8th refused with 503
        for _ in range(2):
            held.enter_context(hold(srv, "127.0.0.2"))
        time.sleep(0.3)
        seventh = connect(srv, "127.0.0.3")
        seventh.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert seventh.recv(65536).startswith(b"HTTP/1.1 200")
        eighth = connect(srv, "127.0.0.4")
        eighth.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        out, _ = read_until_closed(eighth)
        assert out.startswith(b"HTTP/1.1 503") and b"MAPPER_MAX_CONNECTIONS" in out, out
        seventh.close()
    time.sleep(0.5)
    # closed connections free their slots
    r = httpx.get(srv.url + "/healthz", timeout=30)
    assert r.status_code == 200
    text = metrics(srv)
    assert metric(text, "mapper_connections_closed_total", reason="per_client") >= 1
    assert metric(text, "mapper_connections_closed_total", reason="total") >= 1
    # the closed WebSocket streams were released too: open now is this scrape's connection (and at most
    # one more closing)
    assert 1 <= metric(text, "mapper_connections") <= 2, text


def test_client_disconnect_mid_upload_is_499(srv):
    log_before = srv.log_path.read_text(errors="replace")
    before = metric(metrics(srv), "mapper_http_request_duration_seconds_count", status="499")
    for _ in range(3):
        sock = connect(srv)
        sock.sendall(post_head(srv, 100_000) + b"\0" * 5000)
        time.sleep(0.2)
        sock.close()
    deadline = time.monotonic() + 20
    while True:
        text = metrics(srv)
        got = metric(text, "mapper_http_request_duration_seconds_count", status="499") - before
        if got == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == 3
    assert not re.search(r'mapper_http_request_duration_seconds_count\{[^}]*status="5\d\d"', text)
    new = srv.log_path.read_text(errors="replace")[len(log_before) :]
    lines = [ln for ln in new.splitlines() if "disconnected" in ln]
    assert len(lines) == 3, new
    assert "Traceback" not in new and "ERROR" not in new, new


def test_snapshot_on_a_full_disk_is_507(tmp_path):
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "m", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        ct = {"content-type": wire.MSGPACK}
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0, n=500), headers=ct).status_code == 200
        entry = c.app.state.service.maps[mid]

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        entry.dir.write_snapshot = full
        r = c.post(f"/v1/maps/{mid}/snapshot")
        assert r.status_code == 507, r.text
        assert r.json()["type"] == "insufficient_storage" and "disk full" in r.json()["detail"]
        # the map keeps serving; once there is room the snapshot succeeds
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(1, n=500), headers=ct).status_code == 200
        del entry.dir.write_snapshot
        r = c.post(f"/v1/maps/{mid}/snapshot")
        assert r.status_code == 200, r.text
        # another OSError stays an internal error
        entry.dir.write_snapshot = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
        c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(2, n=500), headers=ct)
        assert c.post(f"/v1/maps/{mid}/snapshot").status_code == 500

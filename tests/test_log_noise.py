"""Log noise: the viewer's polls are no access-log lines (a real ``mapper serve`` at log level info), and the
Foxglove bridge logs one line, not a traceback per tick, while maps restore or a publish keeps failing."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from test_service_helpers import Server

from mapper.api.access_log import PollFilter


def access_record(method: str, path: str, status: int) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", method, path, "1.1", status),
        None,
    )


@pytest.mark.parametrize(
    ("method", "path", "status", "kept"),
    [
        ("GET", "/v1/maps/abc/mesh/blocks?since_version=3", 200, False),
        ("GET", "/v1/maps/abc/mesh/blocks", 304, False),
        ("GET", "/v1/maps/abc/status", 200, False),
        ("GET", "/v1/maps/abc/trajectory?start=4", 200, False),
        ("GET", "/v1/maps/abc/esdf/slice?z=1.0&format=msgpack", 200, False),
        ("GET", "/metrics", 200, False),
        ("GET", "/v1/maps/abc/mesh/blocks", 404, True),  # errors stay
        ("GET", "/v1/maps/abc/status", 500, True),
        ("POST", "/v1/maps/abc/frames", 200, True),  # writes stay
        ("GET", "/v1/maps/abc/mesh", 200, True),  # a one-off download, not a poll
        ("GET", "/v1/maps", 200, True),
        ("DELETE", "/v1/maps/abc", 200, True),
        ("GET", "/v1/maps/abc/mesh/blocks/x", 200, True),
    ],
)
def test_poll_filter_drops_only_successful_read_polls(method, path, status, kept):
    assert PollFilter().filter(access_record(method, path, status)) is kept


def test_poll_filter_keeps_records_it_does_not_understand():
    r = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "something %s", ("else",), None)
    assert PollFilter().filter(r) is True


def test_served_access_log_has_no_poll_lines(tmp_path):
    import httpx

    with Server(tmp_path / "data", tmp_path / "server.log", MAPPER_LOG_LEVEL="info") as srv:
        http = httpx.Client(base_url=srv.url, timeout=60)
        mid = http.post("/v1/maps", json={"name": "quiet", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()[
            "id"
        ]
        for _ in range(5):
            assert http.get(f"/v1/maps/{mid}/mesh/blocks", params={"since_version": 0}).status_code == 200
            assert http.get(f"/v1/maps/{mid}/status").status_code == 200
        assert http.get("/v1/maps/nope/mesh/blocks").status_code == 404
        assert http.get(f"/v1/maps/{mid}").status_code == 200
        log = srv.log()
    lines = [ln for ln in log.splitlines() if '"GET ' in ln or '"POST ' in ln]
    assert any('"POST /v1/maps HTTP' in ln for ln in lines), log
    assert any(f'"GET /v1/maps/{mid} HTTP' in ln for ln in lines), log
    assert any("/v1/maps/nope/mesh/blocks" in ln and "404" in ln for ln in lines), log
    assert not any(re.search(rf"/v1/maps/{mid}/(mesh/blocks|status)", ln) for ln in lines), log


class _Service:
    """A stand-in for MapService whose list() raises the given error every time."""

    def __init__(self, error: Exception):
        self.error, self.calls = error, 0

    def list(self):
        self.calls += 1
        raise self.error


def _run_bridge(service, seconds: float) -> None:
    pytest.importorskip("foxglove", reason="foxglove-sdk is not installed")
    from mapper.foxglove import FoxgloveBridge

    bridge = FoxgloveBridge(service, port=0, interval_s=0.02)

    async def main():
        task = asyncio.create_task(bridge.run())
        await asyncio.sleep(seconds)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        bridge.stop()


def test_bridge_is_quiet_while_the_service_restores(caplog):
    from mapper.api.errors import Unavailable

    svc = _Service(Unavailable("the service is restoring maps; retry shortly"))
    with caplog.at_level(logging.INFO, logger="mapper.foxglove"):
        _run_bridge(svc, 0.5)
    assert svc.calls >= 5  # it kept trying
    assert [r for r in caplog.records if r.name == "mapper.foxglove"] == []


def test_bridge_logs_a_repeated_failure_once_without_traceback(caplog):
    svc = _Service(RuntimeError("disk on fire"))
    with caplog.at_level(logging.INFO, logger="mapper.foxglove"):
        _run_bridge(svc, 0.5)
    assert svc.calls >= 5
    recs = [r for r in caplog.records if r.name == "mapper.foxglove"]
    assert len(recs) == 1, [r.getMessage() for r in recs]
    assert recs[0].levelno == logging.WARNING and recs[0].exc_info is None
    assert "RuntimeError: disk on fire" in recs[0].getMessage()

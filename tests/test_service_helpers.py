"""Helpers shared by the service tests (no tests here): synthetic frames, an app in a TestClient, a real
``mapper serve`` subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from mapper import wire
from mapper.api import create_app
from mapper.settings import Settings

TOKEN = "test-token-123"
READ_TOKEN = "read-only-456"
MSGPACK_HEADERS = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}
# moto's test credentials for the S3 store (tests/test_objstore.py); also in the environment Ray starts with
# (conftest.py: local_ray), which is the environment of every map worker it starts later
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def scan(i: int = 0, n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small synthetic LiDAR scan (sensor frame) of a room with a floor, and a pose moving along x."""
    rng = np.random.default_rng(seed * 1000 + i)
    az = rng.uniform(-np.pi, np.pi, n)
    el = rng.uniform(-0.5, 0.3, n)
    d = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], 1)
    r_wall = 6.0 / np.maximum(np.abs(np.cos(az)), np.abs(np.sin(az))) / np.cos(el)
    r_floor = np.where(d[:, 2] < 0, -1.0 / np.minimum(d[:, 2], -1e-3), np.inf)
    r = np.minimum(r_wall, r_floor)
    T = np.eye(4)
    T[0, 3] = 0.1 * i
    return (d * r[:, None]).astype(np.float32), T


def frame_bytes(i: int = 0, n: int = 3000, frame_id: str | None = None) -> bytes:
    pts, T = scan(i, n)
    return wire.packb(wire.lidar_message(pts, T, float(i), frame_id))


def settings(tmp_path: Path, **kw) -> Settings:
    base = dict(data_dir=tmp_path / "data", device="cpu", snapshot_interval_s=0, fsync=True)
    base.update(kw)
    return Settings(**base)


@contextlib.contextmanager
def client(tmp_path: Path, **kw):
    """A TestClient (lifespan running) on a fresh app; waits until maps are restored."""
    app = create_app(settings(tmp_path, **kw))
    with TestClient(app) as c:
        wait_ready(c)
        yield c


def wait_ready(c, timeout: float | None = None) -> None:
    # on CUDA /readyz waits for the warm-up: every kernel compiled cold (cache empty) and the CUDA graphs
    # captured, ~30-50 s with 8 test workers compiling at once on the H200 (a 30 s wait failed there once)
    if timeout is None:
        timeout = 180.0 if c.app.state.service.settings.device != "cpu" else 30.0
    deadline = time.monotonic() + timeout
    while c.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "service never became ready"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m mapper serve`` on a free loopback port with a temp data dir; always cleaned up."""

    def __init__(self, data_dir: Path, log_path: Path, cmd: list[str] | None = None, **env):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "MAPPER_HOST": "127.0.0.1",
            "MAPPER_PORT": str(self.port),
            "MAPPER_DATA_DIR": str(data_dir),
            "MAPPER_DEVICE": "cpu",
            "MAPPER_LOG_LEVEL": "warning",
            **{k: str(v) for k, v in env.items()},
        }
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        # the command: `mapper serve` (settings from the environment) unless given, e.g. plain uvicorn
        self.cmd = cmd or [sys.executable, "-m", "mapper", "serve"]

    def start(self, timeout: float = 90.0) -> Server:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [c.format(port=self.port) for c in self.cmd],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout} s: {self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Compile before the first frame (issues 12/13): the warm-up of a map configuration, the map's hook, and the
service's: ``/readyz`` stays 503 until the warm-up ends, and Triton's cache lives under the data directory."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from test_service_helpers import frame_bytes, settings

from mapper import Map, warmup
from mapper.api import create_app
from mapper.api.service import triton_cache_dir


def test_warm_up_runs_the_kernels_or_skips(backend, monkeypatch):
    """Under the Triton interpreter (``backend == "triton"``) the warm-up runs the frame path of a small
    configuration; with the torch kernels (a CPU without Triton) it is skipped at no cost."""
    monkeypatch.setattr(warmup, "_done", set())
    cfg = Map(0.2, layers=("tsdf",), device="cpu", max_range_m=8.0, warmup=False).config()
    if os.environ.get("MAPPER_TRITON_SM90") == "1":
        pytest.skip("every kernel here is compiled for sm_90 by its own tests")
    if backend == "torch":
        t = time.perf_counter()
        assert warmup.warm_up(cfg, "cpu") == 0.0
        assert time.perf_counter() - t < 0.05
        assert not warmup.warmed(cfg, "cpu")
        return
    calls = []
    real = warmup._run
    monkeypatch.setattr(warmup, "_run", lambda *a: calls.append(a) or real(*a))
    assert warmup.warm_up(cfg, "cpu", sizes=(4,)) > 0.0
    assert warmup.warmed(cfg, "cpu") and len(calls) == 1
    assert warmup.warm_up(cfg, "cpu", sizes=(4,)) == 0.0  # once per configuration and device
    assert len(calls) == 1


def test_warm_up_scene_has_returns():
    pts, T = warmup._scene_points(0.1, torch.device("cpu"), 16)
    assert pts.shape[1] == 3 and 150 <= pts.shape[0] <= 16 * 16
    assert torch.isfinite(pts).all() and T.shape == (4, 4)


def test_map_warms_up_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda cfg, dev, **kw: calls.append((cfg, dev)) or 0.0)
    Map(0.1, device="cpu")
    assert calls == []  # the CPU: the torch path, nothing to compile
    if torch.cuda.is_available():
        Map(0.1, device="cuda", warmup=False)
        assert calls == []
        m = Map(0.1, device="cuda")
        assert calls == [(m.config(), m.device)]


@pytest.mark.gpu
def test_cuda_map_is_warm_after_creation():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = Map(0.1, layers=("tsdf", "esdf"), device="cuda", max_range_m=20.0)
    assert warmup.warmed(m.config(), m.device)


def test_readyz_waits_for_the_warm_up(tmp_path, monkeypatch):
    release = threading.Event()
    started = threading.Event()
    seen = []

    def slow(cfg, device, **kw):
        seen.append(cfg)
        started.set()
        assert release.wait(20)
        return 0.5

    monkeypatch.setattr(warmup, "needed", lambda device: True)
    monkeypatch.setattr(warmup, "warm_up", slow)
    app = create_app(settings(tmp_path, default_voxel_size_m=0.2, default_layers=["tsdf", "esdf"]))
    with TestClient(app) as c:
        assert started.wait(20)
        for _ in range(3):
            r = c.get("/readyz")
            assert r.status_code == 503 and r.json()["detail"] == "restoring"
            assert c.post("/v1/maps", json={}).status_code == 503  # no work before the warm-up ends
            time.sleep(0.05)
        release.set()
        deadline = time.monotonic() + 20
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # the default configuration of POST /v1/maps, as a new map has it
        assert seen == [Map(0.2, layers=("tsdf", "esdf"), device="cpu", warmup=False).config()]
        mid = c.post("/v1/maps", json={}).json()["id"]
        r = c.post(
            f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={"content-type": "application/msgpack"}
        )
        assert r.status_code == 200, r.text


def test_warm_up_disabled_by_setting(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(warmup, "needed", lambda device: True)
    monkeypatch.setattr(warmup, "warm_up", lambda cfg, dev, **kw: calls.append(cfg) or 0.0)
    with TestClient(create_app(settings(tmp_path, warmup=False))) as c:
        deadline = time.monotonic() + 20
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert calls == []


def test_triton_cache_dir_under_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # restored after the test
    monkeypatch.delenv("TRITON_CACHE_DIR")
    app = create_app(settings(tmp_path))
    with TestClient(app):
        want = (tmp_path / "data" / "triton-cache").resolve()
        assert os.environ["TRITON_CACHE_DIR"] == str(want)
        assert want.is_dir()
    assert "TRITON_CACHE_DIR" not in os.environ  # the service leaves the environment as it found it
    # a directory the user chose is kept
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert triton_cache_dir(tmp_path / "data") == str(tmp_path / "mine")
    with TestClient(create_app(settings(tmp_path))):
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")

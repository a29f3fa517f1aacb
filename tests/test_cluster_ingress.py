"""Pieces of the Ray ingress that need no Ray: the merged Prometheus text, the route gate a move closes,
and the ``mapper serve --ray`` flags (including the error without the ray package)."""

from __future__ import annotations

import asyncio
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mapper import cli
from mapper.cluster.ingress import Route, merge_metrics

W0 = """# HELP mapper_frames_total Frames integrated
# TYPE mapper_frames_total counter
mapper_frames_total{map="a",name="x",kind="lidar"} 3.0
# HELP mapper_maps Maps served
# TYPE mapper_maps gauge
mapper_maps 1.0
"""
W1 = """# HELP mapper_frames_total Frames integrated
# TYPE mapper_frames_total counter
mapper_frames_total{map="b",name="y",kind="depth"} 5.0
# HELP mapper_maps Maps served
# TYPE mapper_maps gauge
mapper_maps 2.0
"""


def test_merge_metrics_labels_every_sample_and_groups_families():
    text = merge_metrics([("w0", W0), ("w1", W1)])
    assert text.count("# TYPE mapper_frames_total counter") == 1
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, s.labels.get("worker"), s.labels.get("map"))] = s.value
    assert samples == {
        ("mapper_frames_total", "w0", "a"): 3.0,
        ("mapper_frames_total", "w1", "b"): 5.0,
        ("mapper_maps", "w0", None): 1.0,
        ("mapper_maps", "w1", None): 2.0,
    }
    # the families stay contiguous: each name's samples follow its TYPE line
    lines = text.splitlines()
    i = lines.index("# TYPE mapper_maps gauge")
    assert lines[i + 1 : i + 3] == ['mapper_maps{worker="w0"} 1.0', 'mapper_maps{worker="w1"} 2.0']
    assert merge_metrics([]) == "\n"


def test_route_gate_waits_for_work_in_flight():
    async def run():
        r = Route(worker=0, name="m")
        order = []

        async def request(tag, hold):
            async with r.use():
                order.append(f"{tag}+")
                await asyncio.sleep(hold)
                order.append(f"{tag}-")

        first = asyncio.create_task(request("a", 0.05))
        await asyncio.sleep(0.01)
        r.paused = True  # a move closes the gate ...
        r.resumed.clear()
        late = asyncio.create_task(request("b", 0))
        await asyncio.wait_for(r.idle.wait(), 1)  # ... and waits for the request in flight only
        order.append("moved")
        r.worker = 1
        r.paused = False
        r.resumed.set()
        await asyncio.gather(first, late)
        return order, r.inflight

    order, inflight = asyncio.run(run())
    assert order == ["a+", "a-", "moved", "b+", "b-"]
    assert inflight == 0


def test_serve_ray_flags():
    p = cli.build_parser()
    a = p.parse_args(["serve"])
    assert a.ray is None and a.ray_workers is None
    a = p.parse_args(["serve", "--ray"])
    assert a.ray == "" and a.ray_workers is None
    a = p.parse_args(["serve", "--ray", "ray://head:10001", "--ray-workers", "4"])
    assert a.ray == "ray://head:10001" and a.ray_workers == 4


def test_serve_ray_without_the_package_says_how_to_install(monkeypatch, tmp_path, capsys):
    import builtins

    real = builtins.__import__

    def no_ray(name, *args, **kw):
        if name == "ray":
            raise ImportError("no ray here")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--ray", "--data-dir", str(tmp_path), "--device", "cpu"])
    assert e.value.code == 2
    assert "pip install 'mapper[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_serve_ray_workers_must_be_positive(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--ray", "--ray-workers", bad, "--data-dir", str(tmp_path), "--device", "cpu"])
    assert e.value.code == 2
    assert "--ray-workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "device, gpus, n, expect",
    [
        ("auto", 0, None, (2, 0.0, 0.5)),  # CPU-only machine: 2 CPU workers, half the RAM budget each
        ("cpu", 8, None, (2, 0.0, 0.5)),  # cpu asked: GPUs ignored
        ("auto", 4, None, (4, 1.0, 1.0)),  # one worker per GPU
        ("auto", 1, 4, (4, 0.25, 0.25)),  # four workers share one GPU
        ("cuda", 2, 2, (2, 1.0, 1.0)),
        ("cuda", 0, 3, (3, 1.0, 1.0)),  # no GPU node yet (KubeRay): a whole GPU each, wait for them
        ("cpu", 0, 3, (3, 0.0, 1 / 3)),
    ],
)
def test_plan_workers(device, gpus, n, expect):
    from mapper.cluster.ray_cluster import plan_workers

    assert plan_workers(device, gpus, n) == pytest.approx(expect)


def test_stored_name_of_an_exported_snapshot(tmp_path):
    from mapper import Map
    from mapper.cluster.ingress import stored_name
    from mapper.persistence import MapDir

    m = Map(voxel_size_m=0.5, layers=["tsdf"], device="cpu")
    tensors, meta = m.state_dict()
    d = MapDir(tmp_path / "m", False)
    d.root.mkdir()
    snap = d.write_snapshot(0, tensors, {**meta, "info": {"id": "x", "name": "lab-1"}})
    data = snap.path.read_bytes()
    assert stored_name(data) == "lab-1"
    assert stored_name(d.write_snapshot(1, tensors, meta).path.read_bytes()) is None  # no info stored
    for bad in (b"", b"\xff" * 8, data[:20], (10).to_bytes(8, "little") + b"{not json}"):
        assert stored_name(bad) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ray-workers", "2"], "--ray-workers needs --ray"),
        (["--ray", "--foxglove-port", "8765"], "--foxglove-port: not available with --ray"),
    ],
)
def test_serve_ray_flag_combinations_refused(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv, "--data-dir", str(tmp_path), "--device", "cpu"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert "MAPPER_FOXGLOVE_PORT" not in os.environ  # a refused command leaves the environment alone


def test_serve_in_thread_and_wait_ready():
    """``mapper.cluster.local``: an app served from a thread answers on the URL it yields; ``wait_ready``
    returns the ready body, waits for the worker count, and stops on ``alive() == False`` or its timeout."""
    import httpx
    from fastapi import FastAPI

    from mapper.cluster.local import serve_in_thread, wait_ready

    app = FastAPI()
    calls = []

    @app.get("/readyz")
    async def readyz():
        calls.append(1)
        if len(calls) < 3:  # starting: not ready for the first two polls
            from fastapi.responses import JSONResponse

            return JSONResponse({"type": "unavailable", "detail": "starting"}, status_code=503)
        return {"status": "ready", "workers": 2}

    with serve_in_thread(app, timeout_s=60) as url:
        assert url.startswith("http://127.0.0.1:")
        assert wait_ready(url, 30, workers=2) == {"status": "ready", "workers": 2} and len(calls) == 3
        with pytest.raises(RuntimeError, match="not ready within 1 s"):
            wait_ready(url, 1, workers=3)
        with pytest.raises(RuntimeError, match="stopped before it was ready"):
            wait_ready(url, 30, alive=lambda: False)
    with pytest.raises(httpx.HTTPError):  # stopped on exit
        httpx.get(f"{url}/readyz", timeout=2)

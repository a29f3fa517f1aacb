"""Admission of frames into a running server (issue 30, item 1): the repo's own LiDAR scan at the default
voxel fits a 24 GB machine's default budget; a frame that cannot fit a tiny budget is refused with 507 in
one line, without a traceback in the server's log, and the replay removes the empty map it created."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_service_helpers import Server

from mapper import Map, budget
from mapper.client import MapperClient

# the default budget of the machine: half of its 23.54 GiB (MapService, CPU)
BUDGET_24GB = 12638035968


def _replay(url: str, path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mapper", "replay", "--format", "norlab", str(path), "--server", url]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=600)


def test_footprint_is_exact_for_the_free_record_and_bounds_the_tsdf(shared_data):
    """The tightest bound counts the bricks the frame's rays really cross: on a real scan (subsampled) it
    equals the free record's growth, bounds the TSDF's, and is far below the per-ray bounds."""
    from mapper.datasets import NorlabLidar

    f = NorlabLidar(shared_data / "norlab_lidar")[0]
    pts = torch.as_tensor(f["points"])[::8]
    m = Map(0.2, layers=("tsdf", "esdf"), device="cpu", max_range_m=60.0)
    tight = budget.lidar_growth(m, pts, f["T_world_sensor"])
    loose = budget.lidar_growth(m, pts, f["T_world_sensor"], room=1e18)  # the bounding box's
    assert all(loose.bricks[k] >= 4 * n for k, n in tight.bricks.items()), (loose.bricks, tight.bricks)
    b0 = m.bricks
    m.integrate_lidar(pts, f["T_world_sensor"])
    grown = {k: v - b0[k] for k, v in m.bricks.items()}
    assert tight.bricks["free"] == grown["free"] > 0
    assert grown["tsdf"] <= tight.bricks["tsdf"] <= 3 * grown["tsdf"]
    # the same frame again: the bricks the map has are not counted (the TSDF's left are band bricks the
    # integrator crossed but did not keep: no sample within -tau)
    again = budget.lidar_growth(m, pts, f["T_world_sensor"])
    assert again.bricks["free"] == 0
    assert again.bricks["tsdf"] == tight.bricks["tsdf"] - grown["tsdf"]


def test_esdf_working_memory_uses_the_measured_cpu_rate():
    v = 128_499_968  # computed voxels of the first norlab scan at 0.1 m (peak RSS 3.9 GB in all)
    cpu = budget.esdf_working_bytes(v, "cpu")
    assert cpu == budget.ESDF_CPU_FIXED_BYTES + budget.ESDF_CPU_BYTES_PER_VOXEL * v < 5 << 30
    assert budget.esdf_working_bytes(10_000, "cpu") == budget.ESDF_UPDATE_BYTES_PER_VOXEL * 10_000
    assert budget.esdf_working_bytes(v, "cuda") == budget.ESDF_UPDATE_BYTES_PER_VOXEL * v


@pytest.mark.slow
def test_repo_scan_at_default_voxel_is_accepted(tmp_path, shared_data):
    """The issue's case: `mapper replay --format norlab ... --limit 1` into `mapper serve` at the default
    voxel (0.1 m) and the 24 GB machine's default budget (was 507: "up to 17.97 GiB")."""
    env = {"MAPPER_MEMORY_BUDGET_BYTES": BUDGET_24GB, "MAPPER_ESDF_UPDATE": "lazy"}  # ack after integration
    with Server(tmp_path / "data", tmp_path / "srv.log", **env) as s:
        r = _replay(s.url, shared_data / "norlab_lidar", "--limit", "1")
        assert r.returncode == 0, r.stderr
        assert "replayed 1 lidar frames" in r.stdout
        with MapperClient(s.url) as c:
            assert c.find_map("norlab_lidar")["frames_integrated"] == 1


def test_frame_over_a_tiny_budget_is_507_and_leaves_no_map(tmp_path, shared_data):
    with Server(tmp_path / "data", tmp_path / "srv.log", MAPPER_MEMORY_BUDGET_BYTES=8 << 20) as s:
        r = _replay(s.url, shared_data / "norlab_lidar", "--limit", "1", "--voxel", "0.4")
        assert r.returncode == 1
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("mapper replay")]
        assert len(lines) == 1 and "507 insufficient_storage" in lines[0], r.stderr
        assert "removed" in lines[0], lines
        with MapperClient(s.url) as c:
            assert c.list_maps() == []
        # over a WebSocket with frames in flight: no "Future exception was never retrieved" tracebacks
        r = _replay(s.url, shared_data / "norlab_lidar", "--limit", "6", "--voxel", "0.4", "--name", "w")
        assert r.returncode == 1 and "507" in r.stderr
    log = s.log()
    assert "Traceback" not in log and "never retrieved" not in log, log

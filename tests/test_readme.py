"""The README's examples run, so README and API cannot drift apart.

Conventions for README.md (keep them when adding text):

* Every fenced ```python block runs, in file order, in ONE shared namespace (later blocks use names that
  earlier ones defined), with the working directory a temporary folder and the literal path
  ``../shared/data`` pointing at the sample data (``MAPPER_SHARED_DATA`` or ``../shared/data`` beside the
  checkout). Blocks must run on a CPU in a few seconds: pick the device with
  ``device = "cuda" if torch.cuda.is_available() else "cpu"`` (defined in the first block) and use small
  data.
* A block that cannot run here (needs a running server, a GPU, a user's own files) is preceded by an HTML
  comment ``<!-- not-run: <reason> -->`` on the line(s) just above its fence; the reason must be given.
  Such blocks are still compiled, so they stay valid Python.
* A ```bash block preceded by ``<!-- run-cli: <what the test provides> -->`` has each of its ``mapper ...``
  lines run through ``mapper.cli.main`` (exit code 0 expected) in a folder where
  :func:`_write_recordings` made the recordings the commands name (``lab.bag``, ``lab_ros2/``, ``scans/``).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*(not-run|run-cli):\s*(.*?)\s*-->\s*$")


def readme_blocks(text: str) -> list[dict]:
    """``[{"lang", "code", "line", "mark", "reason"}]`` for every fenced block, in order; ``mark`` is the
    HTML comment directly above the fence (only blank lines between), if any."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [ln for ln in text[: m.start()].splitlines() if ln.strip()]
        mk = MARK.search(before[-1]) if before else None
        out.append(
            {
                "lang": m.group(1),
                "code": m.group(2),
                "line": line,
                "mark": mk.group(1) if mk else None,
                "reason": mk.group(2) if mk else None,
            }
        )
    return out


def test_block_parser_reads_marks():
    text = "a\n\n<!-- not-run: needs a server -->\n```python\nx = 1\n```\n\n```python\ny = x\n```\n"
    b = readme_blocks(text)
    assert [(x["mark"], x["reason"], x["code"], x["line"]) for x in b] == [
        ("not-run", "needs a server", "x = 1\n", 4),
        (None, None, "y = x\n", 8),
    ]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    if not SHARED_DATA.is_dir():
        pytest.skip(f"sample data not found at {SHARED_DATA}")
    blocks = [b for b in readme_blocks(README.read_text()) if b["lang"] == "python"]
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "readme"}
    ran = 0
    for b in blocks:
        code = b["code"].replace("../shared/data", str(SHARED_DATA))
        compiled = compile(code, f"README.md:{b['line']}", "exec")
        if b["mark"] == "not-run":
            assert b["reason"], f"README.md:{b['line']}: not-run needs a reason"
            continue
        assert b["mark"] is None, f"README.md:{b['line']}: {b['mark']} is for bash blocks"
        try:
            exec(compiled, ns)
        except Exception as e:
            raise AssertionError(
                f"README.md block at line {b['line']} failed: {type(e).__name__}: {e}"
            ) from e
        ran += 1
    assert ran >= 5
    # the examples did what their comments say
    assert ns["g"].num_voxels == 3 and ns["mesh"].num_faces > 0
    assert Path("map.ply").read_bytes().startswith(b"ply\n") and ns["png"].startswith(b"\x89PNG")
    d, observed = ns["d"].cpu().numpy(), ns["observed"].cpu().numpy()
    assert d.shape == (2,) and observed.tolist() == [True, False]
    assert abs(d[0]) < 0.2 and np.isnan(d[1])  # the surface point seen at the image centre; unknown
    assert ns["r"]["T_world_sensor"].shape == (4, 4) and ns["T"].shape == (4, 4)


def _write_recordings(root: Path) -> None:
    """What the README's "bring your own recording" commands read: ``lab.bag`` (ROS 1: /velodyne_points
    in frame velodyne, /tf map -> base_link, /tf_static base_link -> velodyne, /odom), ``lab_ros2/`` (ROS 2
    MCAP: /camera/depth/image_rect_raw 16UC1 + /camera/depth/camera_info, /tf world -> camera), ``scans/``
    (PCD files without poses)."""
    from pypcd4 import Encoding, PointCloud
    from recording_helpers import BagWriter, quat_z
    from test_service_helpers import scan

    with BagWriter(root / "lab", "ros1") as b:
        b.add("/velodyne_points", "sensor_msgs/msg/PointCloud2")
        b.add("/tf", "tf2_msgs/msg/TFMessage")
        b.add("/tf_static", "tf2_msgs/msg/TFMessage")
        b.add("/odom", "nav_msgs/msg/Odometry")
        b.write("/tf_static", 0.0, b.tf(0.0, "base_link", "velodyne", (0.0, 0.0, 0.3), quat_z(0.0)))
        for k in range(3):
            t = 10.0 + 0.1 * k
            b.write("/tf", t, b.tf(t, "map", "base_link", (0.1 * k, 0.0, 0.0), quat_z(0.0)))
            b.write("/odom", t, b.odometry(t, "odom", "base_link", (0.1 * k, 0.0, 0.0), quat_z(0.0)))
            b.write("/velodyne_points", t, b.pointcloud2(t, "velodyne", scan(k, 1500)[0]))
    with BagWriter(root / "lab_ros2", "ros2-mcap") as b:
        b.add("/camera/depth/image_rect_raw", "sensor_msgs/msg/Image")
        b.add("/camera/depth/camera_info", "sensor_msgs/msg/CameraInfo")
        b.add("/tf", "tf2_msgs/msg/TFMessage")
        K = np.array([[40.0, 0, 20.0], [0, 40.0, 15.0], [0, 0, 1]])
        for k in range(2):
            t = 5.0 + 0.1 * k
            b.write(
                "/tf", t, b.tf(t, "world", "camera_depth_optical_frame", (0.05 * k, 0.0, 0.0), quat_z(0.0))
            )
            b.write("/camera/depth/camera_info", t, b.camera_info(t, "camera_depth_optical_frame", K, 40, 30))
            depth = np.full((30, 40), 1.5, np.float32)
            b.write(
                "/camera/depth/image_rect_raw",
                t,
                b.depth_image(t, "camera_depth_optical_frame", depth, "16UC1"),
            )
    (root / "scans").mkdir()
    for k in range(2):
        PointCloud.from_xyz_points(scan(k, 1500)[0]).save(
            root / "scans" / f"{k:06d}.pcd", encoding=Encoding.BINARY
        )


def test_readme_cli_blocks_run(tmp_path, monkeypatch, capsys):
    from mapper.cli import main

    blocks = [b for b in readme_blocks(README.read_text()) if b["mark"] == "run-cli"]
    assert blocks, "the README's bring-your-own-recording commands are not marked run-cli"
    _write_recordings(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    ran = 0
    for b in blocks:
        lines = re.sub(r"\\\n\s*", " ", b["code"]).splitlines()
        for ln in lines:
            ln = ln.split(" #", 1)[0].strip()
            if not ln.startswith("mapper "):
                continue
            argv = shlex.split(ln)[1:]
            with pytest.raises(SystemExit) as e:
                main(argv)
            out = capsys.readouterr()
            assert e.value.code == 0, f"README.md:{b['line']}: `{ln}` exited {e.value.code}: {out.err}"
            ran += 1
    assert ran >= 4
    assert os.path.getsize("lab.glb") > 0 and Path("lab-slice.png").read_bytes().startswith(b"\x89PNG")

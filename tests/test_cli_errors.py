"""CLI errors of issue 30 (item 3): each is one line on stderr with exit 1 (bad input) or 2 (usage)."""

from __future__ import annotations

import numpy as np
from recording_helpers import BagWriter
from test_cli import run
from test_service_helpers import scan


def _bag_without_tf(path, with_odom: bool):
    pts = scan(0, 100)[0]
    with BagWriter(path, "ros2-sqlite3") as b:
        b.add("/points", "sensor_msgs/msg/PointCloud2")
        if with_odom:
            b.add("/odom", "nav_msgs/msg/Odometry")
            b.write(
                "/odom", 100.0, b.odometry(100.0, "odom", "base_link", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))
            )
        b.write("/points", 100.0, b.pointcloud2(100.0, "lidar", pts, big_endian=False, row_pad=3))
    return b.path


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bag_without_tf(tmp_path, capsys):
    bag = _bag_without_tf(tmp_path / "notf", with_odom=False)
    out = str(tmp_path / "o")
    code, _, err = run(["replay", "--format", "rosbag", str(bag), "--points-topic", "/points",
                        "--world-frame", "map", "--out", out], capsys)  # fmt: skip
    assert code == 1 and "no /tf or /tf_static" in _one_line(err)
    bag = _bag_without_tf(tmp_path / "odom", with_odom=True)
    code, _, err = run(["replay", "--format", "rosbag", str(bag), "--points-topic", "/points",
                        "--odom-topic", "/odom", "--out", out], capsys)  # fmt: skip
    assert code == 1 and "pose:" in _one_line(err)


def test_bad_recording_files(tmp_path, capsys):
    out = str(tmp_path / "o")
    junk = tmp_path / "random.bag"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    code, _, err = run(
        ["replay", "--format", "rosbag", str(junk), "--points-topic", "/p", "--out", out], capsys
    )
    assert code == 1 and "not a readable ROS 1/ROS 2 bag" in _one_line(err)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.pcd").write_bytes(b"garbage\x00\xffnot a pcd\nFIELDS x\n")
    code, _, err = run(["replay", "--format", "pcd", str(tmp_path / "bad"), "--out", out], capsys)
    assert code == 1 and "not a readable PCD file" in _one_line(err)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "a.pcd").write_text(
        "# .PCD v0.7\nVERSION 0.7\nFIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nCOUNT 1 1 1\n"
        "WIDTH 4000000000000000000\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS 4000000000000000000\n"
        "DATA ascii\n1 2 3\n4 5 6\n"
    )
    code, _, err = run(["replay", "--format", "pcd", str(tmp_path / "big"), "--out", out], capsys)
    assert code == 1 and "declares POINTS 4000000000000000000 but holds 2" in _one_line(err)


def test_usage_errors_exit_2(tmp_path, capsys):
    base = ["replay", "--format", "pcd", str(tmp_path), "--out", str(tmp_path / "o")]
    for flag in ("--limit", "--stride", "--window"):
        code, _, err = run([*base, flag, "0"], capsys)
        assert code == 2 and f"{flag}: expected a whole number >= 1, got 0" in err.splitlines()[-1], err
    code, _, err = run(["serve", "--port", "99999"], capsys)
    assert code == 2 and "--port: expected a port number 0-65535, got 99999" in err.splitlines()[-1], err
    assert "Traceback" not in err and "pydantic" not in err


def test_depth_without_pose_names_the_flags(tmp_path, capsys):
    bag = _bag_without_tf(tmp_path / "b", with_odom=False)
    code, _, err = run(["replay", "--format", "rosbag", str(bag), "--depth-topic", "/d",
                        "--camera-info-topic", "/i", "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    line = _one_line(err)
    assert code == 1 and "--world-frame" in line and "--odom-topic" in line

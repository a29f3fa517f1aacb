"""The ``mapper`` command with a robot's own recordings (ROS bags, PCD), mesh formats by extension, and
errors: one line on stderr and the documented exit code (1 error, 2 usage, 3 server unreachable)."""

from __future__ import annotations

import ast
import re
import time

import numpy as np
import pytest
from recording_helpers import expected_pose, write_depth_bag, write_lidar_bag
from test_cli import run
from test_service_helpers import Server, free_port, scan

from mapper import Map, io
from mapper.client import MapperClient

TIMES = [0.0, 0.5, 1.0]


def _voxels(stdout: str) -> dict:
    return ast.literal_eval(re.search(r"voxels per layer (\{.*?\})", stdout).group(1))


def test_replay_rosbag_offline_matches_the_api_and_exports_meshes(tmp_path, capsys):
    scans = [scan(i, 1500)[0] for i in range(3)]
    bag = write_lidar_bag(tmp_path / "lab", "ros1", scans, TIMES)  # lab.bag
    out = tmp_path / "maps"
    code, stdout, err = run(
        ["replay", "--format", "rosbag", str(bag), "--points-topic", "/points", "--world-frame", "map",
         "--out", str(out), "--voxel", "0.25", "--device", "cpu", "--layers", "tsdf,esdf"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "replayed 3 lidar frames into new map 'lab'" in stdout and "3/3 acked" in err
    # reference: the same frames with the hand-derived poses through the Python API
    m = Map(0.25, layers=("tsdf", "esdf"), device="cpu", max_range_m=100.0)
    for pts, t in zip(scans, TIMES, strict=True):
        m.integrate_lidar(pts, expected_pose(t))
    assert _voxels(stdout)["tsdf"] == m.stats()["layers"]["tsdf"]["voxels"] > 0

    # the map kept the recording's name; meshes by extension
    ref = io.read_ply(io.mesh_to_ply_bytes(m.mesh()))
    for ext in ("ply", "obj", "glb"):
        code, stdout, err = run(
            ["export", "--data-dir", str(out), "--map", "lab", "--mesh", str(tmp_path / f"lab.{ext}"),
             "--device", "cpu"],
            capsys,
        )  # fmt: skip
        assert code == 0, err
    data = {ext: (tmp_path / f"lab.{ext}").read_bytes() for ext in ("ply", "obj", "glb")}
    assert data["ply"].startswith(b"ply\n") and data["glb"][:4] == b"glTF"
    obj_v = [ln for ln in data["obj"].decode().splitlines() if ln.startswith("v ")]
    obj_f = [ln for ln in data["obj"].decode().splitlines() if ln.startswith("f ")]
    assert len(obj_v) == ref.num_vertices and len(obj_f) == ref.num_faces > 0
    v0 = np.array(obj_v[0].split()[1:4], dtype=np.float64)
    np.testing.assert_allclose(v0, ref.vertices[0].numpy(), atol=1e-5)
    code, _, err = run(
        ["export", "--data-dir", str(out), "--map", "lab", "--mesh", str(tmp_path / "lab.stl")], capsys
    )
    assert code == 2 and "cannot write a mesh as '.stl'" in err and not (tmp_path / "lab.stl").exists()
    # a second replay into the same data directory under the same name is refused (names stay unique)
    code, _, err = run(
        ["replay", "--format", "rosbag", str(bag), "--points-topic", "/points", "--out", str(out)], capsys
    )
    assert code == 1 and "a map named 'lab' already exists" in err


def test_replay_pcd_without_poses(tmp_path, capsys):
    from pypcd4 import Encoding, PointCloud

    pcd = tmp_path / "scans"
    pcd.mkdir()
    for i in range(2):
        PointCloud.from_xyz_points(scan(i, 3000)[0]).save(
            pcd / f"{i:04d}.pcd", encoding=Encoding.BINARY_COMPRESSED
        )
    code, stdout, err = run(
        ["replay", "--format", "pcd", str(pcd), "--out", str(tmp_path / "o"), "--voxel", "0.3",
         "--device", "cpu"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "replayed 2 lidar frames into new map 'scans'" in stdout  # registered: no pose in the files


def test_cli_errors_are_one_line_with_exit_codes(tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    bag = write_lidar_bag(tmp_path / "b", "ros2-sqlite3", [scan(0, 100)[0]], [0.0])
    t = time.monotonic()
    code, stdout, err = run(
        ["replay", "--format", "rosbag", str(bag), "--points-topic", "/points", "--server", dead,
         "--wait", "0.5"],
        capsys,
    )  # fmt: skip
    assert code == 3 and time.monotonic() - t < 10
    assert err.count("\n") == 1 and "cannot reach the mapper service at " + dead in err
    assert "Traceback" not in err + stdout
    code, _, err = run(["export", "--server", dead, "--map", "x", "--slice", "s.png", "--wait", "0"], capsys)
    assert code == 3 and err.count("\n") == 1 and "cannot reach" in err
    # bad recordings and options: exit 1 (error) or 2 (usage), one line
    code, _, err = run(
        ["replay", "--format", "rosbag", str(bag), "--points-topic", "/x", "--out", "o"], capsys
    )
    assert code == 1 and err.count("\n") == 1 and "/x is not in" in err and "/points" in err
    code, _, err = run(["replay", "--format", "rosbag", str(bag), "--out", str(tmp_path / "o")], capsys)
    assert code == 1 and "--points-topic" in err
    code, _, err = run(["replay", "--format", "pcd", str(tmp_path / "none"), "--out", "o"], capsys)
    assert code == 1 and "does not exist" in err
    code, _, err = run(
        ["replay", "--format", "kitti", str(tmp_path), "--points-topic", "/p", "--out", "o"], capsys
    )
    assert code == 2 and "--format rosbag only" in err


def test_every_flag_has_help():
    from mapper.cli import build_parser

    ap = build_parser()
    subs = next(a for a in ap._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in subs.choices.items():
        for a in p._actions:
            if a.dest != "help":
                assert a.help, f"mapper {name} {a.option_strings or a.dest} has no help text"


def test_replay_depth_bag_into_server_counts_acks(tmp_path, capsys):
    depths = [np.full((24, 32), 2.0, np.float32) for _ in range(2)]
    K = np.array([[30.0, 0, 16.0], [0, 30.0, 12.0], [0, 0, 1]])
    bag = write_depth_bag(tmp_path / "cam", "ros2-mcap", depths, K, [0.0, 5.0], "32FC1")
    with Server(tmp_path / "data", tmp_path / "srv.log") as s:
        code, stdout, err = run(
            ["replay", "--format", "rosbag", str(bag), "--depth-topic", "/camera/depth",
             "--camera-info-topic", "/camera/info", "--world-frame", "world", "--server", s.url,
             "--voxel", "0.1", "--layers", "tsdf"],
            capsys,
        )  # fmt: skip
        assert code == 0, err
        assert "2/2 acked" in err and "ack p50" in err and "ack latency p50" in stdout
        with MapperClient(s.url) as c:
            assert c.find_map("cam")["frames_integrated"] == 2
        code, _, err = run(
            ["export", "--server", s.url, "--map", "cam", "--mesh", str(tmp_path / "c.obj")], capsys
        )
        assert code == 0, err
        assert (tmp_path / "c.obj").read_text().count("\nf ") > 0
        code, _, err = run(
            ["export", "--server", s.url, "--map", "nope", "--slice", str(tmp_path / "n.png")], capsys
        )
        assert code == 1 and "404" in err and err.count("\n") == 1


@pytest.mark.parametrize("name", ["lab.bag", "lab"])
def test_default_map_name(tmp_path, name):
    from mapper.cli import default_map_name

    p = tmp_path / name
    p.write_bytes(b"") if name.endswith(".bag") else p.mkdir()
    assert default_map_name(p) == "lab"


def test_client_query_names_the_expected_shape():
    from mapper.errors import InvalidArgument, InvalidArgumentType

    with MapperClient(f"http://127.0.0.1:{free_port()}") as c:  # refused before any request is made
        with pytest.raises(InvalidArgument, match=r"expected shape \[M, 3\].*got \[4, 2\]"):
            c.query_distance("m", np.zeros((4, 2)))
        with pytest.raises(InvalidArgumentType, match="expected numbers"):
            c.query_occupancy("m", np.array([["a", "b", "c"]]))

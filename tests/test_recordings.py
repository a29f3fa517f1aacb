"""Readers of a robot's own recordings (mapper.recordings): ROS 1 / ROS 2 (sqlite3, MCAP) bags and PCD files,
written here with the libraries' own writers. References: the arrays written, hand-derived poses."""

from __future__ import annotations

import numpy as np
import pytest
from recording_helpers import (
    STORAGES,
    BagWriter,
    expected_pose,
    pose_xyaw,
    write_depth_bag,
    write_lidar_bag,
)

from mapper.errors import InvalidArgument
from mapper.recordings import PcdSequence, RosbagSequence, TransformBuffer

TIMES = [0.0, 0.5, 1.5]


def _scans(n=3, m=40):
    rng = np.random.default_rng(7)
    return [rng.normal(0, 3, (m + i, 3)).astype(np.float32) for i in range(n)]


@pytest.mark.parametrize("storage", STORAGES)
def test_lidar_bag_points_and_poses(tmp_path, storage):
    scans = _scans()
    path = write_lidar_bag(tmp_path / "bag", storage, scans, TIMES)
    ds = RosbagSequence(path, points_topic="/points", world_frame="map")  # /tf + /tf_static
    assert ds.kind == "lidar" and len(ds) == 3 and ds.skipped == 0
    for i, t in enumerate(TIMES):
        f = ds[i]
        np.testing.assert_array_equal(f["points"], scans[i])  # row padding + big-endian (ROS 1) decoded
        np.testing.assert_array_equal(f["intensity"], np.arange(len(scans[i]), dtype=np.float32))
        np.testing.assert_allclose(f["T_world_sensor"], expected_pose(t), atol=1e-9)
        assert f["timestamp"] == pytest.approx(100.0 + t)
    odom = RosbagSequence(path, points_topic="/points", odom_topic="/odom")  # Odometry + /tf_static
    assert odom.world_frame == "odom"
    np.testing.assert_allclose(odom[1]["T_world_sensor"], expected_pose(0.5), atol=1e-9)
    bare = RosbagSequence(path, points_topic="/points")  # no pose: the map registers the scans
    assert bare[2]["T_world_sensor"] is None and len(bare) == 3


def test_lidar_bag_frames_outside_the_poses_are_skipped(tmp_path):
    # scans at 2.05 s (within max_pose_gap_s of the last pose at 2 s) and 2.5 s (outside): one skipped
    path = write_lidar_bag(tmp_path / "bag", "ros2-sqlite3", _scans(3), [0.0, 2.05, 2.5])
    ds = RosbagSequence(path, points_topic="/points", world_frame="map", max_pose_gap_s=0.1)
    assert len(ds) == 2 and ds.skipped == 1
    np.testing.assert_allclose(ds[1]["T_world_sensor"], expected_pose(2.0), atol=1e-9)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("encoding", ["16UC1", "32FC1"])
def test_depth_bag(tmp_path, storage, encoding):
    rng = np.random.default_rng(1)
    depths = [np.round(rng.uniform(0.5, 4.0, (6, 8)), 3).astype(np.float32) for _ in range(2)]
    depths[0][0, 0] = 0.0  # no return
    K = np.array([[50.0, 0, 4.0], [0, 50.0, 3.0], [0, 0, 1]])
    path = write_depth_bag(tmp_path / "bag", storage, depths, K, [0.0, 30.0], encoding)
    ds = RosbagSequence(
        path, depth_topic="/camera/depth", camera_info_topic="/camera/info", world_frame="world"
    )
    assert ds.kind == "depth" and len(ds) == 2
    for k in range(2):
        f = ds[k]
        np.testing.assert_allclose(f["depth_m"], depths[k], atol=1e-6)  # 16UC1: millimetres -> metres
        np.testing.assert_array_equal(f["K"], K)
        np.testing.assert_allclose(f["T_world_sensor"], pose_xyaw(k, [0.0, 30.0][k]), atol=1e-9)


def test_bag_errors(tmp_path):
    path = write_lidar_bag(tmp_path / "bag", "ros2-mcap", _scans(1), [0.0])
    with pytest.raises(InvalidArgument, match=r"/nope is not in .*?/points \(sensor_msgs/msg/PointCloud2\)"):
        RosbagSequence(path, points_topic="/nope")
    with pytest.raises(
        InvalidArgument, match="/odom is nav_msgs/msg/Odometry, expected sensor_msgs/msg/PointCloud2"
    ):
        RosbagSequence(path, points_topic="/odom")
    with pytest.raises(InvalidArgument, match="no transform between 'earth' and 'lidar'"):
        RosbagSequence(path, points_topic="/points", world_frame="earth")
    with pytest.raises(InvalidArgument, match="camera_info_topic"):
        RosbagSequence(path, depth_topic="/points", world_frame="map")
    with pytest.raises(InvalidArgument, match="exactly one"):
        RosbagSequence(path)
    with pytest.raises(InvalidArgument, match="not a readable"):
        (tmp_path / "junk.bag").write_bytes(b"not a bag")
        RosbagSequence(tmp_path / "junk.bag", points_topic="/points")
    with BagWriter(tmp_path / "rgb", "ros2-sqlite3") as b:  # an encoding that is not depth
        b.add("/img", "sensor_msgs/msg/Image")
        b.add("/info", "sensor_msgs/msg/CameraInfo")
        b.add("/tf", "tf2_msgs/msg/TFMessage")
        b.write("/tf", 1.0, b.tf(1.0, "w", "c", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0)))
        b.write("/info", 1.0, b.camera_info(1.0, "c", np.eye(3), 2, 2))
        img = b.depth_image(1.0, "c", np.ones((2, 2), np.float32), "32FC1")
        img.encoding = "rgb8"
        b.write("/img", 1.0, img)
    ds = RosbagSequence(b.path, depth_topic="/img", camera_info_topic="/info", world_frame="w")
    with pytest.raises(InvalidArgument, match="encoding 'rgb8'"):
        ds[0]


def test_transform_buffer_interpolates_rotation():
    tf = TransformBuffer(max_gap_s=0.0)
    tf.add("w", "b", 0.0, pose_xyaw(0.0, 0.0))
    tf.add("w", "b", 1.0, pose_xyaw(2.0, 90.0))
    tf.add("b", "s", None, pose_xyaw(1.0, 0.0))
    # at t = 0.25: base at x = 0.5, yaw 22.5 deg; sensor 1 m ahead along the base's x axis
    expect = pose_xyaw(0.5, 22.5) @ pose_xyaw(1.0, 0.0)
    np.testing.assert_allclose(tf.lookup("w", "s", 0.25), expect, atol=1e-12)
    np.testing.assert_allclose(tf.lookup("s", "w", 0.25), np.linalg.inv(expect), atol=1e-12)
    assert tf.lookup("w", "s", 1.5) is None and tf.lookup("w", "x", 0.5) is None


@pytest.mark.parametrize("encoding", ["ascii", "binary", "binary_compressed"])
def test_pcd_variants(tmp_path, encoding):
    from pypcd4 import Encoding, PointCloud

    scans = _scans(2)
    for i, s in enumerate(scans):
        xyzi = np.hstack([s, np.full((len(s), 1), i, np.float32)])
        PointCloud.from_xyzi_points(xyzi).save(tmp_path / f"scan_{i:03d}.pcd", encoding=Encoding(encoding))
    ds = PcdSequence(tmp_path)
    assert len(ds) == 2
    for i in range(2):
        f = ds[i]
        np.testing.assert_allclose(f["points"], scans[i], rtol=1e-6)  # ASCII keeps ~8 significant digits
        assert f["T_world_sensor"] is None and (f["intensity"] == i).all()
    # poses.txt (KITTI 3x4 rows) gives the poses
    np.savetxt(tmp_path / "poses.txt", np.stack([pose_xyaw(i, 10.0 * i)[:3].ravel() for i in range(2)]))
    np.testing.assert_allclose(PcdSequence(tmp_path)[1]["T_world_sensor"], pose_xyaw(1, 10.0), atol=1e-12)


def test_pcd_viewpoint_and_errors(tmp_path):
    from pypcd4 import PointCloud

    pc = PointCloud.from_xyz_points(_scans(1)[0])
    pc.metadata.viewpoint = (1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 1.0)  # t, then q = (w, x, y, z): 180 deg about z
    pc.save(tmp_path / "one.pcd")
    T = PcdSequence(tmp_path / "one.pcd")[0]["T_world_sensor"]
    np.testing.assert_allclose(
        T, np.array([[-1, 0, 0, 1], [0, -1, 0, 2], [0, 0, 1, 3], [0, 0, 0, 1.0]]), atol=1e-12
    )
    with pytest.raises(InvalidArgument, match="no \\*.pcd"):
        PcdSequence(tmp_path / "empty") if (tmp_path / "empty").mkdir() is None else None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.pcd").write_text("this is not a pcd\n")
    with pytest.raises(InvalidArgument, match="not a readable PCD"):
        PcdSequence(tmp_path / "bad")[0]
    np.savetxt(tmp_path / "poses.txt", np.zeros((1, 7)))
    with pytest.raises(InvalidArgument, match="12 \\(3x4\\) or 16"):
        PcdSequence(tmp_path)

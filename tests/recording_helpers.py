"""Helpers (no tests here): small ROS 1 / ROS 2 bags and PCD files written with the libraries' own writers
(rosbags, pypcd4), so no binary recording is committed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

STORAGES = ("ros1", "ros2-sqlite3", "ros2-mcap")


def _rot_z(deg: float) -> np.ndarray:
    a = np.deg2rad(deg)
    return np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1.0]])


def quat_z(deg: float) -> tuple[float, float, float, float]:
    """(x, y, z, w) of a rotation by ``deg`` about z."""
    a = np.deg2rad(deg) / 2
    return 0.0, 0.0, float(np.sin(a)), float(np.cos(a))


class BagWriter:
    """One writer for the three storages: ``add(topic, msgtype)`` then ``write(topic, t_s, msg)``;
    ``types[...]`` builds messages of the right typestore."""

    def __init__(self, path: Path, storage: str):
        from rosbags.typesys import Stores, get_typestore

        self.storage = storage
        self.ros1 = storage == "ros1"
        self.store = get_typestore(Stores.ROS1_NOETIC if self.ros1 else Stores.ROS2_HUMBLE)
        if "tf2_msgs/msg/TFMessage" not in self.store.types:  # the noetic store lacks tf2_msgs
            from rosbags.typesys import get_types_from_msg

            tf_def = "geometry_msgs/TransformStamped[] transforms"
            self.store.register(get_types_from_msg(tf_def, "tf2_msgs/msg/TFMessage"))
        self.types = self.store.types
        if self.ros1:
            from rosbags.rosbag1 import Writer

            self.path = Path(path).with_suffix(".bag")
            self.w = Writer(self.path)
        else:
            from rosbags.rosbag2 import StoragePlugin, Writer

            plugin = StoragePlugin.MCAP if storage == "ros2-mcap" else StoragePlugin.SQLITE3
            self.path = Path(path)
            self.w = Writer(self.path, version=9, storage_plugin=plugin)
        self.conns: dict[str, object] = {}

    def __enter__(self):
        self.w.open()
        return self

    def __exit__(self, *exc):
        self.w.close()

    def add(self, topic: str, msgtype: str) -> None:
        self.conns[topic] = self.w.add_connection(topic, msgtype, typestore=self.store)

    def write(self, topic: str, t_s: float, msg) -> None:
        c = self.conns[topic]
        ser = self.store.serialize_ros1 if self.ros1 else self.store.serialize_cdr
        self.w.write(c, int(round(t_s * 1e9)), bytes(ser(msg, c.msgtype)))

    # ------------------------------------------------------------------------------------ messages
    def time(self, t_s: float):
        sec = int(np.floor(t_s))
        return self.types["builtin_interfaces/msg/Time"](sec=sec, nanosec=int(round((t_s - sec) * 1e9)))

    def header(self, t_s: float, frame_id: str):
        H = self.types["std_msgs/msg/Header"]
        if self.ros1:
            return H(seq=0, stamp=self.time(t_s), frame_id=frame_id)
        return H(stamp=self.time(t_s), frame_id=frame_id)

    def pointcloud2(self, t_s: float, frame_id: str, points: np.ndarray, big_endian=False, row_pad=0):
        """float32 x, y, z, intensity (intensity = point index), with a padding byte block per point."""
        PF = self.types["sensor_msgs/msg/PointField"]
        n = len(points)
        e = ">" if big_endian else "<"
        rec = np.zeros(
            n,
            dtype=np.dtype(
                {
                    "names": ["x", "y", "z", "intensity"],
                    "formats": [e + "f4"] * 4,
                    "offsets": [0, 4, 8, 16],
                    "itemsize": 24,
                }
            ),
        )
        rec["x"], rec["y"], rec["z"] = points[:, 0], points[:, 1], points[:, 2]
        rec["intensity"] = np.arange(n, dtype=np.float32)
        data = rec.tobytes() + b"\0" * row_pad
        fields = [PF(name=c, offset=o, datatype=7, count=1) for c, o in zip("xyz", (0, 4, 8), strict=True)]
        fields.append(PF(name="intensity", offset=16, datatype=7, count=1))
        return self.types["sensor_msgs/msg/PointCloud2"](
            header=self.header(t_s, frame_id),
            height=1,
            width=n,
            fields=fields,
            is_bigendian=big_endian,
            point_step=24,
            row_step=24 * n + row_pad,
            data=np.frombuffer(data, np.uint8),
            is_dense=True,
        )

    def depth_image(self, t_s: float, frame_id: str, depth_m: np.ndarray, encoding: str, row_pad: int = 0):
        h, w = depth_m.shape
        if encoding == "16UC1":
            px = np.round(depth_m * 1000).astype("<u2")
        else:
            px = depth_m.astype("<f4")
        rows = px.view(np.uint8).reshape(h, -1)
        rows = np.hstack([rows, np.zeros((h, row_pad), np.uint8)])
        return self.types["sensor_msgs/msg/Image"](
            header=self.header(t_s, frame_id),
            height=h,
            width=w,
            encoding=encoding,
            is_bigendian=0,
            step=rows.shape[1],
            data=rows.reshape(-1),
        )

    def camera_info(self, t_s: float, frame_id: str, K: np.ndarray, w: int, h: int):
        CI = self.types["sensor_msgs/msg/CameraInfo"]
        roi = self.types["sensor_msgs/msg/RegionOfInterest"](
            x_offset=0, y_offset=0, height=0, width=0, do_rectify=False
        )
        P = np.hstack([K, np.zeros((3, 1))]).ravel()
        kw = dict(
            header=self.header(t_s, frame_id),
            height=h,
            width=w,
            distortion_model="plumb_bob",
            binning_x=0,
            binning_y=0,
            roi=roi,
        )
        if self.ros1:
            return CI(D=np.zeros(5), K=K.ravel(), R=np.eye(3).ravel(), P=P, **kw)
        return CI(d=np.zeros(5), k=K.ravel(), r=np.eye(3).ravel(), p=P, **kw)

    def _pose_parts(self, T_xyz, q):
        V = self.types["geometry_msgs/msg/Vector3"]
        Q = self.types["geometry_msgs/msg/Quaternion"]
        return V(x=T_xyz[0], y=T_xyz[1], z=T_xyz[2]), Q(x=q[0], y=q[1], z=q[2], w=q[3])

    def tf(self, t_s: float, parent: str, child: str, xyz, q):
        tr, rot = self._pose_parts(xyz, q)
        ts = self.types["geometry_msgs/msg/TransformStamped"](
            header=self.header(t_s, parent),
            child_frame_id=child,
            transform=self.types["geometry_msgs/msg/Transform"](translation=tr, rotation=rot),
        )
        return self.types["tf2_msgs/msg/TFMessage"](transforms=[ts])

    def odometry(self, t_s: float, parent: str, child: str, xyz, q):
        P = self.types["geometry_msgs/msg/Point"](x=xyz[0], y=xyz[1], z=xyz[2])
        _, rot = self._pose_parts(xyz, q)
        pose = self.types["geometry_msgs/msg/PoseWithCovariance"](
            pose=self.types["geometry_msgs/msg/Pose"](position=P, orientation=rot), covariance=np.zeros(36)
        )
        V = self.types["geometry_msgs/msg/Vector3"]
        twist = self.types["geometry_msgs/msg/TwistWithCovariance"](
            twist=self.types["geometry_msgs/msg/Twist"](
                linear=V(x=0.0, y=0.0, z=0.0), angular=V(x=0.0, y=0.0, z=0.0)
            ),
            covariance=np.zeros(36),
        )
        return self.types["nav_msgs/msg/Odometry"](
            header=self.header(t_s, parent), child_frame_id=child, pose=pose, twist=twist
        )


def expected_pose(t_s: float) -> np.ndarray:
    """T_map_lidar of :func:`write_lidar_bag` at time ``t_s`` (hand-derived): base_link moves 1 m/s along x
    and turns 90 deg/s about z (odometry/tf sampled at 0, 1, 2 s; linear + geodesic interpolation is exact
    for this motion); lidar sits 0.5 m above base_link, yawed by 180 deg."""
    T_base = np.eye(4)
    T_base[:3, :3] = _rot_z(90.0 * t_s)
    T_base[0, 3] = t_s
    T_bl = np.eye(4)
    T_bl[:3, :3] = _rot_z(180.0)
    T_bl[2, 3] = 0.5
    return T_base @ T_bl


def write_lidar_bag(path: Path, storage: str, scans: list[np.ndarray], times: list[float]) -> Path:
    """/points (PointCloud2 in frame ``lidar``), /tf (map -> base_link at 0, 1, 2 s), /tf_static
    (base_link -> lidar) and /odom (nav_msgs/Odometry odom -> base_link, same motion)."""
    with BagWriter(path, storage) as b:
        b.add("/points", "sensor_msgs/msg/PointCloud2")
        b.add("/tf", "tf2_msgs/msg/TFMessage")
        b.add("/tf_static", "tf2_msgs/msg/TFMessage")
        b.add("/odom", "nav_msgs/msg/Odometry")
        b.write("/tf_static", 0.0, b.tf(0.0, "base_link", "lidar", (0.0, 0.0, 0.5), quat_z(180.0)))
        for k in range(3):
            t = 100.0 + k
            b.write("/tf", t, b.tf(t, "map", "base_link", (float(k), 0.0, 0.0), quat_z(90.0 * k)))
            b.write("/odom", t, b.odometry(t, "odom", "base_link", (float(k), 0.0, 0.0), quat_z(90.0 * k)))
        for pts, t in zip(scans, times, strict=True):
            b.write(
                "/points",
                100.0 + t,
                b.pointcloud2(100.0 + t, "lidar", pts, big_endian=storage == "ros1", row_pad=3),
            )
    return b.path


def write_depth_bag(
    path: Path,
    storage: str,
    depths: list[np.ndarray],
    K: np.ndarray,
    yaws_deg: list[float],
    encoding: str = "16UC1",
) -> Path:
    """/camera/depth (Image, frame ``cam``) + /camera/info (CameraInfo) + /tf (world -> cam at each image's
    stamp, frame k at 50 + k s: at x = k metres, yawed by ``yaws_deg[k]`` about z)."""
    h, w = depths[0].shape
    with BagWriter(path, storage) as b:
        b.add("/camera/depth", "sensor_msgs/msg/Image")
        b.add("/camera/info", "sensor_msgs/msg/CameraInfo")
        b.add("/tf", "tf2_msgs/msg/TFMessage")
        for k, (d, yaw) in enumerate(zip(depths, yaws_deg, strict=True)):
            t = 50.0 + k
            b.write("/tf", t, b.tf(t, "world", "cam", (float(k), 0.0, 0.0), quat_z(yaw)))
            b.write("/camera/info", t, b.camera_info(t, "cam", K, w, h))
            b.write("/camera/depth", t, b.depth_image(t, "cam", d, encoding, row_pad=4))
    return b.path


def pose_xyaw(x: float, yaw_deg: float) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3] = _rot_z(yaw_deg)
    T[0, 3] = x
    return T

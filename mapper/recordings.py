"""Readers for a robot's own recordings: ROS 1 / ROS 2 bags and PCD files.

Like :mod:`mapper.datasets`, each reader is a plain class with ``__len__``/``__getitem__`` returning numpy
arrays in SI units (nothing here touches torch):

* :class:`RosbagSequence` reads ROS 1 ``.bag`` files and ROS 2 bag folders (sqlite3 or MCAP storage)
  through the pure-Python ``rosbags`` package (no ROS install): ``sensor_msgs/PointCloud2`` scans, or
  depth ``sensor_msgs/Image`` (``16UC1`` millimetres, ``32FC1`` metres) with ``sensor_msgs/CameraInfo``.
  Poses come from ``/tf`` + ``/tf_static`` (``world_frame`` -> the message's frame), from a
  ``nav_msgs/Odometry`` topic (chained with ``/tf_static`` to the sensor frame when they differ), or not
  at all (LiDAR scans are then registered by the map).
* :class:`PcdSequence` reads ``.pcd`` files (ASCII, binary, binary_compressed) through ``pypcd4``; poses
  from a ``poses.txt`` beside them (one row-major 3x4 or 4x4 per line, in file-name order), else from a
  non-identity ``VIEWPOINT``, else none.

Frames whose time falls outside the pose source (by more than ``max_pose_gap_s``) are left out and
counted in ``skipped``.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from .datasets import quaternion_to_matrix
from .errors import InvalidArgument

# sensor_msgs/PointField datatypes
_POINTFIELD_DTYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 8: "f8"}
POINTCLOUD2 = "sensor_msgs/msg/PointCloud2"
IMAGE = "sensor_msgs/msg/Image"
CAMERA_INFO = "sensor_msgs/msg/CameraInfo"
ODOMETRY = "nav_msgs/msg/Odometry"
TF_MESSAGE = "tf2_msgs/msg/TFMessage"


def _stamp(header) -> float:
    """Seconds of a ``std_msgs/Header`` stamp (ROS 1 ``secs/nsecs`` and ROS 2 ``sec/nanosec``)."""
    s = header.stamp
    return float(getattr(s, "sec", 0)) + 1e-9 * float(getattr(s, "nanosec", 0))


def _transform_matrix(translation, rotation) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3] = quaternion_to_matrix(rotation.x, rotation.y, rotation.z, rotation.w)
    T[:3, 3] = [translation.x, translation.y, translation.z]
    return T


def _slerp_matrix(T0: np.ndarray, T1: np.ndarray, a: float) -> np.ndarray:
    """Pose between two 4x4 poses: translation linear, rotation along the geodesic (axis-angle)."""
    R = T0[:3, :3].T @ T1[:3, :3]
    angle = float(np.arccos(np.clip((np.trace(R) - 1) / 2, -1.0, 1.0)))
    out = np.eye(4)
    if angle < 1e-9:
        out[:3, :3] = T0[:3, :3]
    else:
        axis = np.array([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]]) / (2 * np.sin(angle))
        if np.pi - angle < 1e-6:  # 180 degrees: the axis from the symmetric part
            w, v = np.linalg.eigh((R + np.eye(3)) / 2)
            axis = v[:, -1]
        K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
        th = a * angle
        out[:3, :3] = T0[:3, :3] @ (np.eye(3) + np.sin(th) * K + (1 - np.cos(th)) * K @ K)
    out[:3, 3] = (1 - a) * T0[:3, 3] + a * T1[:3, 3]
    return out


class TransformBuffer:
    """A tf tree over time: ``add(parent, child, t, T_parent_child)`` (``t=None``: static), then
    ``lookup(target, source, t)`` -> float64 ``[4, 4]`` ``T_target_source`` or None when the chain is broken
    or ``t`` is outside a dynamic edge's samples by more than ``max_gap_s``."""

    def __init__(self, max_gap_s: float = 0.1):
        self.max_gap_s = max_gap_s
        self.parent: dict[str, str] = {}
        self.static: dict[str, np.ndarray] = {}
        self.samples: dict[str, list[tuple[float, np.ndarray]]] = {}
        self._unsorted: set[str] = set()

    def add(self, parent: str, child: str, t: float | None, T_parent_child: np.ndarray) -> None:
        parent, child = parent.lstrip("/"), child.lstrip("/")
        self.parent[child] = parent
        if t is None:
            self.static[child] = T_parent_child
        else:
            self.samples.setdefault(child, []).append((t, T_parent_child))
            self._unsorted.add(child)

    def frames(self) -> set[str]:
        return set(self.parent) | set(self.parent.values())

    def _edge(self, child: str, t: float) -> np.ndarray | None:
        if child in self.static:
            return self.static[child]
        s = self.samples[child]
        if child in self._unsorted:
            s.sort(key=lambda x: x[0])
            self._unsorted.discard(child)
        times = [x[0] for x in s]
        i = bisect.bisect_left(times, t)
        if i < len(s) and times[i] == t:
            return s[i][1]
        if i == 0:
            return s[0][1] if times[0] - t <= self.max_gap_s else None
        if i == len(s):
            return s[-1][1] if t - times[-1] <= self.max_gap_s else None
        (t0, T0), (t1, T1) = s[i - 1], s[i]
        return _slerp_matrix(T0, T1, (t - t0) / (t1 - t0))

    def _to_root(self, frame: str, t: float) -> tuple[list[str], np.ndarray | None]:
        """(frames from ``frame`` up to its root, T_root_frame or None)."""
        chain, T = [frame], np.eye(4)
        seen = {frame}
        while frame in self.parent:
            E = self._edge(frame, t)
            if E is None:
                return chain, None
            T = E @ T
            frame = self.parent[frame]
            if frame in seen:
                break
            seen.add(frame)
            chain.append(frame)
        return chain, T

    def lookup(self, target: str, source: str, t: float) -> np.ndarray | None:
        target, source = target.lstrip("/"), source.lstrip("/")
        if target == source:
            return np.eye(4)
        cs, Ts = self._to_root(source, t)
        ct, Tt = self._to_root(target, t)
        if Ts is None or Tt is None or cs[-1] != ct[-1]:
            return None
        return np.linalg.inv(Tt) @ Ts  # both are T_root_x


def decode_pointcloud2(msg) -> dict[str, np.ndarray]:
    """``sensor_msgs/PointCloud2`` -> ``{"points": float32 [N, 3], "intensity": [N] (if present)}``."""
    fields = {f.name: f for f in msg.fields}
    if not all(c in fields for c in "xyz"):
        raise InvalidArgument(f"points: PointCloud2 needs x, y, z fields, has {sorted(fields)}")
    order = ">" if msg.is_bigendian else "<"
    names = [c for c in ("x", "y", "z", "intensity") if c in fields]
    for c in names:
        if fields[c].datatype not in _POINTFIELD_DTYPES:
            raise InvalidArgument(f"points: field {c} has unknown PointField datatype {fields[c].datatype}")
    dtype = np.dtype(
        {
            "names": names,
            "formats": [order + _POINTFIELD_DTYPES[fields[c].datatype] for c in names],
            "offsets": [fields[c].offset for c in names],
            "itemsize": msg.point_step,
        }
    )
    n_row = msg.width * msg.point_step
    raw = np.frombuffer(bytes(msg.data), dtype=np.uint8)
    if raw.size < msg.height * msg.row_step or msg.row_step < n_row:
        raise InvalidArgument(
            f"points: PointCloud2 data has {raw.size} bytes, header says {msg.height} x {msg.row_step}"
        )
    rows = raw[: msg.height * msg.row_step].reshape(msg.height, msg.row_step)[:, :n_row]
    rec = np.ascontiguousarray(rows).view(dtype).reshape(-1)
    out = {"points": np.stack([rec[c].astype(np.float32) for c in "xyz"], axis=1)}
    if "intensity" in names:
        out["intensity"] = rec["intensity"].astype(np.float32)
    return out


def decode_depth_image(msg) -> np.ndarray:
    """Depth ``sensor_msgs/Image`` -> float32 ``[H, W]`` metres (0 = no return): ``16UC1``/``mono16`` in
    millimetres, ``32FC1`` in metres (NaN -> 0)."""
    enc = msg.encoding.upper()
    if enc in ("16UC1", "MONO16"):
        dt, scale = np.dtype(">u2" if msg.is_bigendian else "<u2"), 1e-3
    elif enc == "32FC1":
        dt, scale = np.dtype(">f4" if msg.is_bigendian else "<f4"), 1.0
    else:
        raise InvalidArgument(f"depth: image encoding {msg.encoding!r}; expected 16UC1 (mm) or 32FC1 (m)")
    raw = np.frombuffer(bytes(msg.data), dtype=np.uint8)
    if raw.size < msg.height * msg.step or msg.step < msg.width * dt.itemsize:
        raise InvalidArgument(
            f"depth: image data has {raw.size} bytes, header says {msg.height} x {msg.step}"
        )
    rows = raw[: msg.height * msg.step].reshape(msg.height, msg.step)[:, : msg.width * dt.itemsize]
    depth = np.ascontiguousarray(rows).view(dt).astype(np.float32) * np.float32(scale)
    return np.nan_to_num(depth, nan=0.0, posinf=0.0, neginf=0.0)


def camera_matrix(info) -> np.ndarray:
    """float64 ``[3, 3]`` K of a ``sensor_msgs/CameraInfo`` (ROS 2 ``k`` or ROS 1 ``K``)."""
    k = getattr(info, "k", None)
    if k is None:
        k = info.K
    return np.asarray(k, dtype=np.float64).reshape(3, 3)


class RosbagSequence:
    """Frames of a ROS 1 ``.bag`` file or a ROS 2 bag folder (sqlite3 or MCAP).

    Args:
        path: the ``.bag`` file or the ROS 2 bag directory (the one holding ``metadata.yaml``).
        points_topic: a ``sensor_msgs/PointCloud2`` topic (LiDAR frames), or
        depth_topic + camera_info_topic: a depth ``sensor_msgs/Image`` topic and its ``CameraInfo``.
        world_frame: poses from ``/tf`` and ``/tf_static``: ``T_world_frame_sensor`` at each message's
            header stamp, the sensor frame being the message's ``header.frame_id`` (or ``sensor_frame``).
        odom_topic: poses from ``nav_msgs/Odometry`` (world = its ``header.frame_id``), chained through
            ``/tf_static`` to the sensor frame when that differs from the odometry's child frame.
        sensor_frame: overrides the messages' ``header.frame_id``.
        max_pose_gap_s: how far before the first / after the last pose sample a frame may lie.

    ``dataset[i] -> {"points", "intensity", "T_world_sensor" (None without a pose source), "timestamp"}``
    for LiDAR, ``{"depth_m", "K", "T_world_sensor", "timestamp"}`` for depth; ``kind`` is ``"lidar"`` or
    ``"depth"``; ``skipped`` counts frames left out for lack of a pose.
    """

    def __init__(
        self,
        path: str | Path,
        points_topic: str | None = None,
        depth_topic: str | None = None,
        camera_info_topic: str | None = None,
        world_frame: str | None = None,
        odom_topic: str | None = None,
        sensor_frame: str | None = None,
        max_pose_gap_s: float = 0.1,
    ):
        # lazy: rosbags (large) loads only when a bag is opened
        from rosbags.highlevel import AnyReader
        from rosbags.typesys import Stores, get_typestore

        path = Path(path)
        if (points_topic is None) == (depth_topic is None):
            raise InvalidArgument("topics: give exactly one of points_topic or depth_topic")
        if depth_topic is not None and camera_info_topic is None:
            raise InvalidArgument("camera_info_topic: a depth topic needs its sensor_msgs/CameraInfo topic")
        if world_frame is not None and odom_topic is not None:
            raise InvalidArgument("pose: give world_frame (poses from /tf) or odom_topic, not both")
        if depth_topic is not None and world_frame is None and odom_topic is None:
            raise InvalidArgument(
                "pose: depth frames need poses: give --world-frame (world_frame: poses from /tf) or "
                "--odom-topic (odom_topic)"
            )
        if not path.exists():
            raise InvalidArgument(f"path: {path} does not exist")
        self.kind = "lidar" if points_topic else "depth"
        self.sensor_topic = points_topic or depth_topic
        self.skipped = 0
        try:
            self._reader = AnyReader([path], default_typestore=get_typestore(Stores.ROS2_HUMBLE))
            self._reader.open()
        except Exception as e:  # rosbags raises what it meets: AnyReaderError, UnicodeDecodeError, ...
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise InvalidArgument(f"path: {path} is not a readable ROS 1/ROS 2 bag: {why}") from None
        r = self._reader
        by_topic: dict[str, list] = {}
        for c in r.connections:
            by_topic.setdefault(c.topic, []).append(c)

        def conns(topic: str, msgtype: str) -> list:
            cs = by_topic.get(topic)
            if not cs:
                have = ", ".join(f"{t} ({v[0].msgtype})" for t, v in sorted(by_topic.items()))
                raise InvalidArgument(f"topic: {topic} is not in {path}; the bag has: {have}")
            if cs[0].msgtype != msgtype:
                raise InvalidArgument(f"topic: {topic} is {cs[0].msgtype}, expected {msgtype}")
            return cs

        self._conns = conns(self.sensor_topic, POINTCLOUD2 if points_topic else IMAGE)
        self._infos: list[tuple[float, np.ndarray]] = []
        if camera_info_topic is not None:
            for c, _, raw in r.messages(connections=conns(camera_info_topic, CAMERA_INFO)):
                m = r.deserialize(raw, c.msgtype)
                self._infos.append((_stamp(m.header), camera_matrix(m)))
            if not self._infos:
                raise InvalidArgument(f"camera_info_topic: {camera_info_topic} has no messages")
            self._infos.sort(key=lambda x: x[0])

        tf = TransformBuffer(max_pose_gap_s)
        odom_child = None
        if world_frame is not None or odom_topic is not None:
            tf_conns = [
                c for t in ("/tf", "/tf_static") for c in by_topic.get(t, []) if c.msgtype == TF_MESSAGE
            ]
            if not tf_conns and odom_topic is None:
                have = ", ".join(sorted(by_topic))
                raise InvalidArgument(
                    f"--world-frame: {path} has no /tf or /tf_static ({TF_MESSAGE}) to take poses from; "
                    f"give --odom-topic instead (the bag has: {have})"
                )
            # an empty list would make rosbags return every message of the bag
            for c, _, raw in r.messages(connections=tf_conns) if tf_conns else ():
                m = r.deserialize(raw, c.msgtype)
                static = c.topic == "/tf_static"
                for ts in m.transforms:
                    tr = ts.transform
                    T = _transform_matrix(tr.translation, tr.rotation)
                    tf.add(ts.header.frame_id, ts.child_frame_id, None if static else _stamp(ts.header), T)
        if odom_topic is not None:
            for c, _, raw in r.messages(connections=conns(odom_topic, ODOMETRY)):
                m = r.deserialize(raw, c.msgtype)
                p = m.pose.pose
                tf.add(
                    m.header.frame_id,
                    m.child_frame_id,
                    _stamp(m.header),
                    _transform_matrix(p.position, p.orientation),
                )
                world_frame = world_frame or m.header.frame_id.lstrip("/")
                odom_child = m.child_frame_id.lstrip("/")
            if world_frame is None:
                raise InvalidArgument(f"odom_topic: {odom_topic} has no messages")
        self.world_frame = world_frame

        # one pass over the sensor topic: log time (to seek), header stamp and frame (for the pose)
        self._frames: list[tuple[int, float, np.ndarray | None]] = []
        for c, logtime, raw in r.messages(connections=self._conns):
            m = r.deserialize(raw, c.msgtype)
            t = _stamp(m.header)
            T = None
            if world_frame is not None:
                frame = (sensor_frame or m.header.frame_id).lstrip("/")
                T = tf.lookup(world_frame, frame, t)
                if T is None and odom_child is not None and frame not in tf.frames():
                    raise InvalidArgument(
                        f"pose: no transform from the sensor frame {frame!r} to the odometry's child frame "
                        f"{odom_child!r} in /tf_static; pass sensor_frame={odom_child!r} if they coincide"
                    )
                if T is None:
                    if world_frame not in tf.frames() or frame not in tf.frames():
                        raise InvalidArgument(
                            f"pose: no transform between {world_frame!r} and {frame!r} in {path}; "
                            f"frames in /tf: {sorted(tf.frames())}"
                        )
                    self.skipped += 1
                    continue
            self._frames.append((logtime, t, T))
        if not self._frames:
            raise InvalidArgument(f"{self.sensor_topic}: no frames with a pose in {path}")

    def __len__(self) -> int:
        return len(self._frames)

    def _message(self, i: int):
        logtime, t, _ = self._frames[i]
        r = self._reader
        for c, _lt, raw in r.messages(connections=self._conns, start=logtime, stop=logtime + 1):
            m = r.deserialize(raw, c.msgtype)
            if _stamp(m.header) == t:
                return m
        raise InvalidArgument(f"frame {i}: message at {logtime} ns not found again")  # pragma: no cover

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        m = self._message(i)
        _, t, T = self._frames[i]
        if self.kind == "lidar":
            d = decode_pointcloud2(m)
            return {
                "points": d["points"],
                "intensity": d.get("intensity"),
                "T_world_sensor": T,
                "timestamp": t,
            }
        times = [x[0] for x in self._infos]
        j = min(max(bisect.bisect_right(times, t) - 1, 0), len(times) - 1)
        return {"depth_m": decode_depth_image(m), "K": self._infos[j][1], "T_world_sensor": T, "timestamp": t}

    def close(self) -> None:
        self._reader.close()


class PcdSequence:
    """``.pcd`` files (ASCII, binary or binary_compressed) of one directory, in file-name order, or one
    file. ``dataset[i] -> {"points": float32 [N, 3], "intensity", "T_world_sensor", "timestamp": i}``.

    Poses: ``poses.txt`` beside the files (one line per file, 12 or 16 numbers: a row-major 3x4 or 4x4
    sensor-to-world), else each file's ``VIEWPOINT`` when it is not the identity, else None (the map
    registers the scans)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_file():
            self.files, root = [path], path.parent
        elif path.is_dir():
            self.files, root = sorted(path.glob("*.pcd")), path
        else:
            raise InvalidArgument(f"path: {path} does not exist")
        if not self.files:
            raise InvalidArgument(f"path: no *.pcd files in {path}")
        self.poses = None
        pf = root / "poses.txt"
        if pf.exists():
            p = np.loadtxt(pf, ndmin=2)
            if p.shape[1] not in (12, 16):
                raise InvalidArgument(
                    f"poses: {pf} rows have {p.shape[1]} numbers; expected 12 (3x4) or 16 (4x4)"
                )
            if len(p) < len(self.files):
                raise InvalidArgument(f"poses: {pf} has {len(p)} rows for {len(self.files)} .pcd files")
            self.poses = np.tile(np.eye(4), (len(p), 1, 1))
            self.poses[:, : p.shape[1] // 4, :] = p.reshape(len(p), -1, 4)
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        # lazy: pypcd4 loads only when a PCD file is read
        from pypcd4 import PointCloud

        try:
            pc = PointCloud.from_path(self.files[i])
        except Exception as e:  # pypcd4 raises plain exceptions for malformed headers / data
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]  # not pydantic's whole dump
            raise InvalidArgument(f"path: {self.files[i]} is not a readable PCD file: {why}") from None
        fields = pc.fields
        if not all(c in fields for c in "xyz"):
            raise InvalidArgument(f"points: {self.files[i]} has fields {fields}; x, y, z are needed")
        pts = pc.numpy(("x", "y", "z")).astype(np.float32)
        declared = int(pc.metadata.points)
        if declared != len(pts):
            raise InvalidArgument(
                f"points: {self.files[i]} declares POINTS {declared} but holds {len(pts)}: a truncated or "
                "corrupt PCD file"
            )
        intensity = pc.numpy(("intensity",))[:, 0].astype(np.float32) if "intensity" in fields else None
        if self.poses is not None:
            T = self.poses[i]
        else:
            tx, ty, tz, qw, qx, qy, qz = (float(v) for v in pc.metadata.viewpoint)
            T = None
            if (tx, ty, tz, qw, qx, qy, qz) != (0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0):
                T = np.eye(4)
                T[:3, :3] = quaternion_to_matrix(qx, qy, qz, qw)
                T[:3, 3] = [tx, ty, tz]
        return {"points": pts, "intensity": intensity, "T_world_sensor": T, "timestamp": float(i)}

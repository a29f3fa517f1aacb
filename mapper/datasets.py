"""Readers for sensor data (the formats of ``../shared/data`` and public datasets).

Each reader returns numpy arrays in SI units; nothing here touches torch or the GPU.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from .errors import InvalidArgument


def default_data_dir() -> Path:
    """``../shared/data`` next to the checkout (or the working directory), where the sample frames live."""
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *here.parents):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return Path("../shared/data")


def read_vtk_points(path: str | Path) -> dict[str, np.ndarray]:
    """Legacy ASCII VTK POLYDATA (libpointmatcher): ``{"points": float32 [N, 3], <scalar field>: [N]}``."""
    text = Path(path).read_text().split()
    try:
        i = text.index("POINTS")
    except ValueError:
        raise InvalidArgument(f"path: {path} has no POINTS section") from None
    n = int(text[i + 1])
    pts = np.asarray(text[i + 3 : i + 3 + 3 * n], dtype=np.float32).reshape(n, 3)
    out = {"points": pts}
    j = i + 3 + 3 * n
    while j < len(text):
        if text[j] == "SCALARS":
            name = text[j + 1]
            k = j + 3
            if text[k] == "LOOKUP_TABLE":
                k += 2
            out[name] = np.asarray(text[k : k + n], dtype=np.float64)
            j = k + n
        else:
            j += 1
    return out


def quaternion_to_matrix(qx: float, qy: float, qz: float, qw: float) -> np.ndarray:
    """Rotation matrix (float64 [3, 3]) of a unit quaternion (x, y, z, w)."""
    n = math.sqrt(qx * qx + qy * qy + qz * qz + qw * qw)
    x, y, z, w = qx / n, qy / n, qz / n, qw / n
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )


class NorlabLidar:
    """The norlab 32-beam scans: ``dataset[i] -> {"points": [N, 3] sensor frame, "T_world_sensor": [4, 4],
    "timestamp": float, "intensity": [N]}``, in time order (file names sort wrongly: unpadded nanoseconds)."""

    def __init__(self, root: str | Path):
        root = Path(root)
        poses = {}
        with open(root / "icp_odom.csv") as f:
            for row in csv.DictReader(f):
                key = (int(row["header.stamp.sec"]), int(row["header.stamp.nanosec"]))
                T = np.eye(4)
                T[:3, :3] = quaternion_to_matrix(*(float(row[f"pose.pose.orientation.{c}"]) for c in "xyzw"))
                T[:3, 3] = [float(row[f"pose.pose.position.{c}"]) for c in "xyz"]
                poses[key] = T
        scans = []
        for p in (root / "scans").glob("cloud_*.vtk"):
            _, sec, nsec = p.stem.split("_")
            key = (int(sec), int(nsec))
            if key in poses:
                scans.append((key, p))
        self._scans = sorted(scans)
        self._poses = poses

    def __len__(self) -> int:
        return len(self._scans)

    def __getitem__(self, i: int) -> dict:
        key, path = self._scans[i]
        d = read_vtk_points(path)
        return {
            "points": d["points"],
            "intensity": d.get("intensity"),
            "T_world_sensor": self._poses[key],
            "timestamp": key[0] + key[1] * 1e-9,
        }


def read_png(path: str | Path) -> np.ndarray:
    """A PNG as a numpy array (uint16 for 16-bit depth, uint8 [H, W, 3] for colour)."""
    # lazy: Pillow loads only when an image file is read
    from PIL import Image

    with Image.open(path) as im:
        arr = np.array(im)
    if arr.ndim == 3 and arr.shape[2] == 4:
        arr = arr[:, :, :3]
    return arr


def read_image_rgb(path: str | Path) -> np.ndarray:
    # lazy: Pillow loads only when an image file is read
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


class ReplicaSequence:
    """NICE-SLAM Replica renderings: ``depthXXXXXX.png`` (uint16, metres = value / scale),
    ``frameXXXXXX.jpg``, ``traj.txt`` (one row-major 4x4 camera-to-world per line, OpenCV axes) and
    ``cam_params.json`` (fx, fy, cx, cy, w, h, scale); the NICE-SLAM layout with a ``results/`` folder
    is accepted too. ``dataset[i] -> {"depth_m", "color", "K", "T_world_sensor"}``.

    ``pixel_center_shift``: the NICE-SLAM renderings put pixel centres half a pixel off the stated
    principal point (rendering the reference mesh with cx, cy = 599.5, 339.5 under the usual
    pixel-centre convention gives a median depth error of 1.4 mm; with 599.0, 339.0 it is 0.18 mm, the
    PNG's quantisation). The default -0.5 applies that correction to K."""

    def __init__(self, root: str | Path, cam_params: dict | None = None, pixel_center_shift: float = -0.5):
        root = Path(root)
        img_dir = root / "results" if (root / "results").is_dir() else root
        self.depths = sorted(img_dir.glob("depth*.png"))
        self.colors = sorted(img_dir.glob("frame*.jpg"))
        poses = np.loadtxt(root / "traj.txt", ndmin=2)
        self.poses = poses.reshape(-1, 4, 4)
        if cam_params is None:
            for cand in (root / "cam_params.json", root.parent / "cam_params.json"):
                if cand.exists():
                    cam_params = json.loads(cand.read_text())["camera"]
                    break
        if cam_params is None:  # NICE-SLAM's Replica defaults
            cam_params = {"fx": 600.0, "fy": 600.0, "cx": 599.5, "cy": 339.5, "scale": 6553.5}
        c = cam_params
        cx, cy = c["cx"] + pixel_center_shift, c["cy"] + pixel_center_shift
        self.K = np.array([[c["fx"], 0, cx], [0, c["fy"], cy], [0, 0, 1]], dtype=np.float64)
        self.scale = float(c["scale"])
        if not self.depths:
            raise InvalidArgument(f"path: no depth*.png under {img_dir}")

    def __len__(self) -> int:
        return min(len(self.depths), len(self.poses))

    def __getitem__(self, i: int) -> dict:
        depth = read_png(self.depths[i]).astype(np.float32) / self.scale
        color = read_image_rgb(self.colors[i]) if i < len(self.colors) else None
        return {"depth_m": depth, "color": color, "K": self.K, "T_world_sensor": self.poses[i]}


class SevenScenesSequence:
    """3DMatch / 7-Scenes: ``frame-XXXXXX.depth.png`` (uint16 millimetres, 0 = none),
    ``frame-XXXXXX.color.png``, ``frame-XXXXXX.pose.txt`` (4x4 camera-to-world), and
    ``camera-intrinsics.txt`` (3x3; 7-Scenes default fx = fy = 585, cx = 320, cy = 240 if absent)."""

    def __init__(self, root: str | Path, depth_scale: float = 1000.0):
        root = Path(root)
        self.depths = sorted(root.glob("frame-*.depth.png"))
        if not self.depths:
            self.depths = sorted(root.glob("*/frame-*.depth.png"))
        if not self.depths:
            raise InvalidArgument(f"path: no frame-*.depth.png under {root}")
        intr = root / "camera-intrinsics.txt"
        self.K = (
            np.loadtxt(intr).reshape(3, 3)
            if intr.exists()
            else np.array([[585.0, 0, 320.0], [0, 585.0, 240.0], [0, 0, 1]])
        )
        self.depth_scale = depth_scale

    def __len__(self) -> int:
        return len(self.depths)

    def __getitem__(self, i: int) -> dict:
        d = self.depths[i]
        stem = d.name[: -len(".depth.png")]
        pose = np.loadtxt(d.with_name(stem + ".pose.txt")).reshape(4, 4)
        cpath = d.with_name(stem + ".color.png")
        color = read_image_rgb(cpath) if cpath.exists() else None
        depth = read_png(d).astype(np.float32) / self.depth_scale
        if color is not None and color.shape[:2] != depth.shape:
            color = None  # not pixel-aligned in every dataset
        return {"depth_m": depth, "color": color, "K": self.K, "T_world_sensor": pose}


class KittiOdometry:
    """KITTI odometry: ``velodyne/*.bin`` (float32 x, y, z, intensity), ``poses.txt`` (3x4 row-major,
    left-camera frame) and ``calib.txt`` (``Tr:`` velodyne-to-camera). Poses are converted to
    velodyne-to-world: ``T_world_velo = T_world_cam0 @ Tr``. ``dataset[i] -> {"points", "T_world_sensor"}``
    (``T_world_sensor`` is None when there is no poses file)."""

    def __init__(self, root: str | Path):
        root = Path(root)
        self.scans = sorted((root / "velodyne").glob("*.bin"))
        if not self.scans:
            raise InvalidArgument(f"path: no velodyne/*.bin under {root}")
        self.Tr = np.eye(4)
        calib = root / "calib.txt"
        if calib.exists():
            for line in calib.read_text().splitlines():
                if line.startswith("Tr:"):
                    self.Tr[:3, :4] = np.array(line.split()[1:], dtype=np.float64).reshape(3, 4)
        poses_file = root / "poses.txt"
        self.poses = None
        if poses_file.exists():
            p = np.loadtxt(poses_file, ndmin=2).reshape(-1, 3, 4)
            self.poses = np.tile(np.eye(4), (p.shape[0], 1, 1))
            self.poses[:, :3, :] = p

    def __len__(self) -> int:
        return len(self.scans)

    def __getitem__(self, i: int) -> dict:
        pts = np.fromfile(self.scans[i], dtype=np.float32).reshape(-1, 4)
        T = None if self.poses is None else self.poses[i] @ self.Tr
        return {"points": pts[:, :3], "intensity": pts[:, 3], "T_world_sensor": T}

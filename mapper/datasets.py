"""Readers for sensor data (the formats of ``../shared/data`` and public datasets).

Each reader returns numpy arrays in SI units; nothing here touches torch or the GPU.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from .errors import InvalidArgument


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

"""open3d-backed helpers for accuracy tests on real meshes (the Replica office0 reference mesh).

open3d is imported lazily through ``pytest.importorskip``: a test that calls any of these skips cleanly
where open3d is not installed. The ray directions come from ``mapper.sim.PinholeCamera.rays_sensor`` so
that simulated frames and mesh frames share one pixel convention (pixel centres at integer coordinates).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mapper.sim import PinholeCamera


def import_open3d():
    """The ``open3d`` module, or a pytest skip when it is not installed."""
    return pytest.importorskip("open3d")


class MeshScene:
    """A triangle mesh in an ``open3d.t.geometry.RaycastingScene`` (float32 BVH, CPU)."""

    def __init__(self, mesh):
        o3d = import_open3d()
        self.mesh = mesh
        self._scene = o3d.t.geometry.RaycastingScene()
        self._scene.add_triangles(mesh)

    @classmethod
    def from_ply(cls, path: str | Path) -> MeshScene:
        o3d = import_open3d()
        mesh = o3d.t.io.read_triangle_mesh(str(path))
        if mesh.triangle.indices.shape[0] == 0:
            raise ValueError(f"{path}: no triangles")
        # the BVH wants float32 positions and int32 indices
        mesh = o3d.t.geometry.TriangleMesh(
            mesh.vertex.positions.to(o3d.core.float32), mesh.triangle.indices.to(o3d.core.int32)
        )
        return cls(mesh)

    @classmethod
    def from_legacy(cls, legacy_mesh) -> MeshScene:
        o3d = import_open3d()
        return cls(o3d.t.geometry.TriangleMesh.from_legacy(legacy_mesh))

    def raycast(self, origins_world: np.ndarray, dirs_world: np.ndarray, max_range_m: float = np.inf):
        """Distance along ``dirs_world`` (float ``[M, 3]``, normalised here) from ``origins_world``
        (``[M, 3]`` or ``[3]``) to the first triangle, float64 ``[M]``, inf where there is no hit within
        ``max_range_m``."""
        o3d = import_open3d()
        o = np.broadcast_to(np.asarray(origins_world, np.float32), np.shape(dirs_world))
        d = np.asarray(dirs_world, np.float64)
        d = (d / np.linalg.norm(d, axis=1, keepdims=True)).astype(np.float32)
        rays = o3d.core.Tensor(np.ascontiguousarray(np.concatenate([o, d], 1)))
        t = self._scene.cast_rays(rays)["t_hit"].numpy().astype(np.float64)
        t[~(t <= max_range_m)] = np.inf
        return t

    def render_depth(self, camera: PinholeCamera, T_world_sensor, max_range_m: float = 10.0) -> np.ndarray:
        """Z-depth float32 ``[H, W]`` (0 = no surface within ``max_range_m``)."""
        T = np.asarray(T_world_sensor, np.float64)
        rays = camera.rays_sensor(dtype=torch.float64).numpy()
        t = self.raycast(np.broadcast_to(T[:3, 3], rays.shape), rays @ T[:3, :3].T)
        z = t * rays[:, 2]
        z[~(z <= max_range_m)] = 0.0
        return z.astype(np.float32).reshape(camera.height, camera.width)

    def unsigned_distance(self, points_world: np.ndarray) -> np.ndarray:
        """Exact distance to the nearest triangle, float64 ``[M]``."""
        o3d = import_open3d()
        q = o3d.core.Tensor(np.ascontiguousarray(np.asarray(points_world, np.float32)))
        return self._scene.compute_distance(q).numpy().astype(np.float64)

    def signed_distance(self, points_world: np.ndarray) -> np.ndarray:
        """Distance with open3d's inside test (ray parity over several rays): meaningful for watertight
        meshes only; the Replica mesh has holes, so prefer :meth:`unsigned_distance` there."""
        o3d = import_open3d()
        q = o3d.core.Tensor(np.ascontiguousarray(np.asarray(points_world, np.float32)))
        return self._scene.compute_signed_distance(q, nsamples=5).numpy().astype(np.float64)


def read_depth_png(path: str | Path, scale: float) -> np.ndarray:
    """16-bit depth PNG -> float32 metres ``[H, W]`` (``value / scale``; 0 stays 0)."""
    o3d = import_open3d()
    img = o3d.t.io.read_image(str(path)).as_tensor().numpy()
    if img.dtype != np.uint16:
        raise ValueError(f"{path}: expected a 16-bit image, got {img.dtype}")
    return (img[..., 0] if img.ndim == 3 else img).astype(np.float32) / np.float32(scale)


def read_replica(root: str | Path) -> tuple[PinholeCamera, float, np.ndarray]:
    """``(camera, depth_scale, T_world_sensor float64 [n, 4, 4])`` of a NICE-SLAM Replica excerpt."""
    root = Path(root)
    c = json.loads((root / "cam_params.json").read_text())["camera"]
    cam = PinholeCamera(int(c["w"]), int(c["h"]), c["fx"], c["fy"], c["cx"], c["cy"])
    poses = np.loadtxt(root / "traj.txt", dtype=np.float64).reshape(-1, 4, 4)
    return cam, float(c["scale"]), poses

"""Simulated sensors on analytic scenes: exact signed distances, batched ray casting, a pinhole depth
camera, a spinning LiDAR, trajectories and frame generators for tests and benchmarks.

Conventions
-----------
* World frame in metres, **z up** (outdoor and indoor scenes alike).
* ``T_world_sensor``: float64 ``[4, 4]`` sensor-to-world rigid transform; the sensor origin in the world is
  its translation.
* Cameras use OpenCV axes (x right, y down, z forward). Pixel ``(u, v)`` (column, row) has its centre at
  image coordinates ``(u, v)``; its ray in the camera frame is ``((u - cx) / fx, (v - cy) / fy, 1)``.
  Depth images are float32 ``[H, W]`` z-depth in metres (distance along the optical axis), 0 = no return.
* LiDAR frame: x forward, y left, z up. Points are float32 ``[N, 3]`` in the sensor frame.

Scenes
------
A :class:`Scene` is a union of convex primitives (:class:`Plane` half-spaces, :class:`Box` es, vertical
:class:`Cylinder` s, :class:`Sphere` s). ``Scene.sdf`` is the minimum of the primitives' exact signed
distances (negative inside). For a union of convex solids that minimum is the exact Euclidean signed
distance at every point outside the union; inside, it is the (negative) depth in the deepest single
primitive, so its magnitude is a lower bound of the true depth (it is exact wherever the nearest surface
point of that primitive is on the union's boundary, e.g. inside a primitive that overlaps nothing).
Finite planes are thin boxes.

Precision
---------
``Scene.raycast`` finds, for each ray, the nearest primitive in a float32 pass over all (ray, primitive)
pairs that survive culling (rays are processed in chunks so that memory stays bounded), then recomputes
the winner's intersection in float64. Intersections use forms without catastrophic cancellation (the
perpendicular-distance discriminant for spheres and cylinders), so the returned distances are exact to
float64 rounding; only the choice between two surfaces closer than ~1e-5 m apart along a ray is made
in float32. ``Scene.sdf`` computes in the dtype of its input: float64 is exact to rounding, float32 has an
absolute error of about 1e-7 times the coordinates' magnitude (~6e-5 m at 600 m from the origin).

Files
-----
``primitives.py`` the primitives, ``intersect.py`` their ray intervals and distances, ``scene.py`` the
:class:`Scene` (distances, normals, ray casting), ``layouts.py`` and ``factories.py`` the street and the
room, ``sensors.py`` the camera and the LiDAR, ``trajectories.py`` poses along them, ``sequences.py`` frame
generators, ``checks.py`` the input checks; this module re-exports their public names.
"""

from __future__ import annotations

from .factories import indoor_scene, outdoor_scene
from .layouts import Road, Room
from .primitives import Box, Cylinder, Plane, Sphere
from .primitives import Primitive as Primitive  # the union type of the four
from .scene import Scene
from .sensors import PinholeCamera, SpinningLidar
from .sequences import depth_sequence, lidar_sequence
from .trajectories import driving_trajectory, look_at, orbit_trajectory

__all__ = [
    "Box",
    "Cylinder",
    "PinholeCamera",
    "Plane",
    "Road",
    "Room",
    "Scene",
    "Sphere",
    "SpinningLidar",
    "depth_sequence",
    "driving_trajectory",
    "indoor_scene",
    "lidar_sequence",
    "look_at",
    "orbit_trajectory",
    "outdoor_scene",
]

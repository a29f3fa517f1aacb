"""The analytic primitives a scene is a union of: :class:`Plane` half-spaces, :class:`Box` es, vertical
:class:`Cylinder` s and :class:`Sphere` s."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from .checks import _positive, _rotation, _vec


@dataclass(frozen=True)
class Plane:
    """Half-space. The surface passes through ``point_m``; ``normal`` (normalised on construction) points
    into free space, the solid lies behind it. ``Plane((0, 0, 0), (0, 0, 1))`` is the ground ``z <= 0``."""

    point_m: tuple[float, float, float]
    normal: tuple[float, float, float]

    def __post_init__(self):
        p = _vec("Plane.point_m", self.point_m)
        n = np.asarray(_vec("Plane.normal", self.normal))
        norm = float(np.linalg.norm(n))
        if norm < 1e-12:
            raise InvalidArgument("Plane.normal: must be non-zero")
        object.__setattr__(self, "point_m", p)
        object.__setattr__(self, "normal", tuple(float(x) for x in n / norm))


@dataclass(frozen=True)
class Sphere:
    """Solid ball."""

    center_m: tuple[float, float, float]
    radius_m: float

    def __post_init__(self):
        object.__setattr__(self, "center_m", _vec("Sphere.center_m", self.center_m))
        object.__setattr__(self, "radius_m", _positive("Sphere.radius_m", self.radius_m))


@dataclass(frozen=True)
class Box:
    """Solid box: centre, half extents along its own axes, and ``rotation`` (box-to-world, its columns are
    the box axes in the world; ``None`` = axis-aligned)."""

    center_m: tuple[float, float, float]
    half_extents_m: tuple[float, float, float]
    rotation: tuple[tuple[float, float, float], ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "center_m", _vec("Box.center_m", self.center_m))
        h = _vec("Box.half_extents_m", self.half_extents_m)
        if min(h) <= 0:
            raise InvalidArgument(f"Box.half_extents_m: expected values > 0, got {list(h)}")
        object.__setattr__(self, "half_extents_m", h)
        if self.rotation is not None:
            R = _rotation("Box.rotation", self.rotation)
            object.__setattr__(self, "rotation", tuple(tuple(float(x) for x in row) for row in R))

    @classmethod
    def from_bounds(cls, min_m, max_m) -> Box:
        """Axis-aligned box ``[min_m, max_m]``."""
        lo, hi = np.asarray(_vec("min_m", min_m)), np.asarray(_vec("max_m", max_m))
        if np.any(hi <= lo):
            raise InvalidArgument(f"max_m must exceed min_m on every axis, got {lo.tolist()}, {hi.tolist()}")
        return cls(tuple((lo + hi) / 2), tuple((hi - lo) / 2))

    @classmethod
    def from_yaw(cls, center_m, half_extents_m, yaw_rad: float) -> Box:
        """Box rotated by ``yaw_rad`` about the world z axis."""
        c, s = math.cos(yaw_rad), math.sin(yaw_rad)
        return cls(center_m, half_extents_m, ((c, -s, 0.0), (s, c, 0.0), (0.0, 0.0, 1.0)))

    def rotation_matrix(self) -> np.ndarray:
        return np.eye(3) if self.rotation is None else np.asarray(self.rotation, dtype=np.float64)


@dataclass(frozen=True)
class Cylinder:
    """Solid vertical (z axis) cylinder with flat caps at ``z_min_m`` and ``z_max_m``."""

    center_xy_m: tuple[float, float]
    z_min_m: float
    z_max_m: float
    radius_m: float

    def __post_init__(self):
        object.__setattr__(self, "center_xy_m", _vec("Cylinder.center_xy_m", self.center_xy_m, 2))
        z0, z1 = _vec("Cylinder.z_min_m/z_max_m", (self.z_min_m, self.z_max_m), 2)
        if z1 <= z0:
            raise InvalidArgument(f"Cylinder: z_max_m ({z1}) must exceed z_min_m ({z0})")
        object.__setattr__(self, "z_min_m", z0)
        object.__setattr__(self, "z_max_m", z1)
        object.__setattr__(self, "radius_m", _positive("Cylinder.radius_m", self.radius_m))


Primitive = Plane | Sphere | Box | Cylinder

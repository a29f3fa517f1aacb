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
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._validation import as_tensor, resolve_device
from ..errors import InvalidArgument, InvalidArgumentType

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

_INF = math.inf
# (ray, primitive) pairs per chunk of the float32 pass. On the CPU, 2^20 pairs (12 MB per [pairs, 3]
# float32 temporary) was the fastest of 2^16..2^20 on a 2-core machine; on CUDA, 2^26 pairs is ~0.8 GB per
# such temporary and a handful of launches per chunk.
_PAIRS_PER_CHUNK = {"cpu": 1 << 20, "cuda": 1 << 26}
_MIN_RAYS_PER_CHUNK = 1024


# ----------------------------------------------------------------------------------------------------
# input checks


def _vec(name: str, v, n: int = 3) -> tuple[float, ...]:
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentType(f"{name}: expected {n} numbers, got {v!r} ({e})") from None
    if a.shape != (n,):
        raise InvalidArgument(f"{name}: expected {n} numbers, got shape {list(a.shape)}")
    if not np.all(np.isfinite(a)):
        raise InvalidArgument(f"{name}: expected finite values, got {a.tolist()}")
    return tuple(float(x) for x in a)


def _positive(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    x = float(x)
    if not (x > 0 and math.isfinite(x)):
        raise InvalidArgument(f"{name}: expected a finite number > 0, got {x}")
    return x


def _max_range(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    x = float(x)
    if not x > 0:  # also rejects NaN; inf is allowed
        raise InvalidArgument(f"{name}: expected a number > 0 (inf allowed), got {x}")
    return x


def _count(name: str, x, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(x).__name__}")
    if int(x) < minimum:
        raise InvalidArgument(f"{name}: expected an int >= {minimum}, got {x}")
    return int(x)


def _rotation(name: str, R) -> np.ndarray:
    a = np.asarray(R, dtype=np.float64)
    if a.shape != (3, 3) or not np.all(np.isfinite(a)):
        raise InvalidArgument(f"{name}: expected a finite 3x3 rotation matrix, got shape {list(a.shape)}")
    if np.abs(a.T @ a - np.eye(3)).max() > 1e-6 or np.linalg.det(a) < 0:
        raise InvalidArgument(f"{name}: not a rotation matrix (needs R^T R = I and det(R) = +1)")
    return a


def _float_tensor(name: str, x, device: torch.device, shape_tail: tuple[int, ...]) -> torch.Tensor:
    t = as_tensor(name, x, device)
    if not t.is_floating_point():
        raise InvalidArgumentType(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.dim() != 1 + len(shape_tail) or tuple(t.shape[1:]) != shape_tail:
        want = "[N, " + ", ".join(str(s) for s in shape_tail) + "]"
        raise InvalidArgument(f"{name}: expected shape {want}, got {list(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise InvalidArgument(f"{name}: contains NaN or inf")
    return t


def _check_pose(name: str, T, device: torch.device) -> torch.Tensor:
    """A rigid transform ``[4, 4]`` -> float64 tensor on ``device``; raises on anything else."""
    t = as_tensor(name, T, device)
    if not t.is_floating_point():
        raise InvalidArgumentType(f"{name}: expected a floating-point 4x4 matrix, got {t.dtype}")
    if tuple(t.shape) != (4, 4):
        raise InvalidArgument(f"{name}: expected shape [4, 4], got {list(t.shape)}")
    t = t.to(torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise InvalidArgument(f"{name}: contains NaN or inf")
    last = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64, device=device)
    if float((t[3] - last).abs().max()) > 1e-9:
        raise InvalidArgument(f"{name}: last row must be [0, 0, 0, 1], got {t[3].tolist()}")
    R = t[:3, :3]
    eye = torch.eye(3, dtype=torch.float64, device=device)
    if float((R.T @ R - eye).abs().max()) > 1e-5 or float(torch.linalg.det(R)) <= 0:
        raise InvalidArgument(f"{name}: rotation block is not a rotation (needs R^T R = I, det +1)")
    return t


# ----------------------------------------------------------------------------------------------------
# primitives


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

# ----------------------------------------------------------------------------------------------------
# per-primitive math, broadcasting over leading dims. Ray intervals return (t_near, t_far) of the ray's
# line inside the solid; NaN or t_near > t_far means no intersection.


def _plane_interval(s: torch.Tensor, dn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``s``: signed distance of the origin, ``dn``: direction . normal."""
    t0 = -s / dn
    tn = torch.where(dn < 0, t0, -_INF)
    tf = torch.where(dn > 0, t0, _INF)
    outside_parallel = (dn == 0) & (s >= 0)
    return torch.where(outside_parallel, _INF, tn), torch.where(outside_parallel, -_INF, tf)


def _sphere_interval(oc: torch.Tensor, d: torch.Tensor, r: torch.Tensor):
    """``oc``: origin - centre ``[..., 3]``, ``d`` unit ``[..., 3]``. Discriminant as r^2 - |perp|^2 (no
    cancellation for distant spheres)."""
    b = (oc * d).sum(-1)
    perp = oc - b.unsqueeze(-1) * d
    sq = torch.sqrt(r * r - (perp * perp).sum(-1))  # NaN = miss
    return -b - sq, -b + sq


def _box_interval(o_loc: torch.Tensor, d_loc: torch.Tensor, h: torch.Tensor):
    """Slab test in the box frame (``o_loc``, ``d_loc`` ``[..., 3]``, half extents ``h``)."""
    inv = torch.reciprocal(d_loc)
    t1 = (-h - o_loc) * inv
    t2 = (h - o_loc) * inv
    return torch.minimum(t1, t2).amax(-1), torch.maximum(t1, t2).amin(-1)


def _cylinder_interval(ox, oy, oz, dx, dy, dz, r, z0, z1):
    """Origin relative to the axis (``ox, oy``), absolute ``oz``; ``dx, dy`` must not both be 0 (callers
    tilt vertical rays by 1e-6 rad, which changes no intersection inside the caps by more than ~1e-5 m).
    Discriminant in the stable form a r^2 - (o x d)^2."""
    a = dx * dx + dy * dy
    b = ox * dx + oy * dy
    cr = ox * dy - oy * dx
    sq = torch.sqrt(a * r * r - cr * cr)  # NaN = miss
    tn = (-b - sq) / a
    tf = (-b + sq) / a
    inv = torch.reciprocal(dz)
    t1 = (z0 - oz) * inv
    t2 = (z1 - oz) * inv
    return torch.maximum(tn, torch.minimum(t1, t2)), torch.minimum(tf, torch.maximum(t1, t2))


def _tilt_vertical(d: torch.Tensor) -> torch.Tensor:
    """Give exactly vertical rays a 1e-6 horizontal component (cylinder intervals divide by |d_xy|^2)."""
    small = d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1] < 1e-12
    if bool(small.any()):
        d = d.clone()
        d[..., 0] = torch.where(small, torch.full_like(d[..., 0], 1e-6), d[..., 0])
    return d


def _first_hit(tn: torch.Tensor, tf: torch.Tensor, max_range: float) -> torch.Tensor:
    """Nearest positive crossing of the interval's boundary (entry, or exit for an origin inside), inf if
    none within ``max_range``."""
    t = torch.where(tn > 0, tn, tf)
    ok = (tn <= tf) & (t > 0) & (t <= max_range)
    return torch.where(ok, t, _INF)


def _box_sdf_local(q: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    q = q.abs() - h
    return torch.linalg.vector_norm(q.clamp_min(0), dim=-1) + q.amax(-1).clamp_max(0)


def _cylinder_sdf(px, py, pz, cx, cy, r, zc, hz):
    dxy = torch.hypot(px - cx, py - cy) - r
    dz = (pz - zc).abs() - hz
    return torch.hypot(dxy.clamp_min(0), dz.clamp_min(0)) + torch.maximum(dxy, dz).clamp_max(0)


# ----------------------------------------------------------------------------------------------------
# layouts: what the scene factories know about where things are (used by the trajectories)


@dataclass(frozen=True)
class Road:
    """Centre line ``y = sum_i a_i sin(2 pi x / lambda_i + phi_i)`` (z = 0), drivable for ``x`` in
    ``[x_min_m, x_max_m]``; objects are placed from ``x_min_m - 40`` to ``x_max_m + 40``. Driving lane:
    ``lane_offset_m`` to the left of the centre line (negative = right lane)."""

    x_min_m: float
    x_max_m: float
    amplitudes_m: tuple[float, ...]
    wavelengths_m: tuple[float, ...]
    phases_rad: tuple[float, ...]
    lane_offset_m: float = -1.75
    half_width_m: float = 7.0

    def center_y(self, x_m: np.ndarray) -> np.ndarray:
        x = np.asarray(x_m, dtype=np.float64)
        y = np.zeros_like(x)
        for a, lam, ph in zip(self.amplitudes_m, self.wavelengths_m, self.phases_rad, strict=True):
            y = y + a * np.sin(2 * np.pi * x / lam + ph)
        return y

    def heading_rad(self, x_m: np.ndarray) -> np.ndarray:
        x = np.asarray(x_m, dtype=np.float64)
        dy = np.zeros_like(x)
        for a, lam, ph in zip(self.amplitudes_m, self.wavelengths_m, self.phases_rad, strict=True):
            dy = dy + a * 2 * np.pi / lam * np.cos(2 * np.pi * x / lam + ph)
        return np.arctan(dy)

    def offset_point(self, x_m, lateral_m) -> np.ndarray:
        """World xy ``[..., 2]`` of the point ``lateral_m`` to the left of the centre line at station x."""
        x = np.asarray(x_m, dtype=np.float64)
        th = self.heading_rad(x)
        lat = np.asarray(lateral_m, dtype=np.float64)
        return np.stack([x - lat * np.sin(th), self.center_y(x) + lat * np.cos(th)], axis=-1)


@dataclass(frozen=True)
class Room:
    """Room interior ``[min_m, max_m]``; cameras orbit ``orbit_center_m`` (xy) on an ellipse of radii
    ``orbit_radii_m`` looking at ``look_at_m``, where the furniture leaves free space."""

    min_m: tuple[float, float, float]
    max_m: tuple[float, float, float]
    orbit_center_m: tuple[float, float]
    orbit_radii_m: tuple[float, float]
    look_at_m: tuple[float, float, float]
    camera_height_m: float = 1.45


# ----------------------------------------------------------------------------------------------------
# scene


class Scene:
    """Union of analytic primitives on one device. Build with :meth:`from_primitives` or the factories
    :func:`outdoor_scene` / :func:`indoor_scene`. Immutable; :meth:`to` returns a copy on another device."""

    def __init__(self, primitives: tuple[Primitive, ...], device: torch.device, layout):
        self._primitives = primitives
        self._device = device
        self.layout = layout
        self._f64 = self._pack(primitives, device)
        self._f32 = {k: v.float() for k, v in self._f64.items()}

    @classmethod
    def from_primitives(
        cls, primitives: Sequence[Primitive], *, device: str | torch.device = "cpu", layout=None
    ) -> Scene:
        """Scene of ``primitives`` (:class:`Plane`, :class:`Sphere`, :class:`Box`, :class:`Cylinder`), with
        tensors on ``device``. ``layout`` (a :class:`Road`, :class:`Room` or ``None``) is kept for the
        trajectory generators."""
        prims = tuple(primitives)
        if not prims:
            raise InvalidArgument("primitives: need at least one primitive")
        for i, p in enumerate(prims):
            if not isinstance(p, (Plane, Sphere, Box, Cylinder)):
                raise InvalidArgumentType(
                    f"primitives[{i}]: expected Plane, Sphere, Box or Cylinder, got {type(p).__name__}"
                )
        return cls(prims, resolve_device(device, torch.device("cpu")), layout)

    def to(self, device: str | torch.device) -> Scene:
        return Scene(self._primitives, resolve_device(device, self._device), self.layout)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def primitives(self) -> tuple[Primitive, ...]:
        return self._primitives

    def __len__(self) -> int:
        return len(self._primitives)

    def __repr__(self) -> str:
        counts = {k: self._f64[k].shape[0] for k in ("plane_n", "sph_r", "box_h", "cyl_r")}
        return (
            f"Scene(planes={counts['plane_n']}, spheres={counts['sph_r']}, boxes={counts['box_h']}, "
            f"cylinders={counts['cyl_r']}, device={self._device})"
        )

    @staticmethod
    def _pack(prims, device) -> dict[str, torch.Tensor]:
        planes = [p for p in prims if isinstance(p, Plane)]
        spheres = [p for p in prims if isinstance(p, Sphere)]
        boxes = [p for p in prims if isinstance(p, Box)]
        cyls = [p for p in prims if isinstance(p, Cylinder)]

        def arr(rows, width):
            return np.asarray(rows, dtype=np.float64).reshape(-1, *width)

        n = arr([p.normal for p in planes], (3,))
        off = (n * arr([p.point_m for p in planes], (3,))).sum(1)
        sph_c, sph_r = arr([p.center_m for p in spheres], (3,)), arr([p.radius_m for p in spheres], ())
        box_c, box_h = arr([b.center_m for b in boxes], (3,)), arr([b.half_extents_m for b in boxes], (3,))
        box_R = arr([b.rotation_matrix() for b in boxes], (3, 3))
        cyl_c = arr([c.center_xy_m for c in cyls], (2,))
        cyl_z = arr([(c.z_min_m, c.z_max_m) for c in cyls], (2,))
        cyl_r = arr([c.radius_m for c in cyls], ())
        # bounding spheres of the finite primitives, in the order spheres, boxes, cylinders
        cyl_zc, cyl_hz = cyl_z.mean(1), (cyl_z[:, 1] - cyl_z[:, 0]) / 2
        bound_c = np.concatenate([sph_c, box_c, np.concatenate([cyl_c, cyl_zc[:, None]], 1)])
        bound_r = np.concatenate([sph_r, np.linalg.norm(box_h, axis=1), np.hypot(cyl_r, cyl_hz)])
        d = {
            "plane_n": n,
            "plane_off": off,
            "sph_c": sph_c,
            "sph_r": sph_r,
            "box_c": box_c,
            "box_R": box_R,
            "box_h": box_h,
            "box_oc": np.einsum("pi,pij->pj", box_c, box_R),  # R^T c: box centre in box axes
            "cyl_c": cyl_c,
            "cyl_z": cyl_z,
            "cyl_zc": cyl_zc,
            "cyl_hz": cyl_hz,
            "cyl_r": cyl_r,
            "bound_c": bound_c,
            "bound_r": bound_r,
        }
        return {k: torch.as_tensor(v, dtype=torch.float64, device=device) for k, v in d.items()}

    # -- signed distance -------------------------------------------------------------------------------

    def sdf(self, points_world) -> torch.Tensor:
        """Signed distance (m, negative inside) of ``points_world`` (float ``[M, 3]``, any device; moved to
        the scene's device) -> ``[M]`` in the points' dtype (float32 or float64) on the scene's device.

        Exact outside the union; inside, a lower bound of the depth (see the module docstring)."""
        p = _float_tensor("points_world", points_world, self._device, (3,))
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        p = p.to(dtype)
        P = self._f64 if dtype == torch.float64 else self._f32
        n_prims = len(self._primitives)
        step = max(_MIN_RAYS_PER_CHUNK, _PAIRS_PER_CHUNK.get(self._device.type, 1 << 22) // n_prims)
        out = torch.empty(p.shape[0], dtype=dtype, device=self._device)
        for s in range(0, p.shape[0], step):
            out[s : s + step] = self._sdf_chunk(p[s : s + step], P)
        return out

    def _sdf_chunk(self, p: torch.Tensor, P: dict[str, torch.Tensor]) -> torch.Tensor:
        best = torch.full((p.shape[0],), _INF, dtype=p.dtype, device=p.device)
        if P["plane_n"].shape[0]:
            best = torch.minimum(best, (p @ P["plane_n"].T - P["plane_off"]).amin(1))
        if P["sph_r"].shape[0]:
            d = torch.linalg.vector_norm(p[:, None, :] - P["sph_c"][None], dim=-1) - P["sph_r"]
            best = torch.minimum(best, d.amin(1))
        if P["box_h"].shape[0]:
            B = P["box_h"].shape[0]
            rcat = P["box_R"].permute(1, 0, 2).reshape(3, 3 * B)
            q = (p @ rcat).view(-1, B, 3) - P["box_oc"]
            best = torch.minimum(best, _box_sdf_local(q, P["box_h"]).amin(1))
        if P["cyl_r"].shape[0]:
            c = P["cyl_c"]
            d = _cylinder_sdf(
                p[:, 0:1], p[:, 1:2], p[:, 2:3], c[:, 0], c[:, 1], P["cyl_r"], P["cyl_zc"], P["cyl_hz"]
            )
            best = torch.minimum(best, d.amin(1))
        return best

    def normals(self, points_world) -> torch.Tensor:
        """Unit SDF gradient ``[M, 3]`` at ``points_world`` (float ``[M, 3]``): the outward surface normal
        at surface points. Central differences of the float64 SDF with a 1e-6 m step (so within 1e-6 m of
        an edge the result blends the faces). dtype follows the input (float32 or float64)."""
        p = _float_tensor("points_world", points_world, self._device, (3,))
        p64 = p.to(torch.float64)
        eps = 1e-6
        g = torch.empty_like(p64)
        for a in range(3):
            e = torch.zeros(3, dtype=torch.float64, device=self._device)
            e[a] = eps
            g[:, a] = (self.sdf(p64 + e) - self.sdf(p64 - e)) / (2 * eps)
        g = g / torch.linalg.vector_norm(g, dim=1, keepdim=True).clamp_min(1e-30)
        return g if p.dtype == torch.float64 else g.float()

    # -- ray casting -----------------------------------------------------------------------------------

    def raycast(self, origins_world, dirs_world, max_range_m: float = _INF) -> torch.Tensor:
        """Distance (m) along each ray to its nearest surface crossing, ``inf`` where there is none within
        ``max_range_m``.

        Args:
            origins_world: float ``[M, 3]``, or ``[3]`` for one origin shared by all rays.
            dirs_world: float ``[M, 3]``, non-zero; normalised here, so ``t`` is Euclidean distance.
            max_range_m: hits farther than this are reported as ``inf``.

        Returns:
            ``t`` ``[M]`` on the scene's device, float64 if ``origins_world`` is float64, else float32.
            A ray starting inside a primitive returns where it leaves that primitive.
        """
        max_range = _max_range("max_range_m", max_range_m)
        d_in = _float_tensor("dirs_world", dirs_world, self._device, (3,))
        o_in = as_tensor("origins_world", origins_world, self._device)
        if o_in.dim() == 1:
            o_in = o_in.reshape(1, 3) if o_in.shape[0] == 3 else o_in
        o_in = _float_tensor("origins_world", o_in, self._device, (3,))
        if o_in.shape[0] not in (1, d_in.shape[0]):
            raise InvalidArgument(
                f"origins_world: expected [3], [1, 3] or [{d_in.shape[0]}, 3] to match dirs_world, "
                f"got {list(o_in.shape)}"
            )
        out_dtype = torch.float64 if o_in.dtype == torch.float64 else torch.float32
        d64 = d_in.to(torch.float64)
        norm = torch.linalg.vector_norm(d64, dim=1, keepdim=True)
        if bool((norm < 1e-12).any()):
            raise InvalidArgument("dirs_world: contains zero-length directions")
        d64 = d64 / norm
        o64 = o_in.to(torch.float64).expand(d64.shape[0], 3)
        return self._raycast(o64, d64, max_range).to(out_dtype)

    def _raycast(self, o64: torch.Tensor, d64: torch.Tensor, max_range: float) -> torch.Tensor:
        M = d64.shape[0]
        dev = self._device
        n_prims = len(self._primitives)
        step = max(_MIN_RAYS_PER_CHUNK, _PAIRS_PER_CHUNK.get(dev.type, 1 << 22) // n_prims)
        t_broad = torch.full((M,), _INF, dtype=torch.float64, device=dev)
        kind = torch.zeros(M, dtype=torch.int64, device=dev)
        index = torch.zeros(M, dtype=torch.int64, device=dev)
        for s in range(0, M, step):
            e = min(s + step, M)
            t, k, i = self._broad_chunk(o64[s:e], d64[s:e], max_range)
            t_broad[s:e], kind[s:e], index[s:e] = t, k, i
        # float64 recomputation of each ray's winning primitive
        t_out = torch.full((M,), _INF, dtype=torch.float64, device=dev)
        hit = torch.isfinite(t_broad)
        for k, refine in enumerate(
            (self._refine_plane, self._refine_sphere, self._refine_box, self._refine_cyl)
        ):
            rows = torch.nonzero(hit & (kind == k)).squeeze(1)
            if rows.numel() == 0:
                continue
            t = refine(o64[rows], d64[rows], index[rows], max_range)
            t_out[rows] = torch.where(torch.isfinite(t), t, t_broad[rows])
        return t_out

    def _cull(self, o64, d64, max_range) -> torch.Tensor:
        """Indices (into the bounding-sphere list) of finite primitives that some ray of the chunk may hit
        within ``max_range``: distance test against the origins' bounding ball, and a cone test when the
        chunk's directions lie within 78 degrees of their mean (LiDAR wedges, camera tiles)."""
        bc, br = self._f64["bound_c"], self._f64["bound_r"]
        lo, hi = o64.amin(0), o64.amax(0)
        oc, ro = (lo + hi) / 2, float(torch.linalg.vector_norm(hi - lo)) / 2
        v = bc - oc
        dist = torch.linalg.vector_norm(v, dim=1)
        rr = br + ro
        keep = dist - rr <= max_range
        a = d64.sum(0)
        an = torch.linalg.vector_norm(a)
        if float(an) > 1e-9:
            a = a / an
            cosmin = float((d64 @ a).min())
            if cosmin > 0.2:
                half = math.acos(min(1.0, cosmin))
                ang = torch.acos(((v @ a) / dist.clamp_min(1e-12)).clamp(-1, 1))
                spread = torch.asin((rr / dist.clamp_min(1e-12)).clamp(max=1.0))
                keep &= (dist <= rr) | (ang <= half + spread + 1e-4)
        return torch.nonzero(keep).squeeze(1)

    def _broad_chunk(self, o64, d64, max_range):
        P = self._f32
        R = o64.shape[0]
        o, d = o64.float(), d64.float()
        ts, idxs = [], []
        if P["plane_n"].shape[0]:
            s = o @ P["plane_n"].T - P["plane_off"]
            dn = d @ P["plane_n"].T
            t, i = _first_hit(*_plane_interval(s, dn), max_range).min(1)
            ts.append(t)
            idxs.append(i)
        else:
            ts.append(torch.full((R,), _INF, device=o.device))
            idxs.append(torch.zeros(R, dtype=torch.int64, device=o.device))
        kept = self._cull(o64, d64, max_range)
        n_s, n_b = P["sph_r"].shape[0], P["box_h"].shape[0]
        ks = kept[kept < n_s]
        kb = kept[(kept >= n_s) & (kept < n_s + n_b)] - n_s
        kc = kept[kept >= n_s + n_b] - n_s - n_b
        for sel, fn in ((ks, self._broad_sphere), (kb, self._broad_box), (kc, self._broad_cyl)):
            if sel.numel() == 0:
                ts.append(torch.full((R,), _INF, device=o.device))
                idxs.append(torch.zeros(R, dtype=torch.int64, device=o.device))
                continue
            t, i = _first_hit(*fn(o, d, sel, P), max_range).min(1)
            ts.append(t)
            idxs.append(sel[i])
        t_all = torch.stack(ts, 1)
        t, kind = t_all.min(1)
        index = torch.stack(idxs, 1).gather(1, kind[:, None]).squeeze(1)
        return t, kind, index

    @staticmethod
    def _broad_sphere(o, d, sel, P):
        oc = o[:, None, :] - P["sph_c"][sel][None]
        return _sphere_interval(oc, d[:, None, :], P["sph_r"][sel])

    @staticmethod
    def _broad_box(o, d, sel, P):
        Rm = P["box_R"][sel]
        K = Rm.shape[0]
        rcat = Rm.permute(1, 0, 2).reshape(3, 3 * K)  # column block p = R_p, so o @ rcat = R_p^T o
        o_loc = (o @ rcat).view(-1, K, 3) - P["box_oc"][sel]
        d_loc = (d @ rcat).view(-1, K, 3)
        return _box_interval(o_loc, d_loc, P["box_h"][sel])

    @staticmethod
    def _broad_cyl(o, d, sel, P):
        d = _tilt_vertical(d)
        c, z = P["cyl_c"][sel], P["cyl_z"][sel]
        return _cylinder_interval(
            o[:, 0:1] - c[:, 0],
            o[:, 1:2] - c[:, 1],
            o[:, 2:3],
            d[:, 0:1],
            d[:, 1:2],
            d[:, 2:3],
            P["cyl_r"][sel],
            z[:, 0],
            z[:, 1],
        )

    def _refine_plane(self, o, d, i, max_range):
        n = self._f64["plane_n"][i]
        s = (o * n).sum(1) - self._f64["plane_off"][i]
        return _first_hit(*_plane_interval(s, (d * n).sum(1)), max_range)

    def _refine_sphere(self, o, d, i, max_range):
        return _first_hit(*_sphere_interval(o - self._f64["sph_c"][i], d, self._f64["sph_r"][i]), max_range)

    def _refine_box(self, o, d, i, max_range):
        Rm = self._f64["box_R"][i]
        o_loc = torch.einsum("ki,kij->kj", o - self._f64["box_c"][i], Rm)
        d_loc = torch.einsum("ki,kij->kj", d, Rm)
        return _first_hit(*_box_interval(o_loc, d_loc, self._f64["box_h"][i]), max_range)

    def _refine_cyl(self, o, d, i, max_range):
        d = _tilt_vertical(d)
        c, z = self._f64["cyl_c"][i], self._f64["cyl_z"][i]
        tn, tf = _cylinder_interval(
            o[:, 0] - c[:, 0],
            o[:, 1] - c[:, 1],
            o[:, 2],
            d[:, 0],
            d[:, 1],
            d[:, 2],
            self._f64["cyl_r"][i],
            z[:, 0],
            z[:, 1],
        )
        return _first_hit(tn, tf, max_range)


# ----------------------------------------------------------------------------------------------------
# scene factories


def outdoor_scene(seed: int = 0, extent_m: float = 600.0, *, device: str | torch.device = "cpu") -> Scene:
    """A KITTI-like street, deterministic from ``seed`` (z up, ground = the plane z = 0).

    A gently curving road runs along +x (see :class:`Road`, in ``scene.layout``), drivable from x = 0 to
    x = ``extent_m``, with objects from x = -40 to ``extent_m`` + 40: building blocks (rotated boxes,
    6-22 m tall) set back about 11-14 m from the centre line on both sides, parked cars and vans (boxes) in
    parking lanes 4.6-6.6 m from the centre line, poles (thin cylinders) and trees (cylinder trunk +
    sphere crown) on the sidewalks. The driving lane (|lateral + 1.75| < 2.4 m) is free at every height.
    ``extent_m`` = 600 gives about 200 primitives.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidArgumentType(f"seed: expected an int, got {type(seed).__name__}")
    extent = _positive("extent_m", extent_m)
    if extent < 50:
        raise InvalidArgument(f"extent_m: expected at least 50 m, got {extent}")
    rng = np.random.default_rng(int(seed))
    road = Road(
        x_min_m=0.0,
        x_max_m=extent,
        amplitudes_m=(float(rng.uniform(4, 8)), float(rng.uniform(0.5, 1.5))),
        wavelengths_m=(float(rng.uniform(250, 400)), float(rng.uniform(120, 180))),
        phases_rad=(float(rng.uniform(0, 2 * np.pi)), float(rng.uniform(0, 2 * np.pi))),
    )
    x_lo, x_hi = -40.0, extent + 40.0
    prims: list[Primitive] = [Plane((0.0, 0.0, 0.0), (0.0, 0.0, 1.0))]

    def box_along(x, lateral, half_lwh, z_bottom, yaw_jitter=0.0):
        (cx, cy) = road.offset_point(x, lateral)
        yaw = float(road.heading_rad(x)) + yaw_jitter
        hl, hw, hh = half_lwh
        return Box.from_yaw((float(cx), float(cy), z_bottom + hh), (hl, hw, hh), yaw)

    for side in (-1.0, 1.0):
        # building blocks
        x = x_lo + rng.uniform(0, 10)
        while x < x_hi:
            length = rng.uniform(12, 30)
            depth, height = rng.uniform(8, 15), rng.uniform(6, 22)
            setback = rng.uniform(11, 14)
            prims.append(
                box_along(
                    x + length / 2, side * (setback + depth / 2), (length / 2, depth / 2, height / 2), 0.0
                )
            )
            x += length + (rng.uniform(10, 20) if rng.random() < 0.1 else rng.uniform(0, 6))
        # parked cars
        x = x_lo + rng.uniform(0, 10)
        while x < x_hi:
            if rng.random() < 0.5:
                if rng.random() < 0.15:  # van
                    hl, hw, hh = 2.6, 1.0, 1.05
                else:
                    hl, hw, hh = rng.uniform(1.95, 2.4), rng.uniform(0.85, 0.95), rng.uniform(0.7, 0.8)
                lat = side * (5.6 + rng.uniform(-0.2, 0.2))
                prims.append(box_along(x, lat, (hl, hw, hh), 0.0, math.radians(rng.uniform(-3, 3))))
            x += rng.uniform(7, 14)
        # poles
        x = x_lo + rng.uniform(0, 20)
        while x < x_hi:
            (cx, cy) = road.offset_point(x, side * 7.6)
            prims.append(Cylinder((float(cx), float(cy)), 0.0, float(rng.uniform(5, 8)), 0.12))
            x += rng.uniform(30, 45)
        # trees: trunk + crown
        x = x_lo + rng.uniform(0, 20)
        while x < x_hi:
            (cx, cy) = road.offset_point(x, side * 9.0)
            trunk_h, crown_r = float(rng.uniform(2.0, 3.5)), float(rng.uniform(1.2, 2.2))
            prims.append(Cylinder((float(cx), float(cy)), 0.0, trunk_h, float(rng.uniform(0.15, 0.3))))
            prims.append(Sphere((float(cx), float(cy), trunk_h + 0.7 * crown_r), crown_r))
            x += rng.uniform(25, 40)
    return Scene.from_primitives(prims, device=device, layout=road)


def indoor_scene(seed: int = 0, *, device: str | torch.device = "cpu") -> Scene:
    """A Replica-like room, deterministic from ``seed`` (z up, floor at z = 0, room centred on x = y = 0).

    Interior about 6 x 5 x 3 m (each dimension jittered by up to 0.3 m); floor, ceiling and walls are
    inward-facing :class:`Plane` s (the solid is everything outside the room, so the SDF inside the room is
    exact). Furniture: a table with four legs in the middle and a small sphere on it, a sofa (seat + back)
    against the -y wall, a bookshelf against the +x wall, a cabinet against the +y wall, an armchair rotated
    45 degrees in the (-x, +y) corner, a floor lamp (three cylinders) in the (+x, -y) corner and a ball on
    the floor. ``scene.layout`` is a :class:`Room` describing a free orbit for cameras.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidArgumentType(f"seed: expected an int, got {type(seed).__name__}")
    rng = np.random.default_rng(int(seed))
    hx, hy = 3.0 + rng.uniform(-0.15, 0.15), 2.5 + rng.uniform(-0.15, 0.15)
    H = 3.0 + rng.uniform(-0.3, 0.1)
    prims: list[Primitive] = [
        Plane((0, 0, 0), (0, 0, 1)),
        Plane((0, 0, H), (0, 0, -1)),
        Plane((-hx, 0, 0), (1, 0, 0)),
        Plane((hx, 0, 0), (-1, 0, 0)),
        Plane((0, -hy, 0), (0, 1, 0)),
        Plane((0, hy, 0), (0, -1, 0)),
    ]
    # table: top at 0.75 m, four legs, a small sphere on it
    tx, ty, tyaw = rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1), rng.uniform(-0.3, 0.3)
    c, s = math.cos(tyaw), math.sin(tyaw)
    prims.append(Box.from_yaw((tx, ty, 0.75), (0.6, 0.4, 0.02), tyaw))
    for lx, ly in ((0.55, 0.35), (-0.55, 0.35), (0.55, -0.35), (-0.55, -0.35)):
        prims.append(
            Box.from_yaw((tx + c * lx - s * ly, ty + s * lx + c * ly, 0.365), (0.025, 0.025, 0.365), tyaw)
        )
    prims.append(Sphere((tx + rng.uniform(-0.3, 0.3), ty + rng.uniform(-0.15, 0.15), 0.77 + 0.08), 0.08))
    # sofa against the -y wall
    sx = rng.uniform(-1.0, 0.5)
    prims.append(Box.from_bounds((sx - 1.0, -hy, 0.0), (sx + 1.0, -hy + 0.9, 0.45)))
    prims.append(Box.from_bounds((sx - 1.0, -hy, 0.45), (sx + 1.0, -hy + 0.2, 0.9)))
    # bookshelf against the +x wall, cabinet against the +y wall
    by = rng.uniform(-0.6, 0.8)
    prims.append(Box.from_bounds((hx - 0.35, by - 0.6, 0.0), (hx, by + 0.6, rng.uniform(1.8, 2.2))))
    cx = rng.uniform(-0.5, 1.5)
    prims.append(Box.from_bounds((cx - 0.5, hy - 0.5, 0.0), (cx + 0.5, hy, 0.8)))
    # armchair turned 45 degrees in the (-x, +y) corner
    prims.append(Box.from_yaw((-hx + 0.65, hy - 0.65, 0.4), (0.4, 0.4, 0.4), math.pi / 4))
    # floor lamp in the (+x, -y) corner
    lx, ly = hx - 0.3, -hy + 0.3
    prims.append(Cylinder((lx, ly), 0.0, 0.03, 0.18))
    prims.append(Cylinder((lx, ly), 0.03, 1.5, 0.02))
    prims.append(Cylinder((lx, ly), 1.45, 1.75, 0.2))
    # a ball on the floor near the cabinet
    br = rng.uniform(0.12, 0.22)
    prims.append(Sphere((cx + rng.uniform(-0.8, 0.8), hy - 0.5 - 0.3 - br, br), br))
    room = Room(
        min_m=(-hx, -hy, 0.0),
        max_m=(hx, hy, H),
        orbit_center_m=(tx, ty),
        orbit_radii_m=(hx - 1.5, hy - 1.4),
        look_at_m=(tx, ty, 0.6),
    )
    return Scene.from_primitives(prims, device=device, layout=room)


# ----------------------------------------------------------------------------------------------------
# sensors


@dataclass(frozen=True)
class PinholeCamera:
    """Pinhole depth camera, OpenCV axes (x right, y down, z forward), intrinsics in pixels."""

    width: int
    height: int
    fx: float
    fy: float
    cx: float
    cy: float

    def __post_init__(self):
        object.__setattr__(self, "width", _count("width", self.width))
        object.__setattr__(self, "height", _count("height", self.height))
        object.__setattr__(self, "fx", _positive("fx", self.fx))
        object.__setattr__(self, "fy", _positive("fy", self.fy))
        cx, cy = _vec("cx, cy", (self.cx, self.cy), 2)
        object.__setattr__(self, "cx", cx)
        object.__setattr__(self, "cy", cy)

    @classmethod
    def replica(cls) -> PinholeCamera:
        """The Replica office0 camera of the NICE-SLAM renderings (1200 x 680, 90 degree horizontal FOV)."""
        return cls(1200, 680, 600.0, 600.0, 599.5, 339.5)

    @classmethod
    def kinect(cls) -> PinholeCamera:
        """Kinect-v1-like camera, 640 x 480."""
        return cls(640, 480, 570.3422, 570.3422, 320.0, 240.0)

    @property
    def K(self) -> torch.Tensor:
        """Intrinsic matrix, float64 ``[3, 3]`` on the CPU."""
        return torch.tensor(
            [[self.fx, 0.0, self.cx], [0.0, self.fy, self.cy], [0.0, 0.0, 1.0]], dtype=torch.float64
        )

    def rays_sensor(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Unit ray directions ``[H * W, 3]`` (camera frame), row-major: index ``v * W + u``."""
        dev = resolve_device(device, torch.device("cpu"))
        v, u = torch.meshgrid(
            torch.arange(self.height, dtype=torch.float64, device=dev),
            torch.arange(self.width, dtype=torch.float64, device=dev),
            indexing="ij",
        )
        r = torch.stack([(u - self.cx) / self.fx, (v - self.cy) / self.fy, torch.ones_like(u)], -1)
        r = r.reshape(-1, 3)
        return (r / torch.linalg.vector_norm(r, dim=1, keepdim=True)).to(dtype)

    def render_depth(self, scene: Scene, T_world_sensor, max_range_m: float = 10.0) -> torch.Tensor:
        """Z-depth image ``depth_m`` float32 ``[H, W]`` on ``scene.device`` (0 = no surface, or z-depth
        beyond ``max_range_m``), for the camera at ``T_world_sensor`` (float ``[4, 4]``, camera-to-world)."""
        if not isinstance(scene, Scene):
            raise InvalidArgumentType(f"scene: expected a Scene, got {type(scene).__name__}")
        max_range = _max_range("max_range_m", max_range_m)
        T = _check_pose("T_world_sensor", T_world_sensor, scene.device)
        rays = self.rays_sensor(scene.device, torch.float64)
        dirs_world = rays @ T[:3, :3].T
        # z-depth <= max_range means ray length <= max_range / cos(angle to the optical axis)
        t = scene.raycast(T[:3, 3], dirs_world, max_range / float(rays[:, 2].min()))
        z = t * rays[:, 2]
        z = torch.where(torch.isfinite(z) & (z <= max_range), z, 0.0)
        return z.to(torch.float32).reshape(self.height, self.width)


@dataclass(frozen=True)
class SpinningLidar:
    """Spinning multi-beam LiDAR (HDL-64-like defaults). Sensor frame: x forward, y left, z up.

    Beams at elevations ``linspace(fov_up_deg, fov_down_deg, n_beams)``; azimuths ``2 pi j / n_azimuth``
    counter-clockwise from +x. 64 x 1875 = 120 000 rays per scan. ``range_noise_std_m`` adds Gaussian
    noise along each ray; ``dropout_prob`` drops returns at random; both draw from the generator given to
    :meth:`scan`, or from one seeded with ``seed``.
    """

    n_beams: int = 64
    n_azimuth: int = 1875
    fov_up_deg: float = 2.0
    fov_down_deg: float = -24.8
    max_range_m: float = 60.0
    range_noise_std_m: float = 0.0
    dropout_prob: float = 0.0
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "n_beams", _count("n_beams", self.n_beams))
        object.__setattr__(self, "n_azimuth", _count("n_azimuth", self.n_azimuth))
        up, down = _vec("fov_up_deg, fov_down_deg", (self.fov_up_deg, self.fov_down_deg), 2)
        if not (-90 <= down <= up <= 90) or (up == down and self.n_beams > 1):
            raise InvalidArgument(f"fov: need -90 <= fov_down_deg < fov_up_deg <= 90, got {down}, {up}")
        object.__setattr__(self, "max_range_m", _positive("max_range_m", self.max_range_m))
        sigma = float(self.range_noise_std_m)
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise InvalidArgument(f"range_noise_std_m: expected a finite value >= 0, got {sigma}")
        p = float(self.dropout_prob)
        if not 0 <= p < 1:
            raise InvalidArgument(f"dropout_prob: expected a value in [0, 1), got {p}")

    @property
    def n_rays(self) -> int:
        return self.n_beams * self.n_azimuth

    def elevations_rad(self) -> torch.Tensor:
        """Beam elevations, float64 ``[n_beams]``, from ``fov_up_deg`` down to ``fov_down_deg``."""
        return torch.deg2rad(
            torch.linspace(self.fov_up_deg, self.fov_down_deg, self.n_beams, dtype=torch.float64)
        )

    def rays_sensor(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Unit directions ``[n_azimuth * n_beams, 3]`` in firing order (azimuth-major: index
        ``j * n_beams + b``)."""
        dev = resolve_device(device, torch.device("cpu"))
        el = self.elevations_rad().to(dev)
        az = torch.arange(self.n_azimuth, dtype=torch.float64, device=dev) * (2 * math.pi / self.n_azimuth)
        az, el = torch.meshgrid(az, el, indexing="ij")
        d = torch.stack([el.cos() * az.cos(), el.cos() * az.sin(), el.sin()], -1).reshape(-1, 3)
        return d.to(dtype)

    def scan(
        self,
        scene: Scene,
        T_world_sensor,
        *,
        return_misses: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One sweep from the pose ``T_world_sensor`` (float ``[4, 4]``, sensor-to-world).

        Returns ``points_sensor`` float32 ``[N, 3]`` on ``scene.device`` (returns within ``max_range_m``, in
        firing order), and with ``return_misses=True`` also ``miss_dirs_sensor`` float32 ``[K, 3]``: unit
        directions of the rays without a return (nothing in range, or dropped); ``N + K = n_rays``.
        ``generator`` (on the scene's device) drives noise and dropout; pass one to get different noise in
        every frame of a sequence.
        """
        if not isinstance(scene, Scene):
            raise InvalidArgumentType(f"scene: expected a Scene, got {type(scene).__name__}")
        T = _check_pose("T_world_sensor", T_world_sensor, scene.device)
        rays = self.rays_sensor(scene.device, torch.float64)
        t = scene.raycast(T[:3, 3], rays @ T[:3, :3].T, self.max_range_m)
        noisy = self.range_noise_std_m > 0 or self.dropout_prob > 0
        if noisy and generator is None:
            generator = torch.Generator(device=scene.device).manual_seed(self.seed)
        if self.range_noise_std_m > 0:
            n = torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float64)
            t = t + self.range_noise_std_m * n
        ok = torch.isfinite(t) & (t > 0) & (t <= self.max_range_m)
        if self.dropout_prob > 0:
            u = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float64)
            ok &= u >= self.dropout_prob
        points = (rays[ok] * t[ok, None]).to(torch.float32)
        if return_misses:
            return points, rays[~ok].to(torch.float32)
        return points


# ----------------------------------------------------------------------------------------------------
# trajectories


def _rot_zyx(yaw, pitch, roll) -> np.ndarray:
    """R = Rz(yaw) Ry(pitch) Rx(roll), float64 ``[..., 3, 3]``."""
    cy, sy = np.cos(yaw), np.sin(yaw)
    cp, sp = np.cos(pitch), np.sin(pitch)
    cr, sr = np.cos(roll), np.sin(roll)
    R = np.empty(np.shape(yaw) + (3, 3))
    R[..., 0, 0] = cy * cp
    R[..., 0, 1] = cy * sp * sr - sy * cr
    R[..., 0, 2] = cy * sp * cr + sy * sr
    R[..., 1, 0] = sy * cp
    R[..., 1, 1] = sy * sp * sr + cy * cr
    R[..., 1, 2] = sy * sp * cr - cy * sr
    R[..., 2, 0] = -sp
    R[..., 2, 1] = cp * sr
    R[..., 2, 2] = cp * cr
    return R


def look_at(eye_m, target_m, up=(0.0, 0.0, 1.0)) -> torch.Tensor:
    """Camera-to-world float64 ``[4, 4]`` for an OpenCV camera at ``eye_m`` looking at ``target_m``:
    z (forward) towards the target, x (right) = forward x up, y (down) = forward x right."""
    eye, target = np.asarray(_vec("eye_m", eye_m)), np.asarray(_vec("target_m", target_m))
    z = target - eye
    if np.linalg.norm(z) < 1e-9:
        raise InvalidArgument("look_at: eye_m and target_m coincide")
    z = z / np.linalg.norm(z)
    x = np.cross(z, np.asarray(_vec("up", up)))
    if np.linalg.norm(x) < 1e-9:
        raise InvalidArgument("look_at: viewing direction is parallel to up")
    x = x / np.linalg.norm(x)
    y = np.cross(z, x)
    T = np.eye(4)
    T[:3, 0], T[:3, 1], T[:3, 2], T[:3, 3] = x, y, z, eye
    return torch.from_numpy(T)


def driving_trajectory(
    n_frames: int,
    *,
    scene: Scene | None = None,
    speed_mps: float = 10.0,
    hz: float = 10.0,
    seed: int = 0,
    sensor_height_m: float = 1.73,
) -> torch.Tensor:
    """Poses of a roof LiDAR driving along the road of an :func:`outdoor_scene` (``outdoor_scene(seed)`` if
    ``scene`` is None): float64 ``[n_frames, 4, 4]`` ``T_world_sensor`` on the CPU.

    Starts at station x = 0 in the right lane, moves ``speed_mps / hz`` metres (along the path) per frame;
    sensor x forward (path tangent), z up, at ``sensor_height_m``. ``seed`` adds a smooth lateral weave of
    up to 0.3 m and pitch/roll oscillations of up to 0.5 degrees.
    """
    n = _count("n_frames", n_frames)
    speed, rate = _positive("speed_mps", speed_mps), _positive("hz", hz)
    height = _positive("sensor_height_m", sensor_height_m)
    if scene is None:
        scene = outdoor_scene(seed)
    if not isinstance(scene, Scene) or not isinstance(scene.layout, Road):
        raise InvalidArgument("scene: expected a Scene from outdoor_scene() (its layout must be a Road)")
    road: Road = scene.layout
    step = speed / rate
    length = (n - 1) * step
    rng = np.random.default_rng(int(seed) + 7919)
    weave_lam, weave_ph = rng.uniform(60, 120), rng.uniform(0, 2 * np.pi)
    ph_p, ph_r = rng.uniform(0, 2 * np.pi, size=2)
    # fine polyline of the path, arc length by summed chords
    xs = np.arange(road.x_min_m, road.x_max_m + 0.01, 0.01)
    lateral = road.lane_offset_m + 0.3 * np.sin(2 * np.pi * xs / weave_lam + weave_ph)
    pts = road.offset_point(xs, lateral)
    arc = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(pts, axis=0), axis=1))])
    if length > arc[-1]:
        raise InvalidArgument(
            f"n_frames: a drive of {length:.0f} m does not fit the road ({arc[-1]:.0f} m); "
            f"use fewer frames, a lower speed or a larger extent_m"
        )
    s = np.arange(n) * step
    px, py = np.interp(s, arc, pts[:, 0]), np.interp(s, arc, pts[:, 1])
    tang = np.gradient(pts, axis=0)
    yaw = np.interp(s, arc, np.unwrap(np.arctan2(tang[:, 1], tang[:, 0])))
    pitch = np.radians(0.5) * np.sin(2 * np.pi * s / 23.0 + ph_p)
    roll = np.radians(0.5) * np.sin(2 * np.pi * s / 17.0 + ph_r)
    T = np.tile(np.eye(4), (n, 1, 1))
    T[:, :3, :3] = _rot_zyx(yaw, pitch, roll)
    T[:, 0, 3], T[:, 1, 3], T[:, 2, 3] = px, py, height
    return torch.from_numpy(T)


def orbit_trajectory(
    n_frames: int, *, scene: Scene | None = None, seed: int = 0, revolutions: float = 1.0
) -> torch.Tensor:
    """Camera poses (OpenCV axes) on an ellipse inside an :func:`indoor_scene` room (``indoor_scene(seed)``
    if ``scene`` is None), each looking at the room's centre table from about 1.45 m height (+-0.1 m
    bobbing): float64 ``[n_frames, 4, 4]`` ``T_world_sensor`` on the CPU."""
    n = _count("n_frames", n_frames)
    if scene is None:
        scene = indoor_scene(seed)
    if not isinstance(scene, Scene) or not isinstance(scene.layout, Room):
        raise InvalidArgument("scene: expected a Scene from indoor_scene() (its layout must be a Room)")
    room: Room = scene.layout
    rng = np.random.default_rng(int(seed) + 104729)
    phase = rng.uniform(0, 2 * np.pi)
    ang = phase + 2 * np.pi * float(revolutions) * np.arange(n) / n
    (ox, oy), (rx, ry) = room.orbit_center_m, room.orbit_radii_m
    eyes = np.stack(
        [ox + rx * np.cos(ang), oy + ry * np.sin(ang), room.camera_height_m + 0.1 * np.sin(2 * ang)], 1
    )
    return torch.stack([look_at(e, room.look_at_m) for e in eyes])


# ----------------------------------------------------------------------------------------------------
# frame generators for benchmarks (frames are made on the target device, nothing is shipped)


def lidar_sequence(
    n_frames: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    *,
    lidar: SpinningLidar | None = None,
    extent_m: float = 600.0,
    speed_mps: float = 10.0,
    hz: float = 10.0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields ``(points_sensor float32 [N, 3], T_world_sensor float64 [4, 4])`` on ``device`` for a drive
    through ``outdoor_scene(seed, extent_m)``; one noise generator (seeded with ``seed``) for the sequence."""
    lidar = SpinningLidar() if lidar is None else lidar
    dev = resolve_device(device, torch.device("cpu"))
    scene = outdoor_scene(seed, extent_m, device=dev)
    poses = driving_trajectory(n_frames, scene=scene, speed_mps=speed_mps, hz=hz, seed=seed).to(dev)
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    for T in poses:
        yield lidar.scan(scene, T, generator=gen), T


def depth_sequence(
    n_frames: int,
    camera: PinholeCamera | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    *,
    max_range_m: float = 10.0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yields ``(depth_m float32 [H, W], K float64 [3, 3], T_world_sensor float64 [4, 4])`` on ``device``
    for an orbit in ``indoor_scene(seed)``, rendered with ``camera`` (default
    :meth:`PinholeCamera.replica`)."""
    camera = PinholeCamera.replica() if camera is None else camera
    dev = resolve_device(device, torch.device("cpu"))
    scene = indoor_scene(seed, device=dev)
    poses = orbit_trajectory(n_frames, scene=scene, seed=seed).to(dev)
    K = camera.K.to(dev)
    for T in poses:
        yield camera.render_depth(scene, T, max_range_m), K, T

"""Sensor trajectories over the factories' layouts: :func:`look_at`, :func:`driving_trajectory` (along the
road), :func:`orbit_trajectory` (around a room)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgument
from .checks import _count, _positive, _vec
from .factories import indoor_scene, outdoor_scene
from .layouts import Road, Room
from .scene import Scene


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

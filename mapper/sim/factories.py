"""Scene factories: a KITTI-like street (:func:`outdoor_scene`) and a furnished room
(:func:`indoor_scene`)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import InvalidArgument, InvalidArgumentType
from .checks import _positive
from .layouts import Road, Room
from .primitives import Box, Cylinder, Plane, Primitive, Sphere
from .scene import Scene


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

"""Layouts: what the scene factories know about where things are (used by the trajectories)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

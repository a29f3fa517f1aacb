"""Argument checks of the registration functions (numbers, kernel names, point clouds)."""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from ..integrators.common import check_points

KERNELS = ("geman_mcclure", "huber", "none")


def _positive(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x <= 0:
        raise InvalidArgument(f"{name}: expected a finite value > 0, got {x}")
    return float(x)


def _non_negative(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x < 0:
        raise InvalidArgument(f"{name}: expected a finite value >= 0, got {x}")
    return float(x)


def _int_at_least(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(x).__name__}")
    if x < lo:
        raise InvalidArgument(f"{name}: expected an int >= {lo}, got {x}")
    return x


def _kernel_name(kernel) -> str:
    if kernel is None:
        return "none"
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise InvalidArgument(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return kernel


def _check_cloud(name: str, x, device: torch.device) -> torch.Tensor:
    pts = check_points(name, x, device)
    if pts.shape[0] == 0:
        raise InvalidArgument(f"{name}: expected at least one point")
    if not bool(torch.isfinite(pts).all()):
        raise InvalidArgument(f"{name}: contains NaN or Inf")
    return pts

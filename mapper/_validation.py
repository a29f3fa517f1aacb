"""Input checks at the library boundary: one place that turns user input into well-formed tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .errors import InvalidArgument, InvalidArgumentType

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def resolve_device(device: str | torch.device | None, fallback: torch.device | None = None) -> torch.device:
    """Turn a user device spec into a ``torch.device`` ("auto"/None -> fallback, else cuda if available)."""
    if device is None or device == "auto":
        if fallback is not None:
            return fallback
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"device: cannot parse {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device: {device!r} requested but CUDA is not available")
    return dev


def as_tensor(name: str, x, device: torch.device | None = None) -> torch.Tensor:
    """Accept a torch tensor, numpy array or nested sequence; return a tensor (on ``device`` if given)."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        if x.dtype == object:
            raise InvalidArgumentType(f"{name}: object arrays are not supported")
        t = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        try:
            t = torch.as_tensor(np.asarray(x))
        except (ValueError, TypeError) as e:
            raise InvalidArgumentType(f"{name}: cannot convert to a tensor: {e}") from None
    else:
        raise InvalidArgumentType(f"{name}: expected a torch.Tensor or numpy array, got {type(x).__name__}")
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def check_ijk(name: str, ijk, device: torch.device | None = None) -> torch.Tensor:
    """Integer voxel coordinates ``[N, 3]`` -> int64 tensor. Raises on float/bool dtypes or wrong shape."""
    t = as_tensor(name, ijk, device)
    if t.dtype not in _INT_DTYPES:
        raise InvalidArgumentType(f"{name}: expected an integer dtype (int32 or int64), got {t.dtype}")
    if t.dim() != 2 or t.shape[1] != 3:
        raise InvalidArgument(f"{name}: expected shape [N, 3], got {list(t.shape)}")
    return t.to(torch.int64)


def check_bool_mask(name: str, mask, length: int, device: torch.device) -> torch.Tensor:
    """A bool vector of exactly ``length`` elements on ``device``."""
    t = as_tensor(name, mask)
    if t.dtype != torch.bool:
        raise InvalidArgumentType(f"{name}: expected dtype torch.bool, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        raise InvalidArgument(f"{name}: expected shape [{length}], got {list(t.shape)}")
    if t.device != device:
        raise InvalidArgument(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_int_in(name: str, value, allowed) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(value).__name__}")
    if int(value) not in allowed:
        raise InvalidArgument(f"{name}: expected one of {sorted(allowed)}, got {value}")
    return int(value)


# ---------------------------------------------------------------------------- sensor geometry (numbers)
# Shared by the wire decoder (before a frame is logged) and by Map (library calls): a frame that passes
# these checks cannot make an integrator fail or run away (NOTES.md, "No poison records").
MAX_RAY_ANGLE_DEG = 85.0  # every pixel's ray within this angle of the optical axis (FOV <= 170 deg)
MIN_FOV_DEG = 0.1  # per axis, edge to edge


def check_pinhole(name: str, fx: float, fy: float, cx: float, cy: float, width: int, height: int) -> None:
    """Pinhole intrinsics that project a ``width x height`` image to a sane field of view.

    Raises ``InvalidArgument`` naming the problem unless: all four are finite, ``fx, fy > 0``, the
    principal point lies within the image enlarged by half its size on each side, every pixel's ray is
    within ``MAX_RAY_ANGLE_DEG`` of the optical axis and each axis sees at least ``MIN_FOV_DEG``.
    """
    vals = (fx, fy, cx, cy)
    if not all(math.isfinite(x) for x in vals):
        raise InvalidArgument(f"{name}: contains NaN or Inf")
    if fx <= 0 or fy <= 0:
        raise InvalidArgument(f"{name}: focal lengths must be positive, got fx={fx:g}, fy={fy:g}")
    slope = math.tan(math.radians(MAX_RAY_ANGLE_DEG))
    for axis, f, c, size in (("x", fx, cx, width), ("y", fy, cy, height)):
        if not -0.5 * size <= c <= 1.5 * size:
            raise InvalidArgument(
                f"{name}: principal point c{axis}={c:g} is far outside the image (size {size} pixels)"
            )
        if max(abs(c), abs(size - c)) / f > slope:
            raise InvalidArgument(
                f"{name}: f{axis}={f:g} makes rays more than {MAX_RAY_ANGLE_DEG:g} deg from the optical axis "
                f"(image {size} pixels, c{axis}={c:g}); the field of view must stay under "
                f"{2 * MAX_RAY_ANGLE_DEG:g} deg"
            )
        fov = math.degrees(math.atan2(size - c, f) + math.atan2(c, f))
        if fov < MIN_FOV_DEG:
            raise InvalidArgument(
                f"{name}: f{axis}={f:g} gives a field of view of {fov:.3g} deg over {size} pixels "
                f"(minimum {MIN_FOV_DEG:g})"
            )


def check_translation(name: str, t, limit_m: float, why: str) -> None:
    """Every component of the translation ``t`` (3 numbers, metres) finite and within ``+-limit_m``."""
    vals = [float(x) for x in t]
    if not all(math.isfinite(x) for x in vals):
        raise InvalidArgument(f"{name}: translation contains NaN or Inf")
    worst = max(abs(x) for x in vals)
    if worst > limit_m:
        raise InvalidArgument(
            f"{name}: translation {worst:.6g} m from the origin exceeds {limit_m:.6g} m ({why})"
        )


def positive(name: str, x, allow_none: bool = False) -> float | None:
    """A finite number > 0 -> float (None passes when ``allow_none``); raises naming ``name`` otherwise."""
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x <= 0:
        raise InvalidArgument(f"{name}: expected a finite value > 0, got {x}")
    return float(x)


def finite_vector(name: str, x, n: int, device: torch.device) -> torch.Tensor:
    """``n`` finite numbers (a tensor, array or sequence) -> float64 ``[n]`` on ``device``."""
    if x is None:
        raise InvalidArgument(f"{name}: required")
    t = as_tensor(name, x).to(torch.float64).reshape(-1)
    if t.numel() != n or not bool(torch.isfinite(t).all()):
        raise InvalidArgument(f"{name}: expected {n} finite numbers")
    return t.to(device)

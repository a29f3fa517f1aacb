"""Input checks of the simulator (vectors, positive numbers, counts, rotations, poses)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .._validation import as_tensor
from ..errors import InvalidArgument, InvalidArgumentType


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

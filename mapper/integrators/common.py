"""Building blocks shared by the integrators: input checks, ray traversal, de-duplication, aggregation.

All functions are pure torch (the reference, and the CPU path); they run on CPU and CUDA tensors.
"""

from __future__ import annotations

import math

import torch

from .._validation import as_tensor, check_pinhole
from ..errors import InvalidArgument, InvalidArgumentType
from ..kernels.chunks import row_slices
from ..kernels.dda import dda  # noqa: F401 (re-exported: the integrators' traversal)
from ..kernels.keys import (  # noqa: F401 (re-exported: the integrators' keys, unique_voxels)
    VOXEL_KEY_BIAS,
    VOXEL_KEY_BITS,
    VOXEL_KEY_LIMIT,
    in_key_range,
    keys_to_ijk,
    unique_voxels,
    voxel_keys,
)
from ..kernels.transfer import host_to_device  # noqa: F401 (re-exported: map.py)

# voxel keys for aggregation (mapper.kernels.keys owns the format; the names are re-exported here)
KEY_BITS = VOXEL_KEY_BITS
KEY_BIAS = VOXEL_KEY_BIAS
KEY_LIMIT = VOXEL_KEY_LIMIT


# ------------------------------------------------------------------------------------------- checks
def check_pose(name: str, T, device: torch.device) -> torch.Tensor:
    """A rigid 4x4 transform (numpy/torch/list of 16) -> float64 ``[4, 4]`` on ``device``."""
    t = as_tensor(name, T).detach().cpu()  # 16 numbers: validate on the host, whatever device they came on
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise InvalidArgumentType(f"{name}: expected a float 4x4 matrix, got dtype {t.dtype}")
    t = t.to(torch.float64)
    if t.numel() == 16 and t.dim() == 1:
        t = t.reshape(4, 4)
    if tuple(t.shape) != (4, 4):
        raise InvalidArgument(f"{name}: expected shape [4, 4] (or 16 row-major values), got {list(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise InvalidArgument(f"{name}: contains NaN or Inf")
    R = t[:3, :3]
    if not torch.allclose(R @ R.T, torch.eye(3, dtype=torch.float64), atol=1e-3) or float(torch.det(R)) < 0:
        raise InvalidArgument(f"{name}: the rotation block is not a rotation (R R^T != I or det < 0)")
    if not torch.allclose(t[3], torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64), atol=1e-6):
        raise InvalidArgument(f"{name}: last row must be [0, 0, 0, 1]")
    return host_to_device(t, device)


def check_intrinsics(
    name: str, K, device: torch.device, image_hw: tuple[int, int] | None = None
) -> torch.Tensor:
    """Pinhole intrinsics as a 3x3 matrix or [fx, fy, cx, cy] -> float64 ``[3, 3]``. With ``image_hw``
    (H, W), the field of view must be sane too (``mapper._validation.check_pinhole``)."""
    t = as_tensor(name, K).detach().cpu().to(torch.float64)
    if t.numel() == 4 and t.dim() == 1:
        fx, fy, cx, cy = t.tolist()
        t = torch.tensor([[fx, 0, cx], [0, fy, cy], [0, 0, 1]], dtype=torch.float64)
    if tuple(t.shape) != (3, 3):
        raise InvalidArgument(f"{name}: expected shape [3, 3] or [fx, fy, cx, cy], got {list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or t[0, 0] <= 0 or t[1, 1] <= 0:
        raise InvalidArgument(f"{name}: focal lengths must be positive and finite")
    if image_hw is not None:
        check_pinhole(
            name, float(t[0, 0]), float(t[1, 1]), float(t[0, 2]), float(t[1, 2]), image_hw[1], image_hw[0]
        )
    return host_to_device(t, device)


def check_points(name: str, pts, device: torch.device) -> torch.Tensor:
    """``[N, 3]`` or ``[N, 4]`` float points -> float32 ``[N, 3]`` on ``device`` (extra columns dropped)."""
    t = as_tensor(name, pts)
    if not t.is_floating_point():
        raise InvalidArgumentType(f"{name}: expected a float array, got dtype {t.dtype}")
    if t.dim() != 2 or t.shape[1] not in (3, 4):
        raise InvalidArgument(f"{name}: expected shape [N, 3] or [N, 4], got {list(t.shape)}")
    return t[:, :3].to(device=device, dtype=torch.float32)


def check_depth(name: str, depth, device: torch.device) -> torch.Tensor:
    t = as_tensor(name, depth)
    if not t.is_floating_point():
        raise InvalidArgumentType(f"{name}: expected float metres, got dtype {t.dtype}")
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise InvalidArgument(f"{name}: expected shape [H, W], got {list(t.shape)}")
    return t.to(device=device, dtype=torch.float32)


def check_color(name: str, color, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    t = as_tensor(name, color)
    if t.dtype != torch.uint8:
        raise InvalidArgumentType(f"{name}: expected uint8 RGB, got dtype {t.dtype}")
    if tuple(t.shape) != (shape[0], shape[1], 3):
        raise InvalidArgument(f"{name}: expected shape [{shape[0]}, {shape[1]}, 3], got {list(t.shape)}")
    return t.to(device)


def aggregate(ijk: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None = None):
    """Per unique voxel of int64 ``[M, 3]`` ``ijk``: (unique voxels ``[U, 3]``, sum of ``values`` ``[U, *C]``,
    sum of ``weights`` (or counts) ``[U]``)."""
    keys, inv = torch.unique(voxel_keys(ijk), return_inverse=True)
    w = torch.ones(ijk.shape[0], dtype=values.dtype, device=ijk.device) if weights is None else weights
    wsum = torch.zeros(keys.numel(), dtype=values.dtype, device=ijk.device).index_add_(0, inv, w)
    vsum = torch.zeros((keys.numel(), *values.shape[1:]), dtype=values.dtype, device=ijk.device)
    vsum.index_add_(0, inv, values * (w if values.dim() == 1 else w[:, None]))
    return keys_to_ijk(keys), vsum, wsum


# ---------------------------------------------------------------------------------------- traversal
def max_dda_steps(segment_length: float, cell: float) -> int:
    """Upper bound on the cells a segment crosses (3 axes x crossings + the start cell)."""
    return 3 * (math.ceil(segment_length / cell) + 1) + 1


def chunked_rays(n: int, device: torch.device, rows: int = 1 << 15):
    """Ray chunks for the torch path (bounded temporaries on CPU, one chunk on CUDA)."""
    return row_slices(n, device, cpu_rows=rows)

"""Robust Gauss-Newton ICP: :func:`align` of a cloud against a :class:`~mapper.registration.VoxelPointMap`,
:func:`register` of two clouds."""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import _validation as v
from ..integrators.common import check_pose
from ..kernels import nn
from .checks import _check_cloud, _int_at_least, _kernel_name, _non_negative, _positive
from .se3 import _HOST, _se3_exp_np
from .voxel_map import VoxelPointMap


def _unpack_system(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``(H [6, 6], g [6], pairs, sum of squared residuals)`` of ``nn.icp_system``'s float64 ``[29]``."""
    H = np.zeros((6, 6))
    H[np.triu_indices(6)] = s[:21]
    H = H + np.triu(H, 1).T
    return H, s[21:27].copy(), int(round(s[27])), float(s[28])


def align(
    source: torch.Tensor,
    vmap: VoxelPointMap,
    T_init: torch.Tensor,
    max_correspondence_m: float,
    kernel_scale_m: float,
    *,
    kernel: str = "geman_mcclure",
    max_iterations: int = 50,
    convergence: float = 1e-4,
    min_kernel_scale_m: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Robust point-to-plane ICP of ``source`` (float32 ``[N, 3]``, source frame, on the map's device) against
    ``vmap``, from ``T_init`` (float64 ``[4, 4]`` map <- source). Stops when the update's norm (metres and
    radians) falls below ``convergence``. With ``min_kernel_scale_m`` below ``kernel_scale_m``, the kernel
    scale drops to that floor (and the search radius to 3 times it) once the update is below a tenth of
    it: the wide kernel gives the basin, the narrow one the accuracy. Returns ``(T float64 [4, 4] on the
    CPU, info)``;
    info: ``iterations``, ``converged``, ``correspondences`` (inliers of the last iteration), ``fitness``
    (their fraction), ``rmse_m`` (RMS of the inliers' residuals ``r``).

    Each iteration is one ``nn.icp_system`` call (on CUDA one fused Triton launch: search, residuals,
    weights, per-program sums) and one 29-number device->host copy; the 6x6 solve and the pose stay on the
    host, and the pose goes back as kernel arguments."""
    T = T_init.detach().to(device=_HOST, dtype=torch.float64).numpy().copy()  # the pose lives on the host
    info = {"iterations": 0, "converged": False, "correspondences": 0, "fitness": 0.0, "rmse_m": float("nan")}
    if vmap.empty() or source.shape[0] == 0:
        return torch.from_numpy(T), info
    radius = float(max_correspondence_m)
    find = vmap.searcher(radius)
    scale = float(kernel_scale_m)
    floor = scale if min_kernel_scale_m is None else min(float(min_kernel_scale_m), scale)
    pairs, sse = 0, 0.0
    for it in range(max_iterations):
        pose = tuple(T[:3, :3].ravel().tolist()) + tuple(T[:3, 3].tolist())
        S = nn.icp_system(
            source, pose, vmap.keys, vmap.slots, vmap.points, vmap.normals, vmap.flatness,
            vmap.voxel_size_m, radius, vmap.neighbourhood(radius), kernel, scale, find=find,
        )  # fmt: skip
        H, g, pairs, sse = _unpack_system(S.cpu().numpy())  # the iteration's one sync
        info["iterations"] = it + 1
        if pairs < 6:
            break
        dx = np.linalg.solve(H + 1e-9 * np.eye(6), -g)
        D = _se3_exp_np(dx)
        # rotate about the sensor: R <- R_d R, t <- t + t_d (the linearisation point is the sensor)
        T[:3, :3] = D[:3, :3] @ T[:3, :3]
        T[:3, 3] += D[:3, 3]
        step = float(np.linalg.norm(dx))
        if scale <= floor and step < convergence:
            info["converged"] = True
            break
        if scale > floor and step < 0.1 * floor:  # the wide kernel has brought it into the narrow one's basin
            scale = floor
            if 3 * scale < radius:  # pairs beyond 3 scales weigh < 1 %: search less
                radius = 3 * scale
                find = vmap.searcher(radius)
    info.update(
        correspondences=pairs,
        fitness=pairs / source.shape[0],
        rmse_m=math.sqrt(sse / pairs) if pairs else float("nan"),
    )
    return torch.from_numpy(T), info


def register(
    source,
    target,
    T_init=None,
    *,
    voxel_size_m: float = 0.5,
    max_correspondence_m: float = 0.5,
    kernel: str = "geman_mcclure",
    kernel_scale_m: float | None = None,
    iterations: int = 50,
    convergence: float = 1e-5,
    max_points_per_voxel: int = 20,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, dict]:
    """Rigid registration of two clouds: ``T_target_source`` (float64 ``[4, 4]``, on the CPU) such that
    ``T @ source ~ target``, by robust point-to-plane ICP against a :class:`VoxelPointMap` of ``target``.

    Args:
        source, target: float ``[N, 3]`` / ``[M, 3]`` (numpy or torch; ``[N, 4]`` drops the 4th column).
        T_init: initial ``T_target_source`` (``[4, 4]``, default identity); ICP converges from within about
            ``max_correspondence_m`` of the answer.
        voxel_size_m: voxel edge of the target map (up to ``max_points_per_voxel`` points, a plane each).
        max_correspondence_m: pairs farther apart are ignored.
        kernel: ``"geman_mcclure"`` (default), ``"huber"`` or ``"none"``; ``kernel_scale_m`` its scale
            (default ``max_correspondence_m / 3``).
        iterations, convergence: Gauss-Newton stops after ``iterations`` or when the update's norm is
            below ``convergence``.
        device: where to compute (default: CUDA when available).
    Returns: ``(T, info)`` with info as :func:`align`'s.
    Raises: InvalidArgument / InvalidArgumentType naming the argument.
    """
    dev = v.resolve_device(device)
    src = _check_cloud("source", source, dev)
    tgt = _check_cloud("target", target, dev)
    T0 = torch.eye(4, dtype=torch.float64) if T_init is None else check_pose("T_init", T_init, _HOST)
    vox = _positive("voxel_size_m", voxel_size_m)
    h = _positive("max_correspondence_m", max_correspondence_m)
    kernel = _kernel_name(kernel)
    scale = h / 3 if kernel_scale_m is None else _positive("kernel_scale_m", kernel_scale_m)
    iters = _int_at_least("iterations", iterations, 1)
    conv = _non_negative("convergence", convergence)
    vmap = VoxelPointMap(vox, max_points_per_voxel=max_points_per_voxel, device=dev)
    vmap.add_points(tgt)
    return align(src, vmap, T0, h, scale, kernel=kernel, max_iterations=iters, convergence=conv)

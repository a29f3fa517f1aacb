"""LiDAR registration: scan-to-map point-to-plane ICP against a voxel-hashed local map (KISS-ICP style).

Pieces, in the order the pipeline uses them:

* SE(3) helpers: :func:`se3_exp`, :func:`se3_log` (float64, batched), twist = ``(translation, rotation)``.
* :func:`voxel_downsample`: first point per voxel (input order).
* :class:`VoxelPointMap`: up to ``K`` points per voxel in fixed-capacity slots (``points [C, 3, K]``, the
  first K kept, at least ``min_point_spacing_m`` apart), sorted int64 voxel keys for lookup, a plane per voxel
  (PCA of its points) for the point-to-plane residual, removal of voxels far from the sensor.
* :func:`align`: robust Gauss-Newton ICP of a cloud against a map (nearest neighbours from
  ``mapper.kernels.nn``), :func:`register`: the same for two clouds.
* :class:`AdaptiveThreshold`, :class:`OdometryConfig`, :class:`Odometry`: the scan-to-map odometry
  (``Odometry.register_frame`` reads as the recipe).

Residual. A correspondence ``(p, q)`` (source point in the map frame, nearest map point) in a voxel with
plane normal ``n`` and flatness ``beta = lambda_min / lambda_mid`` of its points' covariance costs
``r^2 = (1 - beta) (n . (p - q))^2 + beta |p - q|^2``: point-to-plane on flat voxels, point-to-point on
edges, poles, vegetation and voxels with too few points to fit a plane (``beta = 1``). The Geman-McClure
weight ``(s^2 / (s^2 + r^2))^2`` (scale ``s``) makes the least squares robust; the 6x6 normal equations are
accumulated and solved in float64. Updates rotate about the current sensor position (left perturbation
``T <- exp(dx) T`` in a frame centred on the sensor), which keeps the system well conditioned far from the
world origin.

Frames: ``T_world_sensor`` / ``T_target_source`` are float64 ``[4, 4]`` rigid transforms mapping
source/sensor coordinates into world/target coordinates; they live on the CPU (a GPU would only add tiny
launches and syncs for 4x4 algebra). Points are float32 ``[N, 3]`` on the compute device.

Files: ``se3.py`` the SE(3) helpers, ``voxel_map.py`` downsampling and the voxel point map, ``icp.py``
:func:`align` / :func:`register`, ``odometry.py`` the odometry, ``checks.py`` the argument checks; this module
re-exports their names (``from mapper.registration import X`` keeps working).
"""

from __future__ import annotations

from .checks import KERNELS
from .icp import align, register
from .odometry import AdaptiveThreshold, Odometry, OdometryConfig, deskew
from .se3 import se3_exp, se3_log, skew
from .voxel_map import VoxelPointMap, voxel_downsample

__all__ = [
    "KERNELS",
    "AdaptiveThreshold",
    "Odometry",
    "OdometryConfig",
    "VoxelPointMap",
    "align",
    "deskew",
    "register",
    "se3_exp",
    "se3_log",
    "skew",
    "voxel_downsample",
]

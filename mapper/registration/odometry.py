"""The scan-to-map odometry: :class:`AdaptiveThreshold`, :class:`OdometryConfig`, :func:`deskew`,
:class:`Odometry` (``Odometry.register_frame`` reads as the recipe)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import _validation as v
from ..errors import InvalidArgument, InvalidArgumentType
from ..integrators.common import check_points, check_pose
from .checks import _int_at_least, _kernel_name, _non_negative, _positive
from .icp import align
from .se3 import _HOST, _rotation_angle, se3_exp, se3_log
from .voxel_map import VoxelPointMap, voxel_downsample


class AdaptiveThreshold:
    """KISS-ICP's correspondence threshold: ``sigma = sqrt(mean of model_error^2)`` over the frames whose
    model error (deviation of the registered pose from the constant-velocity prediction, translation +
    the chord its rotation sweeps at ``max_range_m``) exceeded ``min_motion_m``; starts at
    ``initial_threshold_m``."""

    def __init__(self, initial_threshold_m: float, min_motion_m: float, max_range_m: float):
        self.min_motion_m = min_motion_m
        self.max_range_m = max_range_m
        self._sse = initial_threshold_m**2
        self._n = 1

    @property
    def sigma(self) -> float:
        return math.sqrt(self._sse / self._n)

    def update(self, deviation: torch.Tensor) -> None:
        """``deviation``: float64 ``[4, 4]`` = ``inv(prediction) @ estimate``."""
        theta = _rotation_angle(deviation)
        err = float(deviation[:3, 3].norm()) + 2 * self.max_range_m * math.sin(theta / 2)
        if err > self.min_motion_m:
            self._sse += err * err
            self._n += 1


@dataclass(frozen=True)
class OdometryConfig:
    """Settings of :class:`Odometry` (KISS-ICP's defaults where they exist).

    ``voxel_size_m`` None = ``max_range_m / 100``; the frame is downsampled at half of it (map update) and
    the ICP source at 1.5 times it. ``max_iterations``/``convergence``: Gauss-Newton stopping rule (update
    norm, metres + radians; 1e-3 gave the same trajectories as KISS-ICP's 1e-4 with ~40 % fewer
    iterations). ``kernel``: robust kernel; its scale starts at the adaptive sigma (correspondences up to
    3 sigma, as KISS-ICP) and, once the update is below a tenth of ``min_kernel_scale_m`` (default
    ``voxel / 10``), drops to that floor for the final iterations. ``deskew``: undo the motion during the
    sweep when per-point timestamps are given."""

    max_range_m: float = 100.0
    min_range_m: float = 0.0
    voxel_size_m: float | None = None
    max_points_per_voxel: int = 20
    initial_threshold_m: float = 2.0
    min_motion_m: float = 0.1
    max_iterations: int = 50
    convergence: float = 1e-3
    kernel: str = "geman_mcclure"
    min_kernel_scale_m: float | None = None
    deskew: bool = True

    def __post_init__(self):
        _positive("max_range_m", self.max_range_m)
        if _non_negative("min_range_m", self.min_range_m) >= self.max_range_m:
            raise InvalidArgument("min_range_m: must be below max_range_m")
        if self.voxel_size_m is not None:
            _positive("voxel_size_m", self.voxel_size_m)
        _int_at_least("max_points_per_voxel", self.max_points_per_voxel, 1)
        _positive("initial_threshold_m", self.initial_threshold_m)
        _non_negative("min_motion_m", self.min_motion_m)
        _int_at_least("max_iterations", self.max_iterations, 1)
        _non_negative("convergence", self.convergence)
        _kernel_name(self.kernel)
        if self.min_kernel_scale_m is not None:
            _positive("min_kernel_scale_m", self.min_kernel_scale_m)

    @property
    def voxel_size(self) -> float:
        return self.max_range_m / 100.0 if self.voxel_size_m is None else float(self.voxel_size_m)

    @property
    def min_kernel_scale(self) -> float:
        return self.voxel_size / 10.0 if self.min_kernel_scale_m is None else float(self.min_kernel_scale_m)


def deskew(points: torch.Tensor, timestamps: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Motion-compensate a sweep: point ``i`` (float32 ``[N, 3]``) stamped ``timestamps[i]`` moves by
    ``exp((s_i - 1) log(delta))`` with ``s`` the stamps normalised to [0, 1] and ``delta`` (float64
    ``[4, 4]``) the motion over the last sweep: every point is expressed in the sensor frame at the end of
    the sweep, assuming constant velocity."""
    t = timestamps.to(torch.float64)
    t0, t1 = t.min(), t.max()
    if float(t1 - t0) <= 0:
        return points
    s = (t - t0) / (t1 - t0)
    xi = se3_log(delta.to(torch.float64)).to(t.device)
    T = se3_exp((s - 1)[:, None] * xi[None, :])
    p = points.to(torch.float64)
    return ((T[:, :3, :3] @ p[..., None])[..., 0] + T[:, :3, 3]).to(points.dtype)


class Odometry:
    """Scan-to-map LiDAR odometry: ``register_frame(points_sensor) -> T_world_sensor``.

    The first frame defines the world frame (``T_world_sensor`` = ``initial_pose``, default identity) unless
    it comes with a known pose. State: the local :class:`VoxelPointMap` (voxels within ``max_range_m`` of the
    last pose), the last pose and the last inter-frame motion (constant-velocity prior), the adaptive
    threshold. ``last_info`` holds the last frame's ICP statistics. :meth:`state_dict` /
    :meth:`load_state_dict` save and restore all of it (a restored odometry continues bit for bit on the
    same device).
    """

    def __init__(
        self,
        config: OdometryConfig | None = None,
        device: str | torch.device | None = None,
        initial_pose=None,
    ):
        self.config = OdometryConfig() if config is None else config
        if not isinstance(self.config, OdometryConfig):
            raise InvalidArgumentType(f"config: expected an OdometryConfig, got {type(config).__name__}")
        self.device = v.resolve_device(device)
        c = self.config
        self.map = VoxelPointMap(c.voxel_size, c.max_points_per_voxel, device=self.device)
        self.threshold = AdaptiveThreshold(c.initial_threshold_m, c.min_motion_m, c.max_range_m)
        pose = torch.eye(4, dtype=torch.float64) if initial_pose is None else initial_pose
        self.pose = check_pose("initial_pose", pose, _HOST)
        self.delta = torch.eye(4, dtype=torch.float64)
        self.frames = 0
        self.last_info: dict = {}

    def preprocess(self, points_sensor, timestamps=None) -> torch.Tensor:
        """Validated float32 ``[N, 3]`` points within ``(min_range_m, max_range_m)``, deskewed when enabled
        and ``timestamps`` (float ``[N]``) are given."""
        c = self.config
        pts = check_points("points_sensor", points_sensor, self.device)
        r = torch.linalg.vector_norm(pts, dim=1)
        ok = torch.isfinite(pts).all(1) & (r < c.max_range_m) & (r > max(c.min_range_m, 1e-6))
        if timestamps is not None:
            ts = v.as_tensor("timestamps", timestamps, self.device)
            if ts.dim() != 1 or ts.shape[0] != pts.shape[0] or not ts.is_floating_point():
                raise InvalidArgument(f"timestamps: expected float [{pts.shape[0]}], got {list(ts.shape)}")
            if c.deskew:
                return deskew(pts[ok], ts[ok], self.delta)
        return pts[ok]

    def register_frame(
        self, points_sensor, timestamps=None, *, pose=None, estimated: bool = False, accept=None
    ):
        """Estimate the pose of one sweep and add it to the local map.

        Args:
            points_sensor: float ``[N, 3]`` (or ``[N, 4]``) returns in the sensor frame.
            timestamps: optional float ``[N]`` per-point times (any unit/origin) for deskewing.
            pose: the sweep's ``T_world_sensor`` when it is known (another pose source in a mixed stream):
                ICP is skipped, the sweep enters the local map at that pose and the motion model follows
                it; the adaptive threshold learns only from estimated poses.
            estimated: ``pose`` is one this odometry estimated for this sweep before (a replayed log): the
                state then changes exactly as when it was estimated.
            accept: optional ``accept(T_world_sensor)``, called with the pose before the state changes; an
                exception it raises refuses the sweep and leaves the odometry as it was.
        Returns: ``T_world_sensor`` float64 ``[4, 4]`` on the CPU (poses stay on the host).
        """
        c = self.config
        vox = c.voxel_size
        # 1. range filter (+ deskew with the last motion when timestamps are given); the map gets the frame
        #    at vox / 2
        frame = voxel_downsample(self.preprocess(points_sensor, timestamps), 0.5 * vox)
        # 2. constant-velocity prediction
        prediction = self.pose @ self.delta
        if pose is None:
            # 3. robust point-to-plane ICP of a sparser source (1.5 vox) against the local map: pairs up to
            #    3 sigma (adaptive threshold), kernel scale sigma, narrowed to voxel / 10 once in the basin
            sigma = self.threshold.sigma
            pose, self.last_info = align(
                voxel_downsample(frame, 1.5 * vox),
                self.map,
                prediction,
                3.0 * sigma,
                sigma,
                kernel=c.kernel,
                max_iterations=c.max_iterations,
                convergence=c.convergence,
                min_kernel_scale_m=c.min_kernel_scale,
            )
            estimated = True
        else:
            pose = check_pose("pose", pose, _HOST)
            self.last_info = {}
        if accept is not None:  # nothing of the state has changed yet
            accept(pose)
        # 4. how far the estimate is from the prediction feeds the threshold
        if estimated and not self.map.empty():
            self.threshold.update(torch.linalg.inv(prediction) @ pose)
        # 5. map update: the registered frame in, voxels beyond max_range of the sensor out
        Rt = pose[:3].T.to(frame.device, torch.float32)  # [R^T; t^T]
        self.map.add_points(frame @ Rt[:3] + Rt[3])
        self.map.remove_far(pose[:3, 3], c.max_range_m)
        # 6. motion model: the last inter-frame motion predicts the next one
        if self.frames:
            self.delta = torch.linalg.inv(self.pose) @ pose
        self.pose = pose
        self.frames += 1
        return pose

    def state_dict(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON metadata) of the whole state; tensor names start with ``prefix``."""
        tensors = self.map.state_dict(prefix + "map.")
        tensors[prefix + "pose"] = self.pose
        tensors[prefix + "delta"] = self.delta
        meta = {
            "config": dataclasses.asdict(self.config),
            "frames": self.frames,
            "threshold": [self.threshold._sse, self.threshold._n],
        }
        return tensors, meta

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], meta: dict, prefix: str = "", device=None):
        """An odometry saved with :meth:`state_dict` (on ``device``, default CUDA when available)."""
        odo = cls(OdometryConfig(**meta["config"]), device=device)
        odo.map.load_state_dict(tensors, prefix + "map.")
        odo.pose = tensors[prefix + "pose"].to(_HOST, torch.float64)
        odo.delta = tensors[prefix + "delta"].to(_HOST, torch.float64)
        odo.frames = int(meta["frames"])
        odo.threshold._sse, odo.threshold._n = float(meta["threshold"][0]), int(meta["threshold"][1])
        return odo

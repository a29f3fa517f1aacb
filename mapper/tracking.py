"""LiDAR tracking for frames without a pose: the odometry state of one map (see :meth:`Map.track_lidar`).

Scans without a pose are registered (KISS-ICP-style robust point-to-plane ICP,
:class:`mapper.registration.Odometry`) against a local voxel point map kept on the map's device, from a
constant-velocity prediction. Tracking is off until the first such scan; until then only the last posed
scan is kept (points, pose, previous pose) to seed it, so that posed maps pay nothing.
"""

from __future__ import annotations

import torch

from .registration import Odometry, OdometryConfig

_HOST = torch.device("cpu")  # tracking poses live on the host (see mapper.registration)


class LidarTracker:
    """The tracking state of one map.

    Args:
        config: the odometry configuration.
        device: where the local registration map lives (the map's device).
    """

    def __init__(self, config: OdometryConfig, device: torch.device):
        self.config = config
        self.device = device
        self.odometry: Odometry | None = None
        # (float32 [N, 3] points on the device, float64 [4, 4] pose, previous pose or None), CPU poses
        self.last_posed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def track(
        self,
        points_sensor: torch.Tensor,
        T_world_sensor: torch.Tensor | None,
        estimated: bool = False,
        accept=None,
    ) -> tuple[torch.Tensor | None, dict | None]:
        """One scan (float32 ``[N, 3]`` on the device; its float64 ``[4, 4]`` CPU pose or None).

        The first pose-less scan of a tracker that has seen no posed scan gets the identity (it defines the
        world frame), else tracking starts from the last posed scan; once tracking runs, posed scans feed it
        too (mixed streams). ``estimated=True``: the pose is one this tracker estimated for this scan before
        (replaying a log), and the state changes exactly as it did then. ``accept``: ``accept(T)`` is called
        with the pose (the estimate for a scan without one) before the state changes; an exception it raises
        refuses the scan and leaves the tracker as it was (tracking not started by it either).

        Returns: (the pose, float64 ``[4, 4]`` CPU, or None while tracking is off and none was given; the
        ICP statistics when the pose was estimated here, else None).
        """
        before = (self.odometry, self.last_posed)
        if T_world_sensor is None or estimated:
            self.start()
        odo = self.odometry
        if odo is None:  # tracking is off: remember the last posed scan to seed it
            if accept is not None:
                accept(T_world_sensor)
            prev = None if self.last_posed is None else self.last_posed[1]
            self.last_posed = (points_sensor.clone(), T_world_sensor, prev)
            return T_world_sensor, None
        try:
            pose = odo.register_frame(
                points_sensor,
                pose=T_world_sensor,
                estimated=estimated,
                accept=accept,
            )
        except BaseException:
            if before[0] is None:  # the scan that started tracking was refused: tracking stays off
                self.odometry, self.last_posed = before
            raise
        return pose, (dict(odo.last_info) if T_world_sensor is None else None)

    def start(self) -> None:
        """Turn tracking on (from the last posed scan when there is one)."""
        if self.odometry is not None:
            return
        odo = Odometry(self.config, device=self.device)
        if self.last_posed is not None:
            pts, T, prev = self.last_posed
            if prev is not None:  # the motion model starts from the last two posed scans
                odo.pose, odo.frames = prev, 1
            odo.register_frame(pts, pose=T)
        self.odometry, self.last_posed = odo, None

    # ---------------------------------------------------------------------------------- persistence
    def state_dict(self, prefix: str = "tracking.") -> tuple[dict[str, torch.Tensor], dict | None]:
        """(tensors, JSON metadata or None): the odometry (local map, poses, threshold), or the last posed
        scan that seeds it."""
        if self.odometry is not None:
            return self.odometry.state_dict(prefix)
        tensors = {}
        if self.last_posed is not None:
            pts, T, prev = self.last_posed
            tensors = {f"{prefix}last_points": pts, f"{prefix}last_pose": T}
            if prev is not None:
                tensors[f"{prefix}prev_pose"] = prev
        return tensors, None

    def load_state_dict(
        self, tensors: dict[str, torch.Tensor], meta: dict | None, prefix="tracking."
    ) -> None:
        """Restore what :meth:`state_dict` saved (``meta``: its metadata, None when there was none)."""
        if meta is not None:
            self.odometry = Odometry.from_state_dict(tensors, meta, prefix, self.device)
        elif f"{prefix}last_points" in tensors:
            prev = tensors.get(f"{prefix}prev_pose")
            self.last_posed = (
                tensors[f"{prefix}last_points"].to(self.device, torch.float32),
                tensors[f"{prefix}last_pose"].to(_HOST, torch.float64),
                None if prev is None else prev.to(_HOST, torch.float64),
            )

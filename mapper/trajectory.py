"""The sensor trajectory of a map: the pose of every integrated frame and the map version after it."""

from __future__ import annotations

import torch

_HOST = torch.device("cpu")


class Trajectory:
    """Poses (float64 ``[4, 4]``, kept on the device they came on; moved to the host only when read) and
    the map version after each. Past ``limit`` poses the oldest are dropped (down to ``limit // 2``);
    ``start`` counts them, so frame indices stay stable."""

    def __init__(self):
        self.poses: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.start = 0

    def __len__(self) -> int:
        """Frames recorded since the map was created (dropped ones included)."""
        return self.start + len(self.poses)

    def copy(self) -> Trajectory:
        t = Trajectory()
        t.poses, t.versions, t.start = list(self.poses), list(self.versions), self.start
        return t

    def append(self, T_world_sensor: torch.Tensor, version: int, limit: int) -> None:
        self.poses.append(T_world_sensor.detach())
        self.versions.append(version)
        if len(self.poses) > limit:
            drop = len(self.poses) - limit // 2
            del self.poses[:drop], self.versions[:drop]
            self.start += drop

    def read(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(float64 ``[N, 4, 4]`` poses, int64 ``[N]`` versions, index of the first) from frame ``start`` on,
        CPU tensors."""
        first = max(start, self.start)
        i = first - self.start
        poses = self.poses[i:]
        T = (
            torch.stack([p.to(_HOST, torch.float64) for p in poses])
            if poses
            else torch.zeros(0, 4, 4).double()
        )
        versions = torch.tensor(self.versions[i:], dtype=torch.int64).reshape(-1)
        return T.to(torch.float64), versions, first

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """(``trajectory.poses`` / ``trajectory.versions`` tensors, the first index), or ({}, None) when
        empty."""
        if not self.poses:
            return {}, None
        poses, versions, start = self.read()
        return {"trajectory.poses": poses, "trajectory.versions": versions}, start

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], start: int) -> None:
        if "trajectory.poses" in tensors:
            self.poses = list(tensors["trajectory.poses"].to(_HOST, torch.float64).unbind(0))
            self.versions = [int(x) for x in tensors["trajectory.versions"].tolist()]
            self.start = int(start)

"""The integrators' contract: a sensor frame in, the bricks it updated out; and the queues of those bricks.

As nvblox's mapper (``integrateFrame(frame, pose, camera, layer, &updated_blocks)``): every integrator is
an object built from its configuration whose ``integrate(frame, layer, timer)`` fuses one frame into one
layer and returns the bricks it updated (int64 ``[B, 3]`` brick coordinates, ``voxel >> 2``, at the
layer's voxel). The map queues them for the consumers that must follow (the ESDF); the mesh follows the
layers' per-brick versions (``BrickLayer.changed_since``), which serve any number of readers.

Frames are plain tensors in world coordinates on the map's device, checked by the map beforehand:

* :class:`LidarFrame`: the sensor origin and the returns (float64);
* :class:`DepthFrame`: a depth image, its intrinsics, pose and optional colour.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .common import keys_to_ijk, voxel_keys

# pending queued rows past which a queue is merged into unique rows: a map whose ESDF is never read (lazy
# updates, a library user) would otherwise keep every frame's list
DIRTY_COMPACT_ROWS = 1 << 18


def no_timer(stage: str):
    """A stage timer that times nothing (``timer(stage)`` is a context manager)."""
    return nullcontext()


@dataclass
class LidarFrame:
    """One LiDAR scan in the world frame.

    Args:
        origin: float64 ``[3]`` sensor position (metres).
        points_world: float64 ``[N, 3]`` returns (finite, within the map's range of the origin).
    """

    origin: torch.Tensor
    points_world: torch.Tensor
    _rays: tuple | None = field(default=None, repr=False)

    def rays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(origin float64 ``[3]``, unit directions float64 ``[N, 3]``, ranges float64 ``[N]``): the rays
        ending in the returns (computed once per frame)."""
        if self._rays is None:
            d = self.points_world - self.origin
            rng = torch.linalg.vector_norm(d, dim=1)
            self._rays = (self.origin, d / rng[:, None], rng)
        return self._rays


@dataclass
class DepthFrame:
    """One depth image (OpenCV pinhole camera).

    Args:
        depth_m: float32 ``[H, W]`` depth along the optical axis (metres, 0 = no return).
        K: float64 ``[3, 3]`` intrinsics.
        T_world_sensor: float64 ``[4, 4]`` camera-to-world.
        color: optional uint8 ``[H, W, 3]`` RGB aligned with the depth.
        max_range_m: depths beyond this are ignored.
    """

    depth_m: torch.Tensor
    K: torch.Tensor
    T_world_sensor: torch.Tensor
    color: torch.Tensor | None
    max_range_m: float


class Integrator(Protocol):
    """What the map calls for every frame: fuse ``frame`` into ``layer``; return the bricks updated
    (int64 ``[B, 3]``, on the layer's device; duplicates allowed, empty when nothing changed)."""

    def integrate(self, frame: LidarFrame | DepthFrame, layer, timer=no_timer) -> torch.Tensor: ...


class BrickQueue:
    """Bricks (int64 ``[B, 3]`` parts, duplicates allowed) a consumer (the ESDF) must still process.

    :meth:`push` appends a part; :meth:`compact` merges the parts into one of unique rows once they hold
    more than ``DIRTY_COMPACT_ROWS`` rows and twice the rows of the last merge (its result is the first
    part): the pending rows stay within ~2x the distinct bricks, at an amortised O(1) per row.
    """

    def __init__(self, parts: list[torch.Tensor] | None = None):
        self.parts: list[torch.Tensor] = list(parts or [])

    def __bool__(self) -> bool:
        return bool(self.parts)

    def push(self, bricks: torch.Tensor) -> None:
        if bricks.numel():
            self.parts.append(bricks)

    def push_always(self, bricks: torch.Tensor) -> None:
        """Append even an empty part (an edit that must still wake the consumer)."""
        self.parts.append(bricks)

    def drain(self) -> list[torch.Tensor]:
        parts, self.parts = self.parts, []
        return parts

    def copy(self) -> BrickQueue:
        return BrickQueue(self.parts)

    def compact(self) -> None:
        parts = self.parts
        rows = sum(int(t.shape[0]) for t in parts)
        if rows <= max(DIRTY_COMPACT_ROWS, 2 * (int(parts[0].shape[0]) if parts else 0)):
            return
        self.parts = [keys_to_ijk(torch.unique(voxel_keys(torch.cat(parts))))]

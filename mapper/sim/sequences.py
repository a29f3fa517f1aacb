"""Frame generators for benchmarks (frames are made on the target device, nothing is shipped)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .._validation import resolve_device
from .factories import indoor_scene, outdoor_scene
from .sensors import PinholeCamera, SpinningLidar
from .trajectories import driving_trajectory, orbit_trajectory


def lidar_sequence(
    n_frames: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    *,
    lidar: SpinningLidar | None = None,
    extent_m: float = 600.0,
    speed_mps: float = 10.0,
    hz: float = 10.0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields ``(points_sensor float32 [N, 3], T_world_sensor float64 [4, 4])`` on ``device`` for a drive
    through ``outdoor_scene(seed, extent_m)``; one noise generator (seeded with ``seed``) for the sequence."""
    lidar = SpinningLidar() if lidar is None else lidar
    dev = resolve_device(device, torch.device("cpu"))
    scene = outdoor_scene(seed, extent_m, device=dev)
    poses = driving_trajectory(n_frames, scene=scene, speed_mps=speed_mps, hz=hz, seed=seed).to(dev)
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    for T in poses:
        yield lidar.scan(scene, T, generator=gen), T


def depth_sequence(
    n_frames: int,
    camera: PinholeCamera | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    *,
    max_range_m: float = 10.0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yields ``(depth_m float32 [H, W], K float64 [3, 3], T_world_sensor float64 [4, 4])`` on ``device``
    for an orbit in ``indoor_scene(seed)``, rendered with ``camera`` (default
    :meth:`PinholeCamera.replica`)."""
    camera = PinholeCamera.replica() if camera is None else camera
    dev = resolve_device(device, torch.device("cpu"))
    scene = indoor_scene(seed, device=dev)
    poses = orbit_trajectory(n_frames, scene=scene, seed=seed).to(dev)
    K = camera.K.to(dev)
    for T in poses:
        yield camera.render_depth(scene, T, max_range_m), K, T

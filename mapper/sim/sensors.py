"""Simulated sensors: a :class:`PinholeCamera` (depth images) and a :class:`SpinningLidar` (point scans)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validation import resolve_device
from ..errors import InvalidArgument, InvalidArgumentType
from .checks import _check_pose, _count, _max_range, _positive, _vec
from .scene import Scene


@dataclass(frozen=True)
class PinholeCamera:
    """Pinhole depth camera, OpenCV axes (x right, y down, z forward), intrinsics in pixels."""

    width: int
    height: int
    fx: float
    fy: float
    cx: float
    cy: float

    def __post_init__(self):
        object.__setattr__(self, "width", _count("width", self.width))
        object.__setattr__(self, "height", _count("height", self.height))
        object.__setattr__(self, "fx", _positive("fx", self.fx))
        object.__setattr__(self, "fy", _positive("fy", self.fy))
        cx, cy = _vec("cx, cy", (self.cx, self.cy), 2)
        object.__setattr__(self, "cx", cx)
        object.__setattr__(self, "cy", cy)

    @classmethod
    def replica(cls) -> PinholeCamera:
        """The Replica office0 camera of the NICE-SLAM renderings (1200 x 680, 90 degree horizontal FOV)."""
        return cls(1200, 680, 600.0, 600.0, 599.5, 339.5)

    @classmethod
    def kinect(cls) -> PinholeCamera:
        """Kinect-v1-like camera, 640 x 480."""
        return cls(640, 480, 570.3422, 570.3422, 320.0, 240.0)

    @property
    def K(self) -> torch.Tensor:
        """Intrinsic matrix, float64 ``[3, 3]`` on the CPU."""
        return torch.tensor(
            [[self.fx, 0.0, self.cx], [0.0, self.fy, self.cy], [0.0, 0.0, 1.0]], dtype=torch.float64
        )

    def rays_sensor(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Unit ray directions ``[H * W, 3]`` (camera frame), row-major: index ``v * W + u``."""
        dev = resolve_device(device, torch.device("cpu"))
        v, u = torch.meshgrid(
            torch.arange(self.height, dtype=torch.float64, device=dev),
            torch.arange(self.width, dtype=torch.float64, device=dev),
            indexing="ij",
        )
        r = torch.stack([(u - self.cx) / self.fx, (v - self.cy) / self.fy, torch.ones_like(u)], -1)
        r = r.reshape(-1, 3)
        return (r / torch.linalg.vector_norm(r, dim=1, keepdim=True)).to(dtype)

    def render_depth(self, scene: Scene, T_world_sensor, max_range_m: float = 10.0) -> torch.Tensor:
        """Z-depth image ``depth_m`` float32 ``[H, W]`` on ``scene.device`` (0 = no surface, or z-depth
        beyond ``max_range_m``), for the camera at ``T_world_sensor`` (float ``[4, 4]``, camera-to-world)."""
        if not isinstance(scene, Scene):
            raise InvalidArgumentType(f"scene: expected a Scene, got {type(scene).__name__}")
        max_range = _max_range("max_range_m", max_range_m)
        T = _check_pose("T_world_sensor", T_world_sensor, scene.device)
        rays = self.rays_sensor(scene.device, torch.float64)
        dirs_world = rays @ T[:3, :3].T
        # z-depth <= max_range means ray length <= max_range / cos(angle to the optical axis)
        t = scene.raycast(T[:3, 3], dirs_world, max_range / float(rays[:, 2].min()))
        z = t * rays[:, 2]
        z = torch.where(torch.isfinite(z) & (z <= max_range), z, 0.0)
        return z.to(torch.float32).reshape(self.height, self.width)


@dataclass(frozen=True)
class SpinningLidar:
    """Spinning multi-beam LiDAR (HDL-64-like defaults). Sensor frame: x forward, y left, z up.

    Beams at elevations ``linspace(fov_up_deg, fov_down_deg, n_beams)``; azimuths ``2 pi j / n_azimuth``
    counter-clockwise from +x. 64 x 1875 = 120 000 rays per scan. ``range_noise_std_m`` adds Gaussian
    noise along each ray; ``dropout_prob`` drops returns at random; both draw from the generator given to
    :meth:`scan`, or from one seeded with ``seed``.
    """

    n_beams: int = 64
    n_azimuth: int = 1875
    fov_up_deg: float = 2.0
    fov_down_deg: float = -24.8
    max_range_m: float = 60.0
    range_noise_std_m: float = 0.0
    dropout_prob: float = 0.0
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "n_beams", _count("n_beams", self.n_beams))
        object.__setattr__(self, "n_azimuth", _count("n_azimuth", self.n_azimuth))
        up, down = _vec("fov_up_deg, fov_down_deg", (self.fov_up_deg, self.fov_down_deg), 2)
        if not (-90 <= down <= up <= 90) or (up == down and self.n_beams > 1):
            raise InvalidArgument(f"fov: need -90 <= fov_down_deg < fov_up_deg <= 90, got {down}, {up}")
        object.__setattr__(self, "max_range_m", _positive("max_range_m", self.max_range_m))
        sigma = float(self.range_noise_std_m)
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise InvalidArgument(f"range_noise_std_m: expected a finite value >= 0, got {sigma}")
        p = float(self.dropout_prob)
        if not 0 <= p < 1:
            raise InvalidArgument(f"dropout_prob: expected a value in [0, 1), got {p}")

    @property
    def n_rays(self) -> int:
        return self.n_beams * self.n_azimuth

    def elevations_rad(self) -> torch.Tensor:
        """Beam elevations, float64 ``[n_beams]``, from ``fov_up_deg`` down to ``fov_down_deg``."""
        return torch.deg2rad(
            torch.linspace(self.fov_up_deg, self.fov_down_deg, self.n_beams, dtype=torch.float64)
        )

    def rays_sensor(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Unit directions ``[n_azimuth * n_beams, 3]`` in firing order (azimuth-major: index
        ``j * n_beams + b``)."""
        dev = resolve_device(device, torch.device("cpu"))
        el = self.elevations_rad().to(dev)
        az = torch.arange(self.n_azimuth, dtype=torch.float64, device=dev) * (2 * math.pi / self.n_azimuth)
        az, el = torch.meshgrid(az, el, indexing="ij")
        d = torch.stack([el.cos() * az.cos(), el.cos() * az.sin(), el.sin()], -1).reshape(-1, 3)
        return d.to(dtype)

    def scan(
        self,
        scene: Scene,
        T_world_sensor,
        *,
        return_misses: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One sweep from the pose ``T_world_sensor`` (float ``[4, 4]``, sensor-to-world).

        Returns ``points_sensor`` float32 ``[N, 3]`` on ``scene.device`` (returns within ``max_range_m``, in
        firing order), and with ``return_misses=True`` also ``miss_dirs_sensor`` float32 ``[K, 3]``: unit
        directions of the rays without a return (nothing in range, or dropped); ``N + K = n_rays``.
        ``generator`` (on the scene's device) drives noise and dropout; pass one to get different noise in
        every frame of a sequence.
        """
        if not isinstance(scene, Scene):
            raise InvalidArgumentType(f"scene: expected a Scene, got {type(scene).__name__}")
        T = _check_pose("T_world_sensor", T_world_sensor, scene.device)
        rays = self.rays_sensor(scene.device, torch.float64)
        t = scene.raycast(T[:3, 3], rays @ T[:3, :3].T, self.max_range_m)
        noisy = self.range_noise_std_m > 0 or self.dropout_prob > 0
        if noisy and generator is None:
            generator = torch.Generator(device=scene.device).manual_seed(self.seed)
        if self.range_noise_std_m > 0:
            n = torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float64)
            t = t + self.range_noise_std_m * n
        ok = torch.isfinite(t) & (t > 0) & (t <= self.max_range_m)
        if self.dropout_prob > 0:
            u = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float64)
            ok &= u >= self.dropout_prob
        points = (rays[ok] * t[ok, None]).to(torch.float32)
        if return_misses:
            return points, rays[~ok].to(torch.float32)
        return points

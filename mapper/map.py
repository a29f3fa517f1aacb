"""``Map``: fuses depth images and LiDAR scans into sparse layers (TSDF + colour, occupancy, ESDF).

Every layer is a :class:`~mapper.layers.BrickLayer`; each frame runs the same recipe per layer:
grow (bricks touched by the observation) -> merge (new grid epoch) -> inject (slot table) -> update.
See ``mapper/integrators`` for the per-layer semantics and NOTES.md for the design.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager

import torch

from . import _validation as v
from . import queries as Q
from .errors import InvalidArgument, InvalidArgumentType, NotFound, RequestTooLarge
from .grid import IndexGrid
from .integrators import free as free_space
from .integrators import occupancy as occ
from .integrators import tsdf
from .integrators.common import (
    KEY_LIMIT,
    check_color,
    check_depth,
    check_intrinsics,
    check_points,
    check_pose,
    keys_to_ijk,
    voxel_keys,
)
from .integrators.free import free_fields
from .kernels.dispatch import use_triton
from .layers import BrickLayer, brick_offsets
from .mesh import Mesh, extract_mesh, mesh_since
from .registration import Odometry, OdometryConfig
from .sharding import ShardSpec

LAYERS = ("tsdf", "color", "occupancy", "esdf")
# pending dirty-brick rows (frames since the last ESDF update) past which they are merged into unique rows:
# a map whose ESDF is never read (lazy updates, a library user) would otherwise keep every frame's list
DIRTY_COMPACT_ROWS = 1 << 18
# points per chunk of a point query (bounds its temporaries: ~1.2 KB per point in one piece on the CPU torch
# path, so a 16 M-cell slice needed ~20 GB; chunked, a query costs its outputs plus one chunk's working set)
QUERY_CHUNK = {"cpu": 1 << 15, "cuda": 1 << 20}
_HOST = torch.device("cpu")  # tracking poses live on the host (see mapper.registration)
MAX_TRAJECTORY = 100_000  # sensor poses kept per map (the oldest half is dropped beyond)


class _StageTimer:
    """Per-stage wall times of the last frame. On CUDA, events are recorded without synchronising and
    resolved when ``stats()`` asks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: dict[str, list] = {}
        self.last: dict[str, float] = {}

    def reset(self) -> None:
        self.pending = {}

    @contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            try:
                yield
            finally:
                b.record()
                self.pending.setdefault(stage, []).append((a, b))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.last[stage] = self.last.get(stage, 0.0) + (time.perf_counter() - t0) * 1e3

    def begin_frame(self) -> None:
        self.pending = {}
        self.last = {}

    def resolve(self) -> dict[str, float]:
        if self.cuda and self.pending:
            torch.cuda.synchronize()
            self.last = {k: sum(a.elapsed_time(b) for a, b in pairs) for k, pairs in self.pending.items()}
            self.pending = {}
        return dict(self.last)


def _positive(name: str, x, allow_none: bool = False) -> float | None:
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x <= 0:
        raise InvalidArgument(f"{name}: expected a finite value > 0, got {x}")
    return float(x)


class Map:
    """A sparse multi-layer map.

    Args:
        voxel_size_m: edge of a voxel in metres (all layers).
        layers: any of ``"tsdf"``, ``"color"`` (needs tsdf), ``"occupancy"``, ``"esdf"`` (needs tsdf or
            occupancy for its surface sites).
        device: ``"cpu"``, ``"cuda"``, or None (CUDA when available).
        truncation_vox: TSDF truncation distance in voxels.
        esdf_max_distance_m: distances beyond this are reported as this value.
        esdf_voxel_size_m: the ESDF's own voxel edge (metres), ``>= voxel_size_m``; None: ``max(voxel_size_m,
            0.05)``. Distances are measured to the fine TSDF's sub-voxel surface points either way.
        max_range_m: returns beyond this range are dropped before anything is allocated.
        tsdf_max_weight, tsdf_obs_weight: weight cap and per-observation weight of the running average.
        occupancy: optional dict of ``OccupancyConfig`` fields (``l_hit``, ``l_miss``, ``clamp_min``, ...).
        registration: optional dict of ``mapper.registration.OdometryConfig`` fields for LiDAR frames
            without a pose (``max_range_m`` defaults to the map's; voxel ``max_range_m / 100``).
        keep_radius_m: optional radius policy (bounded memory, like nvblox's radius clearing): after each
            frame, the bricks lying wholly farther than this from the frame's sensor origin are freed in
            every layer. Deterministic (a function of the frames), so a replayed log gives the same map.
        shard: optional ``mapper.sharding.ShardSpec`` (or its dict): this map is one shard of a sharded
            map; after each frame it frees the bricks wholly outside the halo of the blocks it owns (like the
            radius policy: deterministic, so a replayed log gives the same shard). None: an ordinary map.
        warmup: on CUDA, compile every Triton kernel this configuration uses now (once per configuration
            per process, see :mod:`mapper.warmup`), not on the first frames. Not part of :meth:`config`.
    """

    def __init__(
        self,
        voxel_size_m: float,
        layers=("tsdf", "esdf"),
        device: str | torch.device | None = None,
        truncation_vox: float = 3.0,
        esdf_max_distance_m: float = 2.0,
        max_range_m: float = 100.0,
        tsdf_max_weight: float = 100.0,
        tsdf_obs_weight: float = 1.0,
        occupancy: dict | None = None,
        registration: dict | None = None,
        keep_radius_m: float | None = None,
        esdf_voxel_size_m: float | None = None,
        shard: dict | None = None,
        warmup: bool = True,
    ):
        self.voxel_size_m = _positive("voxel_size_m", voxel_size_m)
        self.shard = None if shard is None else ShardSpec.from_dict(shard)
        self.keep_radius_m = _positive("keep_radius_m", keep_radius_m, allow_none=True)
        if esdf_voxel_size_m is None:
            esdf_voxel_size_m = max(self.voxel_size_m, 0.05)
        self.esdf_voxel_size_m = _positive("esdf_voxel_size_m", esdf_voxel_size_m)
        if self.esdf_voxel_size_m < self.voxel_size_m:
            raise InvalidArgument(
                f"esdf_voxel_size_m: expected a value >= voxel_size_m ({self.voxel_size_m}), "
                f"got {esdf_voxel_size_m}"
            )
        if isinstance(layers, str):
            layers = (layers,)
        layers = tuple(layers)
        for name in layers:
            if name not in LAYERS:
                raise InvalidArgument(f"layers: unknown layer {name!r}; expected some of {LAYERS}")
        if "color" in layers and "tsdf" not in layers:
            raise InvalidArgument("layers: 'color' needs 'tsdf'")
        if "esdf" in layers and not ({"tsdf", "occupancy"} & set(layers)):
            raise InvalidArgument("layers: 'esdf' needs 'tsdf' or 'occupancy' for its surface")
        self.layers = layers
        self.device = v.resolve_device(device)
        self.max_range_m = _positive("max_range_m", max_range_m)
        self.esdf_max_distance_m = _positive("esdf_max_distance_m", esdf_max_distance_m)
        self.tsdf_config = tsdf.TsdfConfig(
            self.voxel_size_m,
            _positive("truncation_vox", truncation_vox),
            _positive("tsdf_obs_weight", tsdf_obs_weight),
            _positive("tsdf_max_weight", tsdf_max_weight),
            with_color="color" in layers,
        )
        try:
            self.occupancy_config = occ.OccupancyConfig(self.voxel_size_m, **(occupancy or {}))
        except TypeError as e:
            raise InvalidArgument(f"occupancy: {e}") from None
        self._tsdf = BrickLayer(tsdf.tsdf_fields(self.tsdf_config), self.device) if "tsdf" in layers else None
        self._occ = BrickLayer(occ.occupancy_fields(), self.device) if "occupancy" in layers else None
        if registration is not None and not isinstance(registration, dict):
            raise InvalidArgumentType(f"registration: expected a dict, got {type(registration).__name__}")
        self._registration = dict(registration or {})
        try:
            cfg = {"max_range_m": self.max_range_m, **self._registration}
            self.registration_config = OdometryConfig(**cfg)
        except (TypeError, InvalidArgument) as e:
            raise InvalidArgument(f"registration: {e}") from None
        # LiDAR tracking (frames without a pose): off until the first such frame; until then only the last
        # posed frame is kept (points, pose, previous pose) to seed it, so that posed maps pay nothing
        self._odometry: Odometry | None = None
        self._last_posed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._esdf = None
        self._free = None  # observed free space at the ESDF's resolution (see mapper.integrators.free)
        if "esdf" in layers:
            from .integrators.esdf import EsdfIntegrator

            self._esdf = EsdfIntegrator(
                self.esdf_voxel_size_m,
                self.esdf_max_distance_m,
                self.device,
                source_voxel_size_m=self.voxel_size_m,
            )
            if self._occ is None or not self._esdf.same_lattice:
                self._free = BrickLayer(free_fields(), self.device)
        self.frames_integrated = 0
        self.version = 0
        self._timer = _StageTimer(self.device)
        self._dirty_bricks: list[torch.Tensor] = []
        # the sensor trajectory: the pose of every integrated frame (float64 [4, 4], on the device it came
        # on; moved to the host only when read) and the map version after it; the oldest are dropped past
        # MAX_TRAJECTORY poses (``_trajectory_start`` counts them, so indices stay stable)
        self._poses: list[torch.Tensor] = []
        self._pose_versions: list[int] = []
        self._trajectory_start = 0
        self._dirty_free: list[torch.Tensor] = []  # ESDF bricks whose free-record state changed
        self.read_only = False  # a read_view(): queries only
        if warmup and self.device.type == "cuda":
            from .warmup import warm_up

            warm_up(self.config(), self.device)

    def read_view(self) -> Map:
        """A read-only version of the map as it is now, for readers on other threads while this map keeps
        integrating (the service publishes one per batch). O(layers + pages) to make: it shares the layers'
        immutable index grids and their pool pages; later writes to this map copy the pages and tables they
        change first (``PagedPool.freeze``), so the view answers every query (distances, slices, boxes,
        meshes, layers, trajectory, stats) for this ``version`` for as long as it is referenced. Its ESDF is
        as of now (``update_esdf()`` first for a fresh one); a view never updates it and cannot integrate."""
        v = copy.copy(self)
        v.read_only = True
        for name in ("_tsdf", "_occ", "_free"):
            layer = getattr(self, name)
            if layer is not None:
                setattr(v, name, layer.frozen())
        if self._esdf is not None:
            v._esdf = copy.copy(self._esdf)
            v._esdf.layer = self._esdf.layer.frozen()
            v._esdf.last = dict(self._esdf.last)
        v._odometry, v._last_posed = None, None  # tracking state: the writer's alone
        v._poses, v._pose_versions = list(self._poses), list(self._pose_versions)
        v._dirty_bricks, v._dirty_free = list(self._dirty_bricks), list(self._dirty_free)
        v._timer = _StageTimer(torch.device("cpu"))
        v._timer.last = dict(self._timer.last)
        return v

    def _writable(self) -> None:
        if self.read_only:
            raise RuntimeError("Map: this is a read_view(); it cannot integrate or update the ESDF")

    # ----------------------------------------------------------------------------------- integration
    def _begin(self):
        self._writable()
        self._timer.begin_frame()

    def _end(self, touched: list[torch.Tensor], T_world_sensor: torch.Tensor | None = None) -> None:
        self.frames_integrated += 1
        self.version += 1
        if T_world_sensor is not None:
            self._poses.append(T_world_sensor.detach())
            self._pose_versions.append(self.version)
            if len(self._poses) > MAX_TRAJECTORY:
                drop = len(self._poses) - MAX_TRAJECTORY // 2
                del self._poses[:drop], self._pose_versions[:drop]
                self._trajectory_start += drop
        if self._esdf is not None:
            self._dirty_bricks.extend(t for t in touched if t.numel())
            self._dirty_bricks = _compact_dirty(self._dirty_bricks)
            self._dirty_free = _compact_dirty(self._dirty_free)

    def integrate_lidar(
        self, points_sensor, T_world_sensor=None, *, estimated: bool = False, track: bool = True
    ) -> dict:
        """Fuse one LiDAR scan; without a pose, register it first (scan-to-map ICP, see :meth:`track_lidar`).

        Args:
            points_sensor: ``[N, 3]`` (or ``[N, 4]`` with intensity) float returns in the sensor frame.
            T_world_sensor: ``[4, 4]`` sensor-to-world transform (the sensor origin is its translation), or
                None: the map estimates it against its local registration map.
            estimated, track: passed to :meth:`track_lidar` (``track=False`` skips it: the caller already
                tracked this scan, as the service does before logging it; it then needs the pose).
        Returns: ``{"points_used", "points_dropped", "T_world_sensor"}`` with the pose used as a float64
            ``[4, 4]`` CPU tensor, plus ``"registration"`` (ICP statistics: ``iterations``, ``converged``,
            ``fitness``, ``rmse_m``, ...) when the pose was estimated here.
        """
        pts = check_points("points_sensor", points_sensor, self.device)
        self._begin()
        info = None
        if track:
            with self._timer("registration"):
                T_world_sensor, info = self.track_lidar(pts, T_world_sensor, estimated=estimated)
        elif T_world_sensor is None:
            raise InvalidArgument("T_world_sensor: required when track=False")
        T_host = self.check_sensor_pose(T_world_sensor).clone()  # returned as is: no copy back
        T = T_host.to(self.device)
        r = torch.linalg.vector_norm(pts, dim=1)
        ok = torch.isfinite(pts).all(dim=1) & (r > 1e-6) & (r <= self.max_range_m)
        pts = pts[ok].to(torch.float64)
        used = int(pts.shape[0])
        touched = []
        if used:
            world = pts @ T[:3, :3].T + T[:3, 3]
            origin = T[:3, 3]
            if self._tsdf is not None:
                tsdf.integrate_lidar(self._tsdf, origin, world, self.tsdf_config, self._timer)
                touched.append(self._last_bricks(self._tsdf))
            if self._occ is not None or self._free is not None:
                d = world - origin
                rng = torch.linalg.vector_norm(d, dim=1)
                dirs = d / rng[:, None]
            if self._occ is not None:
                touched.append(self._carve(origin, dirs, rng))
            if self._free is not None:
                self._walk_free(origin, dirs, rng)
        cleared = self._keep_radius(T[:3, 3])
        self._keep_shard()
        self._end(touched, T_host)
        out = {"points_used": used, "points_dropped": int(ok.numel() - used), "T_world_sensor": T_host}
        if cleared is not None:
            out["bricks_cleared"] = cleared
        if info is not None:
            out["registration"] = info
        return out

    def track_lidar(self, points_sensor, T_world_sensor=None, *, estimated: bool = False):
        """The LiDAR tracking step of :meth:`integrate_lidar` alone (no layer changes).

        Without a pose, the scan is registered (KISS-ICP-style robust point-to-plane ICP, see
        ``mapper.registration.Odometry``) against a local voxel point map kept on the map's device, from a
        constant-velocity prediction; the first pose-less scan of a map that has seen no posed LiDAR scan
        gets the identity (it defines the world frame), else tracking starts from the last posed scan.
        Once tracking runs, posed scans feed it too (mixed streams); before that only the last posed scan
        is kept. ``estimated=True``: ``T_world_sensor`` is a pose this map estimated for this scan before
        (replaying a log), and the tracking state changes exactly as it did then.

        Returns: ``(T_world_sensor float64 [4, 4] on the CPU, ICP info dict or None)``.
        """
        pts = check_points("points_sensor", points_sensor, self.device)
        T = None if T_world_sensor is None else check_pose("T_world_sensor", T_world_sensor, _HOST)
        if T is None or estimated:
            self._start_tracking()
        odo = self._odometry
        if odo is None:  # tracking is off: remember the last posed scan to seed it
            prev = None if self._last_posed is None else self._last_posed[1]
            self._last_posed = (pts.clone(), T, prev)
            return T, None
        pose = odo.register_frame(pts, pose=T, estimated=estimated)
        return pose, (dict(odo.last_info) if T is None else None)

    def _start_tracking(self) -> None:
        if self._odometry is not None:
            return
        odo = Odometry(self.registration_config, device=self.device)
        if self._last_posed is not None:
            pts, T, prev = self._last_posed
            if prev is not None:  # the motion model starts from the last two posed scans
                odo.pose, odo.frames = prev, 1
            odo.register_frame(pts, pose=T)
        self._odometry, self._last_posed = odo, None

    def integrate_depth(self, depth_m, K, T_world_sensor, color=None) -> dict:
        """Fuse one depth image.

        Args:
            depth_m: ``[H, W]`` float depth in metres along the optical axis, 0 = no return.
            K: ``[3, 3]`` pinhole intrinsics (or ``[fx, fy, cx, cy]``).
            T_world_sensor: ``[4, 4]`` camera-to-world, OpenCV axes (x right, y down, z forward).
            color: optional ``[H, W, 3]`` uint8 RGB aligned with the depth (needs the "color" layer).
        Returns: ``{"points_used", "points_dropped"}`` (pixels).
        """
        T = self._check_sensor_pose(T_world_sensor)
        depth = check_depth("depth_m", depth_m, self.device)
        Kt = check_intrinsics("K", K, self.device, tuple(depth.shape))
        col = None
        if color is not None:
            col = check_color("color", color, tuple(depth.shape), self.device)
        d = depth.reshape(-1)
        ok = torch.isfinite(d) & (d > 0) & (d <= self.max_range_m)
        used = int(ok.sum())
        self._begin()
        touched = []
        if used:
            if self._tsdf is not None:
                tsdf.integrate_depth(
                    self._tsdf, depth, Kt, T, col, self.tsdf_config, self.max_range_m, self._timer
                )
                touched.append(self._last_bricks(self._tsdf))
            if self._occ is not None:
                _, origin, dirs, rng = tsdf.pixel_rays(depth, Kt, T, self.max_range_m)
                touched.append(self._carve(origin, dirs, rng))
            if self._free is not None:
                with self._timer("free"):
                    # free_space.depth_stride computed on the device (the same float64 arithmetic; no
                    # host sync): every st-th pixel of every st-th row
                    z_max = torch.where(ok, d, torch.zeros_like(d)).max().to(torch.float64)
                    f_min = Kt[:2, :2].diagonal().min()
                    st = (
                        torch.floor(0.5 * self.esdf_voxel_size_m * f_min / z_max).clamp(min=1).to(torch.int64)
                    )
                    h, w = depth.shape
                    rows = torch.arange(h, device=self.device)[:, None] % st == 0
                    sub = rows & (torch.arange(w, device=self.device)[None, :] % st == 0)
                    sparse = torch.where(sub, depth, torch.zeros_like(depth))
                    _, origin, dirs, rng = tsdf.pixel_rays(sparse, Kt, T, self.max_range_m)
                    self._walk_free(origin, dirs, rng)
        cleared = self._keep_radius(T[:3, 3])
        self._keep_shard()
        self._end(touched, T)
        out = {"points_used": used, "points_dropped": int(d.numel() - used)}
        if cleared is not None:
            out["bricks_cleared"] = cleared
        return out

    def _keep_radius(self, origin: torch.Tensor) -> int | None:
        """The radius policy: free the bricks lying wholly outside ``keep_radius_m`` of ``origin`` (float64
        [3]) in every source layer (the ESDF follows on its next update); the number freed, or None when
        the map has no policy."""
        if self.keep_radius_m is None:
            return None
        c = origin.to(self.device, torch.float64)
        n = 0
        for name, layer in self._brick_layers():
            if layer.num_bricks == 0:
                continue
            bm = 4 * self._layer_voxel_m(name)  # the free record has the ESDF's voxel
            bricks, _ = layer.brick_table()
            lo = bricks.to(torch.float64) * bm
            near = torch.minimum(torch.maximum(c, lo), lo + bm)  # the brick's point nearest to the origin
            far = torch.linalg.vector_norm(near - c, dim=1) > self.keep_radius_m
            n += self._free_bricks(layer, bricks, far, name)
        return n

    def _keep_shard(self) -> None:
        """A shard (``shard``): free the bricks of every source layer lying wholly outside the halo of its own
        blocks (the ESDF follows on its next update)."""
        if self.shard is None:
            return
        for name, layer in self._brick_layers():
            if layer.num_bricks == 0:
                continue
            bricks, _ = layer.brick_table()
            keep = self.shard.keep_bricks(bricks, 4 * self._layer_voxel_m(name), self.voxel_size_m)
            self._free_bricks(layer, bricks, ~keep, name)

    @property
    def coordinate_limit_m(self) -> float:
        """Map coordinates reach ``+-coordinate_limit_m`` per axis (the integrators' keys hold voxel
        coordinates within ``+-2^20``, NOTES.md); a sensor outside cannot add anything."""
        return (KEY_LIMIT - 8) * self.voxel_size_m

    def check_sensor_pose(self, T_world_sensor) -> torch.Tensor:
        """A rigid ``[4, 4]`` transform whose translation lies inside the map's coordinate range
        (``coordinate_limit_m``) -> float64 ``[4, 4]`` on the CPU; raises ``InvalidArgument`` otherwise.
        The service runs this before it logs a frame."""
        T = check_pose("T_world_sensor", T_world_sensor, _HOST)  # checked on the host: no device sync
        v.check_translation(
            "T_world_sensor",
            T[:3, 3].tolist(),
            self.coordinate_limit_m,
            f"the map's coordinate range: 2^20 voxels of {self.voxel_size_m:g} m",
        )
        return T

    def _check_sensor_pose(self, T_world_sensor) -> torch.Tensor:
        return self.check_sensor_pose(T_world_sensor).to(self.device)

    def _carve(self, origin: torch.Tensor, dirs: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
        """Occupancy update for rays that all end in a return; the bricks it touched."""
        hit = torch.ones_like(rng, dtype=torch.bool)
        occ.integrate_rays(self._occ, origin, dirs, rng, hit, self.occupancy_config, self._timer)
        return self._last_bricks(self._occ)

    def _walk_free(self, origin: torch.Tensor, dirs: torch.Tensor, rng: torch.Tensor) -> None:
        """Record the free space of rays ending in a return at ``rng`` (see mapper.integrators.free)."""
        tau = self.tsdf_config.tau if self._tsdf is not None else 0.0
        gap = free_space.free_gap(tau, self.esdf_voxel_size_m)
        new = free_space.integrate_free(self._free, origin, dirs, rng - gap, self.esdf_voxel_size_m)
        if new.numel():
            self._dirty_free.append(new)

    def _last_bricks(self, layer: BrickLayer) -> torch.Tensor:
        """Bricks touched by the last allocate (recorded by the layer)."""
        return layer.last_bricks

    # ------------------------------------------------------------------------------------------ ESDF
    def update_esdf(self) -> dict:
        """Bring the ESDF up to date with the surface; recomputes only the region the frames since the
        last call could change (nothing when nothing changed)."""
        if self._esdf is None:
            raise NotFound("layer 'esdf' is not enabled on this map")
        self._writable()
        dirty, dirty_free = self._dirty_bricks, self._dirty_free
        self._dirty_bricks, self._dirty_free = [], []
        with self._timer("esdf"):
            return self._esdf.update(self._tsdf, self._occ, dirty, self.tsdf_config, self._free, dirty_free)

    # --------------------------------------------------------------------------------- maintenance
    def _brick_layers(self):
        """(name, layer) of the stored layers: tsdf, occupancy and the free record ("free", ESDF voxels)."""
        pairs = (("tsdf", self._tsdf), ("occupancy", self._occ), ("free", self._free))
        return [(n, la) for n, la in pairs if la is not None]

    def _layer_voxel_m(self, name: str) -> float:
        return self.esdf_voxel_size_m if name == "free" else self.voxel_size_m

    def _dirty_of(self, name: str) -> list[torch.Tensor]:
        return self._dirty_free if name == "free" else self._dirty_bricks

    def decay(self, factor: float = 0.5, threshold: float = 0.05) -> dict:
        """Fade old observations: weights (TSDF) and |log-odds| (occupancy) are multiplied by ``factor``;
        voxels whose weight (|log-odds|) falls below ``threshold`` become unobserved, bricks with no
        observed voxel are freed and pruned from the grid."""
        f = _positive("factor", factor)
        if f > 1:
            raise InvalidArgument(f"factor: expected a value in (0, 1], got {factor}")
        th = float(threshold)
        if not math.isfinite(th) or th < 0:
            raise InvalidArgument(f"threshold: expected a finite value >= 0, got {threshold}")
        freed = {}
        for name, layer in self._brick_layers():
            bricks, slots = layer.brick_table()
            if slots.numel() == 0:
                continue
            if name == "tsdf":
                w_old = layer.pool.gather("weight", slots).to(torch.float32)
                w = w_old * f
                dead = w < th
                died = dead & (w_old > 0)
                w = torch.where(dead, torch.zeros_like(w), w)
                t = torch.where(dead, torch.zeros_like(w), layer.pool.gather("tsdf", slots).to(torch.float32))
                layer.pool.scatter("weight", slots, w)
                layer.pool.scatter("tsdf", slots, t)
                if "color_weight" in layer.pool.fields:
                    cw = layer.pool.gather("color_weight", slots).to(torch.float32) * f
                    layer.pool.scatter("color_weight", slots, torch.where(dead, torch.zeros_like(cw), cw))
                alive = ~dead.all(dim=1)
            else:
                lo_old = layer.pool.gather("log_odds", slots).to(torch.float32)
                lo = lo_old * f
                lo = torch.where(lo.abs() < th, torch.full_like(lo, float("nan")), lo)
                died = torch.isnan(lo) & ~torch.isnan(lo_old)
                layer.pool.scatter("log_odds", slots, lo)
                alive = ~torch.isnan(lo).all(dim=1)
            if self._esdf is not None:  # voxels that became unobserved in surviving bricks
                self._dirty_of(name).append(bricks[died.any(dim=1) & alive])
            layer.touch(bricks[alive])
            freed[name] = self._free_bricks(layer, bricks, ~alive, name)
        self.version += 1
        return {"bricks_freed": freed}

    def _free_bricks(
        self, layer: BrickLayer, bricks: torch.Tensor, drop: torch.Tensor, name: str = ""
    ) -> int:
        n = int(drop.sum())
        if n:
            if self._esdf is not None:
                self._dirty_of(name).append(bricks[drop])
            leaf = layer.grid.ijk_to_leaf(bricks[drop] << 2)
            from .layers import brick_in_leaf

            mask = torch.zeros_like(layer.slots, dtype=torch.bool)
            mask[leaf, brick_in_leaf(bricks[drop] << 2)] = True
            layer.release_bricks(mask)
        return n

    def _reset_voxels(self, layer: BrickLayer, name: str, slots, off) -> None:
        if name == "tsdf":
            for f in ("tsdf", "weight", "color_weight"):
                if f in layer.pool.fields:
                    layer.pool.scatter(f, slots, torch.zeros(slots.numel(), device=self.device), off)
        else:
            layer.pool.scatter(
                "log_odds", slots, torch.full((slots.numel(),), float("nan"), device=self.device), off
            )

    def _clear_where(self, inside_fn) -> dict:
        """Remove voxels where ``inside_fn(world centres [M, 3]) -> bool`` holds."""
        freed = {}
        for name, layer in self._brick_layers():
            s = self._layer_voxel_m(name)
            bricks, slots = layer.brick_table()
            if slots.numel() == 0:
                continue
            local = torch.stack(
                torch.meshgrid(*(torch.arange(4, device=self.device),) * 3, indexing="ij"), -1
            ).reshape(1, 64, 3)
            full = torch.zeros(bricks.shape[0], dtype=torch.bool, device=self.device)
            step = QUERY_CHUNK.get(self.device.type, 1 << 15) // 64  # ~4 KB of temporaries per brick
            for a in range(0, bricks.shape[0], step):
                bk, sl = bricks[a : a + step], slots[a : a + step]
                vox = bk[:, None, :] * 4 + local
                inside = inside_fn(((vox.to(torch.float64) + 0.5) * s).reshape(-1, 3)).reshape(-1, 64)
                full[a : a + step] = inside.all(dim=1)
                part = inside & ~full[a : a + step, None]
                if bool(part.any()):
                    b, o = part.nonzero(as_tuple=True)
                    self._reset_voxels(layer, name, sl[b], brick_offsets(vox[b, o]))
                    layer.touch(bk[part.any(dim=1)])
                    if self._esdf is not None:
                        self._dirty_of(name).append(bk[part.any(dim=1)])
            freed[name] = self._free_bricks(layer, bricks, full, name)
        self.version += 1
        return {"bricks_freed": freed}

    def clear(self, aabb_min=None, aabb_max=None) -> dict:
        """Remove the voxels whose centres lie in the box ``[aabb_min, aabb_max]`` (metres); no box = all."""
        if aabb_min is None and aabb_max is None:
            return self._clear_where(lambda c: torch.ones(c.shape[0], dtype=torch.bool, device=c.device))
        lo = self._vec3("aabb_min", aabb_min)
        hi = self._vec3("aabb_max", aabb_max)
        if bool((lo > hi).any()):
            raise InvalidArgument("aabb_min: must be <= aabb_max on every axis")
        return self._clear_where(lambda c: ((c >= lo) & (c <= hi)).all(dim=1))

    def clear_outside(self, center_m, radius_m) -> dict:
        """Keep only voxels whose centres lie within ``radius_m`` of ``center_m`` (bounded memory)."""
        c0 = self._vec3("center_m", center_m)
        r = _positive("radius_m", radius_m)
        return self._clear_where(lambda c: torch.linalg.vector_norm(c - c0, dim=1) > r)

    def _vec3(self, name: str, x) -> torch.Tensor:
        if x is None:
            raise InvalidArgument(f"{name}: required")
        t = v.as_tensor(name, x).to(torch.float64).reshape(-1)
        if t.numel() != 3 or not bool(torch.isfinite(t).all()):
            raise InvalidArgument(f"{name}: expected 3 finite numbers")
        return t.to(self.device)

    # ---------------------------------------------------------------------------------- persistence
    def config(self) -> dict:
        """The constructor arguments (JSON-serialisable); ``Map(**m.config())`` makes an empty twin."""
        return {
            "voxel_size_m": self.voxel_size_m,
            "layers": list(self.layers),
            "truncation_vox": self.tsdf_config.truncation_vox,
            "esdf_max_distance_m": self.esdf_max_distance_m,
            "esdf_voxel_size_m": self.esdf_voxel_size_m,
            "max_range_m": self.max_range_m,
            "tsdf_max_weight": self.tsdf_config.max_weight,
            "tsdf_obs_weight": self.tsdf_config.obs_weight,
            "occupancy": {
                k: getattr(self.occupancy_config, k) for k in ("l_hit", "l_miss", "clamp_min", "clamp_max")
            },
            "registration": dict(self._registration),
            "keep_radius_m": self.keep_radius_m,
            **({"shard": self.shard.to_dict()} if self.shard is not None else {}),
        }

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(CPU tensors, JSON metadata) of the whole map. The ESDF is not stored: it is recomputed from the
        surface on the first ``update_esdf`` after loading (it is a pure function of the surface)."""
        tensors = {}
        for name, layer in self._brick_layers():
            tensors.update(layer.state_tensors(name))
        meta = {"config": self.config(), "frames_integrated": self.frames_integrated, "version": self.version}
        # LiDAR tracking: the odometry (local map, poses, threshold) or the last posed scan that seeds it
        if self._odometry is not None:
            odo_tensors, meta["tracking"] = self._odometry.state_dict("tracking.")
            tensors.update(odo_tensors)
        elif self._last_posed is not None:
            pts, T, prev = self._last_posed
            tensors.update({"tracking.last_points": pts, "tracking.last_pose": T})
            if prev is not None:
                tensors["tracking.prev_pose"] = prev
        if self._poses:
            poses, versions, start = self.trajectory()
            tensors.update({"trajectory.poses": poses, "trajectory.versions": versions})
            meta["trajectory_start"] = start
        return {k: t.detach().cpu() for k, t in tensors.items()}, meta

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], meta: dict, device=None) -> Map:
        """Rebuild a map saved with :meth:`state_dict` (on ``device``, default: CUDA when available)."""
        m = cls(**meta["config"], device=device)  # older snapshots: the ESDF voxel takes its default
        for name, layer in m._brick_layers():
            if f"{name}.bricks" not in tensors and name == "free":
                continue  # no free record in the snapshot (written before it existed): known after new frames
            layer.load_state_tensors(tensors, name)
            if m._esdf is not None:
                m._dirty_of(name).append(layer.brick_table()[0])
        m.frames_integrated = int(meta.get("frames_integrated", 0))
        m.version = int(meta.get("version", 0))
        if "trajectory.poses" in tensors:
            m._poses = list(tensors["trajectory.poses"].to(_HOST, torch.float64).unbind(0))
            m._pose_versions = [int(x) for x in tensors["trajectory.versions"].tolist()]
            m._trajectory_start = int(meta.get("trajectory_start", 0))
        if "tracking" in meta:
            m._odometry = Odometry.from_state_dict(tensors, meta["tracking"], "tracking.", m.device)
        elif "tracking.last_points" in tensors:
            prev = tensors.get("tracking.prev_pose")
            m._last_posed = (
                tensors["tracking.last_points"].to(m.device, torch.float32),
                tensors["tracking.last_pose"].to(_HOST, torch.float64),
                None if prev is None else prev.to(_HOST, torch.float64),
            )
        return m

    # -------------------------------------------------------------------------------------- queries
    def _require(self, name: str):
        layer = {"tsdf": self._tsdf, "occupancy": self._occ, "esdf": self._esdf}[name]
        if layer is None:
            raise NotFound(f"layer {name!r} is not enabled on this map (layers: {self.layers})")
        return layer

    @property
    def esdf_dirty(self) -> bool:
        """True when frames or edits since the last ``update_esdf()`` may have changed the ESDF."""
        return bool(self._dirty_bricks or self._dirty_free)

    def _esdf_current(self, update: bool = True):
        esdf = self._require("esdf")
        if update and not self.read_only and (self._dirty_bricks or self._dirty_free):
            self.update_esdf()
        return esdf

    def query_tsdf(self, points_world) -> tuple[torch.Tensor, torch.Tensor]:
        """Trilinear TSDF at ``[M, 3]`` world points: (tsdf float32 [M] metres, NaN where any of the 8
        corner voxels is unobserved; weight float32 [M], 0 there)."""
        layer = self._require("tsdf")
        p = Q.check_query_points("points_world", points_world, self.device)
        return self._chunked(lambda q: self._query_tsdf(layer, q), p)

    def _query_tsdf(self, layer, p: torch.Tensor):
        _, frac, ok, vals, present = Q.gather_corners(
            layer, p, self.voxel_size_m, ["tsdf", "weight"], [0.0, 0.0]
        )
        obs = (present & (vals["weight"] > 0)).all(dim=1) & ok
        t, _ = Q.masked_trilinear(vals["tsdf"], frac, obs, self.voxel_size_m)
        w, _ = Q.masked_trilinear(vals["weight"], frac, obs, self.voxel_size_m)
        return t, torch.nan_to_num(w, nan=0.0)

    def query_occupancy(self, points_world) -> tuple[torch.Tensor, torch.Tensor]:
        """Occupancy of the voxel holding each ``[M, 3]`` world point: (state int8 [M]: -1 unknown, 0 free,
        1 occupied; probability float32 [M], 0.5 where unknown)."""
        layer = self._require("occupancy")
        p = Q.check_query_points("points_world", points_world, self.device)
        return self._chunked(lambda q: self._query_occupancy(layer, q), p)

    def _query_occupancy(self, layer, p: torch.Tensor):
        ijk, ok = Q.voxel_of(p, self.voxel_size_m)
        (lo,), present = Q.gather_voxels(layer, ijk, ["log_odds"], [float("nan")])
        known = ok & present & ~torch.isnan(lo)
        state = torch.where(known, torch.where(lo > 0, 1, 0), -1).to(torch.int8)
        prob = torch.where(known, torch.sigmoid(torch.nan_to_num(lo)), torch.full_like(lo, 0.5))
        return state, prob

    def query_distance(
        self, points_world, update_esdf: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Signed distance at ``[M, 3]`` world points, trilinear in the ESDF voxels: (distance float32 [M]
        metres, NaN where unknown; gradient float32 [M, 3] of the interpolant; observed bool [M]). Voxels
        farther than ``esdf_max_distance_m`` from every surface that the map has observed count as that
        distance. Brings the ESDF up to date first (free when nothing changed) unless ``update_esdf`` is
        False (then the map is only read: a service keeps the ESDF current in its writer)."""
        esdf = self._esdf_current(update_esdf)
        p = Q.check_query_points("points_world", points_world, self.device)
        return self._chunked(lambda q: self._query_distance(esdf, q), p)

    def _chunked(self, fn, p: torch.Tensor, n: int | None = None) -> tuple[torch.Tensor, ...]:
        """``fn(points [m, 3]) -> tuple of [m, ...] tensors`` over ``QUERY_CHUNK`` points at a time, into
        preallocated outputs. ``p``: float64 ``[n, 3]`` points, or a callable ``(start, end) -> points``
        (then ``n`` is the count), so lattice queries never hold all their points at once."""
        if n is None:
            n = p.shape[0]
        step = QUERY_CHUNK.get(self.device.type, 1 << 15)
        points = p if callable(p) else (lambda a, b: p[a:b])
        if n <= step:
            return tuple(fn(points(0, n)))
        outs = None
        for a in range(0, n, step):
            b = min(a + step, n)
            part = fn(points(a, b))
            if outs is None:
                outs = tuple(torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in part)
            for o, x in zip(outs, part, strict=True):
                o[a:b] = x
        return outs

    def _query_distance(self, esdf, p: torch.Tensor):
        if use_triton(self.device):
            from .kernels.triton_query import distance_launch, usable  # one launch; same values as below

            if usable(esdf.layer):
                s, md = self.esdf_voxel_size_m, self.esdf_max_distance_m
                return distance_launch(p, s, md, esdf.layer, *self._esdf_fallback())
        return self._query_distance_torch(esdf, p)

    def _esdf_fallback(self) -> tuple[BrickLayer | None, BrickLayer | None]:
        """The layers that tell whether an ESDF voxel outside the ESDF layer (farther than the max distance
        from every site) was observed, at the ESDF's voxel: (TSDF: weight > 0, log-odds layer: not NaN).
        The source layers count only on the same lattice; the free record always (it has the ESDF voxel)."""
        same = self._esdf.same_lattice
        tsdf_layer = self._tsdf if same else None
        occ_layer = self._occ if (same and self._occ is not None) else self._free
        return tsdf_layer, occ_layer

    def _query_distance_torch(self, esdf, p: torch.Tensor):
        s, md = self.esdf_voxel_size_m, self.esdf_max_distance_m
        ijk, frac, ok, vals, present = Q.gather_corners(esdf.layer, p, s, ["esdf", "observed"], [md, 0.0])
        d = vals["esdf"]
        obs = present & (vals["observed"] > 0)
        absent = ~present
        if bool(absent.any()):
            a_ijk = ijk[absent]
            seen = torch.zeros(a_ijk.shape[0], dtype=torch.bool, device=self.device)
            tsdf_layer, occ_layer = self._esdf_fallback()
            if tsdf_layer is not None:
                (w,), pr = Q.gather_voxels(tsdf_layer, a_ijk, ["weight"], [0.0])
                seen |= pr & (w > 0)
            if occ_layer is not None:
                (lo,), pr = Q.gather_voxels(occ_layer, a_ijk, ["log_odds"], [float("nan")])
                seen |= pr & ~torch.isnan(lo)
            obs[absent] = seen
            d[absent] = md
        all_obs = obs.all(dim=1) & ok
        dist, grad = Q.masked_trilinear(d, frac, all_obs, s)
        return dist, grad, all_obs

    def _esdf_bounds(self, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        bricks, _ = self._esdf_current(update).layer.brick_table()
        if self._free is not None and self._free.grid.num_leaves:  # the known free space counts too
            bricks = torch.cat((bricks, self._free.brick_table()[0]))
        if bricks.shape[0] == 0:
            raise InvalidArgument("the map has no ESDF yet: pass explicit bounds")
        s4 = 4 * self.esdf_voxel_size_m
        return bricks.min(dim=0).values.double() * s4, (bricks.max(dim=0).values + 1).double() * s4

    def esdf_slice(
        self, z_m, aabb_min_xy=None, aabb_max_xy=None, resolution_m=None, max_pixels=1 << 24, update_esdf=True
    ) -> Q.Slice:
        """The ESDF on the plane ``z = z_m`` over ``[aabb_min_xy, aabb_max_xy]`` (default: the ESDF's
        extent) at ``resolution_m`` (default: the ESDF voxel size); NaN = unknown."""
        z = float(z_m)
        if not math.isfinite(z):
            raise InvalidArgument(f"z_m: expected a finite number, got {z_m}")
        res = self.esdf_voxel_size_m if resolution_m is None else _positive("resolution_m", resolution_m)
        if aabb_min_xy is None or aabb_max_xy is None:
            lo3, hi3 = self._esdf_bounds(update_esdf)
        lo = self._vecn("aabb_min_xy", aabb_min_xy, 2) if aabb_min_xy is not None else lo3[:2]
        hi = self._vecn("aabb_max_xy", aabb_max_xy, 2) if aabb_max_xy is not None else hi3[:2]
        if bool((hi <= lo).any()):
            raise InvalidArgument("aabb_max_xy: must exceed aabb_min_xy on both axes")
        w = max(1, math.ceil(float(hi[0] - lo[0]) / res))
        h = max(1, math.ceil(float(hi[1] - lo[1]) / res))
        if w * h > max_pixels:
            raise RequestTooLarge(
                f"resolution_m: the slice would have {w}x{h} = {w * h} pixels (limit {max_pixels})"
            )
        xs = lo[0] + (torch.arange(w, device=self.device, dtype=torch.float64) + 0.5) * res
        ys = lo[1] + (torch.arange(h, device=self.device, dtype=torch.float64) + 0.5) * res
        zs = torch.full((1,), z, dtype=torch.float64, device=self.device)
        esdf = self._esdf_current(update_esdf)
        (d,) = self._chunked(
            lambda q: self._query_distance(esdf, q)[:1], _lattice((ys, xs, zs), (1, 0, 2)), h * w
        )
        return Q.Slice(d.reshape(h, w), (float(lo[0]), float(lo[1])), res, z)

    def esdf_box(
        self, aabb_min, aabb_max, resolution_m=None, max_voxels=1 << 24, update_esdf=True
    ) -> Q.EsdfBox:
        """Dense ESDF, its gradient and the observed mask on a box (samples at voxel-size spacing by
        default: the ESDF voxel size), like nvblox's EsdfAndGradients service."""
        lo = self._vec3("aabb_min", aabb_min)
        hi = self._vec3("aabb_max", aabb_max)
        if bool((hi <= lo).any()):
            raise InvalidArgument("aabb_max: must exceed aabb_min on every axis")
        res = self.esdf_voxel_size_m if resolution_m is None else _positive("resolution_m", resolution_m)
        n = [max(1, math.ceil(float(hi[a] - lo[a]) / res)) for a in range(3)]
        if n[0] * n[1] * n[2] > max_voxels:
            raise RequestTooLarge(
                f"aabb_max: the box would have {n} = {n[0] * n[1] * n[2]} samples (limit {max_voxels})"
            )
        axes = [
            lo[a] + (torch.arange(n[a], device=self.device, dtype=torch.float64) + 0.5) * res
            for a in range(3)
        ]
        esdf = self._esdf_current(update_esdf)
        d, g, o = self._chunked(
            lambda q: self._query_distance(esdf, q), _lattice(axes, (0, 1, 2)), n[0] * n[1] * n[2]
        )
        return Q.EsdfBox(d.reshape(*n), g.reshape(*n, 3), o.reshape(*n), tuple(lo.tolist()), res)

    def raycast(self, T_world_sensor, K, width: int, height: int, max_range_m: float | None = None):
        """Render depth (metres along the optical axis, 0 = nothing) and world normals [H, W, 3] of the TSDF
        surface seen by a pinhole camera (OpenCV axes), by sphere tracing the trilinear TSDF."""
        layer = self._require("tsdf")
        T = check_pose("T_world_sensor", T_world_sensor, self.device)
        for name, val in (("width", width), ("height", height)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0 or val > 8192:
                raise InvalidArgument(f"{name}: expected an int in [1, 8192], got {val!r}")
        Kt = check_intrinsics("K", K, self.device, (height, width))
        rng = self.max_range_m if max_range_m is None else _positive("max_range_m", max_range_m)
        return raycast_tsdf(layer, T, Kt, width, height, self.voxel_size_m, self.tsdf_config.tau, rng)

    def _vecn(self, name: str, x, n: int) -> torch.Tensor:
        t = v.as_tensor(name, x).to(torch.float64).reshape(-1)
        if t.numel() != n or not bool(torch.isfinite(t).all()):
            raise InvalidArgument(f"{name}: expected {n} finite numbers")
        return t.to(self.device)

    # ---------------------------------------------------------------------------------------- views
    def layer(self, name: str) -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """(grid, sidecars) of a layer in the grid's voxel order: a copy of the current epoch.

        tsdf -> {"tsdf" (m), "weight"}; color -> {"color" uint8 [N, 3], "weight"}; occupancy ->
        {"log_odds" (NaN = unknown)}; esdf -> {"esdf" (m), "observed" bool}.
        """
        if name not in self.layers:
            raise NotFound(f"layer {name!r} is not enabled on this map (layers: {self.layers})")
        if name == "tsdf":
            g, d = self._tsdf.voxel_view(["tsdf", "weight"])
            return g, {"tsdf": d["tsdf"].float(), "weight": d["weight"].float()}
        if name == "color":
            g, d = self._tsdf.voxel_view(["color", "color_weight"])
            return g, {"color": d["color"], "weight": d["color_weight"].float()}
        if name == "occupancy":
            g, d = self._occ.voxel_view(["log_odds"])
            return g, {"log_odds": d["log_odds"].float()}
        return self._esdf.view()

    def trajectory(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The sensor poses of the integrated frames, oldest first, from frame index ``start`` on.

        Returns: (``T_world_sensor`` float64 ``[N, 4, 4]``, map versions after each frame int64 ``[N]``, the
        frame index of the first pose), CPU tensors. Frame indices count every posed frame since the map
        was created; past ``MAX_TRAJECTORY`` poses the oldest are dropped, so the first index may exceed
        ``start``.
        """
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InvalidArgument(f"start: expected a non-negative int, got {start!r}")
        first = max(start, self._trajectory_start)
        i = first - self._trajectory_start
        poses = self._poses[i:]
        T = (
            torch.stack([p.to(_HOST, torch.float64) for p in poses])
            if poses
            else torch.zeros(0, 4, 4).double()
        )
        versions = torch.tensor(self._pose_versions[i:], dtype=torch.int64).reshape(-1)
        return T.to(torch.float64), versions, first

    @property
    def mesh_version(self) -> int | None:
        """The TSDF layer's version (what ``mesh().version`` would be); None without a TSDF."""
        return None if self._tsdf is None else self._tsdf.version

    def layer_sizes(self) -> dict:
        """Voxels, bricks and bytes per layer and the mesh version, without the per-voxel work of
        :meth:`stats` (cheap enough to poll)."""
        layers = {
            name: {"voxels": la.grid.num_voxels, "bricks": la.num_bricks, "bytes": la.nbytes}
            for name, la in self._brick_layers()
        }
        if self._esdf is not None:
            la = self._esdf.layer
            layers["esdf"] = {"voxels": la.grid.num_voxels, "bricks": la.num_bricks, "bytes": la.nbytes}
        return {
            "frames_integrated": self.frames_integrated,
            "version": self.version,
            "mesh_version": self.mesh_version,
            "trajectory_length": self._trajectory_start + len(self._poses),
            "layers": layers,
        }

    def bounds(self) -> dict[str, tuple[list[float], list[float]]]:
        """Per brick layer (``tsdf``, ``occupancy``) with allocated bricks, its axis-aligned extent in metres
        ``(min [3], max [3])`` (whole bricks)."""
        out = {}
        s4 = 4 * self.voxel_size_m
        for name, layer in self._brick_layers():
            bricks, _ = layer.brick_table()
            if bricks.shape[0]:
                lo = (bricks.min(dim=0).values.double() * s4).tolist()
                hi = ((bricks.max(dim=0).values + 1).double() * s4).tolist()
                out[name] = (lo, hi)
        return out

    def occupied_voxels(self, max_voxels: int | None = None) -> tuple[torch.Tensor, int]:
        """Centres (float32 ``[N, 3]`` metres, on the map's device) of the occupied voxels: occupancy
        log-odds > 0 when the map has the occupancy layer, else observed TSDF voxels within half a voxel of
        the surface. With ``max_voxels``, an evenly strided subset of at most that many.

        Returns: (centres, the number of occupied voxels before capping).
        """
        if max_voxels is not None and (
            isinstance(max_voxels, bool) or not isinstance(max_voxels, int) or max_voxels < 1
        ):
            raise InvalidArgument(f"max_voxels: expected a positive int, got {max_voxels!r}")
        if self._occ is not None:
            g, d = self.layer("occupancy")
            keep = d["log_odds"] > 0
        elif self._tsdf is not None:
            g, d = self.layer("tsdf")
            keep = (d["weight"] > 0) & (d["tsdf"].abs() <= 0.5 * self.voxel_size_m)
        else:
            return torch.zeros((0, 3), dtype=torch.float32, device=self.device), 0
        idx = keep.nonzero().squeeze(1)
        total = int(idx.numel())
        if max_voxels is not None and total > max_voxels:
            idx = idx[torch.linspace(0, total - 1, max_voxels, device=idx.device).long()]
        centres = (g.ijk[idx].to(torch.float32) + 0.5) * self.voxel_size_m
        return centres, total

    # ----------------------------------------------------------------------------------------- meshes
    def mesh(self, since_version: int | None = None) -> Mesh:
        """Marching-cubes triangle mesh of the TSDF zero level set (on the map's device).

        Args:
            since_version: None for the whole mesh; else the ``version`` of a mesh obtained earlier: only the
                blocks (bricks) that may have changed since then, to merge with ``mapper.mesh.apply_delta``
                (a full mesh, ``full=True``, when the change log no longer reaches back that far).
        Versions are the TSDF layer's (``Mesh.version``), not ``Map.version``.
        """
        if self._tsdf is None:
            raise NotFound("layer 'tsdf' is not enabled on this map")
        if since_version is None:
            return extract_mesh(self._tsdf, self.voxel_size_m)
        return mesh_since(self._tsdf, self.voxel_size_m, since_version)

    @property
    def bricks(self) -> dict[str, int]:
        """Allocated bricks (4^3 voxels) per layer, without walking the voxels."""
        out = {name: layer.num_bricks for name, layer in self._brick_layers()}
        if self._esdf is not None:
            out["esdf"] = self._esdf.layer.num_bricks
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the map's layers hold (voxel pools, topology, the ESDF), without walking the voxels."""
        n = sum(layer.nbytes for _, layer in self._brick_layers())
        if self._esdf is not None:
            n += self._esdf.layer.nbytes
        return n

    def timings_ms(self) -> dict[str, float]:
        """Per-stage wall times (ms) of the last frame (and ESDF update), without the O(map) work of
        ``stats()``; on CUDA this synchronises once to read the events."""
        return self._timer.resolve()

    def stats(self) -> dict:
        """Voxels and bytes per layer, frames integrated, last per-stage timings (ms)."""
        layers = {}
        for name, layer in self._brick_layers():
            layers[name] = {
                "voxels": layer.grid.num_voxels,
                "bricks": layer.num_bricks,
                "bytes": layer.nbytes,
                "topology_bytes": layer.grid.nbytes + layer.slots.numel() * 4,
            }
            if name == "tsdf":
                _, slots = layer.brick_table()
                w = (
                    layer.pool.gather("weight", slots)
                    if slots.numel()
                    else torch.zeros(0, device=self.device)
                )
                layers[name]["observed_voxels"] = int((w > 0).sum())
        if self._esdf is not None:
            layers["esdf"] = self._esdf.stats()
        return {
            "voxel_size_m": self.voxel_size_m,
            "device": str(self.device),
            "frames_integrated": self.frames_integrated,
            "version": self.version,
            "layers": layers,
            "timings_ms": self._timer.resolve(),
        }


def _lattice(axes, xyz: tuple[int, int, int]):
    """``(start, end) -> float64 [end - start, 3]``: the points of the lattice of three 1-D coordinate
    tensors ``axes`` (C order over them) with flat indices in ``[start, end)``; column ``c`` takes its
    coordinate from ``axes[xyz[c]]``."""
    n1, n2 = axes[1].numel(), axes[2].numel()

    def points(a: int, b: int) -> torch.Tensor:
        idx = torch.arange(a, b, device=axes[0].device)
        ijk = (idx // (n1 * n2), (idx // n2) % n1, idx % n2)
        return torch.stack([axes[xyz[c]][ijk[xyz[c]]] for c in range(3)], dim=1)

    return points


def raycast_tsdf(layer, T, K, width, height, s, tau, max_range_m, chunk=1 << 16) -> Q.RaycastResult:
    """Sphere tracing: step by the (positive) trilinear TSDF, at least half a voxel, one brick through
    unallocated space, until the TSDF changes sign; the hit is the linear zero crossing."""
    dev = T.device
    u = torch.arange(width, device=dev, dtype=torch.float64)
    vv = torch.arange(height, device=dev, dtype=torch.float64)
    gv, gu = torch.meshgrid(vv, u, indexing="ij")
    x = (gu - K[0, 2]) / K[0, 0]
    y = (gv - K[1, 2]) / K[1, 1]
    ray_c = torch.stack((x, y, torch.ones_like(x)), dim=-1).reshape(-1, 3)
    znorm = torch.linalg.vector_norm(ray_c, dim=1)
    dirs = (ray_c / znorm[:, None]) @ T[:3, :3].T
    origin = T[:3, 3]
    n = dirs.shape[0]
    depth = torch.zeros(n, dtype=torch.float64, device=dev)
    normals = torch.zeros((n, 3), dtype=torch.float64, device=dev)
    max_steps = int(max_range_m / (0.5 * s)) + 2
    for c0 in range(0, n, chunk):
        idx = torch.arange(c0, min(c0 + chunk, n), device=dev)
        t = torch.full((idx.numel(),), 0.5 * s, dtype=torch.float64, device=dev)
        prev_t = t.clone()
        prev_v = torch.full_like(t, float("nan"))
        for _ in range(max_steps):
            if idx.numel() == 0:
                break
            p = origin + dirs[idx] * t[:, None]
            _, frac, ok, vals, present = Q.gather_corners(layer, p, s, ["tsdf", "weight"], [0.0, 0.0])
            obs = (present & (vals["weight"] > 0)).all(dim=1) & ok
            val, _ = Q.masked_trilinear(vals["tsdf"], frac, obs, s)
            val = val.to(torch.float64)
            hit = obs & (val <= 0) & torch.isfinite(prev_v) & (prev_v > 0)
            if bool(hit.any()):
                hi = hit.nonzero().squeeze(1)
                th = prev_t[hi] + (t[hi] - prev_t[hi]) * prev_v[hi] / (prev_v[hi] - val[hi])
                ph = origin + dirs[idx[hi]] * th[:, None]
                _, fr2, _, v2, _ = Q.gather_corners(layer, ph, s, ["tsdf"], [0.0])
                _, grad = Q.trilinear(v2["tsdf"].to(torch.float64), fr2, s)
                nrm = grad / torch.linalg.vector_norm(grad, dim=1, keepdim=True).clamp(min=1e-12)
                depth[idx[hi]] = th / znorm[idx[hi]]
                normals[idx[hi]] = nrm
            any_alloc = present.any(dim=1)
            step = torch.where(
                obs & (val > 0),
                (0.8 * val).clamp(min=0.5 * s, max=tau),
                torch.where(any_alloc, torch.full_like(t, 0.5 * s), torch.full_like(t, 2.0 * s)),
            )
            prev_t = torch.where(obs, t, prev_t)
            prev_v = torch.where(obs, val, torch.where(any_alloc, prev_v, torch.full_like(val, float("nan"))))
            t = t + step
            live = ~hit & (t < max_range_m)
            idx, t, prev_t, prev_v = idx[live], t[live], prev_t[live], prev_v[live]
    return Q.RaycastResult(
        depth.reshape(height, width).to(torch.float32), normals.reshape(height, width, 3).to(torch.float32)
    )


def _compact_dirty(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` (int64 ``[B, 3]`` bricks, duplicates allowed) as at most one tensor of unique rows once
    they hold more than ``DIRTY_COMPACT_ROWS`` rows and twice the rows of the last merge (its result is
    the first part): the pending rows stay within ~2x the distinct bricks, at an amortised O(1) per row."""
    rows = sum(int(t.shape[0]) for t in parts)
    if rows <= max(DIRTY_COMPACT_ROWS, 2 * (int(parts[0].shape[0]) if parts else 0)):
        return parts
    return [keys_to_ijk(torch.unique(voxel_keys(torch.cat(parts))))]

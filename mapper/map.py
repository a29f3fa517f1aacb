"""``Map``: fuses depth images and LiDAR scans into sparse layers (TSDF + colour, occupancy, ESDF).

The recipe of a frame: check the input; build the frame (:mod:`mapper.integrators.base`); each integrator
of the map fuses it into its layer and returns the bricks it updated, which the map queues for the ESDF;
the radius policy; the trajectory. Every stored layer is a kind of :class:`~mapper.layers.BrickLayer`
(:mod:`mapper.layer_kinds`) that owns its fields, reset, decay and views; the ESDF follows its queues on
:meth:`Map.update_esdf`. Queries live in :mod:`mapper.queries`, ray casting in :mod:`mapper.raycast`,
tracking in :mod:`mapper.tracking`. See NOTES.md for the design.
"""

from __future__ import annotations

import copy
import math

import torch

from . import _validation as v
from . import maintenance
from . import queries as Q
from .errors import InvalidArgument, InvalidArgumentType, NotFound, RequestTooLarge
from .grid import IndexGrid
from .integrators.base import BrickQueue, DepthFrame, LidarFrame
from .integrators.common import (
    check_color,
    check_depth,
    check_intrinsics,
    check_points,
    check_pose,
    host_to_device,
)
from .integrators.free import FreeSpaceIntegrator
from .integrators.occupancy import OccupancyConfig, OccupancyIntegrator
from .integrators.tsdf import TsdfConfig, TsdfIntegrator
from .kernels.keys import COORD_LIMIT_VOX
from .layer_kinds import ObservedRecord, OccupancyLayer, StoredLayer, TsdfLayer
from .layers import BrickLayer
from .mesh import Mesh, extract_mesh, mesh_since
from .raycast import raycast_tsdf
from .registration import OdometryConfig
from .sharding import ShardSpec
from .timing import StageTimer
from .tracking import LidarTracker
from .trajectory import Trajectory

LAYERS = ("tsdf", "color", "occupancy", "esdf")
# points per chunk of a point query (bounds its temporaries: ~1.2 KB per point in one piece on the CPU torch
# path, so a 16 M-cell slice needed ~20 GB; chunked, a query costs its outputs plus one chunk's working set)
QUERY_CHUNK = {"cpu": 1 << 15, "cuda": 1 << 20}
_HOST = torch.device("cpu")  # tracking poses live on the host (see mapper.registration)
MAX_TRAJECTORY = 100_000  # sensor poses kept per map (the oldest half is dropped beyond)


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
        self.tsdf_config = TsdfConfig(
            self.voxel_size_m,
            _positive("truncation_vox", truncation_vox),
            _positive("tsdf_obs_weight", tsdf_obs_weight),
            _positive("tsdf_max_weight", tsdf_max_weight),
            with_color="color" in layers,
        )
        try:
            self.occupancy_config = OccupancyConfig(self.voxel_size_m, **(occupancy or {}))
        except TypeError as e:
            raise InvalidArgument(f"occupancy: {e}") from None
        s = self.voxel_size_m
        self._tsdf = TsdfLayer(self.device, s, with_color="color" in layers) if "tsdf" in layers else None
        self._occ = OccupancyLayer(self.device, s) if "occupancy" in layers else None
        if registration is not None and not isinstance(registration, dict):
            raise InvalidArgumentType(f"registration: expected a dict, got {type(registration).__name__}")
        self._registration = dict(registration or {})
        try:
            cfg = {"max_range_m": self.max_range_m, **self._registration}
            self.registration_config = OdometryConfig(**cfg)
        except (TypeError, InvalidArgument) as e:
            raise InvalidArgument(f"registration: {e}") from None
        self._tracker = LidarTracker(self.registration_config, self.device)  # frames without a pose
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
                self._free = ObservedRecord(self.device, self.esdf_voxel_size_m)
        # what the ESDF must still update: source bricks whose surface or sign changed, and ESDF bricks
        # whose free-record state changed (the integrators' results and the edits, see _bind)
        self._surface_queue, self._free_queue = BrickQueue(), BrickQueue()
        self._integrators = {
            TsdfLayer: TsdfIntegrator(self.tsdf_config),
            OccupancyLayer: OccupancyIntegrator(self.occupancy_config),
            ObservedRecord: FreeSpaceIntegrator(
                self.esdf_voxel_size_m, self.tsdf_config.tau if self._tsdf is not None else 0.0
            ),
        }
        self._bind()
        self._last_updated: dict[str, torch.Tensor] = {}  # the bricks each layer's integrator last updated
        self.frames_integrated = 0
        self.version = 0
        self._timer = StageTimer(self.device)
        self._trajectory = Trajectory()  # the pose of every integrated frame and the map version after it
        self.read_only = False  # a read_view(): queries only
        if warmup and self.device.type == "cuda":
            from .warmup import warm_up

            warm_up(self.config(), self.device)

    def _bind(self) -> None:
        """The stored layers in integration order with their ESDF queue (None without an ESDF)."""
        esdf = self._esdf is not None
        pairs = (
            (self._tsdf, self._surface_queue),
            (self._occ, self._surface_queue),
            (self._free, self._free_queue),
        )
        self._stores: list[tuple[StoredLayer, BrickQueue | None]] = [
            (layer, queue if esdf else None) for layer, queue in pairs if layer is not None
        ]

    def read_view(self) -> Map:
        """A read-only version of the map as it is now, for readers on other threads while this map keeps
        integrating (the service publishes one per batch). O(layers + pages) to make: it shares the layers'
        immutable index grids and their pool pages; later writes to this map copy the pages and tables they
        change first (``PagedPool.freeze``), so the view answers every query (distances, slices, boxes,
        meshes, layers, trajectory, stats) for this ``version`` for as long as it is referenced. Its ESDF is
        as of now (``update_esdf()`` first for a fresh one); a view never updates it and cannot integrate."""
        v = copy.copy(self)
        v.read_only = True
        v._tsdf, v._occ, v._free = (
            None if la is None else la.frozen() for la in (self._tsdf, self._occ, self._free)
        )
        if self._esdf is not None:
            v._esdf = copy.copy(self._esdf)
            v._esdf.layer = self._esdf.layer.frozen()
            v._esdf.last = dict(self._esdf.last)
        v._tracker = LidarTracker(self.registration_config, self.device)  # tracking state: the writer's alone
        v._trajectory = self._trajectory.copy()
        v._surface_queue, v._free_queue = self._surface_queue.copy(), self._free_queue.copy()
        v._bind()
        v._last_updated = dict(self._last_updated)
        v._timer = StageTimer(torch.device("cpu"))
        v._timer.last = dict(self._timer.last)
        return v

    def _writable(self) -> None:
        if self.read_only:
            raise RuntimeError("Map: this is a read_view(); it cannot integrate or update the ESDF")

    # ----------------------------------------------------------------------------------- integration
    def _begin(self):
        self._writable()
        self._timer.begin_frame()

    def _integrate(self, frame: LidarFrame | DepthFrame) -> None:
        """Every stored layer's integrator fuses ``frame``; the bricks each updated go to its ESDF queue."""
        for layer, queue in self._stores:
            bricks = self._integrators[type(layer)].integrate(frame, layer, self._timer)
            self._last_updated[layer.kind] = bricks
            if queue is not None:
                queue.push(bricks)

    def _end(self, T_world_sensor: torch.Tensor | None = None) -> None:
        self.frames_integrated += 1
        self.version += 1
        if T_world_sensor is not None:
            self._trajectory.append(T_world_sensor, self.version, MAX_TRAJECTORY)
        self._surface_queue.compact()
        self._free_queue.compact()

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
        T = host_to_device(T_host, self.device)
        r = torch.linalg.vector_norm(pts, dim=1)
        ok = torch.isfinite(pts).all(dim=1) & (r > 1e-6) & (r <= self.max_range_m)
        pts = pts[ok].to(torch.float64)
        used = int(pts.shape[0])
        if used:
            self._integrate(LidarFrame(T[:3, 3], pts @ T[:3, :3].T + T[:3, 3]))
        cleared = self._keep_radius(T[:3, 3])
        self._keep_shard()
        self._end(T_host)
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
        return self._tracker.track(pts, T, estimated)

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
        if used:
            self._integrate(DepthFrame(depth, Kt, T, col, self.max_range_m))
        cleared = self._keep_radius(T[:3, 3])
        self._keep_shard()
        self._end(T)
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
        return maintenance.free_far_bricks(
            self._stores, origin.to(self.device, torch.float64), self.keep_radius_m
        )

    def _keep_shard(self) -> None:
        """A shard (``shard``): free the bricks of every source layer lying wholly outside the halo of its own
        blocks (the ESDF follows on its next update)."""
        if self.shard is not None:
            maintenance.free_outside_shard(self._stores, self.shard, self.voxel_size_m)

    @property
    def coordinate_limit_m(self) -> float:
        """Map coordinates reach ``+-coordinate_limit_m`` per axis (the integrators' keys hold voxel
        coordinates within ``+-2^20``, NOTES.md); a sensor outside cannot add anything."""
        return COORD_LIMIT_VOX * self.voxel_size_m

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
        return host_to_device(self.check_sensor_pose(T_world_sensor), self.device)

    # ------------------------------------------------------------------------------------------ ESDF
    def update_esdf(self) -> dict:
        """Bring the ESDF up to date with the surface; recomputes only the region the frames since the
        last call could change (nothing when nothing changed)."""
        if self._esdf is None:
            raise NotFound("layer 'esdf' is not enabled on this map")
        self._writable()
        dirty, dirty_free = self._surface_queue.drain(), self._free_queue.drain()
        with self._timer("esdf"):
            return self._esdf.update(self._tsdf, self._occ, dirty, self.tsdf_config, self._free, dirty_free)

    # --------------------------------------------------------------------------------- maintenance
    def _brick_layers(self) -> list[tuple[str, StoredLayer]]:
        """(kind, layer) of the stored layers: tsdf, occupancy and the free record ("free", ESDF voxels)."""
        return [(layer.kind, layer) for layer, _ in self._stores]

    def _all_layers(self) -> list[tuple[str, BrickLayer]]:
        """The stored layers, then the ESDF's ("esdf")."""
        return self._brick_layers() + ([("esdf", self._esdf.layer)] if self._esdf is not None else [])

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
        freed = maintenance.decay(self._stores, f, th)
        self.version += 1
        return {"bricks_freed": freed}

    def _clear_where(self, inside_fn) -> dict:
        """Remove voxels where ``inside_fn(world centres [M, 3]) -> bool`` holds."""
        step = QUERY_CHUNK.get(self.device.type, 1 << 15) // 64  # ~4 KB of temporaries per brick
        freed = maintenance.clear_where(self._stores, inside_fn, step)
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
        for layer, _ in self._stores:
            tensors.update(layer.state_tensors(layer.kind))
        meta = {"config": self.config(), "frames_integrated": self.frames_integrated, "version": self.version}
        # LiDAR tracking: the odometry (local map, poses, threshold) or the last posed scan that seeds it
        tracking, tracking_meta = self._tracker.state_dict("tracking.")
        tensors.update(tracking)
        if tracking_meta is not None:
            meta["tracking"] = tracking_meta
        trajectory, start = self._trajectory.state_tensors()
        if start is not None:
            tensors.update(trajectory)
            meta["trajectory_start"] = start
        return {k: t.detach().cpu() for k, t in tensors.items()}, meta

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], meta: dict, device=None) -> Map:
        """Rebuild a map saved with :meth:`state_dict` (on ``device``, default: CUDA when available)."""
        m = cls(**meta["config"], device=device)  # older snapshots: the ESDF voxel takes its default
        for layer, queue in m._stores:
            if f"{layer.kind}.bricks" not in tensors and layer is m._free:
                continue  # no free record in the snapshot (written before it existed): known after new frames
            layer.load_state_tensors(tensors, layer.kind)
            if queue is not None:
                queue.push_always(layer.brick_table()[0])
        m.frames_integrated = int(meta.get("frames_integrated", 0))
        m.version = int(meta.get("version", 0))
        m._trajectory.load_state_tensors(tensors, meta.get("trajectory_start", 0))
        m._tracker.load_state_dict(tensors, meta.get("tracking"), "tracking.")
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
        return bool(self._surface_queue or self._free_queue)

    def _esdf_current(self, update: bool = True):
        esdf = self._require("esdf")
        if update and not self.read_only and self.esdf_dirty:
            self.update_esdf()
        return esdf

    def query_tsdf(self, points_world) -> tuple[torch.Tensor, torch.Tensor]:
        """Trilinear TSDF at ``[M, 3]`` world points: (tsdf float32 [M] metres, NaN where any of the 8
        corner voxels is unobserved; weight float32 [M], 0 there)."""
        layer = self._require("tsdf")
        p = Q.check_query_points("points_world", points_world, self.device)
        return self._chunked(lambda q: Q.tsdf_at(layer, q, self.voxel_size_m), p)

    def query_occupancy(self, points_world) -> tuple[torch.Tensor, torch.Tensor]:
        """Occupancy of the voxel holding each ``[M, 3]`` world point: (state int8 [M]: -1 unknown, 0 free,
        1 occupied; probability float32 [M], 0.5 where unknown)."""
        layer = self._require("occupancy")
        p = Q.check_query_points("points_world", points_world, self.device)
        return self._chunked(lambda q: Q.occupancy_at(layer, q, self.voxel_size_m), p)

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
        """:func:`mapper.queries.distance_at` on the ESDF, with the layers that tell whether an ESDF voxel
        outside the ESDF layer (farther than the max distance from every site) was observed, at the ESDF's
        voxel: the source layers on the same lattice only; the free record always (it has the ESDF voxel)."""
        same = esdf.same_lattice
        tsdf_layer = self._tsdf if same else None
        occ_layer = self._occ if (same and self._occ is not None) else self._free
        s, md = self.esdf_voxel_size_m, self.esdf_max_distance_m
        return Q.distance_at(esdf.layer, p, s, md, tsdf_layer, occ_layer)

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
            lambda q: self._query_distance(esdf, q)[:1], Q.lattice_points((ys, xs, zs), (1, 0, 2)), h * w
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
            lambda q: self._query_distance(esdf, q), Q.lattice_points(axes, (0, 1, 2)), n[0] * n[1] * n[2]
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
        for layer, _ in self._stores:
            if name in layer.views:
                return layer.view(name)
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
        return self._trajectory.read(start)

    @property
    def mesh_version(self) -> int | None:
        """The TSDF layer's version (what ``mesh().version`` would be); None without a TSDF."""
        return None if self._tsdf is None else self._tsdf.version

    def layer_sizes(self) -> dict:
        """Voxels, bricks and bytes per layer and the mesh version, without the per-voxel work of
        :meth:`stats` (cheap enough to poll)."""
        layers = {
            name: {"voxels": la.grid.num_voxels, "bricks": la.num_bricks, "bytes": la.nbytes}
            for name, la in self._all_layers()
        }
        return {
            "frames_integrated": self.frames_integrated,
            "version": self.version,
            "mesh_version": self.mesh_version,
            "trajectory_length": len(self._trajectory),
            "layers": layers,
        }

    def bounds(self) -> dict[str, tuple[list[float], list[float]]]:
        """Per stored layer (``tsdf``, ``occupancy``, the free record ``free``) with allocated bricks, its
        axis-aligned extent in metres ``(min [3], max [3])`` (whole bricks of the layer's voxel)."""
        out = {}
        for name, layer in self._brick_layers():
            s4 = 4 * layer.voxel_size_m  # the free record has the ESDF's voxel
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
        source = self._occ if self._occ is not None else self._tsdf
        if source is None:
            return torch.zeros((0, 3), dtype=torch.float32, device=self.device), 0
        g, keep = source.occupied()
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
        return {name: layer.num_bricks for name, layer in self._all_layers()}

    @property
    def nbytes(self) -> int:
        """Bytes the map's layers hold (voxel pools, topology, the ESDF), without walking the voxels."""
        return sum(layer.nbytes for _, layer in self._all_layers())

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
            layers[name].update(layer.extra_stats())
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

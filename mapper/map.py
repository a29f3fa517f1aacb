"""``Map``: fuses depth images and LiDAR scans into sparse layers (TSDF + colour, occupancy, ESDF).

The recipe of a frame: check the input; build the frame (:mod:`mapper.integrators.base`); each integrator
of the map fuses it into its layer and returns the bricks it updated, which the map queues for the ESDF;
the radius and shard policies; the trajectory. Every stored layer is a kind of
:class:`~mapper.layers.BrickLayer` (:mod:`mapper.layer_kinds`, which also holds the registry of layer
names) that owns its fields, reset, decay and views; the ESDF follows its queues on :meth:`Map.update_esdf`.
The read side (queries, views, meshes, reports) is :class:`~mapper.map_reads.MapReads`, which ``Map``
inherits. The work lives beside: settings in :mod:`mapper.map_config`, snapshots in :mod:`mapper.map_io`,
queries in :mod:`mapper.queries`, decay and clearing in :mod:`mapper.maintenance`, tracking in
:mod:`mapper.tracking`. See NOTES.md for the design.
"""

from __future__ import annotations

import copy

import torch

from . import _validation as v
from . import maintenance, map_io
from . import warmup as warm  # imports Map back only inside warm_up(); called as warm.warm_up (patchable)
from .errors import InvalidArgument
from .integrators.base import BrickQueue, DepthFrame, LidarFrame
from .integrators.common import (
    check_color,
    check_depth,
    check_intrinsics,
    check_points,
    check_pose,
    host_to_device,
)
from .kernels.keys import COORD_LIMIT_VOX
from .layer_kinds import StoredLayer
from .map_config import MapConfig
from .map_reads import MapReads
from .timing import StageTimer
from .tracking import LidarTracker
from .trajectory import Trajectory

_HOST = torch.device("cpu")  # tracking poses live on the host (see mapper.registration)
MAX_TRAJECTORY = 100_000  # sensor poses kept per map (the oldest half is dropped beyond)


class Map(MapReads):
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
    Bad arguments raise ``InvalidArgument`` / ``InvalidArgumentType`` naming the argument
    (:class:`mapper.map_config.MapConfig`).
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
        c = self._config = MapConfig.check(
            voxel_size_m, layers, truncation_vox, esdf_max_distance_m, max_range_m, tsdf_max_weight,
            tsdf_obs_weight, occupancy, registration, keep_radius_m, esdf_voxel_size_m, shard,
        )  # fmt: skip
        self.voxel_size_m, self.esdf_voxel_size_m, self.layers = c.voxel_size_m, c.esdf_voxel_size_m, c.layers
        self.max_range_m, self.esdf_max_distance_m = c.max_range_m, c.esdf_max_distance_m
        self.keep_radius_m, self.shard = c.keep_radius_m, c.shard
        self.tsdf_config, self.occupancy_config = c.tsdf_config, c.occupancy_config
        self.registration_config = c.registration_config
        self.device = v.resolve_device(device)
        self._tsdf, self._occ, self._free, self._esdf = c.build_layers(self.device)  # stored, then derived
        self._tracker = LidarTracker(self.registration_config, self.device)  # frames without a pose
        # what the ESDF must still update: source bricks whose surface or sign changed, and ESDF bricks
        # whose free-record state changed (the integrators' results and the edits, see _bind)
        self._surface_queue, self._free_queue = BrickQueue(), BrickQueue()
        self._integrators = c.integrators()  # by stored layer kind
        self._bind()
        self._last_updated: dict[str, torch.Tensor] = {}  # the bricks each layer's integrator last updated
        self.frames_integrated = 0
        self.version = 0
        self._timer = StageTimer(self.device)
        self._trajectory = Trajectory()  # the pose of every integrated frame and the map version after it
        self.read_only = False  # a read_view(): queries only
        if warmup and self.device.type == "cuda":
            warm.warm_up(self.config(), self.device)

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
        self, points_sensor, T_world_sensor=None, *, estimated: bool = False, track: bool = True, admit=None
    ) -> dict:
        """Fuse one LiDAR scan; without a pose, register it first (scan-to-map ICP, see :meth:`track_lidar`).

        Args:
            points_sensor: ``[N, 3]`` (or ``[N, 4]`` with intensity) float returns in the sensor frame.
            T_world_sensor: ``[4, 4]`` sensor-to-world transform (the sensor origin is its translation), or
                None: the map estimates it against its local registration map.
            estimated, track: passed to :meth:`track_lidar` (``track=False`` skips it: the caller already
                tracked this scan; it then needs the pose).
            admit: optional ``admit(T_world_sensor)`` (the pose to be used, the estimate for a scan without
                one; float64 ``[4, 4]`` CPU), called before the tracking state or a layer takes the scan in;
                an exception it raises refuses the scan with the map as it was (the service's memory budget
                check of a scan it had no pose for).
        Returns: ``{"points_used", "points_dropped", "T_world_sensor"}`` with the pose used as a float64
            ``[4, 4]`` CPU tensor, plus ``"registration"`` (ICP statistics: ``iterations``, ``converged``,
            ``fitness``, ``rmse_m``, ...) when the pose was estimated here.
        """
        pts = check_points("points_sensor", points_sensor, self.device)
        self._begin()
        info = None
        if track:  # the pose (the estimate) is checked before the tracker takes the scan in

            def accept(T):
                self.check_sensor_pose(T)
                if admit is not None:
                    admit(T.clone())

            with self._timer("registration"):
                T_world_sensor, info = self.track_lidar(
                    pts, T_world_sensor, estimated=estimated, accept=accept
                )
        elif T_world_sensor is None:
            raise InvalidArgument("T_world_sensor: required when track=False")
        T_host = self.check_sensor_pose(T_world_sensor).clone()  # returned as is: no copy back
        if admit is not None and not track:
            admit(T_host)
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

    def track_lidar(self, points_sensor, T_world_sensor=None, *, estimated: bool = False, accept=None):
        """The LiDAR tracking step of :meth:`integrate_lidar` alone (no layer changes).

        Without a pose, the scan is registered (KISS-ICP-style robust point-to-plane ICP, see
        ``mapper.registration.Odometry``) against a local voxel point map kept on the map's device, from a
        constant-velocity prediction; the first pose-less scan of a map that has seen no posed LiDAR scan
        gets the identity (it defines the world frame), else tracking starts from the last posed scan.
        Once tracking runs, posed scans feed it too (mixed streams); before that only the last posed scan
        is kept. ``estimated=True``: ``T_world_sensor`` is a pose this map estimated for this scan before
        (replaying a log), and the tracking state changes exactly as it did then. ``accept(T)``: see
        ``LidarTracker.track`` (a check of the estimate before the tracking state changes).

        Returns: ``(T_world_sensor float64 [4, 4] on the CPU, ICP info dict or None)``.
        """
        pts = check_points("points_sensor", points_sensor, self.device)
        T = None if T_world_sensor is None else check_pose("T_world_sensor", T_world_sensor, _HOST)
        return self._tracker.track(pts, T, estimated, accept)

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
        # counted on the device and read once the frame's work is queued (no host sync before integration;
        # a frame without a valid pixel integrates nothing: the integrators find no bricks)
        used_t = ((d > 0) & (d <= self.max_range_m)).sum()  # NaN and +-inf fail one of the two
        self._begin()
        self._integrate(DepthFrame(depth, Kt, T, col, self.max_range_m))
        cleared = self._keep_radius(T[:3, 3])
        self._keep_shard()
        self._end(T)
        used = int(used_t)
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
        esdf = self._require("esdf")
        self._writable()
        dirty, dirty_free = self._surface_queue.drain(), self._free_queue.drain()
        with self._timer("esdf"):
            return esdf.update(self._tsdf, self._occ, dirty, self.tsdf_config, self._free, dirty_free)

    # --------------------------------------------------------------------------------- maintenance
    def decay(self, factor: float = 0.5, threshold: float = 0.05) -> dict:
        """Fade old observations: weights (TSDF) and |log-odds| (occupancy) are multiplied by ``factor``;
        voxels whose weight (|log-odds|) falls below ``threshold`` become unobserved, bricks with no
        observed voxel are freed and pruned from the grid."""
        freed = maintenance.decay(self._stores, *maintenance.check_decay(factor, threshold))
        self.version += 1
        return {"bricks_freed": freed}

    def _clear_where(self, inside_fn) -> dict:
        """Remove voxels where ``inside_fn(world centres [M, 3]) -> bool`` holds."""
        freed = maintenance.clear_where(self._stores, inside_fn, self._chunk() // 64)  # ~4 KB per brick
        self.version += 1
        return {"bricks_freed": freed}

    def clear(self, aabb_min=None, aabb_max=None) -> dict:
        """Remove the voxels whose centres lie in the box ``[aabb_min, aabb_max]`` (metres); no box = all."""
        if aabb_min is None and aabb_max is None:
            return self._clear_where(lambda c: torch.ones(c.shape[0], dtype=torch.bool, device=c.device))
        lo = v.finite_vector("aabb_min", aabb_min, 3, self.device)
        hi = v.finite_vector("aabb_max", aabb_max, 3, self.device)
        if bool((lo > hi).any()):
            raise InvalidArgument("aabb_min: must be <= aabb_max on every axis")
        return self._clear_where(lambda c: ((c >= lo) & (c <= hi)).all(dim=1))

    def clear_outside(self, center_m, radius_m) -> dict:
        """Keep only voxels whose centres lie within ``radius_m`` of ``center_m`` (bounded memory)."""
        c0 = v.finite_vector("center_m", center_m, 3, self.device)
        r = v.positive("radius_m", radius_m)
        return self._clear_where(lambda c: torch.linalg.vector_norm(c - c0, dim=1) > r)

    # ---------------------------------------------------------------------------------- persistence
    def config(self) -> dict:
        """The constructor arguments (JSON-serialisable); ``Map(**m.config())`` makes an empty twin."""
        return self._config.to_dict()

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(CPU tensors, JSON metadata) of the whole map (:mod:`mapper.map_io`). The ESDF is not stored: it
        is recomputed from the surface on the first ``update_esdf`` after loading."""
        return map_io.state_dict(self)

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], meta: dict, device=None) -> Map:
        """Rebuild a map saved with :meth:`state_dict` (on ``device``, default: CUDA when available)."""
        m = cls(**meta["config"], device=device)  # older snapshots: the ESDF voxel takes its default
        return map_io.load_state(m, tensors, meta)

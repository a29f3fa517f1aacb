"""The read side of a :class:`~mapper.map.Map`: point and lattice queries, ray casting, layer views, meshes,
the trajectory and reports. ``Map`` (the write side: the frame recipe, the ESDF update, edits, snapshots)
inherits it, so these are ``Map``'s own methods; nothing here changes a layer, so a ``Map.read_view()``
answers all of it. The one write reachable from here is bringing the ESDF up to date before a distance
query (``update_esdf=True``, never on a read view).

A ``MapReads`` reads what ``Map.__init__`` sets: ``device``, ``layers``, ``voxel_size_m``,
``esdf_voxel_size_m``, ``esdf_max_distance_m``, ``max_range_m``, ``tsdf_config``, the layers ``_tsdf``,
``_occ``, ``_free``, ``_esdf`` and their ``_stores``, the ESDF queues, ``_trajectory``, ``_timer``,
``frames_integrated``, ``version``, ``read_only``. The work is done in :mod:`mapper.queries`,
:mod:`mapper.raycast`, :mod:`mapper.mesh` and the layer kinds (:mod:`mapper.layer_kinds`).
"""

from __future__ import annotations

import torch

from . import _validation as v
from . import queries as Q
from .errors import InvalidArgument, NotFound
from .grid import IndexGrid
from .integrators.common import check_intrinsics, check_pose
from .layer_kinds import StoredLayer
from .layers import BrickLayer
from .mesh import Mesh, extract_mesh, mesh_since
from .raycast import raycast_tsdf

# points per chunk of a point query (bounds its temporaries: ~1.2 KB per point in one piece on the CPU torch
# path, so a 16 M-cell slice needed ~20 GB; chunked, a query costs its outputs plus one chunk's working set)
QUERY_CHUNK = {"cpu": 1 << 15, "cuda": 1 << 20}


def bricks_extent(bricks: torch.Tensor, voxel_size_m: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(min float64 [3], max float64 [3]) metres of the whole bricks (int64 ``[B, 3]``, ``B > 0``) of a
    layer with voxel ``voxel_size_m``."""
    s4 = 4 * voxel_size_m
    return bricks.min(dim=0).values.double() * s4, (bricks.max(dim=0).values + 1).double() * s4


class MapReads:
    """Queries, views, meshes and reports of a map (see the module's docstring)."""

    # ------------------------------------------------------------------------------------------ layers
    def _brick_layers(self) -> list[tuple[str, StoredLayer]]:
        """(kind, layer) of the stored layers: tsdf, occupancy and the free record ("free", ESDF voxels)."""
        return [(layer.kind, layer) for layer, _ in self._stores]

    def _all_layers(self) -> list[tuple[str, BrickLayer]]:
        """The stored layers, then the ESDF's ("esdf")."""
        return self._brick_layers() + ([("esdf", self._esdf.layer)] if self._esdf is not None else [])

    # the registry as callers outside the map read it (warm-up, service, cluster): no private fields
    def stored_layer(self, kind: str) -> StoredLayer | None:
        """The stored layer of ``kind`` (``"tsdf"``, ``"occupancy"``, ``"free"``), or None."""
        return next((la for k, la in self._brick_layers() if k == kind), None)

    def brick_layers(self) -> list[tuple[str, BrickLayer]]:
        """(kind, brick layer) of every layer the map holds: the stored ones, then the ESDF's (``"esdf"``)."""
        return self._all_layers()

    @property
    def has_esdf(self) -> bool:
        """True when the map derives an ESDF from its stored layers."""
        return self._esdf is not None

    def esdf_bounds(self, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The extent (min, max float64 [3] metres) of the ESDF and the known free space; raises
        ``InvalidArgument`` when the map has no ESDF yet."""
        return self._esdf_bounds(update)

    @property
    def esdf_layer(self) -> BrickLayer | None:
        """The ESDF's brick layer (its stored distances), or None when the map has no ESDF."""
        return self._esdf.layer if self._esdf is not None else None

    @property
    def esdf_brick_radius(self) -> int | None:
        """How many bricks around a surface brick the ESDF reaches (``Rb = ceil(margin / 4)``), or None
        when the map has no ESDF."""
        return self._esdf.brick_radius if self._esdf is not None else None

    @property
    def esdf_last_update(self) -> dict:
        """The report of the ESDF's last update (e.g. ``computed_voxels``); empty without an ESDF or
        before its first update."""
        return self._esdf.last if self._esdf is not None else {}

    def _require(self, name: str):
        """The layer answering the public layer ``name`` (the ESDF's integrator for the ESDF)."""
        if name in self.layers:
            for layer, _ in self._stores:
                if name in layer.views:
                    return layer
            return self._esdf  # the one public layer that is not stored: derived from the others
        raise NotFound(f"layer {name!r} is not enabled on this map (layers: {self.layers})")

    def _chunk(self) -> int:
        return QUERY_CHUNK.get(self.device.type, 1 << 15)

    def query_tsdf(self, points_world) -> tuple[torch.Tensor, torch.Tensor]:
        """Trilinear TSDF at ``[M, 3]`` world points: (tsdf float32 [M] metres, NaN where any of the 8
        corner voxels is unobserved; weight float32 [M], 0 there)."""
        layer = self._require("tsdf")
        p = Q.check_query_points("points_world", points_world, self.device)
        return Q.chunked(lambda q: Q.tsdf_at(layer, q, self.voxel_size_m), p, step=self._chunk())

    def query_occupancy(self, points_world) -> tuple[torch.Tensor, torch.Tensor]:
        """Occupancy of the voxel holding each ``[M, 3]`` world point: (state int8 [M]: -1 unknown, 0 free,
        1 occupied; probability float32 [M], 0.5 where unknown)."""
        layer = self._require("occupancy")
        p = Q.check_query_points("points_world", points_world, self.device)
        return Q.chunked(lambda q: Q.occupancy_at(layer, q, self.voxel_size_m), p, step=self._chunk())

    def query_distance(
        self, points_world, update_esdf: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Signed distance at ``[M, 3]`` world points, trilinear in the ESDF voxels: (distance float32 [M]
        metres, NaN where unknown; gradient float32 [M, 3] of the interpolant; observed bool [M]). Voxels
        farther than ``esdf_max_distance_m`` from every surface that the map has observed count as that
        distance. Brings the ESDF up to date first (free when nothing changed) unless ``update_esdf`` is
        False (then the map is only read: a service keeps the ESDF current in its writer)."""
        distance = self._distance(update_esdf)
        p = Q.check_query_points("points_world", points_world, self.device)
        return Q.chunked(distance, p, step=self._chunk())

    def esdf_slice(
        self, z_m, aabb_min_xy=None, aabb_max_xy=None, resolution_m=None, max_pixels=1 << 24, update_esdf=True
    ) -> Q.Slice:
        """The ESDF on the plane ``z = z_m`` over ``[aabb_min_xy, aabb_max_xy]`` (default: the ESDF's
        extent) at ``resolution_m`` (default: the ESDF voxel size); NaN = unknown."""
        return Q.esdf_slice(
            lambda: self._distance(update_esdf), lambda: self._esdf_bounds(update_esdf), self.device,
            self._chunk(), self.esdf_voxel_size_m, z_m, aabb_min_xy, aabb_max_xy, resolution_m, max_pixels,
        )  # fmt: skip

    def esdf_box(
        self, aabb_min, aabb_max, resolution_m=None, max_voxels=1 << 24, update_esdf=True
    ) -> Q.EsdfBox:
        """Dense ESDF, its gradient and the observed mask on a box (samples at voxel-size spacing by
        default: the ESDF voxel size), like nvblox's EsdfAndGradients service."""
        return Q.esdf_box(
            lambda: self._distance(update_esdf), self.device, self._chunk(), self.esdf_voxel_size_m,
            aabb_min, aabb_max, resolution_m, max_voxels,
        )  # fmt: skip

    def raycast(self, T_world_sensor, K, width: int, height: int, max_range_m: float | None = None):
        """Render depth (metres along the optical axis, 0 = nothing) and world normals [H, W, 3] of the TSDF
        surface seen by a pinhole camera (OpenCV axes), by sphere tracing the trilinear TSDF."""
        layer = self._require("tsdf")
        T = check_pose("T_world_sensor", T_world_sensor, self.device)
        for name, val in (("width", width), ("height", height)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0 or val > 8192:
                raise InvalidArgument(f"{name}: expected an int in [1, 8192], got {val!r}")
        Kt = check_intrinsics("K", K, self.device, (height, width))
        rng = self.max_range_m if max_range_m is None else v.positive("max_range_m", max_range_m)
        return raycast_tsdf(layer, T, Kt, width, height, self.voxel_size_m, self.tsdf_config.tau, rng)

    # ------------------------------------------------------------------------------------------ ESDF
    @property
    def esdf_dirty(self) -> bool:
        """True when frames or edits since the last ``update_esdf()`` may have changed the ESDF."""
        return bool(self._surface_queue or self._free_queue)

    def _esdf_current(self, update: bool = True):
        esdf = self._require("esdf")
        if update and not self.read_only and self.esdf_dirty:
            self.update_esdf()
        return esdf

    def _distance(self, update: bool = True):
        """``points float64 [m, 3] -> (distance, gradient, observed)`` (:func:`mapper.queries.distance_at`)
        on the ESDF (brought up to date first unless ``update`` is False or this is a read view), with the
        layers that tell whether an ESDF voxel outside the ESDF layer (farther than the max distance from
        every site) was observed, at the ESDF's voxel: the source layers on the same lattice only; the free
        record always (it has the ESDF voxel)."""
        esdf = self._esdf_current(update)
        same = esdf.same_lattice
        tsdf = self._tsdf if same else None
        occ = self._occ if (same and self._occ is not None) else self._free
        s, md = self.esdf_voxel_size_m, self.esdf_max_distance_m
        return lambda q: Q.distance_at(esdf.layer, q, s, md, tsdf, occ)

    def _esdf_bounds(self, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The extent (min, max float64 [3] metres) of the ESDF and the known free space."""
        bricks, _ = self._esdf_current(update).layer.brick_table()
        if self._free is not None and self._free.grid.num_leaves:  # the known free space counts too
            bricks = torch.cat((bricks, self._free.brick_table()[0]))
        if bricks.shape[0] == 0:
            raise InvalidArgument("the map has no ESDF yet: pass explicit bounds")
        return bricks_extent(bricks, self.esdf_voxel_size_m)

    # ---------------------------------------------------------------------------------------- views
    def layer(self, name: str) -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """(grid, sidecars) of a layer in the grid's voxel order: a copy of the current epoch.

        tsdf -> {"tsdf" (m), "weight"}; color -> {"color" uint8 [N, 3], "weight"}; occupancy ->
        {"log_odds" (NaN = unknown)}; esdf -> {"esdf" (m), "observed" bool}.
        """
        layer = self._require(name)
        return layer.view() if layer is self._esdf else layer.view(name)

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
            bricks, _ = layer.brick_table()
            if bricks.shape[0]:
                lo, hi = bricks_extent(bricks, layer.voxel_size_m)  # the free record has the ESDF's voxel
                out[name] = (lo.tolist(), hi.tolist())
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
        layer = self._require("tsdf")
        if since_version is None:
            return extract_mesh(layer, self.voxel_size_m)
        return mesh_since(layer, self.voxel_size_m, since_version)

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
        """Voxels, bricks, bytes (topology apart) and per-kind statistics per layer, frames integrated,
        version and the last frame's per-stage timings (ms). O(voxels)."""
        layers = {}
        for name, layer in self._brick_layers():
            layers[name] = {
                "voxels": layer.grid.num_voxels,
                "bricks": layer.num_bricks,
                "bytes": layer.nbytes,
                "topology_bytes": layer.grid.nbytes + layer.slots.numel() * 4,
                **layer.extra_stats(),
            }
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

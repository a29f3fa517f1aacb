"""The voxel-hashed local map of the registration: :func:`voxel_downsample` and :class:`VoxelPointMap` (up to
``K`` points per voxel, a plane per voxel, removal of far voxels)."""

from __future__ import annotations

import math

import torch

from .. import _validation as v
from ..errors import InvalidArgument
from ..integrators.common import check_points, keys_to_ijk
from ..kernels import nn
from ..kernels.dispatch import compiled
from .checks import _int_at_least, _non_negative, _positive


def _voxel_ijk(points: torch.Tensor, voxel_size: float, name: str) -> torch.Tensor:
    ijk = torch.floor(points / voxel_size).to(torch.int64)
    if ijk.numel() and bool((ijk.abs() >= nn.KEY_LIMIT).any()):
        raise InvalidArgument(
            f"{name}: points farther than {nn.KEY_LIMIT} voxels ({nn.KEY_LIMIT * voxel_size:.0f} m) "
            "from the origin"
        )
    return ijk


def voxel_downsample(points: torch.Tensor, voxel_size_m: float) -> torch.Tensor:
    """The first point (in input order) of every occupied voxel of edge ``voxel_size_m``.

    Args: points: float ``[N, 3]`` (any device). Returns: ``[M, 3]`` of the same dtype, in input order (so
    that the map's "first K points per voxel" means the first in the sensor's order).
    """
    if points.shape[0] == 0:
        return points
    keys = nn.voxel_keys(_voxel_ijk(points, voxel_size_m, "points"))
    sk, order = torch.sort(keys, stable=True)
    first = torch.ones_like(sk, dtype=torch.bool)
    first[1:] = sk[1:] != sk[:-1]
    keep = torch.zeros_like(first)
    keep[order[first]] = True  # a mask, not an index: the survivors stay in input order without a sort
    return points[keep]


def _smallest_eigen(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form eigen-analysis of symmetric ``[T, 3, 3]`` float64 matrices: (smallest eigenvalue,
    middle eigenvalue, unit eigenvector of the smallest). Trigonometric solution of the characteristic
    cubic; the eigenvector is the largest cross product of two rows of ``C - lambda I``."""
    eye = torch.eye(3, dtype=C.dtype, device=C.device)
    q = C.diagonal(dim1=-2, dim2=-1).sum(-1) / 3
    off = C[:, 0, 1] ** 2 + C[:, 0, 2] ** 2 + C[:, 1, 2] ** 2
    p2 = ((C.diagonal(dim1=-2, dim2=-1) - q[:, None]) ** 2).sum(-1) + 2 * off
    p = torch.sqrt(p2 / 6).clamp_min(1e-30)
    B = (C - q[:, None, None] * eye) / p[:, None, None]
    r = (torch.linalg.det(B) / 2).clamp(-1.0, 1.0)
    phi = torch.arccos(r) / 3
    l_max = q + 2 * p * torch.cos(phi)
    l_min = q + 2 * p * torch.cos(phi + 2 * math.pi / 3)
    l_mid = 3 * q - l_max - l_min
    M = C - l_min[:, None, None] * eye
    c = torch.stack(
        [
            torch.linalg.cross(M[:, 0], M[:, 1]),
            torch.linalg.cross(M[:, 0], M[:, 2]),
            torch.linalg.cross(M[:, 1], M[:, 2]),
        ],
        1,
    )
    nrm = torch.linalg.vector_norm(c, dim=-1)
    best = nrm.argmax(1)
    ar = torch.arange(C.shape[0], device=C.device)
    vec = c[ar, best] / nrm[ar, best, None].clamp_min(1e-30)
    return l_min, l_mid, vec


_NEIGHBOUR_OFFSETS_27 = torch.tensor(
    [(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)], dtype=torch.float64
)  # the order of nn.key_offsets(27)
_SYM = (0, 1, 2, 4, 5, 8)  # xx, xy, xz, yy, yz, zz in a flattened 3x3


def _point_moments(local: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, 10]``: (1, x, y, z, xx, xy, xz, yy, yz, zz) of points ``[N, 3]``."""
    outer = (local[:, :, None] * local[:, None, :]).reshape(-1, 9)[:, _SYM]
    return torch.cat([torch.ones_like(local[:, :1]), local, outer], 1)


def _shift_moments(m: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Moments ``[..., 10]`` of points ``p`` -> the moments of ``p + off`` (``off`` ``[..., 3]``)."""
    n, s = m[..., :1], m[..., 1:4]
    o = off.expand_as(s)
    outer = (s[..., :, None] * o[..., None, :]).flatten(-2)
    sym = (
        outer
        + (o[..., :, None] * s[..., None, :]).flatten(-2)
        + n * (o[..., :, None] * o[..., None, :]).flatten(-2)
    )
    return torch.cat([n, s + n * o, m[..., 4:] + sym[..., _SYM]], -1)


def _moment_planes(m: torch.Tensor):
    """(smallest eigenvalue, middle eigenvalue, normal) of the covariance of moments ``[T, 10]``."""
    n = m[:, 0].clamp_min(1)
    mean = m[:, 1:4] / n[:, None]
    c6 = m[:, 4:] / n[:, None] - (mean[:, :, None] * mean[:, None, :]).reshape(-1, 9)[:, _SYM]
    C = torch.stack(
        [c6[:, 0], c6[:, 1], c6[:, 2], c6[:, 1], c6[:, 3], c6[:, 4], c6[:, 2], c6[:, 4], c6[:, 5]], 1
    )
    return _smallest_eigen(C.reshape(-1, 3, 3))


class VoxelPointMap:
    """Voxel-hashed local point map on one device (the KISS-ICP map, plus a plane per voxel).

    State (all on ``device``):

    * ``points`` float32 ``[C, 3, K]``: slot ``c`` holds ``counts[c]`` points (the first ``K`` kept),
      coordinates-major, unused rows at ``nn.EMPTY``; ``counts`` int64 ``[C]`` (0 = free slot);
      ``slot_keys`` int64 ``[C]`` (-1 = free);
    * ``keys``/``slots`` int64 ``[V]``: the occupied voxels' keys sorted ascending, and their slots;
    * ``moments`` float64 ``[C, 10]``: count, sums and sums of products of the points relative to the voxel
      centre (planes of neighbourhoods are sums of these);
    * ``normals`` float32 ``[C, 3]`` and ``flatness`` float32 ``[C]``: the plane of the voxel's points (of
      its 3x3x3 neighbourhood when the voxel alone has fewer than 5 points or they lie on one scan line)
      and the weight of the point-to-point term: 0 where ``lambda_min / lambda_mid < 0.1``, rising to 1 at
      0.5. Where no plane can be fitted at all, normal and flatness are 0: the voxel constrains nothing
      (point-to-point there pulls scan rings onto scan rings).

    Args:
        voxel_size_m: voxel edge.
        max_points_per_voxel: ``K``.
        min_point_spacing_m: a new point closer than this to a point already in its voxel is dropped
            (default ``voxel_size_m / sqrt(K)``, KISS-ICP's rule).
        device: torch device (default CPU).
    """

    def __init__(
        self,
        voxel_size_m: float,
        max_points_per_voxel: int = 20,
        min_point_spacing_m: float | None = None,
        device: str | torch.device | None = "cpu",
    ):
        self.voxel_size_m = _positive("voxel_size_m", voxel_size_m)
        self.max_points = _int_at_least("max_points_per_voxel", max_points_per_voxel, 1)
        if min_point_spacing_m is None:
            min_point_spacing_m = self.voxel_size_m / math.sqrt(self.max_points)
        self.min_point_spacing_m = _non_negative("min_point_spacing_m", min_point_spacing_m)
        self.device = v.resolve_device(device)
        self._alloc(0)

    @classmethod
    def from_points(cls, points, voxel_size_m: float, **kwargs) -> VoxelPointMap:
        """A map of ``points`` (float ``[N, 3]``, map frame); ``kwargs`` as the constructor's."""
        m = cls(voxel_size_m, **kwargs)
        m.add_points(check_points("points", points, m.device))
        return m

    def _alloc(self, capacity: int) -> None:
        dev, K = self.device, self.max_points
        self.points = torch.full((capacity, 3, K), nn.EMPTY, dtype=torch.float32, device=dev)
        self.counts = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.slot_keys = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
        self.normals = torch.zeros((capacity, 3), dtype=torch.float32, device=dev)
        self.flatness = torch.ones(capacity, dtype=torch.float32, device=dev)
        self.moments = torch.zeros((capacity, 10), dtype=torch.float64, device=dev)
        self.keys = torch.zeros(0, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(0, dtype=torch.int64, device=dev)

    def _grow(self, capacity: int) -> None:
        old = (self.points, self.counts, self.slot_keys, self.normals, self.flatness, self.moments)
        keys, slots = self.keys, self.slots
        self._alloc(capacity)
        n = old[0].shape[0]
        new = (self.points, self.counts, self.slot_keys, self.normals, self.flatness, self.moments)
        for dst, src in zip(new, old, strict=True):
            dst[:n] = src
        self.keys, self.slots = keys, slots

    # ------------------------------------------------------------------------------------- queries
    @property
    def num_voxels(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_points(self) -> int:
        return int(self.counts.sum())

    def empty(self) -> bool:
        return self.num_voxels == 0

    def point_cloud(self) -> torch.Tensor:
        """float32 ``[M, 3]``: every map point."""
        rows = torch.arange(self.max_points, device=self.device)
        return self.points.transpose(1, 2)[rows[None, :] < self.counts[:, None]]

    def point_at(self, index: torch.Tensor) -> torch.Tensor:
        """float32 ``[M, 3]``: the points of ``index`` (``slot * K + k``, as :meth:`nearest` returns)."""
        return self.points[index // self.max_points, :, index % self.max_points]

    def nearest(
        self, queries: torch.Tensor, max_distance_m: float, neighbourhood: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dist float32 [N], index int64 [N])`` of the nearest map point to each float32 ``[N, 3]`` query
        (``slot * K + k``, see :meth:`point_at`; -1 where none is within ``max_distance_m``); the search
        visits the voxels of :meth:`neighbourhood` by default (see ``mapper.kernels.nn``)."""
        if neighbourhood is None:
            neighbourhood = self.neighbourhood(max_distance_m)
        return nn.nearest_in_voxel_map(
            queries,
            self.keys,
            self.slots,
            self.points,
            self.voxel_size_m,
            float(max_distance_m),
            neighbourhood,
        )

    def neighbourhood(self, max_distance_m: float) -> int:
        """8 candidate voxels when ``max_distance_m <= voxel_size_m / 2`` (exact), else 27."""
        return 8 if max_distance_m <= 0.5 * self.voxel_size_m else 27

    def searcher(self, max_distance_m: float):
        """A function ``queries -> (dist, index)`` like :meth:`nearest`, for repeated queries of slowly moving
        points (ICP iterations): on the torch path it keeps each query's candidate voxels and looks up again
        only the queries that crossed into another voxel block."""
        nbh = self.neighbourhood(max_distance_m)
        if compiled(self.device):
            return lambda q: self.nearest(q, max_distance_m, nbh)
        state: dict = {}

        def find(q: torch.Tensor):
            base = nn.base_voxels(q, self.voxel_size_m, nbh)
            cand = state.get("cand")
            if cand is None or cand.shape[0] != q.shape[0]:
                cand = nn.candidate_slots(q, self.keys, self.slots, self.voxel_size_m, nbh)
            else:
                moved = (base != state["base"]).any(1).nonzero().squeeze(1)
                if moved.numel():
                    cand[moved] = nn.candidate_slots(q[moved], self.keys, self.slots, self.voxel_size_m, nbh)
            state["cand"], state["base"] = cand, base
            return nn.nearest_among_slots(q, cand, self.points, self.voxel_size_m, max_distance_m, nbh)

        return find

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The occupied voxels, compacted (slot ``i`` = ``keys[i]``): names start with ``prefix``."""
        s = self.slots
        return {
            prefix + "keys": self.keys,
            prefix + "points": self.points[s],
            prefix + "counts": self.counts[s],
            prefix + "normals": self.normals[s],
            prefix + "flatness": self.flatness[s],
            prefix + "moments": self.moments[s],
        }

    def load_state_dict(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
        """Replace the content with :meth:`state_dict`'s (same voxel size and ``K``)."""
        keys = tensors[prefix + "keys"].to(self.device, torch.int64)
        points = tensors[prefix + "points"]
        if points.shape[1:] != (3, self.max_points):
            want = f"[V, 3, {self.max_points}]"
            raise InvalidArgument(f"{prefix}points: expected {want}, got {list(points.shape)}")
        self._alloc(keys.shape[0])
        self.points.copy_(points)
        self.counts.copy_(tensors[prefix + "counts"])
        self.normals.copy_(tensors[prefix + "normals"])
        self.flatness.copy_(tensors[prefix + "flatness"])
        self.moments.copy_(tensors[prefix + "moments"])
        self.slot_keys = keys.clone()
        self.keys = keys
        self.slots = torch.arange(keys.shape[0], device=self.device)

    # ------------------------------------------------------------------------------------- updates
    def add_points(self, points: torch.Tensor) -> None:
        """Insert float32 ``[N, 3]`` map-frame points: per voxel, points closer than ``min_point_spacing_m``
        to a point already in the map are dropped, then the first ``K`` are kept; planes of the touched
        voxels are refitted. Within one call the spacing is approximated by keeping the first point per cell
        of a grid of that edge (so that a dense cloud covers its voxels instead of filling them with its
        first K points)."""
        if points.shape[0] == 0:
            return
        K, dev = self.max_points, self.device
        if self.min_point_spacing_m > 0:
            points = voxel_downsample(points, self.min_point_spacing_m)
        keys = nn.voxel_keys(_voxel_ijk(points, self.voxel_size_m, "points"))
        keys, order = torch.sort(keys, stable=True)
        pts = points[order]
        slot = torch.full_like(keys, -1)
        V = self.keys.shape[0]
        if V:
            pos = torch.searchsorted(self.keys, keys).clamp_(max=V - 1)
            hit = self.keys[pos] == keys
            slot = torch.where(hit, self.slots[pos], slot)
            if self.min_point_spacing_m > 0:  # spacing rule against the points already in the voxel
                h = hit.nonzero().squeeze(1)
                d2 = (self.points[slot[h]] - pts[h, :, None]).square().sum(1)  # unused rows are far
                close = torch.zeros_like(hit)
                close[h] = d2.amin(1) < self.min_point_spacing_m**2
                keep = ~close
                keys, pts, slot = keys[keep], pts[keep], slot[keep]
        if keys.numel() == 0:
            return
        # group the new points by voxel; rank = position inside the group (input order: stable sort)
        head = torch.ones_like(keys, dtype=torch.bool)
        head[1:] = keys[1:] != keys[:-1]
        group = torch.cumsum(head, 0) - 1
        starts = head.nonzero().squeeze(1)
        rank = torch.arange(keys.numel(), device=dev) - starts[group]
        g_keys, g_slot = keys[starts], slot[starts]
        new = g_slot < 0
        n_new = int(new.sum())
        if n_new:
            free = (self.slot_keys < 0).nonzero().squeeze(1)
            if free.numel() < n_new:
                cap = self.points.shape[0]
                self._grow(max(cap + n_new - free.numel(), int(cap * 1.5), 1024))
                free = (self.slot_keys < 0).nonzero().squeeze(1)
            got = free[:n_new]
            g_slot = g_slot.clone()
            g_slot[new] = got
            self.slot_keys[got] = g_keys[new]
            merged_keys = torch.cat([self.keys, g_keys[new]])
            merged_slots = torch.cat([self.slots, got])
            self.keys, perm = torch.sort(merged_keys)
            self.slots = merged_slots[perm]
        slot = g_slot[group]
        row = self.counts[slot] + rank
        ok = row < K
        slot, row = slot[ok], row[ok]
        if slot.numel() == 0:
            return
        pts = pts[ok]
        self.points[slot, :, row] = pts
        self.counts.index_add_(0, slot, torch.ones_like(slot))
        local = pts.to(torch.float64) - self._centres(slot)
        self.moments.index_add_(0, slot, _point_moments(local))
        self._fit_planes(torch.unique(slot))

    def _centres(self, slots: torch.Tensor) -> torch.Tensor:
        """float64 ``[T, 3]`` centres of the voxels of ``slots``."""
        return (keys_to_ijk(self.slot_keys[slots]).to(torch.float64) + 0.5) * self.voxel_size_m

    def _fit_planes(self, slots: torch.Tensor) -> None:
        """Refit the plane (normal, flatness) of the given slots from the moments of their points; a voxel
        whose own points are too few or lie on a line (one scan ring) uses the points of its 3x3x3
        neighbourhood instead."""
        v = self.voxel_size_m
        own = self.moments[slots]
        l_min, l_mid, normal = _moment_planes(own)
        n_pts = own[:, 0]
        ok = (n_pts >= 5) & (l_mid >= (0.1 * v) ** 2)
        need = (~ok).nonzero().squeeze(1)
        if need.numel():
            nk = self.slot_keys[slots[need]][:, None] + nn.key_offsets(27, self.device)  # [T, 27]
            V = self.keys.shape[0]
            pos = torch.searchsorted(self.keys, nk).clamp_(max=V - 1)
            found = self.keys[pos] == nk
            m = self.moments[self.slots[pos]] * found[..., None]  # [T, 27, 10], centred on each voxel
            off = _NEIGHBOUR_OFFSETS_27.to(self.device) * v  # neighbour centre - centre voxel centre
            total = _shift_moments(m, off).sum(1)
            a, b, nrm = _moment_planes(total)
            l_min[need], l_mid[need], normal[need], n_pts[need] = a, b, nrm, total[:, 0]
        ratio = l_min.clamp_min(0) / l_mid.clamp_min(1e-12)
        flat = ((ratio - 0.1) / 0.4).clamp(0.0, 1.0)
        # no plane (too few points, or a single scan line even in the neighbourhood): no constraint at all;
        # point-to-point there would pull scan rings onto scan rings
        usable = (n_pts >= 5) & (l_mid >= (0.05 * v) ** 2)
        self.normals[slots] = torch.where(usable[:, None], normal, torch.zeros_like(normal)).to(torch.float32)
        self.flatness[slots] = torch.where(usable, flat, torch.zeros_like(flat)).to(torch.float32)

    def remove_far(self, origin, max_distance_m: float) -> int:
        """Drop the voxels whose first point is ``max_distance_m`` or farther from ``origin`` (3 floats);
        returns how many."""
        if self.keys.numel() == 0:
            return 0
        o = torch.as_tensor(origin, dtype=torch.float32, device=self.device).reshape(3)
        first = self.points[self.slots, :, 0]
        far = (first - o).square().sum(-1) >= float(max_distance_m) ** 2
        n = int(far.sum())
        if n:
            gone = self.slots[far]
            self.counts[gone] = 0
            self.points[gone] = nn.EMPTY
            self.slot_keys[gone] = -1
            self.flatness[gone] = 1.0
            self.moments[gone] = 0.0
            self.keys, self.slots = self.keys[~far], self.slots[~far]
        return n

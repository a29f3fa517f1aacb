"""LiDAR registration: scan-to-map point-to-plane ICP against a voxel-hashed local map (KISS-ICP style).

Pieces, in the order the pipeline uses them:

* SE(3) helpers: :func:`se3_exp`, :func:`se3_log` (float64, batched), twist = ``(translation, rotation)``.
* :func:`voxel_downsample`: first point per voxel (input order).
* :class:`VoxelPointMap`: up to ``K`` points per voxel in fixed-capacity slots (``points [C, 3, K]``, the
  first K kept, at least ``min_point_spacing_m`` apart), sorted int64 voxel keys for lookup, a plane per voxel
  (PCA of its points) for the point-to-plane residual, removal of voxels far from the sensor.
* :func:`align`: robust Gauss-Newton ICP of a cloud against a map (nearest neighbours from
  ``mapper.kernels.nn``), :func:`register`: the same for two clouds.
* :class:`AdaptiveThreshold`, :class:`OdometryConfig`, :class:`Odometry`: the scan-to-map odometry
  (``Odometry.register_frame`` reads as the recipe).

Residual. A correspondence ``(p, q)`` (source point in the map frame, nearest map point) in a voxel with
plane normal ``n`` and flatness ``beta = lambda_min / lambda_mid`` of its points' covariance costs
``r^2 = (1 - beta) (n . (p - q))^2 + beta |p - q|^2``: point-to-plane on flat voxels, point-to-point on
edges, poles, vegetation and voxels with too few points to fit a plane (``beta = 1``). The Geman-McClure
weight ``(s^2 / (s^2 + r^2))^2`` (scale ``s``) makes the least squares robust; the 6x6 normal equations are
accumulated and solved in float64. Updates rotate about the current sensor position (left perturbation
``T <- exp(dx) T`` in a frame centred on the sensor), which keeps the system well conditioned far from the
world origin.

Frames: ``T_world_sensor`` / ``T_target_source`` are float64 ``[4, 4]`` rigid transforms mapping
source/sensor coordinates into world/target coordinates; they live on the CPU (a GPU would only add tiny
launches and syncs for 4x4 algebra). Points are float32 ``[N, 3]`` on the compute device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import _validation as v
from ..errors import InvalidArgument, InvalidArgumentType
from ..integrators.common import check_points, check_pose, keys_to_ijk
from ..kernels import nn
from ..kernels.dispatch import compiled

KERNELS = ("geman_mcclure", "huber", "none")
_HOST = torch.device("cpu")  # poses (float64 4x4) live on the host, whatever the points' device


# ------------------------------------------------------------------------------------------------ SE(3)
def skew(w: torch.Tensor) -> torch.Tensor:
    """``[..., 3] -> [..., 3, 3]`` cross-product matrices (``skew(a) @ b = a x b``)."""
    z = torch.zeros_like(w[..., 0])
    x, y, zz = w[..., 0], w[..., 1], w[..., 2]
    return torch.stack([z, -zz, y, zz, z, -x, -y, x, z], dim=-1).reshape(*w.shape[:-1], 3, 3)


def _so3_coeffs(theta: torch.Tensor):
    """(sin t / t, (1 - cos t) / t^2, (t - sin t) / t^3) with Taylor series near 0."""
    t2 = theta * theta
    small = theta < 1e-4
    ts = torch.where(small, torch.ones_like(theta), theta)
    a = torch.where(small, 1 - t2 / 6, torch.sin(ts) / ts)
    b = torch.where(small, 0.5 - t2 / 24, (1 - torch.cos(ts)) / (ts * ts))
    c = torch.where(small, 1.0 / 6 - t2 / 120, (ts - torch.sin(ts)) / (ts * ts * ts))
    return a, b, c


def se3_exp(xi: torch.Tensor) -> torch.Tensor:
    """Exponential map: twists ``[..., 6]`` = (translation-like ``rho``, rotation vector ``phi``) ->
    float64 ``[..., 4, 4]``: ``R = exp([phi]x)``, ``t = V(phi) rho``."""
    xi = xi.to(torch.float64)
    rho, phi = xi[..., :3], xi[..., 3:]
    theta = torch.linalg.vector_norm(phi, dim=-1)
    a, b, c = _so3_coeffs(theta)
    K = skew(phi)
    K2 = K @ K
    eye = torch.eye(3, dtype=torch.float64, device=xi.device).expand(K.shape)
    R = eye + a[..., None, None] * K + b[..., None, None] * K2
    V = eye + b[..., None, None] * K + c[..., None, None] * K2
    T = torch.zeros(*xi.shape[:-1], 4, 4, dtype=torch.float64, device=xi.device)
    T[..., :3, :3] = R
    T[..., :3, 3] = (V @ rho[..., None])[..., 0]
    T[..., 3, 3] = 1.0
    return T


def se3_log(T: torch.Tensor) -> torch.Tensor:
    """Logarithm: float ``[..., 4, 4]`` rigid transforms -> twists ``[..., 6]`` (inverse of :func:`se3_exp`
    for rotation angles in ``[0, pi)``; at exactly ``pi`` the sign of the axis is arbitrary)."""
    T = T.to(torch.float64)
    R, t = T[..., :3, :3], T[..., :3, 3]
    cos = ((R.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    vee = torch.stack(
        [R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0], R[..., 1, 0] - R[..., 0, 1]], -1
    )
    a, b, _ = _so3_coeffs(theta)
    phi = vee / (2 * a[..., None])
    # near pi, sin(theta) ~ 0 loses the axis: take it from the symmetric part (R + I) / 2 = cos-term + u u^T
    near_pi = theta > math.pi - 1e-3
    if bool(near_pi.any()):
        S = (R + torch.eye(3, dtype=torch.float64, device=T.device)) / 2
        d = S.diagonal(dim1=-2, dim2=-1)
        k = d.argmax(-1, keepdim=True)
        col = torch.gather(S, -1, k[..., None, :].expand(*S.shape[:-1], 1))[..., 0]
        axis = col / torch.linalg.vector_norm(col, dim=-1, keepdim=True).clamp_min(1e-12)
        sgn = torch.where((axis * vee).sum(-1, keepdim=True) < 0, -1.0, 1.0)
        phi = torch.where(near_pi[..., None], sgn * axis * theta[..., None], phi)
    K = skew(phi)
    th = torch.linalg.vector_norm(phi, dim=-1)
    a, b, _ = _so3_coeffs(th)
    small = th < 1e-4
    bs = torch.where(small, torch.ones_like(b), b)
    ths = torch.where(small, torch.ones_like(th), th)
    d = torch.where(small, torch.full_like(th, 1.0 / 12), (1 - a / (2 * bs)) / (ths * ths))
    eye = torch.eye(3, dtype=torch.float64, device=T.device).expand(K.shape)
    V_inv = eye - 0.5 * K + d[..., None, None] * (K @ K)
    rho = (V_inv @ t[..., None])[..., 0]
    return torch.cat([rho, phi], -1)


def _skew_np(w: np.ndarray) -> np.ndarray:
    return np.array([[0.0, -w[2], w[1]], [w[2], 0.0, -w[0]], [-w[1], w[0], 0.0]])


def _se3_exp_np(xi: np.ndarray) -> np.ndarray:
    """:func:`se3_exp` of one twist on the host (numpy float64 ``[6] -> [4, 4]``)."""
    rho, phi = xi[:3], xi[3:]
    th = float(np.linalg.norm(phi))
    if th < 1e-4:
        a, b, c = 1 - th * th / 6, 0.5 - th * th / 24, 1.0 / 6 - th * th / 120
    else:
        a, b, c = math.sin(th) / th, (1 - math.cos(th)) / th**2, (th - math.sin(th)) / th**3
    K = _skew_np(phi)
    K2 = K @ K
    T = np.eye(4)
    T[:3, :3] = np.eye(3) + a * K + b * K2
    T[:3, 3] = (np.eye(3) + b * K + c * K2) @ rho
    return T


def _rotation_angle(T: torch.Tensor) -> float:
    cos = float(((torch.trace(T[:3, :3]) - 1) / 2).clamp(-1.0, 1.0))
    return math.acos(cos)


# ------------------------------------------------------------------------------------------- voxels
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


# ------------------------------------------------------------------------------------------------ ICP
def _unpack_system(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``(H [6, 6], g [6], pairs, sum of squared residuals)`` of ``nn.icp_system``'s float64 ``[29]``."""
    H = np.zeros((6, 6))
    H[np.triu_indices(6)] = s[:21]
    H = H + np.triu(H, 1).T
    return H, s[21:27].copy(), int(round(s[27])), float(s[28])


def align(
    source: torch.Tensor,
    vmap: VoxelPointMap,
    T_init: torch.Tensor,
    max_correspondence_m: float,
    kernel_scale_m: float,
    *,
    kernel: str = "geman_mcclure",
    max_iterations: int = 50,
    convergence: float = 1e-4,
    min_kernel_scale_m: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Robust point-to-plane ICP of ``source`` (float32 ``[N, 3]``, source frame, on the map's device) against
    ``vmap``, from ``T_init`` (float64 ``[4, 4]`` map <- source). Stops when the update's norm (metres and
    radians) falls below ``convergence``. With ``min_kernel_scale_m`` below ``kernel_scale_m``, the kernel
    scale drops to that floor (and the search radius to 3 times it) once the update is below a tenth of
    it: the wide kernel gives the basin, the narrow one the accuracy. Returns ``(T float64 [4, 4] on the
    CPU, info)``;
    info: ``iterations``, ``converged``, ``correspondences`` (inliers of the last iteration), ``fitness``
    (their fraction), ``rmse_m`` (RMS of the inliers' residuals ``r``).

    Each iteration is one ``nn.icp_system`` call (on CUDA one fused Triton launch: search, residuals,
    weights, per-program sums) and one 29-number device->host copy; the 6x6 solve and the pose stay on the
    host, and the pose goes back as kernel arguments."""
    T = T_init.detach().to(device=_HOST, dtype=torch.float64).numpy().copy()  # the pose lives on the host
    info = {"iterations": 0, "converged": False, "correspondences": 0, "fitness": 0.0, "rmse_m": float("nan")}
    if vmap.empty() or source.shape[0] == 0:
        return torch.from_numpy(T), info
    radius = float(max_correspondence_m)
    find = vmap.searcher(radius)
    scale = float(kernel_scale_m)
    floor = scale if min_kernel_scale_m is None else min(float(min_kernel_scale_m), scale)
    pairs, sse = 0, 0.0
    for it in range(max_iterations):
        pose = tuple(T[:3, :3].ravel().tolist()) + tuple(T[:3, 3].tolist())
        S = nn.icp_system(
            source, pose, vmap.keys, vmap.slots, vmap.points, vmap.normals, vmap.flatness,
            vmap.voxel_size_m, radius, vmap.neighbourhood(radius), kernel, scale, find=find,
        )  # fmt: skip
        H, g, pairs, sse = _unpack_system(S.cpu().numpy())  # the iteration's one sync
        info["iterations"] = it + 1
        if pairs < 6:
            break
        dx = np.linalg.solve(H + 1e-9 * np.eye(6), -g)
        D = _se3_exp_np(dx)
        # rotate about the sensor: R <- R_d R, t <- t + t_d (the linearisation point is the sensor)
        T[:3, :3] = D[:3, :3] @ T[:3, :3]
        T[:3, 3] += D[:3, 3]
        step = float(np.linalg.norm(dx))
        if scale <= floor and step < convergence:
            info["converged"] = True
            break
        if scale > floor and step < 0.1 * floor:  # the wide kernel has brought it into the narrow one's basin
            scale = floor
            if 3 * scale < radius:  # pairs beyond 3 scales weigh < 1 %: search less
                radius = 3 * scale
                find = vmap.searcher(radius)
    info.update(
        correspondences=pairs,
        fitness=pairs / source.shape[0],
        rmse_m=math.sqrt(sse / pairs) if pairs else float("nan"),
    )
    return torch.from_numpy(T), info


def register(
    source,
    target,
    T_init=None,
    *,
    voxel_size_m: float = 0.5,
    max_correspondence_m: float = 0.5,
    kernel: str = "geman_mcclure",
    kernel_scale_m: float | None = None,
    iterations: int = 50,
    convergence: float = 1e-5,
    max_points_per_voxel: int = 20,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, dict]:
    """Rigid registration of two clouds: ``T_target_source`` (float64 ``[4, 4]``, on the CPU) such that
    ``T @ source ~ target``, by robust point-to-plane ICP against a :class:`VoxelPointMap` of ``target``.

    Args:
        source, target: float ``[N, 3]`` / ``[M, 3]`` (numpy or torch; ``[N, 4]`` drops the 4th column).
        T_init: initial ``T_target_source`` (``[4, 4]``, default identity); ICP converges from within about
            ``max_correspondence_m`` of the answer.
        voxel_size_m: voxel edge of the target map (up to ``max_points_per_voxel`` points, a plane each).
        max_correspondence_m: pairs farther apart are ignored.
        kernel: ``"geman_mcclure"`` (default), ``"huber"`` or ``"none"``; ``kernel_scale_m`` its scale
            (default ``max_correspondence_m / 3``).
        iterations, convergence: Gauss-Newton stops after ``iterations`` or when the update's norm is
            below ``convergence``.
        device: where to compute (default: CUDA when available).
    Returns: ``(T, info)`` with info as :func:`align`'s.
    Raises: InvalidArgument / InvalidArgumentType naming the argument.
    """
    dev = v.resolve_device(device)
    src = _check_cloud("source", source, dev)
    tgt = _check_cloud("target", target, dev)
    T0 = torch.eye(4, dtype=torch.float64) if T_init is None else check_pose("T_init", T_init, _HOST)
    vox = _positive("voxel_size_m", voxel_size_m)
    h = _positive("max_correspondence_m", max_correspondence_m)
    kernel = _kernel_name(kernel)
    scale = h / 3 if kernel_scale_m is None else _positive("kernel_scale_m", kernel_scale_m)
    iters = _int_at_least("iterations", iterations, 1)
    conv = _non_negative("convergence", convergence)
    vmap = VoxelPointMap(vox, max_points_per_voxel=max_points_per_voxel, device=dev)
    vmap.add_points(tgt)
    return align(src, vmap, T0, h, scale, kernel=kernel, max_iterations=iters, convergence=conv)


# ------------------------------------------------------------------------------------------ odometry
class AdaptiveThreshold:
    """KISS-ICP's correspondence threshold: ``sigma = sqrt(mean of model_error^2)`` over the frames whose
    model error (deviation of the registered pose from the constant-velocity prediction, translation +
    the chord its rotation sweeps at ``max_range_m``) exceeded ``min_motion_m``; starts at
    ``initial_threshold_m``."""

    def __init__(self, initial_threshold_m: float, min_motion_m: float, max_range_m: float):
        self.min_motion_m = min_motion_m
        self.max_range_m = max_range_m
        self._sse = initial_threshold_m**2
        self._n = 1

    @property
    def sigma(self) -> float:
        return math.sqrt(self._sse / self._n)

    def update(self, deviation: torch.Tensor) -> None:
        """``deviation``: float64 ``[4, 4]`` = ``inv(prediction) @ estimate``."""
        theta = _rotation_angle(deviation)
        err = float(deviation[:3, 3].norm()) + 2 * self.max_range_m * math.sin(theta / 2)
        if err > self.min_motion_m:
            self._sse += err * err
            self._n += 1


@dataclass(frozen=True)
class OdometryConfig:
    """Settings of :class:`Odometry` (KISS-ICP's defaults where they exist).

    ``voxel_size_m`` None = ``max_range_m / 100``; the frame is downsampled at half of it (map update) and
    the ICP source at 1.5 times it. ``max_iterations``/``convergence``: Gauss-Newton stopping rule (update
    norm, metres + radians; 1e-3 gave the same trajectories as KISS-ICP's 1e-4 with ~40 % fewer
    iterations). ``kernel``: robust kernel; its scale starts at the adaptive sigma (correspondences up to
    3 sigma, as KISS-ICP) and, once the update is below a tenth of ``min_kernel_scale_m`` (default
    ``voxel / 10``), drops to that floor for the final iterations. ``deskew``: undo the motion during the
    sweep when per-point timestamps are given."""

    max_range_m: float = 100.0
    min_range_m: float = 0.0
    voxel_size_m: float | None = None
    max_points_per_voxel: int = 20
    initial_threshold_m: float = 2.0
    min_motion_m: float = 0.1
    max_iterations: int = 50
    convergence: float = 1e-3
    kernel: str = "geman_mcclure"
    min_kernel_scale_m: float | None = None
    deskew: bool = True

    def __post_init__(self):
        _positive("max_range_m", self.max_range_m)
        if _non_negative("min_range_m", self.min_range_m) >= self.max_range_m:
            raise InvalidArgument("min_range_m: must be below max_range_m")
        if self.voxel_size_m is not None:
            _positive("voxel_size_m", self.voxel_size_m)
        _int_at_least("max_points_per_voxel", self.max_points_per_voxel, 1)
        _positive("initial_threshold_m", self.initial_threshold_m)
        _non_negative("min_motion_m", self.min_motion_m)
        _int_at_least("max_iterations", self.max_iterations, 1)
        _non_negative("convergence", self.convergence)
        _kernel_name(self.kernel)
        if self.min_kernel_scale_m is not None:
            _positive("min_kernel_scale_m", self.min_kernel_scale_m)

    @property
    def voxel_size(self) -> float:
        return self.max_range_m / 100.0 if self.voxel_size_m is None else float(self.voxel_size_m)

    @property
    def min_kernel_scale(self) -> float:
        return self.voxel_size / 10.0 if self.min_kernel_scale_m is None else float(self.min_kernel_scale_m)


def deskew(points: torch.Tensor, timestamps: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Motion-compensate a sweep: point ``i`` (float32 ``[N, 3]``) stamped ``timestamps[i]`` moves by
    ``exp((s_i - 1) log(delta))`` with ``s`` the stamps normalised to [0, 1] and ``delta`` (float64
    ``[4, 4]``) the motion over the last sweep: every point is expressed in the sensor frame at the end of
    the sweep, assuming constant velocity."""
    t = timestamps.to(torch.float64)
    t0, t1 = t.min(), t.max()
    if float(t1 - t0) <= 0:
        return points
    s = (t - t0) / (t1 - t0)
    xi = se3_log(delta.to(torch.float64)).to(t.device)
    T = se3_exp((s - 1)[:, None] * xi[None, :])
    p = points.to(torch.float64)
    return ((T[:, :3, :3] @ p[..., None])[..., 0] + T[:, :3, 3]).to(points.dtype)


class Odometry:
    """Scan-to-map LiDAR odometry: ``register_frame(points_sensor) -> T_world_sensor``.

    The first frame defines the world frame (``T_world_sensor`` = ``initial_pose``, default identity) unless
    it comes with a known pose. State: the local :class:`VoxelPointMap` (voxels within ``max_range_m`` of the
    last pose), the last pose and the last inter-frame motion (constant-velocity prior), the adaptive
    threshold. ``last_info`` holds the last frame's ICP statistics. :meth:`state_dict` /
    :meth:`load_state_dict` save and restore all of it (a restored odometry continues bit for bit on the
    same device).
    """

    def __init__(
        self,
        config: OdometryConfig | None = None,
        device: str | torch.device | None = None,
        initial_pose=None,
    ):
        self.config = OdometryConfig() if config is None else config
        if not isinstance(self.config, OdometryConfig):
            raise InvalidArgumentType(f"config: expected an OdometryConfig, got {type(config).__name__}")
        self.device = v.resolve_device(device)
        c = self.config
        self.map = VoxelPointMap(c.voxel_size, c.max_points_per_voxel, device=self.device)
        self.threshold = AdaptiveThreshold(c.initial_threshold_m, c.min_motion_m, c.max_range_m)
        pose = torch.eye(4, dtype=torch.float64) if initial_pose is None else initial_pose
        self.pose = check_pose("initial_pose", pose, _HOST)
        self.delta = torch.eye(4, dtype=torch.float64)
        self.frames = 0
        self.last_info: dict = {}

    def preprocess(self, points_sensor, timestamps=None) -> torch.Tensor:
        """Validated float32 ``[N, 3]`` points within ``(min_range_m, max_range_m)``, deskewed when enabled
        and ``timestamps`` (float ``[N]``) are given."""
        c = self.config
        pts = check_points("points_sensor", points_sensor, self.device)
        r = torch.linalg.vector_norm(pts, dim=1)
        ok = torch.isfinite(pts).all(1) & (r < c.max_range_m) & (r > max(c.min_range_m, 1e-6))
        if timestamps is not None:
            ts = v.as_tensor("timestamps", timestamps, self.device)
            if ts.dim() != 1 or ts.shape[0] != pts.shape[0] or not ts.is_floating_point():
                raise InvalidArgument(f"timestamps: expected float [{pts.shape[0]}], got {list(ts.shape)}")
            if c.deskew:
                return deskew(pts[ok], ts[ok], self.delta)
        return pts[ok]

    def register_frame(
        self, points_sensor, timestamps=None, *, pose=None, estimated: bool = False, accept=None
    ):
        """Estimate the pose of one sweep and add it to the local map.

        Args:
            points_sensor: float ``[N, 3]`` (or ``[N, 4]``) returns in the sensor frame.
            timestamps: optional float ``[N]`` per-point times (any unit/origin) for deskewing.
            pose: the sweep's ``T_world_sensor`` when it is known (another pose source in a mixed stream):
                ICP is skipped, the sweep enters the local map at that pose and the motion model follows
                it; the adaptive threshold learns only from estimated poses.
            estimated: ``pose`` is one this odometry estimated for this sweep before (a replayed log): the
                state then changes exactly as when it was estimated.
            accept: optional ``accept(T_world_sensor)``, called with the pose before the state changes; an
                exception it raises refuses the sweep and leaves the odometry as it was.
        Returns: ``T_world_sensor`` float64 ``[4, 4]`` on the CPU (poses stay on the host).
        """
        c = self.config
        vox = c.voxel_size
        # 1. range filter (+ deskew with the last motion when timestamps are given); the map gets the frame
        #    at vox / 2
        frame = voxel_downsample(self.preprocess(points_sensor, timestamps), 0.5 * vox)
        # 2. constant-velocity prediction
        prediction = self.pose @ self.delta
        if pose is None:
            # 3. robust point-to-plane ICP of a sparser source (1.5 vox) against the local map: pairs up to
            #    3 sigma (adaptive threshold), kernel scale sigma, narrowed to voxel / 10 once in the basin
            sigma = self.threshold.sigma
            pose, self.last_info = align(
                voxel_downsample(frame, 1.5 * vox),
                self.map,
                prediction,
                3.0 * sigma,
                sigma,
                kernel=c.kernel,
                max_iterations=c.max_iterations,
                convergence=c.convergence,
                min_kernel_scale_m=c.min_kernel_scale,
            )
            estimated = True
        else:
            pose = check_pose("pose", pose, _HOST)
            self.last_info = {}
        if accept is not None:  # nothing of the state has changed yet
            accept(pose)
        # 4. how far the estimate is from the prediction feeds the threshold
        if estimated and not self.map.empty():
            self.threshold.update(torch.linalg.inv(prediction) @ pose)
        # 5. map update: the registered frame in, voxels beyond max_range of the sensor out
        Rt = pose[:3].T.to(frame.device, torch.float32)  # [R^T; t^T]
        self.map.add_points(frame @ Rt[:3] + Rt[3])
        self.map.remove_far(pose[:3, 3], c.max_range_m)
        # 6. motion model: the last inter-frame motion predicts the next one
        if self.frames:
            self.delta = torch.linalg.inv(self.pose) @ pose
        self.pose = pose
        self.frames += 1
        return pose

    def state_dict(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON metadata) of the whole state; tensor names start with ``prefix``."""
        tensors = self.map.state_dict(prefix + "map.")
        tensors[prefix + "pose"] = self.pose
        tensors[prefix + "delta"] = self.delta
        meta = {
            "config": dataclasses.asdict(self.config),
            "frames": self.frames,
            "threshold": [self.threshold._sse, self.threshold._n],
        }
        return tensors, meta

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], meta: dict, prefix: str = "", device=None):
        """An odometry saved with :meth:`state_dict` (on ``device``, default CUDA when available)."""
        odo = cls(OdometryConfig(**meta["config"]), device=device)
        odo.map.load_state_dict(tensors, prefix + "map.")
        odo.pose = tensors[prefix + "pose"].to(_HOST, torch.float64)
        odo.delta = tensors[prefix + "delta"].to(_HOST, torch.float64)
        odo.frames = int(meta["frames"])
        odo.threshold._sse, odo.threshold._n = float(meta["threshold"][0]), int(meta["threshold"][1])
        return odo


# ------------------------------------------------------------------------------------------- checks
def _positive(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x <= 0:
        raise InvalidArgument(f"{name}: expected a finite value > 0, got {x}")
    return float(x)


def _non_negative(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x) or x < 0:
        raise InvalidArgument(f"{name}: expected a finite value >= 0, got {x}")
    return float(x)


def _int_at_least(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(x).__name__}")
    if x < lo:
        raise InvalidArgument(f"{name}: expected an int >= {lo}, got {x}")
    return x


def _kernel_name(kernel) -> str:
    if kernel is None:
        return "none"
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise InvalidArgument(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return kernel


def _check_cloud(name: str, x, device: torch.device) -> torch.Tensor:
    pts = check_points(name, x, device)
    if pts.shape[0] == 0:
        raise InvalidArgument(f"{name}: expected at least one point")
    if not bool(torch.isfinite(pts).all()):
        raise InvalidArgument(f"{name}: contains NaN or Inf")
    return pts

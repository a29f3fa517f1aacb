"""Per-return surface normals of an unordered scan, from a voxel-hash neighbourhood (torch, any device).

The LiDAR TSDF projects its signed distances on the surface normal at each return (see
:func:`mapper.integrators.tsdf.integrate_lidar`); the scan is an unordered point set, so the normal of a
return is the plane fitted (PCA) to the returns in the 3 x 3 x 3 cells of size ``cell_m`` around its cell:

1. the points' cells are hashed (packed int64 keys, as the bricks'), sorted and numbered (a prefix sum);
2. each cell's moments (count, sum of ``p``, sum of ``p p^T``, ``p`` relative to the sensor origin) are
   summed by ``index_add``; each cell then adds its 26 neighbours' moments (binary search of their keys);
3. the smallest eigenvector of each cell's covariance (closed form for symmetric 3 x 3: the trigonometric
   eigenvalues, then the largest cross product of two rows of ``C - lambda_min I``; no solver, no sync);
4. a normal is kept only where the neighbourhood is a plane: at least :data:`MIN_POINTS` returns,
   ``lambda_0 <= PLANE_RATIO * lambda_1`` (thin) and ``lambda_1 >= SPREAD_RATIO * lambda_2`` (not a line:
   a single ring of a spinning LiDAR is a line), and is oriented towards the sensor. Other returns get a
   zero normal: the integrator keeps the along-ray distance for them (edges, corners, sparse returns).

All float64. A cell's index is the first position of its key in the sorted keys (no numbering needed to
find it). On the GPU (:mod:`mapper.kernels.triton_normals`) the whole fit is the key kernel, one sort of
every scale's keys, two kernels for the moments and the normals of all scales (:func:`cell_normals`) and
one that combines the scales: ~14 launches, no host sync; the torch reference (:func:`cell_normals_torch`)
numbers the cells per scale and reads their count back once per scale.
"""

from __future__ import annotations

import functools
import math

import torch

from .chunks import CPU_ROWS, cpu_rows, row_slices
from .dispatch import kernel
from .keys import VOXEL_KEY_BITS as KEY_BITS
from .keys import brick_keys

MIN_POINTS = 6
PLANE_RATIO = 0.02  # lambda_0 / lambda_1: normal std <= ~14 % of the in-plane spread
SPREAD_RATIO = 0.05  # lambda_1 / lambda_2: the neighbourhood spans two directions
SCALES = (1, 2, 4)
CELL_OFFSET = 0.3819660112501051  # 2 - golden ratio


def _sym_min_eigvec(c: torch.Tensor):
    """Eigenvalues (ascending, ``[U, 3]``) and the unit eigenvector of the smallest (``[U, 3]``) of float64
    symmetric ``[U, 3, 3]`` matrices (closed form; rows where it is ill-defined get any unit vector)."""
    a00, a11, a22 = c[:, 0, 0], c[:, 1, 1], c[:, 2, 2]
    a01, a02, a12 = c[:, 0, 1], c[:, 0, 2], c[:, 1, 2]
    q = (a00 + a11 + a22) / 3.0
    p1 = a01 * a01 + a02 * a02 + a12 * a12
    p2 = (a00 - q) ** 2 + (a11 - q) ** 2 + (a22 - q) ** 2 + 2.0 * p1
    p = torch.sqrt(p2 / 6.0)
    ps = torch.where(p > 0, p, torch.ones_like(p))
    b00, b11, b22 = (a00 - q) / ps, (a11 - q) / ps, (a22 - q) / ps
    b01, b02, b12 = a01 / ps, a02 / ps, a12 / ps
    det = b00 * (b11 * b22 - b12 * b12) - b01 * (b01 * b22 - b12 * b02) + b02 * (b01 * b12 - b11 * b02)
    phi = torch.acos((det / 2.0).clamp(-1.0, 1.0)) / 3.0
    l2 = q + 2.0 * p * torch.cos(phi)
    l0 = q + 2.0 * p * torch.cos(phi + 2.0 * math.pi / 3.0)
    l1 = 3.0 * q - l2 - l0
    eye = torch.eye(3, dtype=c.dtype, device=c.device)
    m = c - l0[:, None, None] * eye
    r0, r1, r2 = m[:, 0], m[:, 1], m[:, 2]
    cands = torch.stack(
        (torch.linalg.cross(r0, r1), torch.linalg.cross(r0, r2), torch.linalg.cross(r1, r2)), 1
    )
    norms = torch.linalg.vector_norm(cands, dim=2)
    best = norms.argmax(dim=1)
    v = cands[torch.arange(c.shape[0], device=c.device), best]
    nv = norms.gather(1, best[:, None]).squeeze(1)
    v = v / torch.where(nv > 0, nv, torch.ones_like(nv))[:, None]
    return torch.stack((l0, l1, l2), dim=1), v


def scan_normals(
    origin: torch.Tensor, points_w: torch.Tensor, cell_m: float, scales=SCALES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit normals of the returns, oriented towards the sensor, or zero where no plane fits, and how far the
    plane is known to extend around each return.

    Args:
        origin: float ``[3]`` sensor origin (world); points_w: float ``[N, 3]`` world returns.
        cell_m: edge of the hash cells (metres); the neighbourhood is the 3 x 3 x 3 cells around a return's.
        scales: cell multipliers tried in turn; a return keeps the normal of the first scale whose
            neighbourhood is planar (sparse rings far from the sensor need the larger ones).
    Returns:
        normals: float64 ``[N, 3]`` on the points' device;
        support: float64 ``[N]`` metres: the largest cell edge (``cell_m * scale``) at which the return's
        neighbourhood is planar (0: none). The neighbourhood reaches at least one cell beyond the return
        in every direction, so the plane holds that far from it (the integrator's band stays within).
    """
    n = points_w.shape[0]
    dev = points_w.device
    if n == 0:
        return torch.zeros((0, 3), dtype=torch.float64, device=dev), torch.zeros(
            0, dtype=torch.float64, device=dev
        )
    o = origin.to(torch.float64)
    x = points_w.to(torch.float64) - o  # sensor-relative: small values, exact enough in float64
    inv_cell, edges_t = _edge_tensors(tuple(cell_m * k for k in scales), dev)
    sorted_keys, order = torch.sort(cell_keys(points_w, inv_cell), dim=1)  # every scale in one sort
    tables, inv = cell_normals(x, sorted_keys, order)
    return combine_normals(x, tables, inv, edges_t)


@functools.lru_cache(maxsize=64)
def _edge_tensors(edges: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[S]`` reciprocal cell edges and cell edges on ``device``, uploaded once per configuration (a
    host-to-device copy of a pageable tensor waits for the device: a sync per frame otherwise)."""
    e = torch.tensor(edges, dtype=torch.float64)
    return (1.0 / e).to(device), e.to(device)


def cell_keys_torch(points_w: torch.Tensor, inv_cell: torch.Tensor) -> torch.Tensor:
    """int64 ``[S, N]``: the packed key of each return's cell at each of ``S`` cell edges (``-1``: outside
    the key range). Cells are ``floor(p * inv_cell + CELL_OFFSET)``, offset by an irrational fraction so that
    synthetic surfaces at round coordinates do not sit on cell boundaries (where rounding noise in a pose
    would move returns between cells).

    Args:
        points_w: float ``[N, 3]`` world returns; inv_cell: float64 ``[S]`` reciprocal cell edges (1/m).
    """
    p = points_w.to(torch.float64)
    out = torch.empty((inv_cell.shape[0], p.shape[0]), dtype=torch.int64, device=p.device)
    for sl in row_slices(p.shape[0], p.device, cpu_rows(CPU_ROWS, 24)):  # [n, 3] float64 temporaries
        for k in range(inv_cell.shape[0]):
            out[k, sl] = brick_keys(torch.floor(p[sl] * inv_cell[k] + CELL_OFFSET).to(torch.int64))
    return out


def cell_keys(points_w: torch.Tensor, inv_cell: torch.Tensor) -> torch.Tensor:
    """:func:`cell_keys_torch` or its Triton kernel (one launch for every scale), as dispatch decides."""
    return kernel(points_w.device, cell_keys_torch, "triton_normals:cell_keys_triton")(points_w, inv_cell)


def combine_normals_torch(
    x: torch.Tensor, cell_normals: torch.Tensor, inv: torch.Tensor, edges: torch.Tensor
):
    """Per return, the normal of the first scale whose neighbourhood is planar, oriented towards the sensor,
    and the largest planar cell edge.

    Args:
        x: float64 ``[N, 3]`` returns relative to the sensor; cell_normals: float64 ``[S, N, 3]`` per scale
            and cell index (:func:`cell_plane_normals`); inv: int64 ``[S, N]`` each return's cell index per
            scale; edges: float64 ``[S]`` the scales' cell edges (m).
    Returns:
        normals float64 ``[N, 3]`` (zero: none), support float64 ``[N]`` (as :func:`scan_normals`).
    """
    n = x.shape[0]
    s = cell_normals.shape[0]
    if s == 0 or n == 0:
        return torch.zeros((n, 3), dtype=torch.float64, device=x.device), x.new_zeros(n)
    # per scale and cell: planar (a flag gathered per return, not a [N, 3] row)
    planar_cell = (cell_normals != 0).any(dim=2)  # [S, N]
    table = cell_normals.reshape(-1, 3)
    idx = torch.arange(s, device=x.device)[:, None]
    out = torch.empty((n, 3), dtype=torch.float64, device=x.device)
    support = torch.empty(n, dtype=torch.float64, device=x.device)
    for sl in row_slices(n, x.device, cpu_rows(CPU_ROWS, 24)):  # [S, n] and [n, 3] temporaries
        inv_s = inv[:, sl]
        planar = planar_cell.gather(1, inv_s)
        # the first planar scale (none: the last, whose normal is then zero), the largest planar edge
        pf = planar.to(torch.int64)
        first = (s - (pf * (s - idx)).amax(dim=0)).clamp(max=s - 1)
        support[sl] = (planar.to(torch.float64) * edges[:, None]).amax(dim=0)
        # the normal of the first planar scale's cell: one gather from the [S * N, 3] table (a cell that is
        # not planar has a zero normal)
        nrm = table.index_select(0, first * cell_normals.shape[1] + inv_s.gather(0, first[None]).squeeze(0))
        # towards the sensor: n . (origin - p) = -n . x >= 0 (a sign as a factor: exact, no select)
        flip = torch.gt((nrm * x[sl]).sum(dim=1), 0.0, out=x.new_empty(nrm.shape[0]))
        out[sl] = nrm * (1.0 - 2.0 * flip)[:, None]
    return out, support


def combine_normals(x: torch.Tensor, cell_normals: torch.Tensor, inv: torch.Tensor, edges: torch.Tensor):
    """:func:`combine_normals_torch` or its Triton kernel (one launch), as dispatch decides."""
    impl = kernel(x.device, combine_normals_torch, "triton_normals:combine_normals_triton")
    return impl(x, cell_normals, inv, edges)


def moment_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, 10]`` per return: 1, ``x``, the upper triangle of ``x x^T`` (xx, xy, xz, yy, yz, zz)."""
    vals = torch.empty((x.shape[0], 10), dtype=torch.float64, device=x.device)
    vals[:, 0] = 1.0
    vals[:, 1:4] = x
    for sl in row_slices(x.shape[0], x.device, cpu_rows(CPU_ROWS, 24)):  # [n, 3] float64 temporaries
        xs = x[sl]
        vals[sl, 4:7] = xs * xs[:, 0:1]
        vals[sl, 7:9] = xs[:, 1:] * xs[:, 1:2]
        vals[sl, 9] = xs[:, 2] * xs[:, 2]
    return vals


def cell_moments(
    x: torch.Tensor, sorted_keys: torch.Tensor, order: torch.Tensor, vals: torch.Tensor | None = None
):
    """The cells of one scale and their moments (torch; the reference's first step).

    Args:
        x: float64 ``[N, 3]`` the returns relative to the sensor (the moments' coordinates); sorted_keys,
            order: int64 ``[N]`` the returns' cell keys sorted (``-1``: outside the key range, first) and
            the sorting permutation (``torch.sort`` of :func:`cell_keys`); vals: :func:`moment_rows` of ``x``
            if already computed (the scales share them).
    Returns:
        rank: int64 ``[N]`` the cell number of each sorted position (distinct keys numbered from 0);
        inv: int64 ``[N]`` each return's cell index: the first sorted position of its key;
        mom: float64 ``[N, 10]`` per cell index (other rows zero): count, sum of ``x``, sum of ``x x^T``
        (upper triangle: xx, xy, xz, yy, yz, zz); the out-of-range cell (key ``-1``) sums its returns too
        (the normal step skips it).
    """
    n = x.shape[0]
    dev = x.device
    new = torch.ones(n, dtype=torch.int64, device=dev)
    new[1:] = sorted_keys[1:] != sorted_keys[:-1]
    rank = torch.cumsum(new, 0) - 1
    pos = torch.arange(n, dtype=torch.int64, device=dev)
    first = torch.cummax(pos * new, 0).values  # the first position of each sorted position's key
    inv = torch.empty_like(first).index_copy_(0, order, first)
    vals = moment_rows(x) if vals is None else vals
    mom = torch.zeros((n, 10), dtype=torch.float64, device=dev).index_add_(0, inv, vals)
    return rank, inv, mom


def cell_plane_normals_torch(
    sorted_keys: torch.Tensor, rank: torch.Tensor, mom: torch.Tensor
) -> torch.Tensor:
    """Unit normal of each cell's 3 x 3 x 3 neighbourhood, or zero where it is not a plane (one scale).

    Args:
        sorted_keys, rank, mom: as :func:`cell_moments` returns them (int64 ``[N]``, int64 ``[N]``, float64
            ``[N, 10]`` per cell index = first sorted position).
    Returns:
        float64 ``[N, 3]`` per cell index (other rows, and the out-of-range cell, are zero); the sign is
        arbitrary (:func:`scan_normals` orients them).
    """
    n = sorted_keys.shape[0]
    dev = sorted_keys.device
    out = torch.zeros((n, 3), dtype=torch.float64, device=dev)
    if n == 0:
        return out
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    at = first.nonzero().squeeze(1)  # each cell's first position (sync: their count), by cell number
    uk = sorted_keys.index_select(0, at)  # sorted distinct keys
    u = uk.numel()
    mom = mom.index_select(0, at)
    valid_cell = uk >= 0
    # sum the 27 neighbours' moments in the order (di, dj, dk): per (di, dj) one binary search for the cell
    # (i + di, j + dj, k - 1); the cells k, k + 1 of that column follow it in key order when they exist.
    # A missing neighbour reads the zero row appended at u; [U, 10] temporaries only
    mom_z = torch.cat((mom, mom.new_zeros((1, 10))))
    if not bool(valid_cell.all()):  # the out-of-range cell (key -1, first) sums nothing
        mom_z[:u] *= valid_cell[:, None].to(mom.dtype)
    ukz = torch.cat((uk, uk.new_full((1,), -2)))  # position u never matches a key
    total = torch.zeros_like(mom)
    rows = torch.empty_like(mom)  # the gathered rows, one buffer for the 27 (no fresh [U, 10] block each)
    for di in (-1, 0, 1):
        for dj in (-1, 0, 1):
            nk = uk + ((di << (2 * KEY_BITS)) + (dj << KEY_BITS) - 1)
            pos = torch.searchsorted(uk, nk)  # <= u
            for _ in range(3):
                hit = (ukz.index_select(0, pos) == nk) & valid_cell
                hi = hit.to(torch.int64)
                total += torch.index_select(mom_z, 0, u + (pos - u) * hi, out=rows)
                pos = pos + hi
                nk = nk + 1
    cnt = total[:, 0]
    cs = cnt.clamp(min=1.0)
    mean = total[:, 1:4] / cs[:, None]
    s = total[:, 4:] / cs[:, None]  # xx, xy, xz, yy, yz, zz
    iu = torch.triu_indices(3, 3, device=dev)
    cov = torch.empty((u, 3, 3), dtype=torch.float64, device=dev)
    cov[:, iu[0], iu[1]] = s - (mean[:, iu[0]] * mean[:, iu[1]])
    cov[:, iu[1], iu[0]] = cov[:, iu[0], iu[1]]
    lam, nrm = _sym_min_eigvec(cov)
    l0, l1, l2 = lam.unbind(1)
    ok = (cnt >= MIN_POINTS) & (l0 <= PLANE_RATIO * l1) & (l1 >= SPREAD_RATIO * l2) & (l2 > 0)
    out.index_copy_(0, at, nrm * ok[:, None])
    return out


def cell_normals_torch(x: torch.Tensor, sorted_keys: torch.Tensor, order: torch.Tensor):
    """Per scale, the plane normal of each cell's 3 x 3 x 3 neighbourhood and each return's cell (the
    reference of :func:`mapper.kernels.triton_normals.cell_normals_triton`).

    Args:
        x: float64 ``[N, 3]`` returns relative to the sensor; sorted_keys, order: int64 ``[S, N]`` each
            scale's cell keys sorted (``-1``: outside the key range) and the sorting permutation.
    Returns:
        tables: float64 ``[S, N, 3]`` unit normal per scale and cell index (a cell's index is the first
        position of its key in ``sorted_keys``; zero where the neighbourhood is not a plane, for the
        out-of-range cell and at the other rows; arbitrary sign);
        inv: int64 ``[S, N]`` each return's cell index per scale.
    """
    s, n = sorted_keys.shape
    tables = torch.zeros((s, n, 3), dtype=torch.float64, device=x.device)
    inv = torch.empty((s, n), dtype=torch.int64, device=x.device)
    if n == 0:
        return tables, inv
    vals = moment_rows(x)
    for k in range(s):
        rank, inv[k], mom = cell_moments(x, sorted_keys[k], order[k], vals)
        tables[k] = cell_plane_normals_torch(sorted_keys[k], rank, mom)
    return tables, inv


def cell_normals(x: torch.Tensor, sorted_keys: torch.Tensor, order: torch.Tensor):
    """:func:`cell_normals_torch` or its Triton kernels (two launches for every scale, no sync), as dispatch
    decides."""
    return kernel(x.device, cell_normals_torch, "triton_normals:cell_normals_triton")(x, sorted_keys, order)


@functools.lru_cache(maxsize=64)
def ray_band_params(device: torch.device, *values: float) -> torch.Tensor:
    """float64 ``[5]`` ``(tau, longest, reach, min_weight, obs_weight)`` of :func:`ray_bands` on ``device``,
    uploaded once per configuration (no per-frame copy)."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64).to(device)


def ray_bands_torch(x: torch.Tensor, nrm: torch.Tensor, support: torch.Tensor, prm: torch.Tensor):
    """Per return: the ray, its band along the ray and its weight from the scan's normals (the reference of
    :func:`mapper.kernels.triton_normals.ray_bands_triton`; the integrator's rule is
    :func:`mapper.integrators.tsdf.lidar_rays`).

    Args:
        x: float64 ``[N, 3]`` returns relative to the sensor; nrm: float64 ``[N, 3]`` normals towards the
            sensor (zero: none) and support float64 ``[N]`` (as :func:`scan_normals` returns them);
            prm: float64 ``[5]`` ``(tau, longest, reach, min_weight, obs_weight)`` (:func:`ray_band_params`).
    Returns:
        dirs float64 ``[N, 3]``, range ``[N]``, ``t0``, ``t1`` ``[N]``; the normals kept (zero where none or
        facing away from the ray: ``cos = -dir . n <= 0``); float32 ray weights ``[N]``. With a normal the
        half band is ``clamp(min(reach / cos, clamp(support, tau, longest)), min=tau)`` and the weight
        ``obs_weight * clamp(cos, min_weight, 1)``; without one ``tau`` and ``obs_weight``.
    """
    r = torch.linalg.vector_norm(x, dim=1)
    dirs = x / r[:, None]
    tau, longest, reach, w_min, w_obs = prm.unbind(0)
    cos = -(dirs * nrm).sum(dim=1)
    has = (nrm != 0).any(dim=1) & (cos > 0)
    nrm = nrm * has[:, None]
    within = torch.minimum(torch.maximum(support, tau), longest)  # within the verified plane
    half = torch.where(has, torch.maximum(torch.minimum(reach / cos.clamp(min=1e-6), within), tau), tau)
    w = torch.where(has, torch.minimum(torch.maximum(cos, w_min), torch.ones_like(cos)), 1.0) * w_obs
    return dirs, r, (r - half).clamp(min=0.0), r + half, nrm, w.to(torch.float32)


def ray_bands(x: torch.Tensor, nrm: torch.Tensor, support: torch.Tensor, prm: torch.Tensor):
    """:func:`ray_bands_torch` or its Triton kernel (one launch), as dispatch decides."""
    return kernel(x.device, ray_bands_torch, "triton_normals:ray_bands_triton")(x, nrm, support, prm)

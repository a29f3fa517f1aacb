"""Nearest neighbour of query points in a voxel-hashed point map (``mapper.registration.VoxelPointMap``).

The map stores up to ``K`` points per voxel of edge ``voxel_size``: ``points [C, 3, K]`` float32 in slots
(coordinates-major: the distance pass reads three contiguous ``[K]`` rows per voxel, 2.9x faster on the CPU
than ``[C, K, 3]``; unused rows hold the far sentinel ``EMPTY``), and a lookup from voxel key to slot:
``keys [V]`` int64 sorted ascending with ``slots [V]`` int64 beside them. Keys pack the voxel coordinates
``floor(p / voxel_size)`` with :func:`voxel_keys`.

Search region. With ``neighbourhood=8`` the candidates are the points of the 2x2x2 voxels whose centres
surround the query (``floor(q / v - 0.5) + {0, 1}^3``): every point within ``v / 2`` of the query lies in
them, so the result is exact for ``max_distance <= v / 2``. With ``neighbourhood=27`` they are the 3x3x3
voxels around the query's voxel (exact for ``max_distance <= v``). Beyond that radius the result is the
nearest candidate (approximate, as KISS-ICP's search).

Two implementations with one signature: :func:`nearest_in_voxel_map_torch` (the reference, CPU path:
chunked gathers of the candidates, compacted to the voxels that exist) and
:func:`nearest_in_voxel_map_triton` (``triton_nn.py``: one program per block of queries looping over the
candidate voxels), dispatched by :func:`nearest_in_voxel_map` through ``dispatch.kernel``.
"""

from __future__ import annotations

import torch

# voxel keys are the integrators' aggregation keys: 21 bits per axis, biased, coordinates in [-2^20, 2^20);
# their order is lexicographic (i, j, k) and key(ijk + d) = key(ijk) + key_offset(d) inside the range
from .chunks import row_slices
from .dispatch import kernel
from .keys import VOXEL_KEY_BIAS as KEY_BIAS  # noqa: F401 (re-exported)
from .keys import VOXEL_KEY_BITS as KEY_BITS  # noqa: F401 (re-exported)
from .keys import VOXEL_KEY_LIMIT as KEY_LIMIT  # noqa: F401 (re-exported)
from .keys import key_offsets, voxel_keys

# queries per chunk on the CPU: [chunk * ~10 candidate voxels, 3, K] temporaries stay ~1-2 MB
CPU_QUERY_ROWS = 8192
# coordinate of the unused point rows of a slot: its squared distance (~3e18) stays finite in float32
EMPTY = 1.0e9


def base_voxels(queries: torch.Tensor, voxel_size: float, neighbourhood: int) -> torch.Tensor:
    """int64 ``[N, 3]``: the corner voxel of the 2x2x2 block (8) or the centre of the 3x3x3 block (27)."""
    shift = 0.5 if neighbourhood == 8 else 0.0
    return torch.floor(queries / voxel_size - shift).to(torch.int64)


def _check(queries, keys, slots, points, neighbourhood):
    if neighbourhood not in (8, 27):
        raise ValueError(f"neighbourhood: expected 8 or 27, got {neighbourhood}")
    if queries.dim() != 2 or queries.shape[1] != 3 or queries.dtype != torch.float32:
        raise ValueError(f"queries: expected float32 [N, 3], got {queries.dtype} {list(queries.shape)}")
    if points.dim() != 3 or points.shape[1] != 3 or points.dtype != torch.float32:
        raise ValueError(f"points: expected float32 [C, 3, K], got {points.dtype} {list(points.shape)}")
    if keys.shape != slots.shape or keys.dim() != 1:
        raise ValueError("keys, slots: expected two int64 vectors of one length")


def candidate_slots(
    queries: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, voxel_size: float, neighbourhood: int
) -> torch.Tensor:
    """int64 ``[N, 8|27]``: the slots of the candidate voxels of each query (-1 where the voxel is empty)."""
    V = keys.shape[0]
    cand = voxel_keys(base_voxels(queries, voxel_size, neighbourhood))[:, None] + key_offsets(
        neighbourhood, queries.device
    )
    if V == 0:
        return torch.full_like(cand, -1)
    pos = torch.searchsorted(keys, cand).clamp_(max=V - 1)
    return torch.where(keys[pos] == cand, slots[pos], -1)


def _offsets_ijk(neighbourhood: int, device: torch.device) -> torch.Tensor:
    r = (0, 1) if neighbourhood == 8 else (-1, 0, 1)
    return torch.tensor([(a, b, c) for a in r for b in r for c in r], dtype=torch.float32, device=device)


def _pairs_min(q, qi, slot, points, best, arg):
    """Fold the candidate slots ``slot`` of queries ``qi`` into the running minimum ``best``/``arg``."""
    K = points.shape[2]
    g = points[slot]  # [P, 3, K]: coordinates contiguous over the K points (the fast layout on CPU)
    qq = q[qi]
    d2 = (g[:, 0] - qq[:, 0:1]).square_()
    d2 += (g[:, 1] - qq[:, 1:2]).square_()
    d2 += (g[:, 2] - qq[:, 2:3]).square_()
    dmin, kmin = d2.min(dim=1)
    new = best.clone().scatter_reduce_(0, qi, dmin, reduce="amin")
    win = (dmin == new[qi]) & (dmin < best[qi])
    arg[qi[win]] = slot[win] * K + kmin[win]
    best.copy_(new)


def nearest_among_slots(
    queries: torch.Tensor,
    cand: torch.Tensor,
    points: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dist [N], index [N])`` of the nearest point among the candidate slots ``cand`` (``[N, 8|27]`` from
    :func:`candidate_slots`, -1 = none) of each query; see :func:`nearest_in_voxel_map_torch`.

    Two passes: the voxel containing the query first, then only the candidate voxels whose box is closer
    than that first answer (on surfaces ~3 of ~12 occupied neighbours). Unused rows of ``points`` hold the
    far sentinel ``EMPTY``, so no count mask is needed."""
    n, dev = queries.shape[0], queries.device
    dist = torch.full((n,), float("inf"), dtype=torch.float32, device=dev)
    index = torch.full((n,), -1, dtype=torch.int64, device=dev)
    max_d2 = float(max_distance) ** 2
    offs = _offsets_ijk(neighbourhood, dev)
    for s in row_slices(n, dev, CPU_QUERY_ROWS):
        q, c = queries[s], cand[s]
        # squared distance from each query to each candidate voxel's box
        lo = (base_voxels(q, voxel_size, neighbourhood).to(torch.float32)[:, None, :] + offs) * voxel_size
        rel = q[:, None, :] - lo
        box = ((-rel).clamp_min_(0) + (rel - voxel_size).clamp_min_(0)).square_().sum(-1)  # [m, 8|27]
        box.masked_fill_(c < 0, float("inf"))
        best = torch.full((q.shape[0],), max_d2, dtype=torch.float32, device=dev)
        arg = torch.full((q.shape[0],), -1, dtype=torch.int64, device=dev)
        own = box <= 0
        qi, ci = own.nonzero(as_tuple=True)
        if qi.numel():
            _pairs_min(q, qi, c[qi, ci], points, best, arg)
        qi, ci = ((box < best[:, None]) & ~own).nonzero(as_tuple=True)
        if qi.numel():
            _pairs_min(q, qi, c[qi, ci], points, best, arg)
        dist[s] = torch.where(arg >= 0, best.sqrt(), dist[s])
        index[s] = arg
    return dist, index


def nearest_in_voxel_map_torch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int = 27,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest map point of each query (pure torch reference).

    Args:
        queries: float32 ``[N, 3]`` points (map frame), on the map's device.
        keys: int64 ``[V]`` sorted voxel keys of the occupied voxels; ``slots``: int64 ``[V]`` their slots.
        points: float32 ``[C, 3, K]``: slot ``c`` holds up to ``K`` points, coordinates-major (``points[c, :,
            k]`` is point ``k``); unused rows hold ``EMPTY`` (far away, never the nearest).
        voxel_size: voxel edge (metres); ``max_distance``: neighbours farther than this are ignored.
        neighbourhood: 8 or 27 candidate voxels (see the module docstring).
    Returns:
        ``dist`` float32 ``[N]`` (Euclidean distance, ``inf`` where nothing is within ``max_distance``) and
        ``index`` int64 ``[N]``: ``slot * K + k`` of the neighbour, -1 if none.
    """
    _check(queries, keys, slots, points, neighbourhood)
    n = queries.shape[0]
    dist = torch.full((n,), float("inf"), dtype=torch.float32, device=queries.device)
    index = torch.full((n,), -1, dtype=torch.int64, device=queries.device)
    for s in row_slices(n, queries.device, 4 * CPU_QUERY_ROWS):
        cand = candidate_slots(queries[s], keys, slots, voxel_size, neighbourhood)
        dist[s], index[s] = nearest_among_slots(
            queries[s], cand, points, voxel_size, max_distance, neighbourhood
        )
    return dist, index


def nearest_in_voxel_map_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int = 27,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`nearest_in_voxel_map_torch`, as a Triton kernel (CUDA, or the interpreter)."""
    _check(queries, keys, slots, points, neighbourhood)
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_nn import nearest_in_voxel_map_kernel_launch

    return nearest_in_voxel_map_kernel_launch(
        queries, keys, slots, points, voxel_size, max_distance, neighbourhood
    )


def nearest_in_voxel_map(
    queries: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int = 27,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel or the torch reference (``dispatch.kernel``); same arguments."""
    fn = kernel(queries.device, nearest_in_voxel_map_torch, nearest_in_voxel_map_triton)
    return fn(queries, keys, slots, points, voxel_size, max_distance, neighbourhood)


# ------------------------------------------------------------------------------ one ICP iteration
ICP_SYSTEM_SIZE = 29  # 21 (H, upper triangle, row-major) + 6 (g) + inlier count + sum of squared residuals


def robust_weights(r2: torch.Tensor, kernel: str, scale: float) -> torch.Tensor:
    """Weights of squared residuals: Geman-McClure ``(s^2 / (s^2 + r^2))^2``, Huber, or 1 (``"none"``)."""
    if kernel == "geman_mcclure":
        s2 = scale * scale
        return (s2 / (s2 + r2)).square()
    if kernel == "huber":
        r = r2.sqrt()
        return torch.where(r <= scale, torch.ones_like(r), scale / r.clamp_min(1e-12))
    return torch.ones_like(r2)


def _skew(w: torch.Tensor) -> torch.Tensor:
    z = torch.zeros_like(w[0])
    return torch.stack([z, -w[2], w[1], w[2], z, -w[0], -w[1], w[0], z]).reshape(3, 3)


def system_from_pairs(local, e, n, beta, w, r2) -> torch.Tensor:
    """float64 ``[29]`` Gauss-Newton sums of ``sum w [(1 - beta) (n.e)^2 + beta |e|^2]`` over pairs with
    residual ``e = p - q``, ``local = p - sensor`` (the update rotates about the sensor), plane normal
    ``n`` and point-to-point weight ``beta``: point-to-plane row ``[n, local x n]``, point-to-point Jacobian
    ``[I, -[local]x]``. The layout of ``ICP_SYSTEM_SIZE`` (what the Triton kernel writes)."""
    local, e, n = local.to(torch.float64), e.to(torch.float64), n.to(torch.float64)
    beta, w = beta.to(torch.float64), w.to(torch.float64)
    wp, a = w * (1 - beta), w * beta
    X = torch.cat([n, torch.linalg.cross(local, n)], 1)  # [M, 6]
    H = (X * wp[:, None]).T @ X
    g = X.T @ (wp * (n * e).sum(1))
    s1 = a @ local
    s2 = (local * a[:, None]).T @ local
    K1 = _skew(s1)
    H[:3, :3] += a.sum() * torch.eye(3, dtype=H.dtype, device=H.device)
    H[:3, 3:] -= K1
    H[3:, :3] += K1
    H[3:, 3:] += torch.trace(s2) * torch.eye(3, dtype=H.dtype, device=H.device) - s2
    g[:3] += a @ e
    g[3:] += a @ torch.linalg.cross(local, e)
    iu = torch.triu_indices(6, 6, device=H.device)
    tail = torch.stack([torch.tensor(float(e.shape[0]), dtype=H.dtype, device=H.device), r2.double().sum()])
    return torch.cat([H[iu[0], iu[1]], g, tail])


def icp_system_torch(
    source: torch.Tensor,
    pose: tuple[float, ...],
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    normals: torch.Tensor,
    flatness: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int,
    kernel: str,
    scale: float,
    find=None,
) -> torch.Tensor:
    """One ICP iteration's linear system (pure torch reference).

    Args:
        source: float32 ``[N, 3]`` points in the sensor frame.
        pose: 12 floats, the rotation row-major then the translation of ``T_map_sensor``.
        keys, slots, points: the voxel map (see :func:`nearest_in_voxel_map_torch`); ``normals`` float32
            ``[C, 3]`` and ``flatness`` float32 ``[C]`` per slot (0 = point-to-plane, 1 = point-to-point).
        max_distance, neighbourhood: correspondence search (as :func:`nearest_in_voxel_map_torch`).
        kernel, scale: robust kernel (:func:`robust_weights`).
        find: optional ``queries -> (dist, index)`` replacing the search (a cached searcher).
    Returns: float64 ``[29]`` (``ICP_SYSTEM_SIZE``): ``H`` (6x6 upper triangle, row-major), ``g``, the number
        of pairs, the sum of their squared residuals.
    """
    P = torch.tensor(pose, dtype=torch.float32, device=source.device)
    local = source @ P[:9].reshape(3, 3).T
    p = local + P[9:]
    if find is None:
        _, idx = nearest_in_voxel_map_torch(p, keys, slots, points, voxel_size, max_distance, neighbourhood)
    else:
        _, idx = find(p)
    m = (idx >= 0).nonzero().squeeze(1)
    idx = idx[m]
    K = points.shape[2]
    slot = idx // K
    e = p[m] - points[slot, :, idx % K]
    n, beta = normals[slot], flatness[slot]
    rn = (e * n).sum(1)
    r2 = (1 - beta) * rn * rn + beta * e.square().sum(1)
    return system_from_pairs(local[m], e, n, beta, robust_weights(r2, kernel, scale), r2)


def icp_system_triton(
    source: torch.Tensor,
    pose: tuple[float, ...],
    keys: torch.Tensor,
    slots: torch.Tensor,
    points: torch.Tensor,
    normals: torch.Tensor,
    flatness: torch.Tensor,
    voxel_size: float,
    max_distance: float,
    neighbourhood: int,
    kernel: str,
    scale: float,
    find=None,
) -> torch.Tensor:
    """Same as :func:`icp_system_torch`, in one fused Triton launch (``find`` is ignored)."""
    _check(source, keys, slots, points, neighbourhood)
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_nn import icp_system_kernel_launch

    return icp_system_kernel_launch(
        source, pose, keys, slots, points, normals, flatness, voxel_size, max_distance, neighbourhood,
        kernel, scale,
    )  # fmt: skip


def icp_system(*args, **kwargs) -> torch.Tensor:
    """The fused Triton kernel or the torch reference (``dispatch.kernel``); same arguments."""
    return kernel(args[0].device, icp_system_torch, icp_system_triton)(*args, **kwargs)

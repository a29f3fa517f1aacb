"""Farthest point sampling (FPS): the naive O(N*M) reference and an exact, pruned version.

Definition (every implementation here returns exactly this sequence, ties included):

* ``s_0 = start``; ``d_k(i) = min_{j < k} dist2(p_i, p_{s_j})``; ``s_k = argmax_i d_k(i)``, the **smallest
  index** among equal maxima (as ``torch.argmax``).
* Samples repeat only when fewer than ``m`` distinct points exist: once every distance is 0 the argmax
  is index 0 (as in pytorch3d's ``sample_farthest_points``).
* Arithmetic is float32 whatever the input dtype (points are cast to float32 first):
  ``dist2(p, q) = (dx*dx + dy*dy) + dz*dz`` with ``dx = p.x - q.x``, every operation rounded on its own
  (no fused multiply-add; the Triton kernel is compiled with ``enable_fp_fusion=False``).

Pruning (the RadiusFPS idea). Points are sorted once along a Morton (Z-order) curve of a 2^16 grid over
their bounding box and cut into **chunks** of ``B`` consecutive points; a chunk is a compact cell of an
adaptive voxelization (small where the cloud is dense) and keeps the tight bounding box of its points and
the key of its best point. For a new sample ``q`` the per-axis gap ``g = max(lo - q, q - hi, 0)`` gives
``lb = (gx*gx + gy*gy) + gz*gz``; if ``lb >= max_{i in chunk} d(i)`` the chunk is skipped. This is exact,
not approximate: rounding is monotone, so ``fl(lo - q) <= fl(p - q)`` for ``lo <= p`` and every later
operation preserves the order, hence ``lb <= dist2(p, q)`` *as computed* for every point of the chunk, and
``min(d(i), dist2(p_i, q)) = d(i)``: skipping changes nothing.

The argmax with its tie rule is one integer max over ``key = bits(d) << 32 | (2^32 - 1 - index)``: the bit
pattern of a non-negative float32 is monotone in its value, so the largest key has the largest distance
and, among equal distances, the smallest index. Chunks keep their key; the global argmax is the max over
chunk keys. Indices must fit in 32 bits (N < 2^31).

* :func:`farthest_point_sample_naive` - reference: one vectorised update + ``argmax`` per sample.
* :func:`farthest_point_sample_torch` - the pruned algorithm in torch (the CPU path).
* :func:`farthest_point_sample_triton` - the pruned algorithm as one Triton launch per sample (the GPU
  path); the argmax stays on the device (an ``atomic_max`` of chunk keys), so there is no host sync in the
  loop; on CUDA, blocks of iterations are replayed as a CUDA graph.
* :func:`farthest_point_sample` - dispatch (``mapper.kernels.dispatch.kernel``).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .._validation import as_tensor
from ..errors import InvalidArgument, InvalidArgumentType
from .dispatch import kernel

LOW32 = (1 << 32) - 1
TORCH_CHUNK = 64  # points per chunk, torch path (CPU)
TRITON_CHUNK = 64  # points per chunk, Triton path
TRITON_CHUNKS_PER_PROGRAM = 8
GRAPH_ITERS = 64  # iterations per captured CUDA graph (0: no graphs)
_MORTON_BITS = 16


def _check(points, m, start) -> torch.Tensor:
    """float32 ``[N, 3]`` contiguous; raises on bad shapes, types, non-finite points or bad m/start."""
    p = as_tensor("points", points)
    if not p.is_floating_point():
        raise InvalidArgumentType(f"points: expected a floating dtype, got {p.dtype}")
    if p.dim() != 2 or p.shape[1] != 3:
        raise InvalidArgument(f"points: expected shape [N, 3], got {list(p.shape)}")
    n = p.shape[0]
    if n >= 1 << 31:
        raise InvalidArgument(f"points: at most 2^31 - 1 points, got {n}")
    for name, v in (("m", m), ("start", start)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentType(f"{name}: expected an int, got {type(v).__name__}")
    if not 0 <= m <= n:
        raise InvalidArgument(f"m: expected 0 <= m <= N = {n}, got {m}")
    if m and not 0 <= start < n:
        raise InvalidArgument(f"start: expected 0 <= start < N = {n}, got {start}")
    p = p.to(torch.float32).contiguous()
    if n and not bool(torch.isfinite(p).all()):
        raise InvalidArgument("points: contains NaN or infinite coordinates")
    return p


# ---------------------------------------------------------------------------------------------------
# reference


def farthest_point_sample_naive(points: torch.Tensor, m: int, start: int = 0) -> torch.Tensor:
    """FPS by the definition: ``m`` updates of all N distances, each followed by ``argmax``.

    Args: ``points`` float ``[N, 3]`` (any device; computed in float32), ``m`` samples (0 <= m <= N), the
    index of the first sample. Returns int64 ``[m]`` point indices on the points' device.
    """
    p = _check(points, m, start)
    out = torch.empty(m, dtype=torch.int64, device=p.device)
    if m == 0:
        return out
    x, y, z = p.t().contiguous().unbind(0)
    d = torch.full_like(x, math.inf)
    dd = torch.empty_like(x)
    t = torch.empty_like(x)
    last = torch.full((1,), start, dtype=torch.int64, device=p.device)
    out[0] = start
    for k in range(1, m):
        q = p.index_select(0, last)[0]  # no host sync
        torch.sub(x, q[0], out=t)
        torch.mul(t, t, out=dd)
        torch.sub(y, q[1], out=t)
        dd.add_(t.mul_(t))
        torch.sub(z, q[2], out=t)
        dd.add_(t.mul_(t))
        torch.minimum(d, dd, out=d)
        last = torch.argmax(d).view(1)  # first index of the maximum
        out[k : k + 1] = last
    return out


# ---------------------------------------------------------------------------------------------------
# chunk layout shared by the pruned implementations


_SPREAD: dict[torch.device, torch.Tensor] = {}


def _spread_table(device: torch.device) -> torch.Tensor:
    """int64 ``[2^16]``: bit b of the index moved to bit 3b (Morton interleaving by table look-up)."""
    t = _SPREAD.get(device)
    if t is None:
        v = torch.arange(1 << _MORTON_BITS, dtype=torch.int64)
        out = torch.zeros_like(v)
        for b in range(_MORTON_BITS):
            out |= ((v >> b) & 1) << (3 * b)
        t = _SPREAD[device] = out.to(device)
    return t


def morton_order(p: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: permutation sorting float32 ``[N, 3]`` points along a Z-order curve (2^16 per axis)."""
    lo = p.amin(0)
    ext = (p.amax(0) - lo).clamp_min(1e-30)
    scale = (1 << _MORTON_BITS) - 1
    q = ((p - lo) / ext * scale).to(torch.int64).clamp_(0, scale).t().contiguous()
    tab = _spread_table(p.device)
    code = (tab[q[0]] << 2) | (tab[q[1]] << 1) | tab[q[2]]
    return torch.sort(code, stable=True).indices


class Chunks:
    """Points in Morton order cut into ``n`` chunks of ``size`` (the last one padded with copies of its
    last point). Tensors: float32 ``xyz [n*size, 3]``, int64 ``low [n*size]`` (``2^32 - 1 - index``, -1 for
    padding, so that ``bits(d) << 32 | low`` is the point's key and -1 for padding), float32 ``lo, hi
    [n, 3]`` (chunk boxes), int64 ``key [n]`` (chunk keys, initially distance +inf and the chunk's smallest
    index), float32 ``dist [n*size]`` (+inf)."""

    def __init__(self, p: torch.Tensor, size: int):
        n_pts = p.shape[0]
        self.size = size
        self.n = -(-n_pts // size)
        order = morton_order(p)
        pad = self.n * size - n_pts
        if pad:
            order = torch.cat((order, order[-1:].expand(pad)))
        self.xyz = p.index_select(0, order)
        low = LOW32 - order
        if pad:
            low[n_pts:] = -1
        self.low = low
        c = self.xyz.view(self.n, size, 3)
        self.lo = c.amin(1)
        self.hi = c.amax(1)
        inf_bits = int(np.float32(np.inf).view(np.int32))
        self.key = (inf_bits << 32) | low.view(self.n, size).amax(1)
        self.dist = torch.full((self.n * size,), math.inf, dtype=torch.float32, device=p.device)


def _dist2_rows(d: torch.Tensor) -> torch.Tensor:
    """``(dx*dx + dy*dy) + dz*dz`` of float32 differences ``[R, 3]`` (overwrites ``d``)."""
    d.mul_(d)
    out = d[:, 0] + d[:, 1]
    return out.add_(d[:, 2])


# ---------------------------------------------------------------------------------------------------
# pruned, torch


def farthest_point_sample_torch(points: torch.Tensor, m: int, start: int = 0) -> torch.Tensor:
    """The pruned FPS in torch (the CPU path); same signature and result as the naive reference."""
    return _fps_torch(_check(points, m, start), m, start)[0]


def _fps_torch(p: torch.Tensor, m: int, start: int, chunk: int = TORCH_CHUNK) -> tuple[torch.Tensor, int]:
    """Indices and the number of chunk updates done (for benchmarks)."""
    out = torch.empty(m, dtype=torch.int64, device=p.device)
    if m == 0:
        return out, 0
    ch = Chunks(p, chunk)
    key = ch.key
    if sys.byteorder == "little":  # the distance half of each chunk key, as a float32 view
        dmax = key.view(torch.float32)[1::2]
    else:  # pragma: no cover
        dmax = None
    xyz = ch.xyz.view(ch.n, chunk, 3)
    dist = ch.dist.view(ch.n, chunk)
    low = ch.low.view(ch.n, chunk)
    out[0] = start
    q = start
    updates = 0
    for k in range(1, m):
        pq = p[q]  # float32 [3]: the same float32 operations as the reference
        g = torch.maximum(ch.lo - pq, pq - ch.hi).clamp_min_(0.0)
        lb = _dist2_rows(g)
        dm = dmax if dmax is not None else (key >> 32).to(torch.int32).view(torch.float32)
        act = torch.nonzero(lb < dm).squeeze(1)
        if act.numel():
            updates += act.numel()
            dn = torch.minimum(dist[act], _dist2_rows((xyz[act] - pq).view(-1, 3)).view(-1, chunk))
            dist[act] = dn
            kp = (dn.view(torch.int32).to(torch.int64) << 32).bitwise_or_(low[act])
            key[act] = kp.amax(1)
        q = LOW32 - (int(key.max()) & LOW32)
        out[k] = q
    return out, updates


# ---------------------------------------------------------------------------------------------------
# pruned, Triton


def farthest_point_sample_triton(points: torch.Tensor, m: int, start: int = 0) -> torch.Tensor:
    """The pruned FPS as one Triton launch per sample (GPU path); same result as the reference."""
    return _fps_triton(_check(points, m, start), m, start)


def _fps_triton(
    p: torch.Tensor,
    m: int,
    start: int,
    chunk: int = TRITON_CHUNK,
    chunks_per_program: int = TRITON_CHUNKS_PER_PROGRAM,
    prune: bool = True,
    graph_iters: int | None = None,
) -> torch.Tensor:
    """``prune=False`` gives the naive algorithm fused into one launch per sample (benchmark baseline)."""
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_fps import fps_loop

    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=p.device)
    if graph_iters is None:
        graph_iters = GRAPH_ITERS if p.device.type == "cuda" else 0
    ch = Chunks(p, chunk)
    best = torch.full((m,), -1, dtype=torch.int64, device=p.device)
    best[0] = LOW32 - start
    fps_loop(p, ch, best, chunks_per_program, prune, graph_iters)
    return LOW32 - (best & LOW32)


# ---------------------------------------------------------------------------------------------------
# dispatch


def _fps_torch_indices(p: torch.Tensor, m: int, start: int) -> torch.Tensor:
    """The indices of :func:`_fps_torch` (the signature of :func:`_fps_triton`)."""
    return _fps_torch(p, m, start)[0]


def farthest_point_sample(points: torch.Tensor, m: int, start: int = 0) -> torch.Tensor:
    """Exact farthest point sampling, pruned by chunk bounding boxes (see the module docstring).

    Args:
        points: float ``[N, 3]`` (CPU or CUDA; distances in float32).
        m: number of samples, ``0 <= m <= N``.
        start: index of the first sample.

    Returns: int64 ``[m]`` indices into ``points``, on its device: ``start``, then each time the point
    farthest from the samples so far (smallest index on ties), equal to :func:`farthest_point_sample_naive`.
    """
    p = _check(points, m, start)
    return kernel(p.device, _fps_torch_indices, _fps_triton)(p, m, start)

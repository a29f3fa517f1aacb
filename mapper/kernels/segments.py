"""Brick-segment walk: ray traversal at brick resolution, then the voxels of each (ray, brick) segment.

Integrating a ray into a layer of 4^3 bricks needs, per ray, the voxels it crosses and, per voxel, its
brick's place in a frame-local accumulator. Materialising every crossed voxel of every ray and sorting
them (the first implementation) costs ``[rays, steps, 3]`` int64 cells and a sort of up to 10^8 keys per
frame. Here instead:

1. **coarse** (:func:`brick_segments`): a DDA at brick resolution (cell = 4 voxels; brick boundaries are
   voxel boundaries) lists, per ray, the bricks its segment ``[t0, t1]`` crosses: ``seg_ray`` (int32) and
   ``seg_key`` (int64 brick key, ``-1`` = no brick: padding or outside the key range);
2. **unique** (:func:`unique_brick_ranks`): the frame's bricks (sorted by key, as ``voxel_keys`` sorts)
   and each segment's rank among them (int32), by a dense bitmap over the bricks' bounding box when it
   is small, else by a sort;
3. **fine** (:func:`walk_segments`): per segment, the voxels of the ray inside that brick (at most
   :data:`WALK_STEPS` = 10 in a 4^3 brick) applied to a frame-local accumulator at
   ``rank * 64 + offset`` (``offset = ((i&3)<<4)|((j&3)<<2)|(k&3)``): occupancy stores a miss flag (1),
   the LiDAR TSDF adds ``sdf * w`` and ``w`` for voxels with ``sdf = r - |centre - origin| >= -tau``.

Each stage has a pure-torch reference (the CPU path) and a Triton kernel (``triton_segments``), chosen
by :func:`mapper.kernels.dispatch.kernel`. Both do the same float64 operations in the same order
(the Triton kernels are compiled without FMA contraction), so they agree bit for bit.

Exactness against a voxel-resolution DDA (``dda_torch``): the coarse walk is the same DDA with a 4x cell,
whose boundaries ``(b + pos) * 4s`` equal the voxel boundaries ``(4b + 4 pos) * s`` exactly (scaling by a
power of two commutes with rounding); the fine walk starts at the voxel where the ray enters the brick
(slab entry; at exact ties the state the DDA's x-y-z tie order reaches), computes that voxel's boundary
crossings as ``t0 + (boundary - p0) / d`` from the ray's start and then accumulates ``+ s / |d|`` per
step as the reference does. In a ray's first brick this is the reference's arithmetic exactly; later it
differs in the last bits, which changes a voxel only when a ray passes within rounding (~1e-15
relative) of a voxel edge or ends there. The tests check equality on random, axis-aligned and
exactly-tied rays with ends on brick boundaries.
"""

from __future__ import annotations

import math

import torch

from .chunks import cpu_rows, row_slices
from .dispatch import kernel
from .keys import BRICK_HI, BRICK_LO, VOXEL_KEY_BIAS, VOXEL_KEY_BITS, brick_keys, keys_to_ijk  # noqa: F401

KEY_BITS = VOXEL_KEY_BITS  # the voxel keys of mapper.kernels.keys (brick coordinates)
KEY_BIAS = VOXEL_KEY_BIAS
WALK_STEPS = 10  # voxels of a 4^3 brick one straight segment can cross: 3 * 4 - 2
MISS, BAND = 0, 1  # walk modes: occupancy miss flags, LiDAR TSDF band sums
CPU_RAYS = 1 << 17  # rays per batch of the torch coarse walk on the CPU (per-step temporaries ~3 MB)
# segments per chunk of the torch fine walk on the CPU (its temporaries: float64 [m] rows, 8 B a segment;
# fewer under a fixed malloc mmap threshold, chunks.cpu_rows)
CPU_SEGMENTS = 1 << 14
# segment rows per coarse pass (12 B each, + 4 B of rank): frames with more are split into ray chunks
SEGMENT_BUDGET = {"cuda": 1 << 25, "cpu": 1 << 23}


# ------------------------------------------------------------------------------------------------ keys
def keys_to_bricks(keys: torch.Tensor) -> torch.Tensor:
    """Brick coordinates (int64 ``[M, 3]``) of :func:`brick_keys` (``keys.keys_to_ijk``)."""
    return keys_to_ijk(keys)


# ---------------------------------------------------------------------------------------------- coarse
def _dda_setup(origins, dirs, t0, cell):
    """DDA state at ``t0`` (the arithmetic of :func:`mapper.kernels.dda.dda_torch`)."""
    p = origins + dirs * t0[:, None]
    v = torch.floor(p / cell).to(torch.int64)
    step = torch.sign(dirs).to(torch.int64)
    pos = dirs > 0
    boundary = (v + pos.to(torch.int64)).to(torch.float64) * cell
    inv = torch.where(dirs != 0, 1.0 / dirs, torch.full_like(dirs, math.inf))
    tmax = torch.where(dirs != 0, t0[:, None] + (boundary - p) * inv, torch.full_like(dirs, math.inf))
    tdelta = torch.where(dirs != 0, cell * inv.abs(), torch.full_like(dirs, math.inf))
    return v, step, tmax, tdelta


def brick_segments_torch(
    origins: torch.Tensor,
    dirs: torch.Tensor,
    t0: torch.Tensor,
    t1: torch.Tensor,
    cell: float,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list] | None:
    """Bricks (cells of size ``cell`` = 4 voxels) crossed by the segments ``origins + t dirs``,
    ``t in [t0, t1]``: the cells of :func:`dda_torch` with ``tent < t1`` (and the first when ``t0 <= t1``).

    Args: float64 ``[R, 3]`` origins (may be an expanded ``[3]``) and unit dirs, float64 ``[R]`` t0/t1.
    Returns: (int32 ``[M]`` ray of each segment, int64 ``[M]`` brick key, ``-1`` outside the key range;
    ``[[lo], [hi]]``: a box of bricks holding them all, see :func:`ray_bricks_bbox`). Rows with ray ``-1``
    (and key ``-1``) are padding.

    The rays step together, sorted by their cell count ``sum |b1 - b0| + 1`` (exact up to rounding), so
    the rays still walking at step k are a suffix (views, no compaction); a ray gets one step of slack
    past its count (padding rows) for a rounding overshoot; more than that, or cells outside the key
    range, fall back to :func:`_brick_segments_compact`. Keys advance by ``+-2^42 / 2^21 / 1`` per step.

    ``max_rows``: return None instead when the frame's coarse rows (:func:`_ray_chunks`' estimate
    ``sum |b1 - b0| + 4``; the Triton kernel: its exact CSR size) exceed it (the caller cuts the rays).
    """
    dev = dirs.device
    n = dirs.shape[0]
    if n == 0:
        return _no_segments(dev)
    if max_rows is not None and len(_ray_chunks(origins, dirs, t0, t1, cell, max_rows)) > 1:
        return None
    rows = cpu_rows(n, 8) if dev.type == "cpu" else n
    if n > rows:  # a fixed malloc mmap threshold: ray groups whose [n] temporaries stay below it
        return _brick_segments_groups(origins, dirs, t0, t1, cell, rows)
    o = origins.expand(n, 3) if origins.dim() == 1 else origins
    v, step, tmax, tdelta = _dda_setup(o, dirs, t0, cell)
    b1 = torch.floor((o + dirs * t1[:, None]) / cell).to(torch.int64)
    box = torch.stack((torch.minimum(v.amin(0), b1.amin(0)) - 1, torch.maximum(v.amax(0), b1.amax(0)) + 1))
    first = t0 <= t1
    cap = ((b1 - v).abs().sum(dim=1) + 1) * first
    vals = torch.cat((box.reshape(-1), cap.max().reshape(1))).tolist()  # one sync
    cmax = int(vals[6])
    box = [vals[0:3], vals[3:6]]
    if min(vals[:6]) < BRICK_LO or max(vals[:6]) >= BRICK_HI:
        return _brick_segments_compact(o, dirs, t0, t1, cell)
    order = torch.argsort(cap, stable=True)
    counts = torch.bincount(cap, minlength=cmax + 1).cumsum(0).tolist()  # rays with cap <= c
    slack = 1
    key = brick_keys(v).index_select(0, order)
    # the key's change per step on each axis, as float64 (exact: |values| <= 2^42)
    dkey = (step * torch.tensor([1 << (2 * KEY_BITS), 1 << KEY_BITS, 1], device=dev)).to(torch.float64)
    dkey = dkey.index_select(0, order).T.contiguous()
    tm = tmax.index_select(0, order).T.contiguous()
    td = torch.where(torch.isinf(tdelta), 0.0, tdelta).index_select(0, order).T.contiguous()
    e = t1.index_select(0, order)
    t = t0.index_select(0, order)
    first = first.index_select(0, order)
    ray = order.to(torch.int32)
    overrun = torch.zeros((), dtype=torch.bool, device=dev)
    rays_out, keys_out = [], []
    # the step masks as float64 0/1 written by the comparisons (out=): a bool mask would cost a conversion
    # in every product; the same selection as the reference's x-y-z tie order (x: tm_x is the minimum)
    fx, fy, fz = (torch.empty(n, dtype=torch.float64, device=dev) for _ in range(3))
    for k in range(cmax + slack + 1):
        lo = counts[k - slack] if k >= slack else 0  # rays with cap + slack <= k have left
        if k >= slack:  # the rays that left now must have finished
            prev = counts[k - slack - 1] if k > slack else 0
            if prev < lo:
                overrun |= (t[prev:lo] < e[prev:lo]).any()
        if lo >= n:
            break
        valid = (t[lo:] < e[lo:]) if k else first[lo:]
        vi = valid.to(torch.int32)
        rays_out.append((ray[lo:] + 1) * vi - 1)
        keys_out.append((key[lo:] + 1) * vi - 1)
        tms = tm[:, lo:]
        ts = t[lo:]
        x, y, z = fx[lo:], fy[lo:], fz[lo:]
        torch.minimum(torch.minimum(tms[0], tms[1], out=ts), tms[2], out=ts)
        torch.eq(tms[0], ts, out=x)
        torch.eq(tms[1], ts, out=y)
        y.addcmul_(y, x, value=-1.0)  # y and not x
        torch.sub(1.0 - x, y, out=z)
        tms[0].addcmul_(td[0, lo:], x)
        tms[1].addcmul_(td[1, lo:], y)
        tms[2].addcmul_(td[2, lo:], z)
        dk = dkey[0, lo:] * x
        dk.addcmul_(dkey[1, lo:], y).addcmul_(dkey[2, lo:], z)
        key[lo:] += dk.to(torch.int64)
    if bool(overrun):  # a rounding overshoot past the slack (never seen): the general walk
        return _brick_segments_compact(o, dirs, t0, t1, cell)
    return torch.cat(rays_out), torch.cat(keys_out), box


def _brick_segments_groups(origins, dirs, t0, t1, cell, rows):
    """:func:`brick_segments_torch` over groups of ``rows`` rays (the same segments, group by group; the
    box the union of the groups')."""
    rays_out, keys_out, los, his = [], [], [], []
    for a in range(0, dirs.shape[0], rows):
        sl = slice(a, a + rows)
        o = origins if origins.dim() == 1 else origins[sl]
        seg_ray, seg_key, (lo, hi) = brick_segments_torch(o, dirs[sl], t0[sl], t1[sl], cell)
        rays_out.append(torch.where(seg_ray >= 0, seg_ray + a, seg_ray))
        keys_out.append(seg_key)
        if all(x <= y for x, y in zip(lo, hi, strict=True)):  # an empty group's box is [0, -1]
            los.append(lo)
            his.append(hi)
    if not los:
        return torch.cat(rays_out), torch.cat(keys_out), [[0] * 3, [-1] * 3]
    box = [[min(x) for x in zip(*los, strict=True)], [max(x) for x in zip(*his, strict=True)]]
    return torch.cat(rays_out), torch.cat(keys_out), box


def _brick_segments_compact(origins, dirs, t0, t1, cell):
    """:func:`brick_segments_torch` by a DDA over an active set (finished rays dropped after every step);
    handles any ray (cells outside the key range get key ``-1``). No padding rows."""
    dev = dirs.device
    n = dirs.shape[0]
    rays_out, keys_out = [], []
    batch = CPU_RAYS if dev.type == "cpu" else max(n, 1)
    for s0 in range(0, n, batch):
        ray = torch.arange(s0, min(n, s0 + batch), device=dev)
        a = t0[ray]
        e = t1[ray]
        v, step, tmax, tdelta = _dda_setup(origins[ray], dirs[ray], a, cell)
        first = a <= e
        if not bool(first.all()):
            ray, v, step, tmax, tdelta, e = (x[first] for x in (ray, v, step, tmax, tdelta, e))
        while ray.numel():
            rays_out.append(ray.to(torch.int32))
            keys_out.append(brick_keys(v))
            tx, ty, tz = tmax.unbind(1)
            mx = (tx <= ty) & (tx <= tz)
            my = ~mx & (ty <= tz)
            m = torch.stack((mx, my, ~mx & ~my), dim=1)
            t = torch.minimum(torch.minimum(tx, ty), tz)
            v = v + step * m
            tmax = tmax + torch.where(m, tdelta, 0.0)
            alive = t < e
            if not bool(alive.all()):
                idx = alive.nonzero().squeeze(1)
                ray, v, step, tmax, tdelta, e = (x[idx] for x in (ray, v, step, tmax, tdelta, e))
    if not rays_out:
        return _no_segments(dev)
    return torch.cat(rays_out), torch.cat(keys_out), ray_bricks_bbox(origins, dirs, t0, t1, cell).tolist()


def _no_segments(dev):
    z = torch.zeros(0, dtype=torch.int64, device=dev)
    return z.to(torch.int32), z, [[0] * 3, [-1] * 3]


def brick_segments(origins, dirs, t0, t1, cell: float, max_rows: int | None = None):
    """:func:`brick_segments_torch`, or its Triton kernel (one launch, CSR output) where Triton runs."""
    impl = brick_segments_torch
    if dirs.shape[0]:
        impl = kernel(dirs.device, brick_segments_torch, "triton_segments:brick_segments_triton")
    return impl(origins, dirs, t0, t1, cell, max_rows)


# ---------------------------------------------------------------------------------------------- frame
def _cap_bound(length: float, cell: float) -> int:
    """Rows the coarse pass may give a segment of ``length``: cells crossed + the Triton kernel's margin."""
    return 3 * (math.ceil(length / cell) + 1) + 4


class FrameSegments:
    """The coarse pass and the unique bricks of one frame, with memory bounded by ray chunks.

    ``bricks`` (int64 ``[U, 3]``, sorted by key) are the bricks of all segments and of ``extra_keys``
    (e.g. the bricks of the returns), ``extra_ranks`` the ranks of the extra keys, and
    :meth:`segments` yields ``(seg_ray, seg_rank)`` (int32, global ray indices) per chunk for
    :func:`walk_segments`. When the rows the coarse pass may produce exceed ``budget`` (estimated per ray
    as ``sum |b1 - b0| + 4``; skipped when ``max_length`` bounds it), the rays are cut into chunks: a
    first pass collects each chunk's bricks, the frame's bricks are their union, and :meth:`segments`
    runs each chunk's coarse pass again, ranking its keys by a binary search in the frame's keys.
    """

    def __init__(self, origins, dirs, t0, t1, cell: float, extra_keys=(), budget=None, max_length=None):
        n = dirs.shape[0]
        dev = dirs.device
        self.args = (origins, dirs, t0, t1, cell)
        budget = SEGMENT_BUDGET["cuda" if dev.type == "cuda" else "cpu"] if budget is None else budget
        first = None
        if max_length is not None and n * _cap_bound(max_length, cell) <= budget:
            self.ranges = [(0, n)]
        else:  # one pass when its rows fit (its own size read decides: no separate row estimate)
            first = brick_segments(origins, dirs, t0, t1, cell, max_rows=budget) if n else None
            self.ranges = [(0, n)] if first is not None else _ray_chunks(origins, dirs, t0, t1, cell, budget)
        if len(self.ranges) == 1:
            seg_ray, seg_key, box = (
                first if first is not None else brick_segments(origins, dirs, t0, t1, cell)
            )
            self.bricks, ranks = unique_brick_ranks(seg_key, *extra_keys, bbox=box)
            self._single = (seg_ray, ranks[0])
            self.extra_ranks = ranks[1:]
            return
        keys, los, his = [], [], []
        for a, b in self.ranges:
            _, seg_key, box = brick_segments(*_rays(self.args, a, b))
            chunk_bricks, _ = unique_brick_ranks(seg_key, bbox=box)
            keys.append(brick_keys(chunk_bricks))
            los.append(box[0])
            his.append(box[1])
        box = [[min(x) for x in zip(*los, strict=True)], [max(x) for x in zip(*his, strict=True)]]
        self.bricks, ranks = unique_brick_ranks(torch.cat(keys), *extra_keys, bbox=box)
        self.extra_ranks = ranks[1:]
        self._keys = brick_keys(self.bricks)

    def segments(self):
        if len(self.ranges) == 1:
            seg = self._single
            self._single = None
            yield seg
            return
        for a, b in self.ranges:
            seg_ray, seg_key, _ = brick_segments(*_rays(self.args, a, b))
            pos = torch.searchsorted(self._keys, seg_key).clamp(max=max(self._keys.numel() - 1, 0))
            found = (seg_key >= 0) & (self._keys[pos] == seg_key)
            yield (
                torch.where(seg_ray >= 0, seg_ray + a, -1).to(torch.int32),
                torch.where(found, pos, -1).to(torch.int32),
            )


def _rays(args, a, b):
    origins, dirs, t0, t1, cell = args
    return origins[a:b], dirs[a:b], t0[a:b], t1[a:b], cell


def _ray_chunks(origins, dirs, t0, t1, cell, budget) -> list[tuple[int, int]]:
    """Contiguous ray ranges whose estimated coarse rows (``sum |b1 - b0| + 4`` per ray) fit ``budget``
    (a single ray may exceed it). One host sync (two when the frame is split)."""
    n = dirs.shape[0]
    b0 = torch.floor((origins + dirs * t0[:, None]) / cell)
    b1 = torch.floor((origins + dirs * t1[:, None]) / cell)
    csum = torch.cumsum((b1 - b0).abs().sum(dim=1).to(torch.int64) + 4, 0)
    total = int(csum[-1])
    if total <= budget:
        return [(0, n)]
    marks = torch.arange(1, -(-total // budget), device=dirs.device, dtype=torch.int64) * budget
    cuts = [0, *sorted(set(torch.searchsorted(csum, marks, right=True).tolist())), n]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


# ---------------------------------------------------------------------------------------------- unique
def ray_bricks_bbox(origins, dirs, t0, t1, cell: float) -> torch.Tensor:
    """int64 ``[2, 3]`` (device): a box of bricks holding every cell the coarse walk can visit: the cells of
    the segments' end points (the walk moves monotonically between them), one cell of margin for a
    rounding overshoot, clipped to the key range."""
    b0 = torch.floor((origins + dirs * t0[:, None]) / cell)
    b1 = torch.floor((origins + dirs * t1[:, None]) / cell)
    lo = torch.minimum(b0.amin(dim=0), b1.amin(dim=0)) - 1
    hi = torch.maximum(b0.amax(dim=0), b1.amax(dim=0)) + 1
    return torch.stack((lo.clamp(BRICK_LO, BRICK_HI - 1), hi.clamp(BRICK_LO, BRICK_HI - 1))).to(torch.int64)


def coarse_caps_torch(origins, dirs, t0, t1, cell: float):
    """Per ray the rows the coarse pass may give it, and the frame's brick box (the reference of
    :func:`mapper.kernels.triton_segments.coarse_caps_triton`).

    Args:
        origins: float64 ``[N, 3]`` (or one row expanded); dirs ``[N, 3]``; t0, t1 ``[N]``; cell: brick edge.
    Returns:
        cap: int64 ``[N]``: the bricks between the start and end bricks (``sum |b1 - b0|``, float64 as the
        coarse kernel's start) + 4 (one per axis for a rounding overshoot, and the start), 1 when
        ``t0 > t1``; caps: int64 ``[7]``: the box of bricks holding every cell the walk can visit (lo x3,
        hi x3: the end cells with one of margin, clipped to the key range; lo = ``BRICK_HI - 1``, hi =
        ``BRICK_LO`` for no ray) and the largest capacity (0 for no ray).
    """
    o = origins.to(torch.float64)
    d, a, e = dirs.to(torch.float64), t0.to(torch.float64), t1.to(torch.float64)
    b0 = torch.floor((o + d * a[:, None]) / cell)
    b1 = torch.floor((o + d * e[:, None]) / cell)
    cap = (b1 - b0).abs().sum(dim=1).to(torch.int64) + 4
    cap = torch.where(a <= e, cap, torch.ones_like(cap))
    if cap.numel() == 0:
        lo = torch.full((3,), BRICK_HI - 1, dtype=torch.int64, device=d.device)
        return cap, torch.cat((lo, torch.full_like(lo, BRICK_LO), lo.new_zeros(1)))
    lo = torch.minimum(b0.amin(dim=0), b1.amin(dim=0)) - 1
    hi = torch.maximum(b0.amax(dim=0), b1.amax(dim=0)) + 1
    box = torch.stack((lo, hi)).clamp(BRICK_LO, BRICK_HI - 1).to(torch.int64)
    return cap, torch.cat((box.reshape(-1), cap.max().reshape(1)))


def _keys_bbox(keys) -> torch.Tensor:
    """int64 ``[2, 3]`` (device): the bounding box of the valid (``>= 0``) keys' bricks (lo > hi: none)."""
    big = 1 << 40
    m = (1 << KEY_BITS) - 1
    los, his = [], []
    for k in keys:
        if k.numel() == 0:
            continue
        valid = k >= 0
        for sh in (2 * KEY_BITS, KEY_BITS, 0):
            c = ((k >> sh) & m) - KEY_BIAS
            los.append(torch.where(valid, c, big).amin())
            his.append(torch.where(valid, c, -big).amax())
    if not los:
        return torch.tensor([[big] * 3, [-big] * 3], dtype=torch.int64, device=keys[0].device)
    lo = torch.stack(los).reshape(-1, 3).amin(dim=0)
    hi = torch.stack(his).reshape(-1, 3).amax(dim=0)
    return torch.stack((lo, hi))


def _dense_flat_torch(k: torch.Tensor, lo, ext, cells: int) -> torch.Tensor:
    """Row-major index of each key's brick in the box ``lo + [0, ext)``; ``cells`` for ``-1`` keys and
    keys outside the box."""
    m = (1 << KEY_BITS) - 1
    i = ((k >> (2 * KEY_BITS)) & m) - (KEY_BIAS + lo[0])
    j = ((k >> KEY_BITS) & m) - (KEY_BIAS + lo[1])
    l_ = (k & m) - (KEY_BIAS + lo[2])
    ok = (k >= 0) & (i >= 0) & (i < ext[0]) & (j >= 0) & (j < ext[1]) & (l_ >= 0) & (l_ < ext[2])
    return torch.where(ok, (i * ext[1] + j) * ext[2] + l_, cells)


def dense_flat_torch(keys: torch.Tensor, lo, ext, cells: int, seen: torch.Tensor) -> torch.Tensor:
    """The reference of ``triton_segments.dense_flat_triton`` (same arguments): the row-major index of
    each key's brick in the box ``lo + [0, ext)`` (``cells`` for ``-1`` keys and keys outside it), and
    ``seen[index] = 1``; int64 indices, in row chunks."""
    dev = keys.device
    f = torch.cat([_dense_flat_torch(keys[sl], lo, ext, cells) for sl in row_slices(keys.numel(), dev)])
    seen.index_fill_(0, f, 1)  # the scalar as a kernel argument (``seen[f] = 1`` copies it from the host)
    return f


def unique_brick_ranks(
    *keys: torch.Tensor,
    bbox: torch.Tensor | None = None,
    max_dense_cells: int = 1 << 26,
    dense_slack: int = 1 << 20,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The distinct bricks of int64 key tensors (``-1`` = none) and every key's rank among them.

    Returns (int64 ``[U, 3]`` bricks sorted by key, [int32 rank per key, ``-1`` for ``-1`` keys]).
    ``bbox`` (``[[lo], [hi]]`` or an int64 ``[2, 3]`` tensor, optional): a box of bricks known to hold
    every key's brick (e.g. the one :func:`brick_segments` returns; on the dense path a key outside it
    gets rank -1); by default the keys' own box. Dense path (the box has at most ``max_dense_cells``
    cells and at most ``4 n + dense_slack`` for ``n`` keys): a bitmap and a rank table over the box (linear,
    no sort; on CUDA one Triton pass marks the bitmap); otherwise ``torch.unique``. Host syncs: the brick
    count (and the box when it is a tensor, or computed here).
    """
    dev = keys[0].device
    n = sum(k.numel() for k in keys)
    if n == 0:
        return _no_bricks(dev, keys)
    if bbox is None:
        bbox = _keys_bbox(keys)
    lo, hi = bbox.tolist() if isinstance(bbox, torch.Tensor) else bbox  # sync (a tensor box)
    if any(a > b for a, b in zip(lo, hi, strict=True)):  # no valid key
        return _no_bricks(dev, keys)
    ext = [b - a + 1 for a, b in zip(lo, hi, strict=True)]
    cells = ext[0] * ext[1] * ext[2]
    if cells <= max_dense_cells and cells <= 4 * n + dense_slack:
        seen = torch.zeros(cells + 1, dtype=torch.uint8, device=dev)
        impl = kernel(dev, dense_flat_torch, "triton_segments:dense_flat_triton")
        flats = [impl(k, lo, ext, cells, seen) for k in keys]
        idx = seen[:cells].nonzero().squeeze(1)  # sync: the brick count
        table = torch.empty(cells + 1, dtype=torch.int32, device=dev)
        table[idx] = torch.arange(idx.numel(), dtype=torch.int32, device=dev)
        table[cells:].fill_(-1)  # fill_: no host-to-device copy of the scalar (``table[cells] = -1`` syncs)
        a = idx // (ext[1] * ext[2])
        r = idx % (ext[1] * ext[2])
        bricks = torch.stack((a + lo[0], r // ext[2] + lo[1], r % ext[2] + lo[2]), dim=1)
        return bricks, [table.index_select(0, f) for f in flats]
    # a -1 key appended: the first unique key is always -1 (no host read to find out whether one was there)
    allk = torch.cat((*keys, torch.full((1,), -1, dtype=torch.int64, device=dev)))
    uk, inv = torch.unique(allk, return_inverse=True)
    uk = uk[1:]
    inv = inv[:-1].to(torch.int32) - 1
    return keys_to_bricks(uk), list(torch.split(inv, [k.numel() for k in keys]))


def _no_bricks(dev, keys):
    return torch.zeros((0, 3), dtype=torch.int64, device=dev), [
        torch.full((k.numel(),), -1, dtype=torch.int32, device=dev) for k in keys
    ]


# ------------------------------------------------------------------------------------------------ fine
def walk_segments_torch(
    mode: int,
    origins: torch.Tensor,
    dirs: torch.Tensor,
    t0: torch.Tensor,
    t1: torch.Tensor,
    rng: torch.Tensor | None,
    seg_ray: torch.Tensor,
    seg_rank: torch.Tensor,
    bricks: torch.Tensor,
    voxel_size: float,
    out: tuple[torch.Tensor, ...],
    tau: float = 0.0,
    weight: float = 1.0,
    normals: torch.Tensor | None = None,
    ray_weight: torch.Tensor | None = None,
) -> None:
    """Walk the voxels of every (ray, brick) segment and apply ``mode`` to frame-local accumulators.

    Args:
        mode: :data:`MISS` (``out = (flags,)``, uint8 ``[>= U * 64]``: ``flags[rank * 64 + offset] = 1``
            for every voxel the ray crosses with entry ``t < t1``, the brick's first one always) or
            :data:`BAND` (``out = (sdf_sum, w_sum)``, float32: for crossed voxels with
            ``sdf = rng - |centre - origin| >= -tau``, add ``min(sdf, tau) * weight`` and ``weight``).
        origins, dirs: float64 ``[R, 3]`` (origins may be an expanded ``[3]``); t0, t1 (and rng for BAND):
            float64 ``[R]``; the segment of ray r is ``[t0[r], t1[r]]``.
        seg_ray, seg_rank: int32 ``[M]``: the segment's ray and its brick's row in ``bricks``
            (``-1`` = skip); bricks: int ``[U, 3]`` brick coordinates (voxel ``>> 2``).
        normals, ray_weight (BAND only, optional, together): float64 ``[R, 3]`` unit surface normal at each
            ray's return, oriented towards the sensor, or a zero row; float32 ``[R]`` weight per ray
            (replaces ``weight``). A ray with a normal gets the distance projected on it,
            ``sdf = (centre - hit) . n`` (computed as ``(centre - origin) . n - q`` with
            ``q = rng * (dir . n)``, see :func:`plane_offsets`), instead of the along-ray distance; a voxel
            behind the return along the ray but in front of its plane is skipped (the plane does not hold
            there: a ray that clipped a box's corner, a surface curving away).
    """
    dev = dirs.device
    m_all = seg_ray.numel()
    chunk = cpu_rows(CPU_SEGMENTS, 8) if dev.type == "cpu" else max(m_all, 1)
    f64 = torch.float64
    # one contiguous row per axis ([R] each, [U] for the bricks), so that a chunk's gathers are rows
    rays = {"d": tuple(dirs.to(f64).T.contiguous()), "a": t0.to(f64), "e": t1.to(f64)}
    o = origins.to(f64)
    if o.dim() == 1 or o.stride(0) == 0:
        o = tuple(o.reshape(-1, 3)[0].reshape(3, 1))  # one origin for all rays: three [1] rows
    else:
        rays["o"] = tuple(o.T.contiguous())
    if mode == BAND:
        rays["r"] = rng.to(f64)
    proj = mode == BAND and normals is not None
    if proj:
        rays["n"] = tuple(normals.to(f64).T.contiguous())
        rays["q"] = plane_offsets(dirs, rng, normals)
        rays["w"] = ray_weight.to(torch.float32)
    lo_all = tuple((bricks.to(torch.int64).T * 4).to(f64).contiguous())
    for c0 in range(0, m_all, chunk):
        sr = seg_ray[c0 : c0 + chunk]
        sk = seg_rank[c0 : c0 + chunk]
        keep = (sr >= 0) & (sk >= 0)
        if not bool(keep.all()):
            keep_idx = keep.nonzero().squeeze(1)
            sr, sk = sr[keep_idx], sk[keep_idx]
        ray = sr.to(torch.int64)
        rank = sk.to(torch.int64)
        g = {
            k: tuple(y.index_select(0, ray) for y in x) if isinstance(x, tuple) else x.index_select(0, ray)
            for k, x in rays.items()
        }
        _walk_chunk(
            mode,
            g.get("o", o),
            g["d"],
            g["a"],
            g["e"],
            g.get("r"),
            rank,
            tuple(x.index_select(0, rank) for x in lo_all),
            float(voxel_size),
            out,
            tau,
            weight,
            (g["n"], g["q"], g["w"]) if proj else None,
        )


_BIG = 1e300  # stands in for an infinite crossing parameter (arithmetic selects: no inf * 0)


def _entry_voxel(c, d, exact, entered, lo, lo4):
    """The brick's first voxel on the ray (float64, one ``[m]`` row per axis), from ``c = floor(pe / s)``
    at the entry point ``pe`` and ``exact`` (``pe`` lies on a voxel boundary of that axis).

    Where the DDA would be: the voxel containing ``pe``, clamped into the brick (on the entry face the
    clamp picks the voxel inside, on a face the ray leaves by at the same time the one it has not left
    yet). At an exact tie the DDA steps the tied axes in the order x, y, z, so a tied *interior* boundary
    has been crossed when a later axis is the one entering the brick: x when y or z enters, y when z
    enters. A segment starting inside the brick (``entered`` false) starts at ``floor`` as the DDA does.

    Rows: tuples of three ``[m]`` rows; ``exact`` bool; ``lo4`` the entry face's voxel coordinate
    ``lo + 4 * (d < 0)``.
    """
    v = [torch.minimum(torch.maximum(c[k], lo[k]), lo[k] + 3) for k in (0, 1, 2)]
    entry_face = [exact[k] & (c[k] == lo4[k]) for k in (0, 1, 2)]
    interior = [exact[k] & (c[k] > lo[k]) & (c[k] < lo[k] + 4) & entered for k in (0, 1, 2)]
    st_x = entry_face[1] | entry_face[2]
    st_y = entry_face[2]
    # floor is the stepped state for d > 0 and the one before for d < 0
    fix = (interior[0] & ((d[0] > 0) ^ st_x), interior[1] & ((d[1] > 0) ^ st_y), interior[2] & (d[2] > 0))
    return [v[k] - fix[k].to(torch.float64) for k in (0, 1, 2)]


def plane_offsets(dirs: torch.Tensor, rng: torch.Tensor, normals: torch.Tensor) -> torch.Tensor:
    """float64 ``[R]``: ``rng * (dir . n)``, the offset of each ray's tangent plane (origin-relative); the
    torch walk takes it from here, the Triton walk computes the same expression per segment (the same
    rounding: no fp fusion)."""
    d = dirs.to(torch.float64)
    n = normals.to(torch.float64)
    return rng.to(torch.float64) * ((d[:, 0] * n[:, 0] + d[:, 1] * n[:, 1]) + d[:, 2] * n[:, 2])


def _walk_chunk(mode, o, d, a, e, r, rank, lo, s, out, tau, weight, plane=None):
    """The walk of one chunk of segments, one float64 ``[m]`` row per axis (tuples of three: origin (each
    ``[1]`` for a shared one), dirs, the brick's first voxel ``lo``; ``[m]``: t0, t1, range) with arithmetic
    selects (the CPU ``where`` is branchy, ~10x slower on random masks); all rows step together, finished
    ones masked, and dropped when fewer than half are left. ``plane``: per-row (normal (three ``[m]``),
    offset ``[m]``, float32 weight ``[m]``) for the projected distance (see :func:`walk_segments_torch`).

    Masks are float 0/1 written by the comparisons themselves (``out=``: a bool mask costs a conversion in
    every product) and the DDA state is updated in place. Every temporary is one ``[m]`` row (no ``[3, m]``
    block), so with ``m`` from :func:`mapper.kernels.chunks.cpu_rows` they stay below a fixed malloc mmap
    threshold (reused heap, no fresh pages)."""
    f64, f32 = torch.float64, torch.float32
    band = mode == BAND
    X = (0, 1, 2)

    def mask(op, x, y, dtype=f64):
        return op(x, y, out=torch.empty(x.shape, dtype=dtype, device=x.device))

    dz = [mask(torch.eq, d[k], 0.0) for k in X]
    inv = [1.0 / (d[k] + dz[k]) * (1.0 - dz[k]) for k in X]  # 1 / d, 0 on axes the ray does not cross
    p0 = [o[k] + d[k] * a for k in X]
    lo4 = [lo[k] + 4.0 * mask(torch.lt, d[k], 0.0) for k in X]  # the entry face's voxel coordinate
    tf = [a + (lo4[k] * s - p0[k]) * inv[k] - _BIG * dz[k] for k in X]  # slab entry per axis
    te = torch.maximum(a, torch.maximum(torch.maximum(tf[0], tf[1]), tf[2]))  # where the ray enters
    del tf
    pe = [o[k] + d[k] * te for k in X]
    c = [torch.floor(pe[k] / s) for k in X]
    exact = [(dz[k] == 0) & (c[k] * s == pe[k]) for k in X]
    v = _entry_voxel(c, d, exact, te > a, lo, lo4)
    del pe, c, exact, te, lo4
    pos = [mask(torch.gt, d[k], 0.0) for k in X]
    # the DDA from the brick's first voxel: crossings t0 + (boundary - p0) / d, then + s / |d| per step
    tm = [a + ((v[k] + pos[k]) * s - p0[k]) * inv[k] + _BIG * dz[k] for k in X]
    td = [s * inv[k].abs() for k in X]
    sgn = [torch.sign(d[k]) for k in X]
    rem = [(lo[k] + 3.0 * pos[k] - v[k]) * sgn[k] for k in X]  # steps left inside the brick per axis
    w = (16.0, 4.0, 1.0)
    dof = [sgn[k] * w[k] for k in X]  # change of the in-brick offset per step
    idx = rank.to(f64) * 64 + (((v[0] - lo[0]) * 16.0 + (v[1] - lo[1]) * 4.0) + (v[2] - lo[2]))
    vh = [v[k] + 0.5 for k in X]  # the voxel's centre in voxels (exact halves), stepped in place below
    del dz, inv, p0, pos, v
    if plane is not None:  # a normal: float64 0/1 and its complement (the distance's select), float32 0/1
        nn, q, wr = plane
        has = (nn[0] != 0) | (nn[1] != 0) | (nn[2] != 0)
        has64 = has.to(f64)
        plane = (*nn, q, wr, has64, 1.0 - has64, has.to(f32))
    parts_i, parts_v, parts_w = [], [], []

    def record(alive):
        if not band:
            parts_i.append(idx if alive is None else idx * alive)
            parts_v.append(torch.ones_like(idx) if alive is None else alive)
            return
        c = [vh[k] * s - o[k] for k in X]
        sq = c[0] * c[0]
        sq += c[1] * c[1]
        sq += c[2] * c[2]
        sdf = r - sq.sqrt_()
        kf = torch.empty(sdf.shape, dtype=f32, device=sdf.device)
        if plane is None:
            wt = weight
            torch.ge(sdf, -tau, out=kf)
        else:
            n0, n1, n2, q, wt, has64, no64, has32 = plane
            proj = c[0] * n0
            proj += c[1] * n1
            proj += c[2] * n2
            proj -= q
            # behind the return along the ray but in front of its plane: the plane does not hold there
            skip = mask(torch.lt, sdf, 0.0, f32)
            skip *= torch.gt(proj, 0.0, out=kf)
            skip *= has32
            sdf = (sdf * no64).addcmul_(proj, has64)  # the projected distance where a normal
            torch.ge(sdf, -tau, out=kf)
            kf -= skip  # skip implies proj > 0 >= -tau: kf = 1 there
        if alive is not None:
            kf *= alive
        parts_i.append(idx * kf)
        parts_v.append(sdf.clamp(max=tau).to(f32) * wt * kf)
        parts_w.append(kf * wt)

    record(None)
    alive = None
    m = idx.numel()
    t, fx, fy, fz = (torch.empty(m, dtype=f64, device=a.device) for _ in range(4))
    g, h = (torch.empty(m, dtype=f32, device=a.device) for _ in range(2))
    for _ in range(WALK_STEPS - 1):
        n = idx.numel()
        t, fx, fy, fz, g, h = t[:n], fx[:n], fy[:n], fz[:n], g[:n], h[:n]
        torch.minimum(torch.minimum(tm[0], tm[1], out=t), tm[2], out=t)
        # the axis that steps: ties x, then y, then z
        torch.eq(tm[0], t, out=fx)
        torch.eq(tm[1], t, out=fy)
        fy.addcmul_(fy, fx, value=-1.0)  # y and not x
        torch.sub(1.0 - fx, fy, out=fz)
        f = (fx, fy, fz)
        for k in X:
            tm[k].addcmul_(td[k], f[k])
            rem[k].sub_(f[k])
        idx = torch.addcmul(idx, dof[0], fx)
        idx.addcmul_(dof[1], fy).addcmul_(dof[2], fz)
        if band:
            for k in X:
                vh[k].addcmul_(sgn[k], f[k])
        # alive: the crossing is before t1 and the stepped axis had a voxel left in the brick
        torch.lt(t, e, out=g)
        nxt = torch.ge(torch.minimum(torch.minimum(rem[0], rem[1]), rem[2]), 0.0, out=h).mul_(g)
        alive = nxt.clone() if alive is None else alive * nxt
        n_alive = int(alive.count_nonzero())
        if n_alive == 0:
            break
        if n_alive <= n // 2:  # drop finished rows
            keep = alive.nonzero().squeeze(1)

            def sel(xs, keep=keep):
                return [x.index_select(0, keep) for x in xs]

            tm, td, rem, dof = sel(tm), sel(td), sel(rem), sel(dof)
            idx, e = sel((idx, e))
            if band:
                vh, sgn = sel(vh), sel(sgn)
                (r,) = sel((r,))
                if o[0].numel() > 1:
                    o = sel(o)
                if plane is not None:
                    plane = tuple(sel(plane))
            alive = None
        record(alive)
    idx = torch.cat(parts_i).to(torch.int64)
    if mode == MISS:
        out[0].index_fill_(0, idx[torch.cat(parts_v) != 0], 1)
    else:
        out[0].index_add_(0, idx, torch.cat(parts_v))
        out[1].index_add_(0, idx, torch.cat(parts_w))


def walk_segments(
    mode,
    origins,
    dirs,
    t0,
    t1,
    rng,
    seg_ray,
    seg_rank,
    bricks,
    voxel_size,
    out,
    tau=0.0,
    weight=1.0,
    normals=None,
    ray_weight=None,
) -> None:
    """:func:`walk_segments_torch`, or its Triton kernel (one launch) where Triton runs (same arguments)."""
    if seg_ray.numel() == 0:
        return
    impl = kernel(dirs.device, walk_segments_torch, "triton_segments:walk_segments_triton")
    args = (mode, origins, dirs, t0, t1, rng, seg_ray, seg_rank, bricks, voxel_size, out)
    impl(*args, tau, weight, normals, ray_weight)

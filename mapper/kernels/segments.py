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
by :func:`mapper.kernels.dispatch.use_triton`. Both do the same float64 operations in the same order
(the Triton kernels are compiled without FMA contraction), so they agree bit for bit.

Exactness against a voxel-resolution DDA (``dda_torch``): the coarse walk is the same DDA with a 4x cell,
whose boundaries ``(b + pos) * 4s`` equal the voxel boundaries ``(4b + 4 pos) * s`` exactly (scaling by a
power of two commutes with rounding); the fine walk starts at the voxel where the ray enters the brick
(slab entry, clamped into the brick) and computes each boundary crossing as ``t0 + (boundary - p0) / d``
from the ray's start, where the reference accumulates ``tmax += tdelta``. The two differ only when a ray
passes within rounding (~1e-15 relative) of a voxel edge or ends there; the tests check equality on
random, axis-aligned and boundary-ending rays.
"""

from __future__ import annotations

import math

import torch

from .dispatch import use_triton

KEY_BITS = 21  # as mapper.integrators.common.voxel_keys: 21 bits per axis, biased, i major
KEY_BIAS = 1 << 20
# bricks whose voxels all lie in the integrators' key range [-2^20 + 8, 2^20 - 8): [BRICK_LO, BRICK_HI)
BRICK_LO = -(1 << 18) + 2
BRICK_HI = (1 << 18) - 2
WALK_STEPS = 10  # voxels of a 4^3 brick one straight segment can cross: 3 * 4 - 2
MISS, BAND = 0, 1  # walk modes: occupancy miss flags, LiDAR TSDF band sums
CPU_RAYS = 1 << 17  # rays per batch of the torch coarse walk on the CPU (per-step temporaries ~3 MB)
CPU_SEGMENTS = 1 << 17  # segments per chunk of the torch fine walk on the CPU


# ------------------------------------------------------------------------------------------------ keys
def brick_keys(b: torch.Tensor) -> torch.Tensor:
    """int64 keys of int64/int32 ``[M, 3]`` brick coordinates; ``-1`` outside ``[BRICK_LO, BRICK_HI)``."""
    b = b.to(torch.int64)
    ok = ((b >= BRICK_LO) & (b < BRICK_HI)).all(dim=1)
    c = b + KEY_BIAS
    k = (c[:, 0] << (2 * KEY_BITS)) | (c[:, 1] << KEY_BITS) | c[:, 2]
    return torch.where(ok, k, torch.full_like(k, -1))


def keys_to_bricks(keys: torch.Tensor) -> torch.Tensor:
    m = (1 << KEY_BITS) - 1
    return torch.stack(((keys >> (2 * KEY_BITS)) & m, (keys >> KEY_BITS) & m, keys & m), dim=1) - KEY_BIAS


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
    origins: torch.Tensor, dirs: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, cell: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bricks (cells of size ``cell`` = 4 voxels) crossed by the segments ``origins + t dirs``,
    ``t in [t0, t1]``: the cells of :func:`dda_torch` with ``tent < t1`` (and the first when ``t0 <= t1``).

    Args: float64 ``[R, 3]`` origins (may be an expanded ``[3]``) and unit dirs, float64 ``[R]`` t0/t1.
    Returns: (int32 ``[M]`` ray of each segment, int64 ``[M]`` brick key, ``-1`` outside the key range).
    Rows with ray ``-1`` are padding (this reference emits none; the Triton kernel may).

    The walk advances all rays of a batch together and drops finished rays after every step (a DDA over
    an active set), so the work is the segments' count, not rays x the longest ray.
    """
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
        return torch.zeros(0, dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.cat(rays_out), torch.cat(keys_out)


def brick_segments(origins, dirs, t0, t1, cell: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`brick_segments_torch`, or its Triton kernel (one launch, CSR output) where Triton runs."""
    if dirs.shape[0] and use_triton(dirs.device):
        from .triton_segments import brick_segments_triton

        return brick_segments_triton(origins, dirs, t0, t1, cell)
    return brick_segments_torch(origins, dirs, t0, t1, cell)


# ---------------------------------------------------------------------------------------------- unique
def unique_brick_ranks(
    *keys: torch.Tensor, max_dense_cells: int = 1 << 26
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The distinct bricks of int64 key tensors (``-1`` = none) and every key's rank among them.

    Returns (int64 ``[U, 3]`` bricks sorted by key, [int32 rank per key, ``-1`` for ``-1`` keys]).
    Dense path (the bricks' bounding box has at most ``max_dense_cells`` cells and not many more than the
    keys): a bitmap and a rank table over the box (linear, no sort); otherwise ``torch.unique``.
    """
    dev = keys[0].device
    n = sum(k.numel() for k in keys)
    big = 1 << 40
    los, his = [], []
    for k in keys:
        if k.numel():
            c = keys_to_bricks(k)
            ok = (k >= 0)[:, None]
            los.append(torch.where(ok, c, big).amin(dim=0))
            his.append(torch.where(ok, c, -big).amax(dim=0))
    if not los:
        return _no_bricks(dev, keys)
    lo_hi = torch.stack((torch.stack(los).amin(dim=0), torch.stack(his).amax(dim=0))).tolist()  # sync
    lo, hi = lo_hi
    if lo[0] > hi[0]:  # no valid key
        return _no_bricks(dev, keys)
    ext = [h - lo_ + 1 for lo_, h in zip(lo, hi, strict=True)]
    cells = ext[0] * ext[1] * ext[2]
    if cells <= max_dense_cells and cells <= 4 * n + (1 << 20):
        lo_t = torch.tensor(lo, dtype=torch.int64, device=dev)
        flats = []
        seen = torch.zeros(cells + 1, dtype=torch.bool, device=dev)
        for k in keys:
            r = keys_to_bricks(k) - lo_t
            f = (r[:, 0] * ext[1] + r[:, 1]) * ext[2] + r[:, 2]
            f = torch.where(k >= 0, f, cells)
            seen[f] = True
            flats.append(f)
        idx = seen[:cells].nonzero().squeeze(1)  # sync: the brick count
        table = torch.empty(cells + 1, dtype=torch.int32, device=dev)
        table[idx] = torch.arange(idx.numel(), dtype=torch.int32, device=dev)
        table[cells] = -1
        a = idx // (ext[1] * ext[2])
        r = idx % (ext[1] * ext[2])
        bricks = torch.stack((a, r // ext[2], r % ext[2]), dim=1) + lo_t
        return bricks, [table[f] for f in flats]
    allk = torch.cat(keys)
    uk, inv = torch.unique(allk, return_inverse=True)
    inv = inv.to(torch.int32)
    if int(uk[0]) < 0:  # the -1 keys
        uk = uk[1:]
        inv = inv - 1
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
    """
    dev = dirs.device
    m_all = seg_ray.numel()
    chunk = CPU_SEGMENTS if dev.type == "cpu" else max(m_all, 1)
    s = float(voxel_size)
    bricks = bricks.to(torch.int64)
    for c0 in range(0, m_all, chunk):
        sr = seg_ray[c0 : c0 + chunk]
        sk = seg_rank[c0 : c0 + chunk]
        keep = (sr >= 0) & (sk >= 0)
        if not bool(keep.all()):
            keep_idx = keep.nonzero().squeeze(1)
            sr, sk = sr[keep_idx], sk[keep_idx]
        ray = sr.to(torch.int64)
        rank = sk.to(torch.int64)
        _walk_chunk(mode, origins, dirs, t0, t1, rng, ray, rank, bricks, s, out, tau, weight)


def _entry_voxel(pe, d, nz, entered, lo, s):
    """The first voxel of a brick on the ray: the one containing the entry point ``pe``, where the DDA
    would be. At an exact tie (``pe`` on the boundaries of several axes) the DDA steps the tied axes in
    the order x, y, z, so the brick's first voxel is the first of the states (none stepped, x stepped,
    x and y, all) that lies in the brick. A segment starting inside the brick (``entered`` false) starts
    at ``floor(pe / s)`` as the DDA does; rounding that leaves every state outside falls back to the
    clamp of ``floor``."""
    c = torch.floor(pe / s).to(torch.int64)
    exact = nz & (c.to(torch.float64) * s == pe)
    before = torch.where(exact & (d > 0), c - 1, c)
    after = torch.where(exact & (d < 0), c - 1, c)
    ib = (before >= lo) & (before <= lo + 3)
    ia = (after >= lo) & (after <= lo + 3)
    ins = torch.stack(
        (
            ib[:, 0] & ib[:, 1] & ib[:, 2],
            ia[:, 0] & ib[:, 1] & ib[:, 2],
            ia[:, 0] & ia[:, 1] & ib[:, 2],
            ia[:, 0] & ia[:, 1] & ia[:, 2],
        ),
        dim=1,
    )
    k = torch.where(ins.any(dim=1), ins.to(torch.int8).argmax(dim=1), 4)  # first state inside, 4 = none
    clamped = torch.minimum(torch.maximum(c, lo), lo + 3)
    axis = torch.arange(3, device=pe.device)
    v = torch.where(axis[None, :] < k[:, None], after, before)  # k axes stepped
    v = torch.where((k == 4)[:, None] | ~entered[:, None], clamped, v)
    return v


def _walk_chunk(mode, origins, dirs, t0, t1, rng, ray, rank, bricks, s, out, tau, weight):
    o = origins[ray]
    d = dirs[ray]
    a = t0[ray]
    e = t1[ray]
    lo = bricks[rank] * 4
    p0 = o + d * a[:, None]
    nz = d != 0
    inv = torch.where(nz, 1.0 / d, torch.full_like(d, math.inf))
    neg = (d < 0).to(torch.int64)
    face = (lo + 4 * neg).to(torch.float64) * s
    tf = torch.where(nz, a[:, None] + (face - p0) * inv, torch.full_like(d, -math.inf))
    te = torch.maximum(a, tf.amax(dim=1))  # where the ray enters the brick
    pe = o + d * te[:, None]
    v = _entry_voxel(pe, d, nz, te > a, lo, s)
    pos = (d > 0).to(torch.int64)
    step = torch.sign(d).to(torch.int64)
    inf = torch.full_like(d, math.inf)
    tm = torch.where(nz, a[:, None] + ((v + pos).to(torch.float64) * s - p0) * inv, inf)
    t = te
    r = rng[ray] if mode == BAND else a
    state = [v, lo, tm, t, e, p0, inv, step, pos, a, o, rank, r]
    idx_parts, val_parts = [], []
    for k in range(WALK_STEPS):
        v, lo, tm, t, e, p0, inv, step, pos, a, o, rank, r = state
        if k:
            # later voxels: while the entry is before t1 and the voxel inside the brick
            go = (t < e) & ((v >= lo) & (v <= lo + 3)).all(dim=1)
            if not bool(go.all()):
                idx = go.nonzero().squeeze(1)
                state = [x[idx] for x in state]
                v, lo, tm, t, e, p0, inv, step, pos, a, o, rank, r = state
            if v.shape[0] == 0:
                break
        off = ((v[:, 0] & 3) << 4) | ((v[:, 1] & 3) << 2) | (v[:, 2] & 3)
        idx = rank * 64 + off
        if mode == MISS:
            idx_parts.append(idx)
        else:
            c = (v.to(torch.float64) + 0.5) * s - o
            dist = torch.sqrt(c[:, 0] * c[:, 0] + c[:, 1] * c[:, 1] + c[:, 2] * c[:, 2])
            sdf = r - dist
            ok = sdf >= -tau
            idx_parts.append(idx[ok])
            val_parts.append(sdf[ok].clamp(max=tau).to(torch.float32))
        if k == WALK_STEPS - 1:
            break
        tx, ty, tz = tm.unbind(1)
        mx = (tx <= ty) & (tx <= tz)
        my = ~mx & (ty <= tz)
        mm = torch.stack((mx, my, ~mx & ~my), dim=1)
        t = torch.minimum(torch.minimum(tx, ty), tz)
        v = v + step * mm
        tm = torch.where(mm, a[:, None] + ((v + pos).to(torch.float64) * s - p0) * inv, tm)
        state[0], state[2], state[3] = v, tm, t
    if not idx_parts:
        return
    idx = torch.cat(idx_parts)
    if mode == MISS:
        out[0][idx] = 1
    else:
        val = torch.cat(val_parts)
        w = torch.full_like(val, weight)
        out[0].index_add_(0, idx, val * w)
        out[1].index_add_(0, idx, w)


def walk_segments(
    mode, origins, dirs, t0, t1, rng, seg_ray, seg_rank, bricks, voxel_size, out, tau=0.0, weight=1.0
) -> None:
    """:func:`walk_segments_torch`, or its Triton kernel (one launch) where Triton runs."""
    if seg_ray.numel() == 0:
        return
    if use_triton(dirs.device):
        from .triton_segments import walk_segments_triton

        return walk_segments_triton(
            mode, origins, dirs, t0, t1, rng, seg_ray, seg_rank, bricks, voxel_size, out, tau, weight
        )
    return walk_segments_torch(
        mode, origins, dirs, t0, t1, rng, seg_ray, seg_rank, bricks, voxel_size, out, tau, weight
    )

"""Triton kernels behind :func:`mapper.kernels.voxelize.voxelize_triton` (imported lazily).

No global sort: five Triton launches, two fills and a ``cumsum``, one host sync (the voxel count, to size
the outputs):

1. ``_insert_kernel`` (per point): the cell (same float32 arithmetic as the reference: ``div_rn``, no
   FMA), its key ``(z * gy + y) * gx + x``, inserted into an open-addressing table (linear probing,
   capacity a power of two >= 2N, so probing always ends) with one ``atomic_cas`` per probe; then
   ``atomic_min(first[slot], i)``: the smallest point index of each cell. ``pslot[i]`` = slot or -1.
2. ``_first_kernel`` (per point): ``flag[i] = (first[pslot[i]] == i)``; an inclusive ``cumsum`` of the
   flags numbers the voxels in the order of their first point: ``vid = csum[first[slot]] - 1``.
3. ``_topk_kernel`` (per point with ``vid < max_voxels``): inserts ``i`` into the voxel's sorted row of
   ``K`` indices ``buf[vid]`` by a chain of ``atomic_min``: at each position keep the smaller, carry the
   larger on, stop at an empty position. Every position's value only decreases and its stream of carried
   values is the input multiset minus its final value, so whatever the interleaving the row ends as the
   ``K`` smallest indices, sorted. A point already beaten by a full row (``buf[vid, K-1] < i``) stops at
   once.
4. (host: V = csum[-1], outputs allocated) ``_meta_kernel`` (per voxel): counts and (z, y, x) coords
   decoded from the first point's key; ``_gather_kernel`` (per voxel row): the points' channels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # the reference's parameter type (no import at run time: no reference <-> kernel cycle)
    from .voxelize import VoxelGrid

_INT32_MAX = 2**31 - 1
_HASH_MUL = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))  # Fibonacci hashing, as int64
_BUF_LIMIT = (
    1 << 23
)  # top-K buffer entries (min(N, max_voxels) * K, 32 MB) allocated before the count is known


@triton.jit
def _insert_kernel(
    pts_ptr,
    stride,
    n,
    lox,
    loy,
    loz,
    vsx,
    vsy,
    vsz,
    gx,
    gy,
    gz,
    keys_ptr,  # int64 [T + BLOCK]: -1 = empty; the last BLOCK entries are scratch for dropped points
    first_ptr,  # int32 [T]
    pslot_ptr,  # int32 [N]
    T,
    LOG2T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lane = tl.arange(0, BLOCK)
    i = tl.program_id(0).to(tl.int64) * BLOCK + lane
    inb = i < n
    x = tl.load(pts_ptr + i * stride + 0, mask=inb, other=0.0).to(tl.float32)
    y = tl.load(pts_ptr + i * stride + 1, mask=inb, other=0.0).to(tl.float32)
    z = tl.load(pts_ptr + i * stride + 2, mask=inb, other=0.0).to(tl.float32)
    fx = tl.floor(tl.math.div_rn(x - lox, vsx))
    fy = tl.floor(tl.math.div_rn(y - loy, vsy))
    fz = tl.floor(tl.math.div_rn(z - loz, vsz))
    ok = inb & (fx >= 0) & (fx < gx) & (fy >= 0) & (fy < gy) & (fz >= 0) & (fz < gz)
    cx = tl.where(ok, fx, 0.0).to(tl.int64)
    cy = tl.where(ok, fy, 0.0).to(tl.int64)
    cz = tl.where(ok, fz, 0.0).to(tl.int64)
    key = (cz * gy + cy) * gx + cx
    h = key * _HASH_MUL
    slot = (h >> (64 - LOG2T)) & (T - 1)  # the top LOG2T bits
    done = ~ok
    empty = tl.full([BLOCK], -1, tl.int64)
    # dropped points (and points already placed) CAS a slot with cmp == val: a no-op
    scratch = T + lane
    while tl.max(tl.where(done, 0, 1), axis=0) > 0:
        tgt = tl.where(ok, slot, scratch)
        old = tl.atomic_cas(keys_ptr + tgt, tl.where(done, key, empty), key)
        hit = (~done) & ((old == -1) | (old == key))
        done = done | hit
        slot = tl.where(done, slot, (slot + 1) & (T - 1))
    tl.atomic_min(first_ptr + slot, i.to(tl.int32), mask=ok)
    tl.store(pslot_ptr + i, tl.where(ok, slot, -1).to(tl.int32), mask=inb)


@triton.jit
def _first_kernel(pslot_ptr, first_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    s = tl.load(pslot_ptr + i, mask=inb, other=-1)
    f = tl.load(first_ptr + s, mask=s >= 0, other=-1)
    tl.store(flag_ptr + i, (f == i).to(tl.int32), mask=inb)


@triton.jit
def _topk_kernel(pslot_ptr, first_ptr, csum_ptr, buf_ptr, n, cap, K: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < n
    s = tl.load(pslot_ptr + i, mask=inb, other=-1)
    f = tl.load(first_ptr + s, mask=s >= 0, other=0)
    v = tl.load(csum_ptr + f, mask=s >= 0, other=0).to(tl.int64) - 1
    act = (s >= 0) & (v < cap)
    row = buf_ptr + v * K
    carry = i.to(tl.int32)
    last = tl.load(row + (K - 1), mask=act, other=2147483647)
    act = act & (last > carry)
    for r in range(K):
        prev = tl.atomic_min(row + r, carry, mask=act)
        carry = tl.where(act, tl.maximum(prev, carry), carry)
        act = act & (prev != 2147483647)


@triton.jit
def _meta_kernel(
    buf_ptr, pslot_ptr, keys_ptr, counts_ptr, coords_ptr, V, gx, gy, K: tl.constexpr, BLOCK: tl.constexpr
):
    v = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    vm = v < V
    cnt = tl.zeros([BLOCK], tl.int32)
    for r in range(K):
        e = tl.load(buf_ptr + v * K + r, mask=vm, other=2147483647)
        cnt += (e != 2147483647).to(tl.int32)
    tl.store(counts_ptr + v, cnt, mask=vm)
    f = tl.load(buf_ptr + v * K, mask=vm, other=0)
    s = tl.load(pslot_ptr + f, mask=vm, other=0)
    key = tl.load(keys_ptr + s, mask=vm, other=0)
    cx = key % gx
    cy = (key // gx) % gy
    cz = key // (gx * gy)
    tl.store(coords_ptr + v * 3 + 0, cz.to(tl.int32), mask=vm)
    tl.store(coords_ptr + v * 3 + 1, cy.to(tl.int32), mask=vm)
    tl.store(coords_ptr + v * 3 + 2, cx.to(tl.int32), mask=vm)


@triton.jit
def _gather_kernel(buf_ptr, pts_ptr, stride, out_ptr, rows, C, ROWS: tl.constexpr, CP: tl.constexpr):
    """Row ``r`` of the flattened ``[V * K, C]`` output = point ``buf[r]`` (zeros for an empty entry)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < rows
    e = tl.load(buf_ptr + r, mask=rm, other=2147483647)
    has = rm & (e != 2147483647)
    c = tl.arange(0, CP)
    cm = c < C
    val = tl.load(
        pts_ptr + e.to(tl.int64)[:, None] * stride + c[None, :], mask=has[:, None] & cm[None, :], other=0
    )
    tl.store(out_ptr + r[:, None] * C + c[None, :], val, mask=rm[:, None] & cm[None, :])


def voxelize_hash(p: torch.Tensor, g: VoxelGrid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hash-table voxelization of validated input (see :func:`mapper.kernels.voxelize.prepare`)."""
    n, c = p.shape
    k = g.max_points
    dev = p.device
    if n == 0:
        return g.empty(p)
    block = 256
    log2t = max(4, (2 * n - 1).bit_length())
    t = 1 << log2t
    keys = torch.full((t + block,), -1, dtype=torch.int64, device=dev)
    vmax = n if g.max_voxels is None else min(n, g.max_voxels)
    sized = vmax * k <= _BUF_LIMIT
    # first [T] and, when it fits, the top-K rows [vmax, K] share one fill
    work = torch.full((t + (vmax * k if sized else 0),), _INT32_MAX, dtype=torch.int32, device=dev)
    first = work[:t]
    pslot = torch.empty(n, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(n, block),)
    _insert_kernel[grid](
        p,
        p.stride(0),
        n,
        *g.range_min,
        *g.voxel_size,
        *g.grid,
        keys,
        first,
        pslot,
        t,
        LOG2T=log2t,
        BLOCK=block,
        enable_fp_fusion=False,
    )
    flag = torch.empty(n, dtype=torch.int32, device=dev)
    _first_kernel[grid](pslot, first, flag, n, BLOCK=block)
    csum = torch.cumsum(flag, 0, dtype=torch.int32)
    if sized:
        buf = work[t:]
        v = None
    else:
        v = int(csum[-1]) if g.max_voxels is None else min(int(csum[-1]), g.max_voxels)
        buf = torch.full((v * k,), _INT32_MAX, dtype=torch.int32, device=dev)
    cap = vmax if g.max_voxels is None else g.max_voxels
    _topk_kernel[grid](pslot, first, csum, buf, n, cap, K=k, BLOCK=block)
    if v is None:
        v = int(csum[-1]) if g.max_voxels is None else min(int(csum[-1]), g.max_voxels)  # the host sync
    if v == 0:
        return g.empty(p)
    counts = torch.empty(v, dtype=torch.int32, device=dev)
    coords = torch.empty((v, 3), dtype=torch.int32, device=dev)
    _meta_kernel[(triton.cdiv(v, block),)](
        buf, pslot, keys, counts, coords, v, g.grid[0], g.grid[1], K=k, BLOCK=block
    )
    voxels = torch.empty((v, k, c), dtype=p.dtype, device=dev)
    rows = v * k
    rblock = 128
    _gather_kernel[(triton.cdiv(rows, rblock),)](
        buf, p, p.stride(0), voxels, rows, c, ROWS=rblock, CP=triton.next_power_of_2(c)
    )
    return voxels, coords, counts

"""Triton kernels behind the depth TSDF's grow stage on CUDA (``mapper.integrators.tsdf.depth_band_bricks``;
imported lazily: triton is optional).

:func:`depth_band_bricks_triton` has the signature of its torch reference
``mapper.integrators.tsdf.depth_band_bricks_torch``: the unique bricks (int64 ``[B, 3]``, sorted by key)
crossed by the truncation bands of a depth image's valid pixels. Per frame:

* ``_band_insert_kernel`` (one program per ``BLOCK`` pixels): each pixel's ray (the reference's float64
  operations in its order, no FMA contraction), the brick-resolution DDA of ``dda_torch`` over
  ``[r - tau, r + tau]`` (the set-up of ``triton_dda``), and each crossed brick's key inserted into an
  open-addressing hash set in device memory (linear probing, ``atomic_cas``; a plain load first, so a brick
  already present costs no atomic). It counts the keys it inserted and the pixels whose insertion ran out
  of probes (a full table: the caller retries once with a table that cannot fill).
* one host read: those two counts (the frame's only size read in this stage);
* ``_table_keys_kernel`` compacts the table into the ``count`` keys (any order), then ``torch.sort`` and a
  key decode give the bricks.

No ``[pixels, steps]`` key tensor, no bounding box (the dense bitmap of the previous path needed one, read
back, and zeroed/scanned up to 2^26 cells when the camera looked across the room). The table, the two
counts and the compaction counter are one ``torch.full(-1)`` buffer (counts start at -1).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .keys import BRICK_HI, BRICK_LO, VOXEL_KEY_BIAS, VOXEL_KEY_BITS, VOXEL_KEY_MASK
from .triton_dda import _axis_setup, _dda_step  # the voxel traversal's set-up and step

_BLOCK = 128
_PROBES = 32  # linear probes per key before a pixel counts as overflowing (load factor <= 1/4: rare)
_MIN_TABLE = 1 << 12


@triton.jit(do_not_specialize=["n", "w", "hmask", "max_probes"])  # sizes vary per frame: no recompiles
def _band_insert_kernel(
    depth_ptr,  # float32 [n] (row-major image)
    k_ptr,  # float64 [3, 3] intrinsics
    t_ptr,  # float64 [4, 4] camera-to-world
    prm_ptr,  # float64 [2]: tau, cell
    table_ptr,  # int64 [hmask + 1] (-1 = empty)
    stats_ptr,  # int64 [2]: inserted - 1, overflowing pixels - 1
    n,
    w,
    max_range,  # fp32, as the reference compares the float32 depth with it
    hmask,
    max_probes,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
    KBITS: tl.constexpr,
    KBIAS: tl.constexpr,
    BLO: tl.constexpr,
    BHI: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    d32 = tl.load(depth_ptr + i, mask=m, other=0.0)
    ok = m & (d32 > 0) & (d32 <= max_range)  # NaN and +-inf fail one of the two (isfinite & > 0 & <= max)
    tau = tl.load(prm_ptr)
    cell = tl.load(prm_ptr + 1)
    fx = tl.load(k_ptr + 0)
    cx = tl.load(k_ptr + 2)
    fy = tl.load(k_ptr + 4)
    cy = tl.load(k_ptr + 5)
    # pixel ray (tsdf._pixel_dirs): ((u - cx) / fx, (v - cy) / fy, 1) / norm, rotated column by column
    x = ((i % w).to(tl.float64) - cx) / fx
    y = ((i // w).to(tl.float64) - cy) / fy
    nn = tl.sqrt(x * x + y * y + 1.0)  # fp64: IEEE sqrt.rn, as torch.sqrt
    ux = x / nn
    uy = y / nn
    uz = 1.0 / nn
    dx = ux * tl.load(t_ptr + 0) + uy * tl.load(t_ptr + 1) + uz * tl.load(t_ptr + 2)
    dy = ux * tl.load(t_ptr + 4) + uy * tl.load(t_ptr + 5) + uz * tl.load(t_ptr + 6)
    dz = ux * tl.load(t_ptr + 8) + uy * tl.load(t_ptr + 9) + uz * tl.load(t_ptr + 10)
    ox = tl.load(t_ptr + 3)
    oy = tl.load(t_ptr + 7)
    oz = tl.load(t_ptr + 11)
    r = tl.where(ok, d32.to(tl.float64), 1.0) * nn
    t0 = tl.maximum(r - tau, 0.0)
    t1 = r + tau
    vx, tmx, tdx, sx = _axis_setup(ox, dx, t0, cell)
    vy, tmy, tdy, sy = _axis_setup(oy, dy, t0, cell)
    vz, tmz, tdz, sz = _axis_setup(oz, dz, t0, cell)
    t = t0
    inserted = tl.zeros((BLOCK,), tl.int64)
    lost = tl.zeros((BLOCK,), tl.int64)
    for k in tl.static_range(S):
        valid = (t < t1) | ((t0 <= t1) & (k == 0))
        inr = (vx >= BLO) & (vx < BHI) & (vy >= BLO) & (vy < BHI) & (vz >= BLO) & (vz < BHI)
        bx = vx + KBIAS
        by = vy + KBIAS
        bz = vz + KBIAS
        key = (bx << (2 * KBITS)) | (by << KBITS) | bz
        h = ((bx * 73856093) ^ (by * 19349663) ^ (bz * 83492791)) & hmask
        todo = ok & valid & inr
        p = max_probes * 0  # a runtime int32 (a loop-carried constexpr 0 would not type-check)
        while (tl.max(todo.to(tl.int32), axis=0) > 0) & (p < max_probes):
            cur = tl.load(table_ptr + h, mask=todo, other=-2)
            hit = todo & (cur == key)
            empty = todo & (cur == -1)
            # lanes with nothing to claim compare with -2 (never stored): a read, no write
            old = tl.atomic_cas(table_ptr + h, tl.where(empty, -1, -2).to(tl.int64), key)
            won = empty & (old == -1)
            same = empty & (old == key)
            inserted += won.to(tl.int64)
            todo = todo & ~hit & ~won & ~same
            h = tl.where(todo, (h + 1) & hmask, h)
            p += 1
        lost += todo.to(tl.int64)
        # next cell (dda_torch's step: x, then y, then z on ties)
        vx, vy, vz, tmx, tmy, tmz, t = _dda_step(vx, vy, vz, tmx, tmy, tmz, sx, sy, sz, tdx, tdy, tdz)
    tl.atomic_add(stats_ptr, tl.sum(inserted, axis=0))
    tl.atomic_add(stats_ptr + 1, tl.sum(lost, axis=0))


@triton.jit(do_not_specialize=["size"])
def _table_keys_kernel(table_ptr, out_ptr, counter_ptr, size, BLOCK: tl.constexpr):
    """The table's keys into ``out`` (any order): a block's at ``counter + 1 ..`` (counter from -1)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(table_ptr + i, mask=i < size, other=-1)
    has = (k >= 0).to(tl.int32)
    base = tl.atomic_add(counter_ptr, tl.sum(has, axis=0).to(tl.int64)) + 1
    pos = tl.cumsum(has, axis=0) - 1
    tl.store(out_ptr + base + pos, k, mask=has > 0)


@functools.cache
def _params(tau: float, cell: float, device: torch.device) -> torch.Tensor:
    """float64 ``[2]`` (tau, cell) on ``device``, kept between frames (no copy per frame)."""
    return torch.tensor([tau, cell], dtype=torch.float64).to(device)


@functools.cache
def _shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor([2 * VOXEL_KEY_BITS, VOXEL_KEY_BITS, 0], dtype=torch.int64).to(device)


def table_size(pixels: int) -> int:
    """Hash-set slots for a frame of ``pixels`` pixels: a power of two >= 4 per pixel (a 640x480 frame's
    bands cross ~0.1-0.5 bricks per pixel, so the load stays low)."""
    return max(_MIN_TABLE, 1 << max(4 * pixels - 1, 1).bit_length())


def _insert(depth, K, T, prm, n, w, max_range_m, size, probes, steps):
    buf = torch.full((size + 3,), -1, dtype=torch.int64, device=depth.device)
    _band_insert_kernel[(triton.cdiv(n, _BLOCK),)](
        depth, K, T, prm, buf, buf[size:], n, w, float(max_range_m), size - 1, probes,
        S=steps, BLOCK=_BLOCK, KBITS=VOXEL_KEY_BITS, KBIAS=VOXEL_KEY_BIAS, BLO=BRICK_LO, BHI=BRICK_HI,
        enable_fp_fusion=False,
    )  # fmt: skip
    count, lost = buf[size : size + 2].tolist()  # sync: the frame's one size read in this stage
    return buf, count + 1, lost + 1  # the counts start at -1 (the buffer's fill)


def depth_band_bricks_triton(depth, K, T, tau: float, cell: float, max_range_m: float) -> torch.Tensor:
    """Same as ``tsdf.depth_band_bricks_torch`` (same arguments and result): the hash-set kernel above, one
    host read (two when the first table overflows, then retried with one that cannot fill)."""
    h, w = depth.shape
    n = h * w
    dev = depth.device
    if n == 0:
        return torch.zeros((0, 3), dtype=torch.int64, device=dev)
    d = depth.reshape(-1).to(torch.float32).contiguous()
    Kc = K.to(torch.float64).contiguous()
    Tc = T.to(torch.float64).contiguous()
    prm = _params(float(tau), float(cell), dev)
    steps = 3 * (math.ceil(2 * float(tau) / float(cell)) + 1) + 1  # integrators.common.max_dda_steps
    size = table_size(n)
    buf, count, lost = _insert(d, Kc, Tc, prm, n, w, max_range_m, size, _PROBES, steps)
    if lost:  # more distinct bricks than the table holds at a low load: one that every key fits in
        size = 1 << (2 * n * steps).bit_length()
        buf, count, lost = _insert(d, Kc, Tc, prm, n, w, max_range_m, size, size, steps)
    keys = torch.empty(count, dtype=torch.int64, device=dev)
    if count:
        _table_keys_kernel[(triton.cdiv(size, 1024),)](buf, keys, buf[size + 2 :], size, BLOCK=1024)
    keys = torch.sort(keys).values
    return ((keys[:, None] >> _shifts(dev)) & VOXEL_KEY_MASK) - VOXEL_KEY_BIAS

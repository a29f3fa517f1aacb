"""Triton kernel behind :func:`mapper.kernels.dda.dda_triton` (imported lazily: triton is optional)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INF = tl.constexpr(float("inf"))


@triton.jit
def _axis_setup(o, d, t0, cell):
    p = o + d * t0
    v = tl.floor(p / cell)
    b = (v + tl.where(d > 0, 1.0, 0.0)) * cell
    nz = d != 0
    inv = tl.where(nz, 1.0 / tl.where(nz, d, 1.0), _INF)
    tm = tl.where(nz, t0 + (b - p) * inv, _INF)
    td = tl.where(nz, cell * tl.abs(inv), _INF)
    st = tl.where(d > 0, 1, tl.where(d < 0, -1, 0)).to(tl.int64)
    return v.to(tl.int64), tm, td, st


@triton.jit
def _dda_step(vx, vy, vz, tmx, tmy, tmz, sx, sy, sz, tdx, tdy, tdz):
    """One traversal step, shared by every DDA walk (voxel DDA, depth grow, coarse and fine segment walks):
    cross the nearest axis boundary (``dda_torch``'s tie order: x, then y, then z), returning the new cell
    ``(vx, vy, vz)``, the axes' next crossings ``(tmx, tmy, tmz)`` and ``t``, the new cell's entry."""
    mx = (tmx <= tmy) & (tmx <= tmz)
    my = (~mx) & (tmy <= tmz)
    mz = (~mx) & (~my)
    t = tl.minimum(tl.minimum(tmx, tmy), tmz)
    vx += tl.where(mx, sx, 0)
    vy += tl.where(my, sy, 0)
    vz += tl.where(mz, sz, 0)
    tmx += tl.where(mx, tdx, 0.0)
    tmy += tl.where(my, tdy, 0.0)
    tmz += tl.where(mz, tdz, 0.0)
    return vx, vy, vz, tmx, tmy, tmz, t


@triton.jit(do_not_specialize=["n"])  # sizes vary per frame: no recompiles
def _dda_kernel(
    o_ptr,
    d_ptr,
    t0_ptr,
    t1_ptr,
    cells_ptr,
    tent_ptr,
    valid_ptr,
    n,
    cell_ptr,
    S,
    S_BOUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cell = tl.load(cell_ptr)  # float64 from memory: a Python float argument would arrive as float32
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < n
    ox = tl.load(o_ptr + r * 3 + 0, mask=m, other=0.0)
    oy = tl.load(o_ptr + r * 3 + 1, mask=m, other=0.0)
    oz = tl.load(o_ptr + r * 3 + 2, mask=m, other=0.0)
    dx = tl.load(d_ptr + r * 3 + 0, mask=m, other=1.0)
    dy = tl.load(d_ptr + r * 3 + 1, mask=m, other=0.0)
    dz = tl.load(d_ptr + r * 3 + 2, mask=m, other=0.0)
    t0 = tl.load(t0_ptr + r, mask=m, other=0.0)
    t1 = tl.load(t1_ptr + r, mask=m, other=0.0)
    vx, tmx, tdx, sx = _axis_setup(ox, dx, t0, cell)
    vy, tmy, tdy, sy = _axis_setup(oy, dy, t0, cell)
    vz, tmz, tdz, sz = _axis_setup(oz, dz, t0, cell)
    t = t0
    # the loop bound is a power-of-two bucket (a constexpr: few compiled variants; a runtime loop bound
    # also trips the interpreter with numpy >= 2.3); steps past S are not stored
    for k in range(S_BOUND):
        base = r * S + k
        mk = m & (k < S)
        tl.store(cells_ptr + base * 3 + 0, vx, mask=mk)
        tl.store(cells_ptr + base * 3 + 1, vy, mask=mk)
        tl.store(cells_ptr + base * 3 + 2, vz, mask=mk)
        tl.store(tent_ptr + base, t, mask=mk)
        ok = (t < t1) | ((t0 <= t1) & (k == 0))
        tl.store(valid_ptr + base, ok.to(tl.int8), mask=mk)
        vx, vy, vz, tmx, tmy, tmz, t = _dda_step(vx, vy, vz, tmx, tmy, tmz, sx, sy, sz, tdx, tdy, tdz)


def dda_kernel_launch(origins, dirs, t0, t1, cell: float, max_steps: int):
    n = origins.shape[0]
    dev = origins.device
    cells = torch.empty((n, max_steps, 3), dtype=torch.int64, device=dev)
    tent = torch.empty((n, max_steps), dtype=torch.float64, device=dev)
    valid = torch.empty((n, max_steps), dtype=torch.bool, device=dev)
    if n:
        block = 128
        _dda_kernel[(triton.cdiv(n, block),)](
            origins.to(torch.float64).contiguous(),
            dirs.to(torch.float64).contiguous(),
            t0.to(torch.float64).contiguous(),
            t1.to(torch.float64).contiguous(),
            cells,
            tent,
            valid.view(torch.int8),
            n,
            torch.tensor([float(cell)], dtype=torch.float64).to(dev, non_blocking=True),
            int(max_steps),
            S_BOUND=1 << max(0, int(max_steps) - 1).bit_length(),
            BLOCK=block,
        )
    return cells, tent, valid

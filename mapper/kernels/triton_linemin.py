"""Triton kernel behind :func:`mapper.kernels.linemin.line_min` (imported lazily; torch reference:
:func:`mapper.kernels.linemin.line_min_torch`, the same float operations, equal bits).

One program per ``BLOCK`` lines, one lane a line (the ESDF's layouts give 16 lines of equal length per
brick run, consecutive: one program a run). A forward sweep keeps the last crossing slot and its rightmost
offset and writes ``min((p - L - hi[L])^2, near[p]^2)``; a backward sweep keeps the next crossing slot
and its leftmost offset and lowers the slot to ``(R - p + lo[R])^2`` where that is smaller. Minima are
taken as ``where(x < v, x, v)`` from ``inf``: a NaN term never wins, as ``torch.fmin`` in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 16


@triton.jit(do_not_specialize=["n_lines"])  # the line count varies per update: no recompiles
def _line_min_kernel(
    lo_ptr,  # float32 [P]
    hi_ptr,  # float32 [P]
    near_ptr,  # float32 [P]
    out_ptr,  # float32 [P]
    start_ptr,  # int64 [L]
    len_ptr,  # int64 [L]
    n_lines,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_lines
    s = tl.load(start_ptr + i, mask=m, other=0)
    ln = tl.load(len_ptr + i, mask=m, other=0).to(tl.int32)
    n = tl.max(ln, 0)  # the block's longest line
    last = tl.full([BLOCK], -1, tl.int32)  # the last slot with a crossing (-1: none yet)
    last_hi = tl.zeros([BLOCK], tl.float32)
    q = 0
    while q < n:
        act = m & (q < ln)
        lo = tl.load(lo_ptr + s + q, mask=act, other=float("nan"))
        hi = tl.load(hi_ptr + s + q, mask=act, other=float("nan"))
        nr = tl.load(near_ptr + s + q, mask=act, other=float("nan"))
        v = tl.full([BLOCK], float("inf"), tl.float32)
        dl = (q - last).to(tl.float32) - last_hi
        x = dl * dl
        v = tl.where((last >= 0) & (x < v), x, v)
        x = nr * nr
        v = tl.where(x < v, x, v)
        tl.store(out_ptr + s + q, v, mask=act)
        has = act & (lo == lo)  # not NaN
        last = tl.where(has, q, last)
        last_hi = tl.where(has, hi, last_hi)
        q += 1
    tl.debug_barrier()
    nxt = tl.full([BLOCK], -1, tl.int32)  # the next slot with a crossing (-1: none)
    nxt_lo = tl.zeros([BLOCK], tl.float32)
    q = n - 1
    while q >= 0:
        act = m & (q < ln)
        v = tl.load(out_ptr + s + q, mask=act, other=float("inf"))
        dr = (nxt - q).to(tl.float32) + nxt_lo
        x = dr * dr
        v = tl.where((nxt >= 0) & (x < v), x, v)
        tl.store(out_ptr + s + q, v, mask=act)
        lo = tl.load(lo_ptr + s + q, mask=act, other=float("nan"))
        has = act & (lo == lo)
        nxt = tl.where(has, q, nxt)
        nxt_lo = tl.where(has, lo, nxt_lo)
        q -= 1


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (Triton specialises pointers on it: a column view of
    one row would otherwise compile a second variant during a frame)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def line_min_triton(
    lo: torch.Tensor, hi: torch.Tensor, near: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> torch.Tensor:
    """Same Args/Returns as :func:`mapper.kernels.linemin.line_min_torch`; no host sync."""
    out = torch.full_like(lo, float("inf"))
    n_lines = start.numel()
    if n_lines == 0 or lo.numel() == 0:
        return out
    grid = (triton.cdiv(n_lines, BLOCK),)
    _line_min_kernel[grid](
        _aligned(lo),
        _aligned(hi),
        _aligned(near),
        out,
        _aligned(start.to(torch.int64)),
        _aligned(length.to(torch.int64)),
        n_lines,
        BLOCK=BLOCK,
        num_warps=1,
    )
    return out

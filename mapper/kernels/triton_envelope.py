"""Triton kernel behind :func:`mapper.kernels.envelope.lower_envelope` (imported lazily; torch reference:
:func:`mapper.kernels.envelope.lower_envelope_torch`, same decisions and float operations, equal bits).

One program per ``BLOCK`` lines (one lane each; lines sorted by length, longest first, so a program's lanes
run about as many steps). Each lane builds its line's envelope in a scratch stack at the line's own slots
(``sv``: slot offsets, ``sf``: values; a stack never outgrows its line), then walks it: the entry at ``p``
is the last one whose takeover point (:func:`mapper.kernels.envelope.takeover`) is ``<= p``. The pops and
the walk's advances are ``while`` loops over the lanes that still have work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32


@triton.jit
def _envelope_kernel(
    f_ptr,  # float32 [P]
    out_ptr,  # float32 [P]
    sv_ptr,  # int32 [P] scratch: stack slot offsets
    sf_ptr,  # float32 [P] scratch: stack values
    start_ptr,  # int64 [L]
    len_ptr,  # int64 [L]
    order_ptr,  # int64 [L] lines by decreasing length
    n_lines,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_lines
    line = tl.load(order_ptr + i, mask=m, other=0)
    s = tl.load(start_ptr + line, mask=m, other=0)
    ln = tl.load(len_ptr + line, mask=m, other=0).to(tl.int32)
    first = tl.load(order_ptr + tl.program_id(0) * BLOCK)
    n = tl.load(len_ptr + first).to(tl.int32)  # the block's longest line
    top = tl.full([BLOCK], -1, tl.int32)
    q = 0
    while q < n:  # (a while loop: the interpreter cannot range() over a loaded scalar)
        act = m & (q < ln)
        fq = tl.load(f_ptr + s + q, mask=act, other=float("inf"))
        push = act & (fq < float("inf"))
        fq64 = fq.to(tl.float64)
        pop = _dominated(sv_ptr, sf_ptr, s, top, q, fq64, push)
        while tl.max(pop.to(tl.int32), 0) > 0:
            top = top - pop.to(tl.int32)
            pop = _dominated(sv_ptr, sf_ptr, s, top, q, fq64, push)
        top = top + push.to(tl.int32)
        tl.store(sv_ptr + s + top, tl.zeros([BLOCK], tl.int32) + q, mask=push)
        tl.store(sf_ptr + s + top, fq, mask=push)
        tl.debug_barrier()
        q += 1
    k = tl.zeros([BLOCK], tl.int32)
    p = 0
    while p < n:
        act = m & (p < ln) & (top >= 0)
        nxt = act & (k < top)
        adv = nxt & (_takeover(sv_ptr, sf_ptr, s, k, nxt) <= p)
        while tl.max(adv.to(tl.int32), 0) > 0:
            k = k + adv.to(tl.int32)
            nxt = act & (k < top)
            adv = nxt & (_takeover(sv_ptr, sf_ptr, s, k, nxt) <= p)
        d = (p - tl.load(sv_ptr + s + k, mask=act, other=0)).to(tl.int64)
        val = tl.load(sf_ptr + s + k, mask=act, other=0.0) + (d * d).to(tl.float32)
        tl.store(out_ptr + s + p, val, mask=act)
        p += 1


@triton.jit
def _dominated(sv_ptr, sf_ptr, s, top, q, fq64, push):
    """Lanes (of ``push``) whose stack top is hidden by the parabola of slot ``q`` (value ``fq64``) and the
    entry below it: the pop test of ``mapper.kernels.envelope.lower_envelope_torch`` (same expressions)."""
    pop = push & (top >= 1)
    v = tl.load(sv_ptr + s + top, mask=pop, other=0)
    u = tl.load(sv_ptr + s + top - 1, mask=pop, other=0)
    fv = tl.load(sf_ptr + s + top, mask=pop, other=0.0).to(tl.float64)
    fu = tl.load(sf_ptr + s + top - 1, mask=pop, other=0.0).to(tl.float64)
    a = (q - v).to(tl.int64)
    b = (v - u).to(tl.int64)
    t = ((b.to(tl.float64) * fq64 + a.to(tl.float64) * fu) - (a + b).to(tl.float64) * fv) + (
        a * b * (a + b)
    ).to(tl.float64)
    return pop & (t <= 0)


@triton.jit
def _lower_at(f1, f0, v1, v0, p):
    d1 = p - v1
    d0 = p - v0
    return f1 + (d1 * d1).to(tl.float32) <= f0 + (d0 * d0).to(tl.float32)


@triton.jit
def _takeover(sv_ptr, sf_ptr, s, k, mask):
    """``mapper.kernels.envelope.takeover`` of stack entry ``k + 1`` over entry ``k`` (same expressions)."""
    v0 = tl.load(sv_ptr + s + k, mask=mask, other=0).to(tl.int64)
    v1 = tl.load(sv_ptr + s + k + 1, mask=mask, other=1).to(tl.int64)
    f0 = tl.load(sf_ptr + s + k, mask=mask, other=0.0)
    f1 = tl.load(sf_ptr + s + k + 1, mask=mask, other=0.0)
    num = (f1.to(tl.float64) - f0.to(tl.float64)) + (v1 * v1 - v0 * v0).to(tl.float64)
    den = (2 * (v1 - v0)).to(tl.float64)
    ok = v1 > v0
    x = tl.where(ok, num / tl.where(ok, den, 1.0), 0.0)
    c = tl.minimum(tl.maximum(tl.ceil(x), -1099511627776.0), 1099511627776.0).to(tl.int64)
    t = tl.where(_lower_at(f1, f0, v1, v0, c), c, c + 1)
    return tl.where(_lower_at(f1, f0, v1, v0, c - 1), c - 1, t)


def lower_envelope_triton(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Same Args/Returns as :func:`mapper.kernels.envelope.lower_envelope`; no host sync."""
    out = torch.full_like(f, float("inf"))
    n_lines = start.numel()
    if n_lines == 0 or f.numel() == 0:
        return out
    f = f.contiguous()
    length = length.to(torch.int64).contiguous()
    order = torch.argsort(length, descending=True)
    sv = torch.empty(f.numel(), dtype=torch.int32, device=f.device)
    sf = torch.empty_like(f)
    grid = (triton.cdiv(n_lines, BLOCK),)
    _envelope_kernel[grid](
        f, out, sv, sf, start.to(torch.int64).contiguous(), length, order, n_lines, BLOCK=BLOCK, num_warps=1
    )
    return out

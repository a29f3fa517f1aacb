"""The ESDF's 1-D min-plus window pass in one Triton launch (imported lazily; torch reference:
``mapper.integrators.esdf._window_min_torch``).

``g[p] = min(f[p], min_{1 <= d <= w, d <= p < n - d} min(f[p - d], f[p + d]) + d^2)``: the torch form runs
``w`` rounds of three element-wise passes over the whole array (~12 bytes x n x w of traffic); here each
lane reads its ``2 w + 1`` neighbours (cached) and writes once. The same float32 operations on the same
operands (min is exact, ``+ d^2`` one rounding), so the bits equal the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_min_kernel(f_ptr, out_ptr, n, W: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < n
    best = tl.load(f_ptr + p, mask=m, other=float("inf"))
    for d in range(1, W + 1):
        ok = m & (p >= d) & (p + d < n)
        a = tl.load(f_ptr + p + d, mask=ok, other=float("inf"))
        b = tl.load(f_ptr + p - d, mask=ok, other=float("inf"))
        df = d + 0.0  # a float32 tensor compiled, a Python float interpreted: d^2 exact either way
        t = tl.minimum(a, b) + df * df
        best = tl.where(ok, tl.minimum(best, t), best)
    tl.store(out_ptr + p, best, mask=m)


def window_min_triton(f: torch.Tensor, w: int) -> torch.Tensor:
    n = f.numel()
    out = torch.empty_like(f)
    if n:
        block = 512
        _window_min_kernel[(triton.cdiv(n, block),)](f.contiguous(), out, n, W=int(w), BLOCK=block)
    return out

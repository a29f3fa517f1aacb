"""Mask-sorted implicit-GEMM sparse convolution in exact FP32, one Triton launch (imported lazily; torch
reference with the same signature: ``sparse_conv.conv_forward_torch``).

One program computes a tile of ``BLOCK_M`` consecutive mask-sorted output rows x ``BLOCK_N`` output
channels, accumulating in registers: for each offset ``k`` present in the union of the tile's neighbour
masks (the others are skipped whole: rows sorted by mask share their offsets), it gathers the tile's
neighbour rows ``[BLOCK_M, BLOCK_K]`` of ``x`` (absent ones read as 0) and multiplies them with the weight
block ``W[k]`` ``[BLOCK_K, BLOCK_N]``; the output row is written once (no atomics, no scatter). The
products use ``input_precision="ieee"``: true FP32 multiply-adds, never TF32, in a fixed order, so the
result is exact FP32 and bit-identical run to run. Tile shapes are chosen per channel width
(:func:`tile_config`, measured on the H200: NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparse_conv import ConvMap


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _accumulate(acc, x_ptr, w_ptr, src, cn, nm, k, C_IN: tl.constexpr, C_OUT: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc += x[src] @ W[k]`` over the input channels, ``BLOCK_K`` at a time (absent rows read 0)."""
    ok = src >= 0
    for c0 in tl.static_range(0, C_IN, BLOCK_K):
        ck = c0 + tl.arange(0, BLOCK_K)
        km = ck < C_IN
        a = tl.load(x_ptr + src[:, None] * C_IN + ck[None, :], mask=ok[:, None] & km[None, :], other=0.0)
        w_off = (k * C_IN + ck[:, None]) * C_OUT + cn[None, :]
        b = tl.load(w_ptr + w_off, mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, nbr_ptr, perm_ptr, masks_ptr, y_ptr, n_out,
    K: tl.constexpr, C_IN: tl.constexpr, C_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = s < n_out
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = cn < C_OUT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SKIP:  # only the offsets in the union of the tile's masks
        union = tl.reduce(tl.load(masks_ptr + s, mask=rm, other=0), 0, _bit_or)
        for k in range(K):
            if ((union >> k) & 1) != 0:
                src = tl.load(nbr_ptr + k * n_out + s, mask=rm, other=-1).to(tl.int64)
                acc = _accumulate(acc, x_ptr, w_ptr, src, cn, nm, k, C_IN, C_OUT, BLOCK_K)
    else:  # every offset, absent rows masked: no branch, so the loads can be pipelined
        for k in range(K):
            src = tl.load(nbr_ptr + k * n_out + s, mask=rm, other=-1).to(tl.int64)
            acc = _accumulate(acc, x_ptr, w_ptr, src, cn, nm, k, C_IN, C_OUT, BLOCK_K)
    rows = tl.load(perm_ptr + s, mask=rm, other=0)
    tl.store(y_ptr + rows[:, None] * C_OUT + cn[None, :], acc, mask=rm[:, None] & nm[None, :])


def _pow2(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, skip absent offsets) per output width class (16, 32, 64, 128+):
# the fastest of sweeps on the H200 (benchmarks/results/sparse_conv_h200.md, NOTES.md)
TILES: dict[int, tuple[int, int, int, int, bool]] = {
    16: (64, 16, 16, 4, True),
    32: (128, 32, 32, 8, True),
    64: (64, 64, 32, 4, True),
    128: (32, 128, 16, 4, True),
}


def tile_config(c_in: int, c_out: int) -> tuple[int, int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, skip)`` for a channel width (``TILES``; ``BLOCK_K`` shrinks
    to the input width, at least 16)."""
    cls = 16 if c_out <= 16 else 32 if c_out <= 32 else 64 if c_out <= 64 else 128
    bm, bn, bk, warps, skip = TILES[cls]
    return bm, bn, min(bk, _pow2(c_in, 16)), warps, skip


def conv_forward_triton(x: torch.Tensor, weight: torch.Tensor, cmap: ConvMap, config=None) -> torch.Tensor:
    """Same Args/Returns as ``sparse_conv.conv_forward_torch`` (float32 only); ``config`` overrides
    :func:`tile_config`."""
    k, c_in, c_out = weight.shape
    n = cmap.num_out
    y = torch.empty((n, c_out), dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    if c_in == 0:
        return y.zero_()
    bm, bn, bk, warps, skip = config or tile_config(c_in, c_out)
    grid = (triton.cdiv(n, bm), triton.cdiv(c_out, bn))
    _conv_kernel[grid](
        x.contiguous(), weight.contiguous(), cmap.nbr, cmap.perm, cmap.masks, y, n,
        K=k, C_IN=c_in, C_OUT=c_out, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SKIP=skip, num_warps=warps,
    )  # fmt: skip
    return y

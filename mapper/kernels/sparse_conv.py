"""Sparse convolution over index grids: mask-sorted neighbour maps and the pure-torch references.

A convolution with ``K`` kernel offsets maps ``N_in`` input rows to ``N_out`` output rows through a
neighbour table: ``y[o] = sum_k x[nbr[k, o]] @ W[k]`` over the offsets ``k`` whose neighbour exists
(``nbr[k, o] >= 0``). The table is built once per (grid, kernel, stride) by ``mapper.nn`` and stored as a
:class:`ConvMap`:

* each output row carries its ``K``-bit **neighbour mask** (bit ``k`` set iff offset ``k`` is present);
* rows are **sorted by mask** (stable, so grid order is kept among equal masks): a tile of consecutive
  sorted rows shares most of its offsets, and a kernel that skips the offsets absent from the tile's union
  mask does almost no wasted work (the idea of the mask-sorted implicit GEMM, see NOTES.md);
* the table is stored transposed ``[K, N_out]`` in sorted order so a tile reads one offset's column
  contiguously.

Everything here is exact FP32 (or FP64) arithmetic with a fixed summation order: results are bit-identical
run to run. :func:`conv_forward_torch` is the reference of ``triton_sparse_conv.conv_forward_triton`` (same
signature) and the CPU path: per chunk of sorted rows, one gather of the offsets present in the chunk and one
GEMM. :func:`conv_gather_gemm_scatter` is the classic per-offset method, the GPU benchmarks' baseline.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ConvMap(NamedTuple):
    """A mask-sorted neighbour table.

    Attributes:
        perm: int64 ``[N_out]``: the output row of each sorted position.
        nbr: int32 ``[K, N_out]``: ``nbr[k, s]`` = input row of offset ``k`` for output row ``perm[s]``,
            -1 where absent.
        masks: int32 ``[N_out]``: sorted neighbour masks (bit ``k`` set iff ``nbr[k, s] >= 0``).
        num_in: number of input rows ``N_in``.
    """

    perm: torch.Tensor
    nbr: torch.Tensor
    masks: torch.Tensor
    num_in: int

    @property
    def num_out(self) -> int:
        return int(self.perm.numel())

    @property
    def num_offsets(self) -> int:
        return int(self.nbr.shape[0])


def make_conv_map(nbr: torch.Tensor, num_in: int) -> ConvMap:
    """Sort an unsorted neighbour table by neighbour mask.

    Args:
        nbr: integer ``[K, N_out]`` (K <= 31): input row of offset ``k`` for output row ``o``, -1 absent.
        num_in: number of input rows.
    Returns:
        The :class:`ConvMap` (same device).
    """
    k = nbr.shape[0]
    if k > 31:
        raise ValueError(f"make_conv_map: at most 31 offsets fit an int32 mask, got {k}")
    bit = torch.ones((), dtype=torch.int32, device=nbr.device) << torch.arange(
        k, dtype=torch.int32, device=nbr.device
    )
    masks = torch.where(nbr >= 0, bit[:, None], 0).sum(0, dtype=torch.int32)  # distinct bits: sum == or
    sorted_masks, perm = torch.sort(masks, stable=True)
    table = nbr.to(torch.int32).index_select(1, perm).contiguous()
    return ConvMap(perm, table, sorted_masks.contiguous(), int(num_in))


def reverse_conv_map(cmap: ConvMap) -> ConvMap:
    """The table of the adjoint convolution (input rows become output rows): ``rev[k, i] = o`` iff
    ``nbr[k, o] = i``. Used for the input gradient: ``dx = conv(dy, W^T, rev)``."""
    k, dev = cmap.num_offsets, cmap.nbr.device
    rev = torch.full((k, cmap.num_in), -1, dtype=torch.int64, device=dev)
    src = cmap.nbr.to(torch.int64)
    ok = src >= 0
    kk = torch.arange(k, device=dev)[:, None].expand_as(src)
    rev[kk[ok], src[ok]] = cmap.perm[None, :].expand_as(src)[ok]  # unique targets: deterministic
    return make_conv_map(rev, cmap.num_out)


_BLOCK_BYTES = 1 << 22  # one gathered block of the torch path (4 MiB: stays in the CPU caches)


def chunk_offsets(cmap: ConvMap, rows: int) -> list[list[int]]:
    """For each chunk of ``rows`` sorted rows, the offsets present in its union mask (one host sync)."""
    n, k = cmap.num_out, cmap.num_offsets
    if n == 0:
        return []
    m = torch.nn.functional.pad(cmap.masks, (0, (-n) % rows)).view(-1, rows)
    bits = (m[:, :, None] >> torch.arange(k, dtype=torch.int32, device=m.device)) & 1
    present = bits.amax(1).bool().cpu()
    return [torch.nonzero(p).flatten().tolist() for p in present]


def _blocks(x: torch.Tensor, cmap: ConvMap):
    """Yield ``(start, end, offsets, A)``: per chunk of sorted rows, the block ``A`` ``[rows, k' C_in]`` of
    the neighbour rows of the chunk's union offsets (absent neighbours read the zero row)."""
    k, c_in = cmap.num_offsets, x.shape[1]
    xpad = torch.cat((x, x.new_zeros((1, c_in))))
    table = torch.where(cmap.nbr >= 0, cmap.nbr, x.shape[0]).to(torch.int64)  # -1 -> the zero row
    rows = max(16, _BLOCK_BYTES // (k * c_in * x.element_size()) // 16 * 16)
    full = list(range(k))
    for ci, offs in enumerate(chunk_offsets(cmap, rows)):
        if not offs:
            continue
        s, e = ci * rows, min((ci + 1) * rows, cmap.num_out)
        idx = table[:, s:e] if offs == full else table[torch.tensor(offs, device=x.device), s:e]
        yield s, e, offs, xpad.index_select(0, idx.t().reshape(-1)).view(e - s, len(offs) * c_in)


def conv_forward_torch(x: torch.Tensor, weight: torch.Tensor, cmap: ConvMap) -> torch.Tensor:
    """Sparse convolution ``y[o] = sum_k x[nbr[k, o]] @ weight[k]``.

    Per chunk of sorted rows: one gather of the neighbour rows of the offsets in the chunk's union mask
    into ``[rows, k' C_in]``, one GEMM with the matching ``[k' C_in, C_out]`` weight rows (on the CPU this
    beats spconv's per-offset gather-GEMM-scatter: NOTES.md).

    Args:
        x: float32/float64 ``[N_in, C_in]`` input rows.
        weight: same dtype ``[K, C_in, C_out]``.
        cmap: the neighbour table (``K`` offsets, ``N_in`` input rows), same device.
    Returns:
        ``[N_out, C_out]`` in output-row order (same dtype and device); rows with no neighbour are 0.
    """
    k, c_in, c_out = weight.shape
    ys = torch.zeros((cmap.num_out, c_out), dtype=x.dtype, device=x.device)
    if cmap.num_out == 0 or c_in == 0:
        return ys
    for s, e, offs, a in _blocks(x, cmap):
        w = weight if len(offs) == k else weight[torch.tensor(offs, device=x.device)]
        torch.mm(a, w.reshape(len(offs) * c_in, c_out), out=ys[s:e])
    y = torch.empty_like(ys)
    y[cmap.perm] = ys
    return y


def conv_weight_grad_torch(x: torch.Tensor, dy: torch.Tensor, cmap: ConvMap) -> torch.Tensor:
    """``dW[k] = sum_o x[nbr[k, o]]^T dy[o]`` -> ``[K, C_in, C_out]`` (fixed chunk order: deterministic)."""
    k, c_in, c_out = cmap.num_offsets, x.shape[1], dy.shape[1]
    dw = torch.zeros((k, c_in, c_out), dtype=x.dtype, device=x.device)
    if cmap.num_out == 0 or c_in == 0:
        return dw
    dys = dy.index_select(0, cmap.perm)
    for s, e, offs, a in _blocks(x, cmap):
        ks = torch.tensor(offs, device=x.device)
        dw.index_add_(0, ks, (a.t() @ dys[s:e]).view(len(offs), c_in, c_out))
    return dw


def gather_gemm_scatter_pairs(cmap: ConvMap) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per offset, the (input rows, output rows) pairs: the rule book of the gather-GEMM-scatter method."""
    out = []
    for k in range(cmap.num_offsets):
        ok = cmap.nbr[k] >= 0
        out.append((cmap.nbr[k][ok].to(torch.int64), cmap.perm[ok]))
    return out


def conv_gather_gemm_scatter(x: torch.Tensor, weight: torch.Tensor, pairs, num_out: int) -> torch.Tensor:
    """The classic gather-GEMM-scatter convolution (one gather, GEMM and scatter-add per offset): the
    baseline of the benchmarks. Output rows are unique per offset, so the scatter-add is deterministic."""
    y = torch.zeros((num_out, weight.shape[2]), dtype=x.dtype, device=x.device)
    for k, (src, dst) in enumerate(pairs):
        if src.numel():
            y.index_add_(0, dst, x[src] @ weight[k])
    return y

"""Sparse 3-D convolution on index grids (submanifold, strided, transposed), exact FP32, with autograd.

Kernel offsets and weights follow ``torch.nn.functional.conv3d`` (cross-correlation): for a submanifold
convolution of size ``k`` (1 or 3), ``y[v] = sum_{a,b,c} x[v + (a, b, c) - k // 2] @ weight[a, b, c]``
over the active neighbours; a strided convolution (``k = 2``, stride 2) maps the fine grid to
``grid.coarsened_grid()`` with ``y[c] = sum_{a,b,c} x[2 c + (a, b, c)] @ weight[a, b, c]``; the transposed
one inverts it: ``y[2 c + (a, b, c)] = x[c] @ weight[a, b, c]`` on the fine grid the coarse grid was
made from. Neighbour maps (``ijk_to_index`` of the offsets, mask-sorted: ``mapper.kernels.sparse_conv``)
are built once per (grid, kernel, stride) and cached on the grid.
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from ..grid import IndexGrid
from ..kernels import sparse_conv as sc
from ..kernels.dispatch import kernel

_DTYPES = (torch.float32, torch.float64)


# ------------------------------------------------------------------------------------------ neighbour maps
def _offsets(k: int, centre: int, device) -> torch.Tensor:
    """int64 ``[k^3, 3]`` offsets in weight order ``(a, b, c)``, a major, minus ``centre``."""
    r = torch.arange(k, device=device)
    a, b, c = torch.meshgrid(r, r, r, indexing="ij")
    return torch.stack((a, b, c), -1).reshape(-1, 3) - centre


_AXIS_BITS = 21  # linear keys: 3 x 21 bits of coordinates relative to the grid's minimum corner


def _linear_index(grid: IndexGrid):
    """(lower corner int64 [3], sorted linear keys int64 [N], their voxel rows int64 [N]) or None when
    the grid spans 2^21 - 2 voxels or more along an axis."""
    if grid.num_voxels == 0:
        return None
    ijk = grid.ijk.to(torch.int64)
    lo = ijk.amin(0) - 1
    if bool(((ijk.amax(0) - lo) >= (1 << _AXIS_BITS) - 1).any()):
        return None
    r = ijk - lo
    keys = (r[:, 0] << (2 * _AXIS_BITS)) | (r[:, 1] << _AXIS_BITS) | r[:, 2]
    skeys, order = torch.sort(keys)
    return lo, skeys, order


def _lookup(grid: IndexGrid, ijk: torch.Tensor) -> torch.Tensor:
    """int32 ``[M]`` rows of voxels int64 ``[M, 3]`` (-1 where inactive): ``grid.ijk_to_index`` on the GPU
    (its Triton kernel); on the CPU a binary search in sorted linear keys, ~30x faster than the grid's
    torch lookup (same result, tested)."""
    index = None if grid.device.type == "cuda" else grid.derived("linear_index", lambda: _linear_index(grid))
    if index is None:
        return grid.ijk_to_index(ijk).to(torch.int32)
    lo, skeys, order = index
    r = ijk - lo
    top = (1 << _AXIS_BITS) - 1
    ok = ((r >= 0) & (r <= top)).all(1)
    keys = (r[:, 0] << (2 * _AXIS_BITS)) | (r[:, 1] << _AXIS_BITS) | r[:, 2]
    pos = torch.searchsorted(skeys, keys).clamp(max=skeys.numel() - 1)
    hit = ok & (skeys[pos] == keys)
    return torch.where(hit, order[pos], -1).to(torch.int32)


def _subm_map(grid: IndexGrid, k: int) -> sc.ConvMap:
    offsets = _offsets(k, k // 2, grid.device)
    index = None if grid.device.type == "cuda" else grid.derived("linear_index", lambda: _linear_index(grid))
    if index is None:
        ijk = grid.ijk.to(torch.int64)
        cols = [_lookup(grid, ijk + d) for d in offsets]
    else:  # CPU: the queries of one offset are the sorted keys shifted: sorted too (cache-friendly search)
        _, skeys, order = index
        top = (1 << _AXIS_BITS) - 1
        cols = []
        for d in offsets.tolist():
            q = skeys + ((d[0] << (2 * _AXIS_BITS)) + (d[1] << _AXIS_BITS) + d[2])  # no field overflows
            pos = torch.searchsorted(skeys, q).clamp(max=skeys.numel() - 1)
            hit = (skeys[pos] == q) & (q >= 0) & (q <= (top << (2 * _AXIS_BITS)) + (top << _AXIS_BITS) + top)
            col = torch.empty_like(order, dtype=torch.int32)
            col[order] = torch.where(hit, order[pos], -1).to(torch.int32)
            cols.append(col)
    return sc.make_conv_map(torch.stack(cols), grid.num_voxels)


def _coarse(grid: IndexGrid) -> IndexGrid:
    coarse = grid.derived("coarsened_grid", grid.coarsened_grid)
    coarse.derived("refines_to", lambda: grid)  # what a transposed conv on ``coarse`` restores
    return coarse


def _down_map(fine: IndexGrid, coarse: IndexGrid) -> sc.ConvMap:
    cijk = coarse.ijk.to(torch.int64) * 2
    cols = [_lookup(fine, cijk + d) for d in _offsets(2, 0, fine.device)]
    return sc.make_conv_map(torch.stack(cols), fine.num_voxels)


def _up_map(coarse: IndexGrid, fine: IndexGrid) -> sc.ConvMap:
    fijk = fine.ijk.to(torch.int64)
    src = _lookup(coarse, fijk >> 1).to(torch.int64)
    o = ((fijk[:, 0] & 1) << 2) | ((fijk[:, 1] & 1) << 1) | (fijk[:, 2] & 1)
    nbr = torch.full((8, fine.num_voxels), -1, dtype=torch.int64, device=fine.device)
    nbr[o, torch.arange(fine.num_voxels, device=fine.device)] = src
    return sc.make_conv_map(nbr, coarse.num_voxels)


def conv_plan(grid: IndexGrid, kernel_size: int, stride: int = 1, transposed: bool = False, out_grid=None):
    """``(out_grid, forward map, backward-map builder)`` of a convolution, built once and cached on the
    grid (the reversed map, for the input gradient, is built on the first backward)."""
    if stride == 1:
        out, key = grid, ("conv_map", kernel_size, 1)
        cmap = grid.derived(key, lambda: _subm_map(grid, kernel_size))
        holder = grid
    elif not transposed:
        out = _coarse(grid)
        key = ("conv_map", 2, 2)
        cmap = grid.derived(key, lambda: _down_map(grid, out))
        holder = grid
    else:
        if out_grid is None:
            out_grid = grid.derived("refines_to", grid.refined_grid)
        out = out_grid
        key = ("conv_map_t", 2, 2, out)
        cmap = grid.derived(key, lambda: _up_map(grid, out))
        holder = grid

    def reverse() -> sc.ConvMap:
        return holder.derived((*key, "reverse"), lambda: sc.reverse_conv_map(cmap))

    return out, cmap, reverse


# ------------------------------------------------------------------------------------------ compute
def _forward(x: torch.Tensor, weight: torch.Tensor, cmap: sc.ConvMap) -> torch.Tensor:
    if x.dtype != torch.float32:  # the Triton implicit GEMM is float32
        return sc.conv_forward_torch(x, weight, cmap)
    impl = kernel(x.device, sc.conv_forward_torch, "triton_sparse_conv:conv_forward_triton")
    return impl(x, weight, cmap)


class _SparseConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cmap, reverse):
        ctx.save_for_backward(x, weight)
        ctx.cmap, ctx.reverse, ctx.has_bias = cmap, reverse, bias is not None
        y = _forward(x, weight, cmap)
        if bias is not None:
            y = y + bias
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _forward(dy, weight.transpose(1, 2).contiguous(), ctx.reverse())
        if ctx.needs_input_grad[1]:
            dw = sc.conv_weight_grad_torch(x, dy, ctx.cmap)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None


# ------------------------------------------------------------------------------------------ public API
def _check(grid, x, weight, bias, stride, transposed, out_grid) -> int:
    if not isinstance(grid, IndexGrid):
        raise InvalidArgumentType(f"grid: expected an IndexGrid, got {type(grid).__name__}")
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentType(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise InvalidArgumentType(f"{name}: expected dtype torch.float32 (or float64), got {t.dtype}")
        if t.device != grid.device:
            raise InvalidArgument(
                f"{name}: expected a tensor on the grid's device {grid.device}, got {t.device}"
            )
    if x.dim() != 2 or x.shape[0] != grid.num_voxels:
        raise InvalidArgument(
            f"x: expected shape [grid.num_voxels={grid.num_voxels}, C_in] (one row per voxel, grid order), "
            f"got {list(x.shape)}"
        )
    if weight.dtype != x.dtype:
        raise InvalidArgumentType(f"weight: dtype {weight.dtype} differs from x's {x.dtype}")
    if isinstance(stride, bool) or stride not in (1, 2):
        raise InvalidArgument(f"stride: expected 1 or 2, got {stride!r}")
    if not isinstance(transposed, bool):
        raise InvalidArgumentType(f"transposed: expected a bool, got {type(transposed).__name__}")
    if transposed and stride != 2:
        raise InvalidArgument("transposed: only a strided (stride=2) convolution can be transposed")
    k = weight.shape[0] if weight.dim() == 5 else -1
    allowed = (1, 3) if stride == 1 else (2,)
    if weight.dim() != 5 or k not in allowed or tuple(weight.shape[:3]) != (k, k, k):
        raise InvalidArgument(
            f"weight: expected shape [k, k, k, C_in, C_out] with k in {allowed} for stride {stride}, "
            f"got {list(weight.shape)}"
        )
    if weight.shape[3] != x.shape[1]:
        raise InvalidArgument(f"weight: C_in={weight.shape[3]} does not match x's {x.shape[1]} channels")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise InvalidArgumentType(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype != x.dtype:
            raise InvalidArgumentType(f"bias: dtype {bias.dtype} differs from x's {x.dtype}")
        if bias.device != grid.device:
            raise InvalidArgument(f"bias: expected a tensor on {grid.device}, got {bias.device}")
        if tuple(bias.shape) != (weight.shape[4],):
            raise InvalidArgument(f"bias: expected shape [{weight.shape[4]}], got {list(bias.shape)}")
    if out_grid is not None:
        if not transposed:
            raise InvalidArgument("out_grid: only a transposed convolution takes an output grid")
        if not isinstance(out_grid, IndexGrid):
            raise InvalidArgumentType(f"out_grid: expected an IndexGrid, got {type(out_grid).__name__}")
        if out_grid.device != grid.device:
            raise InvalidArgument(f"out_grid: grid on {out_grid.device}, expected {grid.device}")
    return k


def sparse_conv3d(
    grid: IndexGrid,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int = 1,
    transposed: bool = False,
    out_grid: IndexGrid | None = None,
) -> tuple[IndexGrid, torch.Tensor]:
    """Sparse 3-D convolution of per-voxel features, exact FP32 (deterministic, TF32 never used).

    Args:
        grid: the input topology.
        x: float32 (float64: torch path, e.g. for gradcheck) ``[grid.num_voxels, C_in]`` in grid order, on
            the grid's device.
        weight: same dtype/device ``[k, k, k, C_in, C_out]``: ``k`` = 3 or 1 for ``stride=1``, 2 for
            ``stride=2``.
        bias: optional ``[C_out]``.
        stride: 1 (submanifold: the output grid is ``grid``) or 2 (output grid ``grid.coarsened_grid()``).
        transposed: with ``stride=2``, invert a strided convolution: ``grid`` is a coarse grid and the
            output lies on the fine grid it was coarsened from by a strided ``sparse_conv3d`` (else on
            ``out_grid`` if given, else on ``grid.refined_grid()``).
        out_grid: the fine output grid of a transposed convolution (optional, see ``transposed``).
    Returns:
        ``(out_grid, y)``: ``y`` is ``[out_grid.num_voxels, C_out]`` in ``out_grid``'s order; autograd
        flows to ``x``, ``weight`` and ``bias``.
    Raises:
        InvalidArgumentType / InvalidArgument: wrong types, dtypes, shapes, devices, or ``x`` does not have
        one row per voxel of ``grid``.
    """
    k = _check(grid, x, weight, bias, stride, transposed, out_grid)
    out, cmap, reverse = conv_plan(grid, k, stride, transposed, out_grid)
    w = weight.reshape(k**3, weight.shape[3], weight.shape[4])
    y = _SparseConvFunction.apply(x.contiguous(), w, bias, cmap, reverse)
    return out, y


class SparseConv3d(torch.nn.Module):
    """``torch.nn.Module`` around :func:`sparse_conv3d`: ``conv(grid, x) -> (out_grid, y)``.

    Args:
        in_channels / out_channels: ``C_in`` / ``C_out``.
        kernel_size: 3 or 1 (``stride=1``), 2 (``stride=2``).
        stride: 1 (submanifold) or 2 (coarsening; ``transposed=True`` refines back).
        bias: learn a bias ``[C_out]``.
        transposed: the transposed (refining) strided convolution.
    Weights ``[k, k, k, C_in, C_out]`` and bias are initialised like ``torch.nn.Conv3d``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        bias: bool = True,
        transposed: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, val in (("in_channels", in_channels), ("out_channels", out_channels)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise InvalidArgument(f"{name}: expected a positive int, got {val!r}")
        allowed = (1, 3) if stride == 1 else (2,) if stride == 2 else ()
        if kernel_size not in allowed:
            raise InvalidArgument(f"kernel_size: {kernel_size!r} is not supported with stride {stride!r}")
        if transposed and stride != 2:
            raise InvalidArgument("transposed: only a strided (stride=2) convolution can be transposed")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.transposed = kernel_size, stride, transposed
        k = kernel_size
        fk = dict(device=device, dtype=dtype or torch.float32)
        self.weight = torch.nn.Parameter(torch.empty((k, k, k, in_channels, out_channels), **fk))
        self.bias = torch.nn.Parameter(torch.empty(out_channels, **fk)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size**3)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, grid: IndexGrid, x: torch.Tensor, out_grid: IndexGrid | None = None):
        return sparse_conv3d(grid, x, self.weight, self.bias, self.stride, self.transposed, out_grid)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        return (
            s
            + (", transposed=True" if self.transposed else "")
            + (", bias=False" if self.bias is None else "")
        )

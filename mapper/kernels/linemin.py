"""The ESDF's line pass: squared 1-D distance from every slot of a line to the nearest crossing on it.

For every line ``l`` (slots ``start[l] .. start[l] + length[l] - 1`` of flat float32 arrays) and every slot
``p`` of it, with ``lo`` / ``hi`` / ``near`` the slot's leftmost, rightmost and nearest crossing (signed
offsets in voxels, in ``[-1/2, 1/2]``; NaN: the slot has none)::

    out[p] = min( (p - L - hi[L])^2,  (R - p + lo[R])^2,  near[p]^2 )

with ``L`` / ``R`` the nearest slots of the line strictly left / right of ``p`` holding a crossing (a
term is absent when there is none; ``inf`` when every term is). A voxel's crossings lie within half a
voxel of it, so the nearest crossing left of ``p`` is ``p``'s own or ``L``'s rightmost, and symmetrically.
Every float is formed from the integer slot difference and the offsets only (float32 subtraction /
addition, then a square): equal lines give equal bits wherever they sit, and both implementations form
the same floats; minima are exact, so they agree bit for bit.

* :func:`line_min_torch` - reference (prefix scans over all slots; ~100 B of temporaries a slot).
* :func:`mapper.kernels.triton_linemin.line_min_triton` - one Triton program per 16 lines, one lane a
  line, a forward and a backward sweep (no temporaries beyond the output).
* :func:`line_min` - dispatch (:func:`mapper.kernels.dispatch.kernel`).
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from .dispatch import kernel


def index_dtype(n: int) -> torch.dtype:
    """int32 for indices below ``n`` where they and the passes' ``+-2^30`` sentinels fit, else int64."""
    return torch.int32 if n < (1 << 30) else torch.int64


def _check(lo, hi, near, start, length) -> None:
    for name, t in (("lo", lo), ("hi", hi), ("near", near)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            raise InvalidArgumentType(f"line_min: {name} must be a float32 [P] tensor")
        if t.shape != lo.shape:
            raise InvalidArgument(f"line_min: {name} has {t.numel()} slots, lo {lo.numel()}")
    for name, t in (("start", start), ("length", length)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool or t.dim() != 1:
            raise InvalidArgumentType(f"line_min: {name} must be an integer [L] tensor")
    if start.shape != length.shape:
        raise InvalidArgument(f"line_min: start has {start.numel()} lines, length {length.numel()}")


def nearest_marked(
    has: torch.Tensor, ar: torch.Tensor, far: int, by_count: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every slot, the nearest slot strictly left / right with ``has`` set (``ar``'s dtype; ``-far`` /
    ``far`` where none). Two equivalent forms (the same integers): on CUDA a prefix count and a lookup,
    because a scan with indices (``torch.cummax``) runs one row per block there (~100x slower on a long
    row); on the CPU the running max/min, 2x cheaper than the count and lookup (``by_count``: force)."""
    if by_count if by_count is not None else has.device.type == "cuda":
        count = torch.cumsum(has, 0, dtype=ar.dtype)
        pos = has.nonzero().squeeze(1).to(ar.dtype)
        left = torch.cat((pos.new_full((1,), -far), pos))[count - has.to(ar.dtype)]
        right = torch.cat((pos, pos.new_full((1,), far)))[count]
        return left, right
    left = torch.cummax(torch.where(has, ar, -far), 0)[0]
    left = torch.cat((left.new_full((1,), -far), left[:-1]))
    right = torch.cummin(torch.where(has, ar, far).flip(0), 0)[0].flip(0)
    right = torch.cat((right[1:], right.new_full((1,), far)))
    return left, right


def line_min_torch(
    lo: torch.Tensor, hi: torch.Tensor, near: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> torch.Tensor:
    """Squared 1-D distance from every slot to the nearest crossing on its line (module docstring).

    Args:
        lo, hi, near: float32 ``[P]`` per slot (NaN: none), any device.
        start, length: integer ``[L]``: the lines, covering the ``P`` slots one after the other.
    Returns:
        float32 ``[P]`` on the same device; ``inf`` where the line has no crossing.
    """
    n = lo.numel()
    idt = index_dtype(n)
    far = 1 << 30 if idt == torch.int32 else 1 << 40  # "no voxel"
    ar = torch.arange(n, dtype=idt, device=lo.device)
    has = ~torch.isnan(lo)
    left, right = nearest_marked(has, ar, far)
    start, length = start.to(idt), length.to(idt)
    ls = torch.repeat_interleave(start, length, output_size=n)
    le = ls + torch.repeat_interleave(length, length, output_size=n)
    dl = (ar - left).to(torch.float32) - hi[left.clamp(0, n - 1)]
    dr = (right - ar).to(torch.float32) + lo[right.clamp(0, n - 1)]
    dl = torch.where(left >= ls, dl, math.nan)  # none on this line
    dr = torch.where(right < le, dr, math.nan)
    best = torch.fmin(torch.fmin(dl * dl, dr * dr), near * near)
    return torch.nan_to_num_(best, nan=math.inf)


def line_min(
    lo: torch.Tensor, hi: torch.Tensor, near: torch.Tensor, start: torch.Tensor, length: torch.Tensor
) -> torch.Tensor:
    """Same Args/Returns as :func:`line_min_torch`; the Triton kernel where Triton runs (no host sync)."""
    _check(lo, hi, near, start, length)
    if lo.numel() == 0:
        return lo.new_empty(0)
    return kernel(lo.device, line_min_torch, "triton_linemin:line_min_triton")(lo, hi, near, start, length)

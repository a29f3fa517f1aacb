"""Voxel traversal of ray segments (Amanatides-Woo): the torch reference and a Triton kernel.

``dda_torch`` is vectorised over rays with a Python loop over the (few) steps: on the GPU that is ~12
kernel launches per step, so ``dda_triton`` (one launch, one program per block of rays, the step loop
inside) replaces it on CUDA. Both compute in float64 with the same operations in the same order.
"""

from __future__ import annotations

import math

import torch

from .dispatch import kernel


def dda_torch(
    origins: torch.Tensor, dirs: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, cell: float, max_steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cells crossed by the segments ``origins + t * dirs``, ``t in [t0, t1]``.

    Args: float64 ``[R, 3]`` origins and unit dirs, float64 ``[R]`` t0/t1, the cell size.
    Returns: int64 ``[R, S, 3]`` cells, float64 ``[R, S]`` entry parameter t, bool ``[R, S]`` valid,
    with ``S = max_steps``; each crossed cell appears once per ray, in order.
    """
    r = origins.shape[0]
    p = origins + dirs * t0[:, None]
    v = torch.floor(p / cell).to(torch.int64)
    step = torch.sign(dirs).to(torch.int64)
    pos = dirs > 0
    boundary = (v + pos.to(torch.int64)).to(torch.float64) * cell
    inv = torch.where(dirs != 0, 1.0 / dirs, torch.full_like(dirs, math.inf))
    tmax = torch.where(dirs != 0, t0[:, None] + (boundary - p) * inv, torch.full_like(dirs, math.inf))
    tdelta = torch.where(dirs != 0, cell * inv.abs(), torch.full_like(dirs, math.inf))
    cells = torch.empty((r, max_steps, 3), dtype=torch.int64, device=origins.device)
    tent = torch.empty((r, max_steps), dtype=torch.float64, device=origins.device)
    t = t0.clone()
    for k in range(max_steps):
        cells[:, k] = v
        tent[:, k] = t
        tx, ty, tz = tmax.unbind(1)
        mx = (tx <= ty) & (tx <= tz)
        my = ~mx & (ty <= tz)
        m = torch.stack((mx, my, ~mx & ~my), dim=1)
        t = torch.minimum(torch.minimum(tx, ty), tz)
        v += step * m
        tmax += torch.where(m, tdelta, 0.0)
    valid = tent < t1[:, None]
    valid[:, 0] |= t0 <= t1  # a zero-length segment still touches its cell
    return cells, tent, valid


def dda_triton(
    origins: torch.Tensor, dirs: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, cell: float, max_steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same as :func:`dda_torch`, one Triton launch."""
    # lazy: Triton is optional (a CPU install imports this module without it)
    from .triton_dda import dda_kernel_launch

    return dda_kernel_launch(origins, dirs, t0, t1, cell, max_steps)


def dda(
    origins: torch.Tensor, dirs: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, cell: float, max_steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dda_torch`, or :func:`dda_triton` where Triton runs (same Args/Returns)."""
    if origins.shape[0] == 0:
        return dda_torch(origins, dirs, t0, t1, cell, max_steps)
    return kernel(origins.device, dda_torch, dda_triton)(origins, dirs, t0, t1, cell, max_steps)

"""Log-odds update of whole bricks from a frame's per-voxel flags (occupancy and the free record).

A frame's integrator marks, per voxel of its ``U`` bricks, uint8 ``flags[rank * 64 + offset]``: 0 = not
observed this frame, 1 = miss (crossed), 2 = hit. :func:`flags_update` then updates the pool field (fp16
log-odds, NaN = unknown, counted as 0) of every flagged voxel once: ``clamp(lo + (l_hit if hit else
l_miss), c_min, c_max)``, and optionally marks the bricks in which a flagged voxel was unknown (it becomes
known: what the ESDF must see of the free record).

:func:`flags_update_torch` (the reference and the CPU path: pool gathers and scatters of brick chunks) and
``triton_logodds.flags_update_triton`` (one launch over all ``U * 64`` voxels through the pool's page
tables: no temporaries, no host sync) have the same signature and give the same fp16 bits.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from .dispatch import kernel

CPU_BRICKS = 1 << 13  # bricks per chunk of the torch path (its [B, 64] float32 temporaries: 2 MB)


def flags_update_torch(
    pool,
    name: str,
    slots: torch.Tensor,
    flags: torch.Tensor,
    l_hit: float,
    l_miss: float,
    c_min: float,
    c_max: float,
    known: torch.Tensor | None = None,
) -> None:
    """Update ``pool``'s fp16 field ``name`` at the flagged voxels of ``slots``.

    Args:
        pool: a :class:`mapper.layers.PagedPool` (``gather``/``scatter`` of whole bricks).
        slots: int64 ``[U]`` the bricks' slots; flags: uint8 ``[U * 64]`` or ``[U, 64]`` (0 / 1 = miss /
            2 = hit), on the pool's device.
        l_hit, l_miss: log-odds added (float32 arithmetic); c_min, c_max: the clamp.
        known: optional uint8 ``[U]``, set to 1 (never cleared) where a flagged voxel was unknown (NaN).
    """
    u = slots.numel()
    f_all = flags.reshape(u, 64)
    step = CPU_BRICKS if slots.device.type == "cpu" else (1 << 16)
    for c0 in range(0, u, step):
        sl, f = slots[c0 : c0 + step], f_all[c0 : c0 + step]
        lo = pool.gather(name, sl).to(torch.float32)
        delta = torch.where(f == 2, torch.full_like(lo, l_hit), torch.full_like(lo, l_miss))
        new = (torch.nan_to_num(lo, nan=0.0) + delta).clamp(c_min, c_max)
        pool.scatter(name, sl, torch.where(f == 0, lo, new))
        if known is not None:
            became = ((f != 0) & torch.isnan(lo)).any(dim=1)
            known[c0 : c0 + step] |= became.to(torch.uint8)


def flags_update(pool, name, slots, flags, l_hit, l_miss, c_min, c_max, known=None) -> None:
    """:func:`flags_update_torch`, or its Triton kernel (one launch, same arguments) where Triton runs."""
    if pool.fields[name].dtype != torch.float16:
        raise InvalidArgumentType(
            f"flags_update: field {name!r} must be float16, not {pool.fields[name].dtype}"
        )
    if flags.numel() != slots.numel() * 64:
        raise InvalidArgument(
            f"flags_update: {flags.numel()} flags for {slots.numel()} bricks (64 per brick)"
        )
    if slots.numel() == 0:
        return
    impl = kernel(slots.device, flags_update_torch, "triton_logodds:flags_update_triton")
    impl(pool, name, slots, flags, l_hit, l_miss, c_min, c_max, known)

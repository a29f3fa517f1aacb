"""Decay, clearing and the radius policy over a map's stored layers (``Map.decay``, ``Map.clear``,
``Map.clear_outside``, ``keep_radius_m``).

Each takes the map's stores, ``(layer, queue)`` pairs: a :class:`~mapper.layer_kinds.StoredLayer` (which
knows how its voxels reset and decay, and its voxel size) and the ESDF queue its changes go to (None
without an ESDF). Bricks left with no observed voxel, or wholly cleared, are freed and pruned from the
grid; partly changed bricks are touched (their mesh version moves) and queued.
"""

from __future__ import annotations

import math

import torch

from ._validation import positive
from .errors import InvalidArgument
from .integrators.base import BrickQueue
from .layer_kinds import StoredLayer
from .layers import brick_in_leaf, brick_local_coords, brick_offsets

Stores = list[tuple[StoredLayer, BrickQueue | None]]


def free_bricks(
    layer: StoredLayer, queue: BrickQueue | None, bricks: torch.Tensor, drop: torch.Tensor
) -> int:
    """Free the bricks ``bricks[drop]`` (int64 ``[B, 3]``, bool ``[B]``) of ``layer``; their number."""
    n = int(drop.sum())
    if n:
        if queue is not None:
            queue.push(bricks[drop])
        leaf = layer.grid.ijk_to_leaf(bricks[drop] << 2)
        mask = torch.zeros_like(layer.slots, dtype=torch.bool)
        mask[leaf, brick_in_leaf(bricks[drop] << 2)] = True
        layer.release_bricks(mask)
    return n


def check_decay(factor, threshold) -> tuple[float, float]:
    """``Map.decay``'s arguments -> (factor in (0, 1], threshold >= 0); raises ``InvalidArgument``."""
    f = positive("factor", factor)
    if f > 1:
        raise InvalidArgument(f"factor: expected a value in (0, 1], got {factor}")
    th = float(threshold)
    if not math.isfinite(th) or th < 0:
        raise InvalidArgument(f"threshold: expected a finite value >= 0, got {threshold}")
    return f, th


def decay(stores: Stores, factor: float, threshold: float) -> dict[str, int]:
    """Every layer's :meth:`~mapper.layer_kinds.StoredLayer.decay_bricks` over all its bricks; the bricks
    freed per layer kind."""
    freed = {}
    for layer, queue in stores:
        bricks, slots = layer.brick_table()
        if slots.numel() == 0:
            continue
        died, alive = layer.decay_bricks(slots, factor, threshold)
        if queue is not None:  # voxels that became unobserved in surviving bricks
            queue.push_always(bricks[died.any(dim=1) & alive])
        layer.touch(bricks[alive])
        freed[layer.kind] = free_bricks(layer, queue, bricks, ~alive)
    return freed


def clear_where(stores: Stores, inside_fn, chunk_bricks: int) -> dict[str, int]:
    """Reset the voxels whose world centres satisfy ``inside_fn(float64 [M, 3]) -> bool [M]``
    (``chunk_bricks`` bricks at a time); the bricks freed per layer kind."""
    freed = {}
    for layer, queue in stores:
        bricks, slots = layer.brick_table()
        if slots.numel() == 0:
            continue
        local = brick_local_coords(layer.device)[None]  # [1, 64, 3] in offset order
        full = torch.zeros(bricks.shape[0], dtype=torch.bool, device=layer.device)
        for a in range(0, bricks.shape[0], chunk_bricks):
            bk, sl = bricks[a : a + chunk_bricks], slots[a : a + chunk_bricks]
            vox = bk[:, None, :] * 4 + local
            centres = ((vox.to(torch.float64) + 0.5) * layer.voxel_size_m).reshape(-1, 3)
            inside = inside_fn(centres).reshape(-1, 64)
            full[a : a + chunk_bricks] = inside.all(dim=1)
            part = inside & ~full[a : a + chunk_bricks, None]
            if bool(part.any()):
                b, o = part.nonzero(as_tuple=True)
                layer.reset_voxels(sl[b], brick_offsets(vox[b, o]))
                layer.touch(bk[part.any(dim=1)])
                if queue is not None:
                    queue.push(bk[part.any(dim=1)])
        freed[layer.kind] = free_bricks(layer, queue, bricks, full)
    return freed


def free_far_bricks(stores: Stores, origin: torch.Tensor, radius_m: float) -> int:
    """Free the bricks lying wholly farther than ``radius_m`` from ``origin`` (float64 ``[3]``, on the
    layers' device) in every layer; how many."""
    n = 0
    for layer, queue in stores:
        if layer.num_bricks == 0:
            continue
        bm = 4 * layer.voxel_size_m  # the free record has the ESDF's voxel
        bricks, _ = layer.brick_table()
        lo = bricks.to(torch.float64) * bm
        near = torch.minimum(torch.maximum(origin, lo), lo + bm)  # the brick's point nearest to the origin
        far = torch.linalg.vector_norm(near - origin, dim=1) > radius_m
        n += free_bricks(layer, queue, bricks, far)
    return n


def free_outside_shard(stores: Stores, shard, voxel_size_m: float) -> int:
    """A shard of a sharded map (``shard``: a ``mapper.sharding.ShardSpec``): free the bricks lying wholly
    outside the halo of the blocks it owns, in every layer; how many."""
    n = 0
    for layer, queue in stores:
        if layer.num_bricks == 0:
            continue
        bricks, _ = layer.brick_table()
        keep = shard.keep_bricks(bricks, 4 * layer.voxel_size_m, voxel_size_m)
        n += free_bricks(layer, queue, bricks, ~keep)
    return n

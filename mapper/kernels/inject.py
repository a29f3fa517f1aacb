"""Source index of every destination voxel, for copying sidecars between grids."""

from __future__ import annotations

import torch

from .bits import unpack_bits
from .chunks import row_slices
from .topology import Leaves, lookup_leaves

_CHUNK_LEAVES = 1 << 10


def inject_index_torch(src: Leaves, dst: Leaves) -> torch.Tensor:
    """int64 ``[N_dst]``: position in ``src``'s order of each voxel of ``dst``, -1 where ``src`` lacks it."""
    dev = dst.keys.device
    parts = []
    for sl_ in row_slices(dst.keys.numel(), dev, cpu_rows=_CHUNK_LEAVES):
        dbits = unpack_bits(dst.masks[sl_])
        sl = lookup_leaves(src.keys, dst.keys[sl_])
        has = sl >= 0
        slc = sl.clamp(min=0)
        sbits = unpack_bits(src.masks[slc]) & has[:, None]
        rank = torch.cumsum(sbits, dim=1, dtype=torch.int32) - 1
        idx = torch.where(sbits, rank.to(torch.int64) + src.offsets[slc][:, None], -1)
        parts.append(idx[dbits])
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.cat(parts)

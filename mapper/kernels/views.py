"""What a kernel sees of a brick layer: a small view handed down by the layer (``BrickLayer.kernel_view``),
so kernels never reach into layer or pool objects (and never import them)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .topology import Tiles


class LayerView(NamedTuple):
    """A brick layer for a kernel that reads fields by voxel.

    ``tiles``: the grid's tile table (keys, masks, starts); ``slots``: int32 ``[L, 8]`` brick slots per
    leaf (-1 absent); ``page_starts``: int64 ``[P + 1]`` first slot of each pool page, then the capacity;
    ``page_tables``: per field, int64 ``[P]`` data pointers of its pages (``PagedPool.page_table``).
    """

    tiles: Tiles
    slots: torch.Tensor
    page_starts: torch.Tensor
    n_pages: int
    page_tables: dict[str, torch.Tensor]
    num_leaves: int
    capacity: int

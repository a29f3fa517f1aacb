"""``IndexGrid``: immutable sparse voxel topology in 8^3 leaves, with bulk topology operators.

The grid stores only which voxels are active. Per-voxel data ("sidecars") are plain tensors
``[num_voxels, ...]`` in the grid's **voxel-sequential order**: leaves sorted by leaf key (tile by tile,
see :mod:`mapper.kernels.keys`), inside a leaf the NanoVDB offset ``((i&7)<<6)|((j&7)<<3)|(k&7)``.
Every operator returns a new grid; ``inject_to`` moves sidecars from one grid's order to another's.

Names follow fVDB: ``from_ijk``, ``ijk_to_index``, ``merged_grid``, ``pruned_grid``, ``dilated_grid``,
``coarsened_grid``, ``refined_grid``, ``inject_to``.
"""

from __future__ import annotations

import torch

from . import _validation as v
from .errors import InvalidArgument, InvalidArgumentType
from .kernels import build, grid_ops, morphology, setops
from .kernels.keys import TILE_AXIS_BITS, TILE_BIAS, VOXEL_LIMIT, decode_leaf_keys, in_range
from .kernels.topology import Leaves, Tiles, build_tiles, empty_leaves, make_leaves

_MAX_RADIUS = 8
TILE_LIMIT = VOXEL_LIMIT >> 5  # tile coordinates lie in [-TILE_LIMIT, TILE_LIMIT)
_AXIS = (1 << TILE_AXIS_BITS) - 1


class IndexGrid:
    """Immutable set of active voxels, grouped in 8^3 leaves with 512-bit masks.

    Build with :meth:`from_ijk` or :meth:`empty`; ``__init__`` is internal.
    """

    __slots__ = ("_leaves", "_tiles", "_num_voxels", "_derived")

    def __init__(self, leaves: Leaves, tiles: Tiles | None = None):
        self._leaves = leaves
        self._tiles = tiles
        self._num_voxels: int | None = None
        self._derived: dict = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty(cls, device: str | torch.device | None = None) -> IndexGrid:
        """A grid with no active voxel on ``device`` (default CPU)."""
        dev = v.resolve_device(device, torch.device("cpu"))
        return cls(empty_leaves(dev))

    @classmethod
    def from_ijk(cls, ijk, device: str | torch.device | None = None) -> IndexGrid:
        """Grid of the voxels in ``ijk``.

        Args:
            ijk: integer ``[N, 3]`` voxel coordinates (torch int32/int64 or numpy); duplicates allowed;
                each coordinate in ``[-2^22, 2^22)``.
            device: where the grid lives; default: ``ijk``'s device.
        """
        src_dev = ijk.device if isinstance(ijk, torch.Tensor) else torch.device("cpu")
        dev = v.resolve_device(device, src_dev)
        t = v.check_ijk("ijk", ijk, dev)
        if t.shape[0] and not bool(in_range(t).all()):
            raise InvalidArgument(f"ijk: coordinates must lie in [-{VOXEL_LIMIT}, {VOXEL_LIMIT}) per axis")
        return cls(build.from_ijk_torch(t))

    @classmethod
    def _from_leaves(cls, keys: torch.Tensor, masks: torch.Tensor) -> IndexGrid:
        """Internal: grid from sorted unique leaf keys int64 ``[L]`` and masks int64 ``[L, 8]``."""
        return cls(make_leaves(keys, masks, drop_empty=True))

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self._leaves.keys.device

    @property
    def num_leaves(self) -> int:
        return int(self._leaves.keys.numel())

    @property
    def num_voxels(self) -> int:
        if self._num_voxels is None:
            self._num_voxels = int(self._leaves.offsets[-1])
        return self._num_voxels

    def __len__(self) -> int:
        return self.num_voxels

    @property
    def leaves(self) -> Leaves:
        """The raw topology (sorted leaf keys, masks, voxel offsets); read-only by convention."""
        return self._leaves

    @property
    def cached_tiles(self) -> Tiles | None:
        """The tile index if it was built already, else None (for a grid with the same leaf keys)."""
        return self._tiles

    @property
    def tiles(self) -> Tiles:
        """The tile index over the leaves (built on first use, then cached)."""
        if self._tiles is None:
            self._tiles = build_tiles(self._leaves.keys)
        return self._tiles

    def _tiles_of(self) -> Tiles:
        return self.tiles

    def derived(self, key, build):
        """Data derived from this grid's topology alone (e.g. the neighbour maps of ``mapper.nn``): built
        by ``build()`` on the first call for a hashable ``key``, then cached on the grid (which is
        immutable, so the cache never goes stale) and freed with it."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @property
    def ijk(self) -> torch.Tensor:
        """int32 ``[num_voxels, 3]`` active voxel coordinates in voxel-sequential order."""
        return grid_ops.voxel_ijk(self._leaves)

    @property
    def leaf_ijk(self) -> torch.Tensor:
        """int32 ``[num_leaves, 3]`` leaf coordinates (voxel coordinates >> 3) in leaf order."""
        return decode_leaf_keys(self._leaves.keys).to(torch.int32)

    @property
    def nbytes(self) -> int:
        """Bytes held by the topology: leaf keys, masks and voxel offsets, plus the tile index."""
        t = self.tiles
        return sum(x.numel() * x.element_size() for x in (*self._leaves, *t))

    def to(self, device: str | torch.device) -> IndexGrid:
        dev = v.resolve_device(device)
        if dev == self.device:
            return self
        return IndexGrid(Leaves(*(x.to(dev) for x in self._leaves)))

    def __repr__(self) -> str:
        return f"IndexGrid(num_leaves={self.num_leaves}, device={self.device})"

    # ------------------------------------------------------------------ queries
    def ijk_to_index(self, ijk) -> torch.Tensor:
        """int64 ``[M]`` position of each voxel of integer ``ijk`` ``[M, 3]`` in the voxel order, -1 where
        inactive (or outside the representable range). ``ijk`` must be on the grid's device (numpy is
        moved there)."""
        t = self._device_ijk("ijk", ijk)
        return grid_ops.ijk_to_index(self._leaves, self._tiles_of, t)

    def ijk_to_leaf(self, ijk) -> torch.Tensor:
        """int64 ``[M]`` index (in leaf order) of the leaf holding each voxel of ``ijk``, -1 where the
        grid has no such leaf. Used to address leaf-level sidecars."""
        t = self._device_ijk("ijk", ijk)
        return grid_ops.ijk_to_index(self._leaves, self._tiles_of, t, leaf_only=True)

    def _device_ijk(self, name: str, ijk) -> torch.Tensor:
        if isinstance(ijk, torch.Tensor) and ijk.device != self.device:
            raise InvalidArgument(f"{name}: expected a tensor on {self.device}, got one on {ijk.device}")
        return v.check_ijk(name, ijk, self.device)

    # ------------------------------------------------------------------ operators
    def _check_other(self, other) -> IndexGrid:
        if not isinstance(other, IndexGrid):
            raise InvalidArgumentType(f"other: expected an IndexGrid, got {type(other).__name__}")
        if other.device != self.device:
            raise InvalidArgument(f"other: grid on {other.device}, expected {self.device}")
        return other

    def merged_grid(self, other: IndexGrid) -> IndexGrid:
        """Union of the active voxels of ``self`` and ``other`` (same device)."""
        other = self._check_other(other)
        return IndexGrid(setops.merge_torch(self._leaves, other._leaves))

    def merged_grid_with_positions(self, other: IndexGrid) -> tuple[IndexGrid, torch.Tensor, torch.Tensor]:
        """``merged_grid`` plus where each leaf of ``self`` and of ``other`` landed (int64 ``[L_self]``,
        ``[L_other]`` leaf indices in the result), for injecting leaf-level sidecars."""
        other = self._check_other(other)
        leaves, pa, pb = setops.merge_with_positions_torch(self._leaves, other._leaves)
        return IndexGrid(leaves), pa, pb

    def pruned_grid(self, keep) -> IndexGrid:
        """The voxels where bool ``keep`` ``[num_voxels]`` (voxel-sequential order) is true."""
        mask = v.check_bool_mask("keep", keep, self.num_voxels, self.device)
        if self.num_leaves == 0:
            return self
        return IndexGrid(grid_ops.prune(self._leaves, mask))

    def _morph(self, radius, connectivity, erode: bool) -> IndexGrid:
        r = v.check_int_in("radius", radius, range(1, _MAX_RADIUS + 1))
        c = v.check_int_in("connectivity", connectivity, morphology.CONNECTIVITIES)
        grid = self
        for _ in range(r):
            if grid.num_leaves == 0:
                break
            leaves, tiles = grid_ops.morph(grid._leaves, grid._tiles_of, c, erode)
            grid = IndexGrid(leaves, tiles)
            if not erode:
                grid._check_range("dilated_grid")
        return grid

    def _check_range(self, op: str) -> None:
        """Raise if a result has voxels outside [-2^22, 2^22) (keys keep a margin, so they are exact)."""
        t = self.tiles.keys
        if t.numel() == 0:
            return
        lo, hi = TILE_BIAS - (TILE_LIMIT), TILE_BIAS + TILE_LIMIT
        f = torch.stack(((t >> (2 * TILE_AXIS_BITS)) & _AXIS, (t >> TILE_AXIS_BITS) & _AXIS, t & _AXIS))
        if bool(((f < lo) | (f >= hi)).any()):
            raise InvalidArgument(f"{op}: the result would leave the representable range [-2^22, 2^22)")

    def dilated_grid(self, radius: int = 1, connectivity: int = 26) -> IndexGrid:
        """Grid grown by ``radius`` (1..8) iterations of the one-voxel stencil with ``connectivity``
        6 (faces), 18 (faces+edges) or 26 (box), as OpenVDB's ``dilateActiveValues``."""
        return self._morph(radius, connectivity, erode=False)

    def eroded_grid(self, radius: int = 1, connectivity: int = 26) -> IndexGrid:
        """Grid shrunk by ``radius`` iterations: a voxel stays iff all its stencil neighbours are active."""
        return self._morph(radius, connectivity, erode=True)

    def coarsened_grid(self) -> IndexGrid:
        """2:1 coarsening: voxel (i, j, k) -> (i >> 1, j >> 1, k >> 1) (floor, negatives included)."""
        return IndexGrid(setops.coarsen_torch(self._leaves))

    def refined_grid(self) -> IndexGrid:
        """1:2 refinement: every voxel -> its 8 children (2i + a, 2j + b, 2k + c)."""
        if self.num_leaves:
            lc = decode_leaf_keys(self._leaves.keys)
            lim = VOXEL_LIMIT >> 4  # children must stay representable
            if bool(((lc < -lim) | (lc >= lim)).any()):
                raise InvalidArgument("grid: refined coordinates would leave the representable range")
        return IndexGrid(setops.refine_torch(self._leaves))

    # ------------------------------------------------------------------ sidecars
    def inject_to(self, dst_grid: IndexGrid, values: torch.Tensor, fill=0) -> torch.Tensor:
        """Sidecar ``values`` ``[num_voxels, *C]`` (any dtype) re-laid out for ``dst_grid``: voxels in both
        grids copy their value, the others get ``fill``. Result ``[dst_grid.num_voxels, *C]``."""
        dst = self._check_other(dst_grid)
        if not isinstance(values, torch.Tensor):
            raise InvalidArgumentType(f"values: expected a torch.Tensor, got {type(values).__name__}")
        if values.dim() == 0 or values.shape[0] != self.num_voxels:
            raise InvalidArgument(
                f"values: expected shape [{self.num_voxels}, ...] (one row per voxel), "
                f"got {list(values.shape)}"
            )
        if values.device != self.device:
            raise InvalidArgument(f"values: expected a tensor on {self.device}, got one on {values.device}")
        idx = self.inject_index(dst)
        out = torch.empty((dst.num_voxels, *values.shape[1:]), dtype=values.dtype, device=self.device)
        try:
            out.fill_(fill)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgument(f"fill: cannot fill a {values.dtype} tensor with {fill!r}: {e}") from None
        has = idx >= 0
        out[has] = values[idx[has]]
        return out

    def inject_index(self, dst_grid: IndexGrid) -> torch.Tensor:
        """int64 ``[dst_grid.num_voxels]``: each destination voxel's index in ``self``, -1 if absent."""
        dst = self._check_other(dst_grid)
        if self.num_leaves == 0 or dst.num_leaves == 0:
            return torch.full((dst.num_voxels,), -1, dtype=torch.int64, device=self.device)
        return grid_ops.inject_index(self._leaves, self._tiles_of, dst._leaves)

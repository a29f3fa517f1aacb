"""Map layers: an index grid of allocated 4^3 bricks, a leaf-level brick-slot table, and paged voxel pools.

Why not sidecars in the grid's voxel order for the live map? Inserting a frame's voxels into a sorted
grid shifts the order of every later voxel, so a per-frame ``inject_to`` copies the whole map (8 B per
voxel each way, and twice the memory while it runs). Here the per-frame ``merge`` still produces a new
``IndexGrid`` epoch, but what is injected into its order is the **leaf-level** slot table
(``int32 [L, 8]``, 32 B per leaf = 1/512 of the voxels' bytes); voxel data lives in fixed brick slots of
paged pools that never move. A frame's cost is its bricks plus a linear pass over the leaf topology
(~100 B per leaf, see NOTES.md). Pools grow by whole pages, so memory peaks at steady state plus one
page (no doubling copy). ``BrickLayer.voxel_view`` produces the classic (grid, sidecars in voxel order)
view on demand.

Conventions: voxel (i, j, k) lies in brick ``v >> 2`` (4^3 voxels, 8 per leaf); inside a leaf the brick
index is ``((i>>2)&1)<<2 | ((j>>2)&1)<<1 | ((k>>2)&1)``; inside a brick the offset is
``((i&3)<<4) | ((j&3)<<2) | (k&3)``. A pool entry is addressed by ``slot * 64 + offset``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from .grid import IndexGrid
from .kernels.dispatch import use_triton
from .kernels.keys import encode_leaf_keys
from .kernels.setops import insert_sorted_keys
from .kernels.topology import lookup_leaves, make_leaves
from .kernels.transfer import host_to_device
from .kernels.views import LayerView

BRICK_VOXELS = 64
PAGE_BRICKS = 1 << 14  # 2^20 voxels per page
# copy-on-write on CUDA: while a field's shared pages total at most this, a write copies all of them at once
# (no host sync to find the pages it touches; HBM copies ~1.5 TB/s); above it, only the touched pages
COW_ALL_BYTES = 256 << 20
_KEY_SENTINEL = torch.iinfo(torch.int64).max  # sorts after every leaf key


@dataclass(frozen=True)
class FieldSpec:
    """One per-voxel field of a layer: dtype, trailing shape and the value of a fresh voxel."""

    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    fill: float = 0.0


def brick_offsets(ijk: torch.Tensor) -> torch.Tensor:
    """In-brick offset ``((i&3)<<4)|((j&3)<<2)|(k&3)`` of int64 ``[M, 3]`` voxels."""
    return ((ijk[:, 0] & 3) << 4) | ((ijk[:, 1] & 3) << 2) | (ijk[:, 2] & 3)


_LOCAL: dict[torch.device, torch.Tensor] = {}


def brick_local_coords(device: torch.device) -> torch.Tensor:
    """int64 ``[64, 3]``: voxel coordinates inside a brick, in offset order ``i << 4 | j << 2 | k``."""
    t = _LOCAL.get(device)
    if t is None:
        o = torch.arange(64)
        t = torch.stack((o >> 4, (o >> 2) & 3, o & 3), dim=1).to(device)
        _LOCAL[device] = t
    return t


def brick_in_leaf(ijk: torch.Tensor) -> torch.Tensor:
    """Brick index inside its leaf (0..7) of int64 ``[M, 3]`` voxel (or ``brick << 2``) coordinates."""
    return (((ijk[:, 0] >> 2) & 1) << 2) | (((ijk[:, 1] >> 2) & 1) << 1) | ((ijk[:, 2] >> 2) & 1)


class PagedPool:
    """Brick storage for several fields, in pages that are never reallocated.

    Page sizes grow geometrically from ``first_page_bricks`` to ``page_bricks`` (so small maps stay
    small and large maps have few pages); slots are handed out from a free list first, then from the
    high-water mark. Growth never copies: peak memory is the live pages plus the newest one.

    Copy-on-write versions (the service's read views, NOTES.md "Reads never wait for writes"):
    :meth:`freeze` returns a read-only view holding the current page tensors and marks them *shared*; the
    next write into a shared page (``scatter``, ``fill_slots``, or a kernel after :meth:`prepare_write`)
    first replaces it by a copy, so the view never changes. Untouched pages stay shared (no copy).
    """

    def __init__(
        self,
        fields: dict[str, FieldSpec],
        device: torch.device,
        page_bricks: int = PAGE_BRICKS,
        first_page_bricks: int = 1 << 10,
    ):
        self.fields = dict(fields)
        self.device = device
        self.page_bricks = page_bricks
        self.first_page_bricks = min(first_page_bricks, page_bricks)
        self.pages: dict[str, list[torch.Tensor]] = {k: [] for k in fields}
        self.page_starts = [0]  # first slot of each page, then the capacity
        self.high_water = 0
        self._free = torch.zeros(0, dtype=torch.int64, device=device)
        self._tables: dict[str, torch.Tensor] | None = None
        self._starts_t: torch.Tensor | None = None
        self._shared: dict[str, list[bool]] = {k: [] for k in fields}  # per page: held by a frozen view
        self.read_only = False  # a view from freeze(): writes raise
        self.cow_bytes = 0  # bytes copied by copy-on-write so far (the cost of publishing versions)
        self.cow_seconds = 0.0  # host time spent copying them (on CUDA: launching the copies)

    # -- capacity -----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.page_starts[-1]

    @property
    def num_allocated(self) -> int:
        return self.high_water - self._free.numel()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for pages in self.pages.values() for p in pages)

    def _add_page(self) -> None:
        n = len(self.page_starts) - 1
        size = min(self.first_page_bricks << n, self.page_bricks)
        for name, spec in self.fields.items():
            page = torch.empty((size, BRICK_VOXELS, *spec.shape), dtype=spec.dtype, device=self.device)
            self.pages[name].append(page)
            self._shared[name].append(False)
        self.page_starts.append(self.page_starts[-1] + size)
        self._tables = None
        self._starts_t = None

    # -- versions (copy-on-write) ---------------------------------------------------------------------
    def freeze(self) -> PagedPool:
        """A read-only view of the pool as it is now (O(pages), no copy). Writes to this pool afterwards copy
        the pages they touch first, so the view keeps its contents for as long as it is referenced."""
        v = copy.copy(self)
        v.pages = {k: list(p) for k, p in self.pages.items()}
        v.page_starts = list(self.page_starts)
        v._shared = {k: [True] * len(p) for k, p in self.pages.items()}
        v.read_only = True
        for k, p in self.pages.items():
            self._shared[k] = [True] * len(p)
        return v

    def prepare_write(self, name: str, slots: torch.Tensor) -> None:
        """Make the pages of ``name`` that hold ``slots`` private to this pool (copy those a view shares);
        a kernel that writes pages through :meth:`page_table` calls this first. One host sync while some
        page is shared (to find the pages), none otherwise; on CUDA none while the field's shared pages
        total at most ``COW_ALL_BYTES`` (they are all copied)."""
        if self.read_only:
            raise RuntimeError("PagedPool: this is a read-only view (freeze()); it cannot be written")
        shared = self._shared[name]
        if not slots.numel() or not any(shared):
            return
        pages = self.pages[name]
        if len(shared) == 1:
            touched = [0]
        elif (
            self.device.type == "cuda"
            and sum(pages[p].numel() * pages[p].element_size() for p in range(len(shared)) if shared[p])
            <= COW_ALL_BYTES
        ):
            touched = range(len(shared))
        else:
            page = torch.searchsorted(
                self.page_start_table()[1:], slots.reshape(-1).to(torch.int64), right=True
            )
            touched = torch.unique(page).tolist()
        t = time.perf_counter()
        for p in touched:
            if p < len(shared) and shared[p]:
                old = self.pages[name][p]
                self.pages[name][p] = old.clone()
                shared[p] = False
                self.cow_bytes += old.numel() * old.element_size()
                self._tables = None
        self.cow_seconds += time.perf_counter() - t

    def alloc(self, n: int) -> torch.Tensor:
        """int64 ``[n]`` fresh slots, their voxels set to each field's fill value."""
        if n <= 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        take = min(n, self._free.numel())
        reused = self._free[self._free.numel() - take :]
        self._free = self._free[: self._free.numel() - take]
        fresh_n = n - take
        while self.high_water + fresh_n > self.capacity:
            self._add_page()
        fresh = torch.arange(self.high_water, self.high_water + fresh_n, device=self.device)
        self.high_water += fresh_n
        slots = torch.cat((reused, fresh))
        for name, spec in self.fields.items():
            self.fill_slots(name, slots, spec.fill)
        return slots

    def release(self, slots: torch.Tensor) -> None:
        """Return slots to the free list (their contents become garbage)."""
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(torch.int64)))

    # -- access (torch path; Triton kernels use ``page_table``) ---------------------------------------
    def page_table(self, name: str) -> torch.Tensor:
        """int64 ``[pages]``: data pointers of the field's pages (for Triton kernels)."""
        if self._tables is None:
            self._tables = {
                k: host_to_device(torch.tensor([p.data_ptr() for p in v], dtype=torch.int64), self.device)
                for k, v in self.pages.items()
            }
        return self._tables[name]

    def page_start_table(self) -> torch.Tensor:
        """int64 ``[pages + 1]``: the first slot of each page, then the capacity (for Triton kernels)."""
        if self._starts_t is None:
            self._starts_t = host_to_device(torch.tensor(self.page_starts, dtype=torch.int64), self.device)
        return self._starts_t

    def _groups(self, slots: torch.Tensor):
        """(page, selector, first slot of the page) covering ``slots`` (selector None = all)."""
        if slots.numel() == 0:
            return
        if len(self.page_starts) == 2:
            yield 0, None, 0
            return
        page = torch.searchsorted(self.page_start_table()[1:], slots, right=True)
        for p in torch.unique(page).tolist():
            yield p, (page == p).nonzero().squeeze(1), self.page_starts[p]

    def _triton(self) -> bool:
        return len(self.page_starts) > 2 and use_triton(self.device)

    def gather(self, name: str, slots: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Values of ``name`` at (slot, offset) pairs (``[M, *C]``), or whole bricks (``[M, 64, *C]``)."""
        spec = self.fields[name]
        if self._triton():
            from .kernels.triton_paged import paged_gather

            return paged_gather(
                self.page_table(name), self.page_start_table(), slots, offsets, spec.dtype, spec.shape
            )
        shape = (slots.numel(), *(() if offsets is not None else (BRICK_VOXELS,)), *spec.shape)
        out = torch.empty(shape, dtype=spec.dtype, device=self.device)
        for p, sel, start in self._groups(slots):
            s = slots if sel is None else slots[sel]
            o = None if offsets is None else (offsets if sel is None else offsets[sel])
            local = s - start
            vals = self.pages[name][p][local] if o is None else self.pages[name][p][local, o]
            if sel is None:
                out = vals
            else:
                out[sel] = vals
        return out

    def scatter(
        self, name: str, slots: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor | None = None
    ):
        """Write ``values`` at (slot, offset) pairs, or whole bricks when ``offsets`` is None."""
        self.prepare_write(name, slots)
        if self._triton():
            from .kernels.triton_paged import paged_scatter

            spec = self.fields[name]
            shape = (slots.numel(), *(() if offsets is not None else (BRICK_VOXELS,)), *spec.shape)
            v = values.to(spec.dtype).expand(shape).contiguous()
            paged_scatter(self.page_table(name), self.page_start_table(), slots, offsets, v)
            return
        for p, sel, start in self._groups(slots):
            s = slots if sel is None else slots[sel]
            v = values if sel is None else values[sel]
            local = s - start
            if offsets is None:
                self.pages[name][p][local] = v.to(self.fields[name].dtype)
            else:
                o = offsets if sel is None else offsets[sel]
                self.pages[name][p][local, o] = v.to(self.fields[name].dtype)

    def fill_slots(self, name: str, slots: torch.Tensor, value) -> None:
        self.prepare_write(name, slots)
        if self._triton():
            spec = self.fields[name]
            v = torch.full((1,), value, dtype=spec.dtype, device=self.device)
            self.scatter(name, slots, v.reshape((1,) * (2 + len(spec.shape))))
            return
        for p, sel, start in self._groups(slots):
            s = slots if sel is None else slots[sel]
            # index_fill_: the scalar is a kernel argument (``page[idx] = value`` copies it from the host)
            self.pages[name][p].index_fill_(0, s - start, value)


def _s64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


# the 4x4 (j, k) block of a brick inside a 64-bit leaf word (bit j*8 + k), for (bj, bk) in {0,1}^2
_WORD_PATTERNS = [
    _s64(sum(1 << ((4 * bj + j) * 8 + 4 * bk + k) for j in range(4) for k in range(4)))
    for bj in range(2)
    for bk in range(2)
]
_PATTERNS: dict[torch.device, torch.Tensor] = {}


def _word_patterns(device: torch.device) -> torch.Tensor:
    t = _PATTERNS.get(device)
    if t is None:
        t = torch.tensor(_WORD_PATTERNS, dtype=torch.int64, device=device)
        _PATTERNS[device] = t
    return t


def brick_masks(present: torch.Tensor) -> torch.Tensor:
    """Leaf masks int64 ``[L, 8]`` of the voxels of the present bricks (bool ``[L, 8]``, brick index
    ``bi << 2 | bj << 1 | bk``): brick ``bi`` covers words ``4 bi .. 4 bi + 3`` with a fixed 4x4 pattern."""
    p = present.to(torch.int64).reshape(-1, 2, 4)  # [L, bi, (bj, bk)]
    w = (p * _word_patterns(present.device)).sum(dim=2)  # disjoint patterns: sum == or
    return w.repeat_interleave(4, dim=1)


class BrickLayer:
    """A map layer: which bricks exist (``grid``) and where their voxels live (``slots`` into ``pool``)."""

    def __init__(self, fields: dict[str, FieldSpec], device: torch.device, page_bricks: int = PAGE_BRICKS):
        self.device = device
        self.grid = IndexGrid.empty(device)
        self.slots = torch.zeros((0, 8), dtype=torch.int32, device=device)
        self.pool = PagedPool(fields, device, page_bricks)
        self.version = 0
        # change tracking for incremental consumers (meshing): the layer version at which each brick was
        # last written (leaf-level sidecar like ``slots``), and a log of removed bricks
        self.brick_versions = torch.zeros((0, 8), dtype=torch.int64, device=device)
        self.removed_log: list[tuple[int, torch.Tensor]] = []
        self.removed_log_limit = 1024
        self._topology_shared = False  # slots / brick_versions are held by a frozen view: copy before writing

    def frozen(self) -> BrickLayer:
        """A read-only view of the layer as it is now: its grid (immutable), slot and version tables, and a
        frozen pool (:meth:`PagedPool.freeze`). Later writes to this layer copy what they change, so the view
        keeps answering for this version (the service publishes one per batch)."""
        v = copy.copy(self)
        v.pool = self.pool.freeze()
        v.removed_log = list(self.removed_log)
        self._topology_shared = True
        return v

    @property
    def num_bricks(self) -> int:
        return self.pool.num_allocated

    @property
    def nbytes(self) -> int:
        return self.grid.nbytes + self.slots.numel() * self.slots.element_size() + self.pool.nbytes

    # -- grow / merge / inject ------------------------------------------------------------------------
    def allocate(self, brick_ijk: torch.Tensor) -> torch.Tensor:
        """Make sure the bricks (unique int64 ``[M, 3]``) exist; return their slots (int64 ``[M]``).

        :meth:`allocate_kept` with every brick kept: one host sync (three sizes read together)."""
        return self.allocate_kept(brick_ijk)[1]

    def allocate_kept(
        self, brick_ijk: torch.Tensor, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Make sure the bricks flagged in bool ``[M]`` ``keep`` (all when None) of the unique int64
        ``[M, 3]`` ``brick_ijk`` exist; return (int64 ``[K]`` rows of the kept bricks, in input order; their
        slots, int64 ``[K]``). Bricks not kept are neither allocated nor marked written.

        All on the device, then **one host sync**: a vector of three sizes (new leaves, new bricks, kept
        bricks), which the sorted leaf layout and the pool need on the host. Existing bricks are found by
        binary search in the layer's leaf keys; the new leaves are the distinct leaf keys of the missing
        bricks (one sort of the frame's ``M`` keys, no ``torch.unique``), spliced into the sorted keys
        (:func:`mapper.kernels.setops.insert_sorted_keys`); the k-th missing brick (input order) takes the
        k-th fresh slot of :meth:`PagedPool.alloc`. With no new leaf the keys and the tile index are reused
        and the slot table is written in place; with no new brick the grid is unchanged. What stays O(leaves)
        per frame with new leaves: the re-layout of the leaf keys, masks, slot and version tables.
        """
        dev = self.device
        m = brick_ijk.shape[0]
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        if m == 0:
            return z, z
        old = self.grid.leaves
        la = old.keys.numel()
        lk = encode_leaf_keys(brick_ijk >> 1)
        b = brick_in_leaf(brick_ijk << 2)
        if la:
            in_old = lookup_leaves(old.keys, lk)
            cur = self.slots[in_old.clamp(min=0), b].to(torch.int64)
            cur = torch.where(in_old >= 0, cur, -1)
        else:
            in_old = torch.full_like(lk, -1)
            cur = in_old
        kept = torch.ones(m, dtype=torch.bool, device=dev) if keep is None else keep.to(torch.bool)
        missing = kept & (cur < 0)
        # new leaves: the distinct leaf keys of missing bricks without a leaf (the others sort last)
        sk, order = torch.sort(torch.where(missing & (in_old < 0), lk, _KEY_SENTINEL))
        first = sk != _KEY_SENTINEL
        first[1:] &= sk[1:] != sk[:-1]
        leaf_rank_sorted = torch.cumsum(first, 0) - 1
        brick_rank = torch.cumsum(missing, 0) - 1
        kept_rank = torch.cumsum(kept, 0) - 1
        sizes = torch.stack((leaf_rank_sorted[-1], brick_rank[-1], kept_rank[-1])) + 1
        n_leaves, n_bricks, n_kept = sizes.tolist()  # the one host sync of the allocation
        if n_kept == 0:
            return z, z
        slots, bver = self.slots, self.brick_versions
        leaf = in_old
        if n_leaves:
            new_keys = torch.empty(n_leaves + 1, dtype=torch.int64, device=dev)
            new_keys[torch.where(first, leaf_rank_sorted, n_leaves)] = sk  # the last row collects the rest
            keys, pos_old, pos_new = insert_sorted_keys(old.keys, new_keys[:n_leaves])
            slots = torch.full((keys.numel(), 8), -1, dtype=torch.int32, device=dev)
            slots[pos_old] = self.slots
            bver = torch.full((keys.numel(), 8), -1, dtype=torch.int64, device=dev)
            bver[pos_old] = self.brick_versions
            leaf_rank = torch.empty_like(leaf_rank_sorted)
            leaf_rank[order] = leaf_rank_sorted
            at_new = pos_new[leaf_rank.clamp(0, n_leaves - 1)]
            leaf = torch.where(in_old >= 0, pos_old[in_old.clamp(min=0)], at_new) if la else at_new
        elif self._topology_shared:  # written in place below: a frozen view holds these
            slots, bver = slots.clone(), bver.clone()
        self._topology_shared = False
        slot = cur
        if n_bricks:
            fresh = self.pool.alloc(n_bricks)
            slot = torch.where(missing, fresh[brick_rank.clamp(0, n_bricks - 1)], cur)
        self.version += 1
        # every kept brick has its own cell now; a row not kept repeats the write of a kept row (same cell,
        # same value: no conflicting duplicates, no boolean mask)
        flat = leaf.clamp(min=0) * 8 + b
        if keep is not None:
            j = kept.to(torch.uint8).argmax().reshape(1)  # gathered, not ``x[j]``: a 0-dim index is read back
            flat = torch.where(kept, flat, flat.index_select(0, j))
            slot = torch.where(kept, slot, slot.index_select(0, j))
        if n_bricks:
            slots.view(-1)[flat] = slot.to(torch.int32)
        bver.view(-1).scatter_(0, flat, self.version)  # a scalar kernel argument (no host-to-device copy)
        if n_bricks:
            keys = keys if n_leaves else old.keys
            tiles = None if n_leaves else self.grid.cached_tiles
            self.grid = IndexGrid(make_leaves(keys, brick_masks(slots >= 0)), tiles)
        self.slots, self.brick_versions = slots, bver
        if keep is None:
            return torch.arange(m, dtype=torch.int64, device=dev), slot
        rows = torch.empty(n_kept + 1, dtype=torch.int64, device=dev)
        rows[torch.where(kept, kept_rank, n_kept)] = torch.arange(m, dtype=torch.int64, device=dev)
        rows = rows[:n_kept]
        return rows, slot[rows]

    def touch(self, brick_ijk: torch.Tensor) -> None:
        """Record that the (existing) bricks' voxels changed without an allocation (decay, clearing)."""
        if brick_ijk.shape[0] == 0:
            return
        leaf = self.grid.ijk_to_leaf(brick_ijk << 2)
        ok = leaf >= 0
        self.version += 1
        if self._topology_shared:
            self.brick_versions = self.brick_versions.clone()
            self._topology_shared = False
        self.brick_versions[leaf[ok], brick_in_leaf(brick_ijk[ok] << 2)] = self.version

    def removed_since(self, version: int) -> torch.Tensor | None:
        """Bricks removed after ``version`` (int64 ``[R, 3]``), or None when the removal log no longer
        reaches back that far (the caller must start over)."""
        if (
            self.removed_log
            and version < self.removed_log[0][0] - 1
            and len(self.removed_log) >= self.removed_log_limit
        ):
            return None
        removed = [r for v, r in self.removed_log if v > version]
        return torch.cat(removed) if removed else torch.zeros((0, 3), dtype=torch.int64, device=self.device)

    def changed_since(self, version: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bricks written after ``version`` (int64 ``[C, 3]``) and bricks removed after it (``[R, 3]``), or
        None when the removal log no longer reaches back that far (the caller must start over)."""
        removed = self.removed_since(version)
        if removed is None:
            return None
        leaf, b = ((self.slots >= 0) & (self.brick_versions > version)).nonzero(as_tuple=True)
        lc = self.grid.leaf_ijk.to(torch.int64)[leaf]
        changed = lc * 2 + torch.stack(((b >> 2) & 1, (b >> 1) & 1, b & 1), dim=1)
        return changed, removed

    # -- lookup ---------------------------------------------------------------------------------------
    def voxel_slots(self, ijk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot int64, offset int64) of int64 ``[M, 3]`` voxels; slot -1 where the brick is absent."""
        if self.grid.num_leaves == 0:
            return torch.full((ijk.shape[0],), -1, dtype=torch.int64, device=ijk.device), brick_offsets(ijk)
        leaf = self.grid.ijk_to_leaf(ijk)
        b = brick_in_leaf(ijk)
        slot = torch.where(
            leaf >= 0, self.slots[leaf.clamp(min=0), b].to(torch.int64), torch.full_like(leaf, -1)
        )
        return slot, brick_offsets(ijk)

    def brick_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All allocated bricks: (brick coordinates int64 ``[B, 3]``, slots int64 ``[B]``), leaf order."""
        if self.grid.num_leaves == 0:
            z = torch.zeros(0, dtype=torch.int64, device=self.device)
            return z.reshape(0, 3), z
        leaf, b = (self.slots >= 0).nonzero(as_tuple=True)
        lc = self.grid.leaf_ijk.to(torch.int64)[leaf]
        bc = lc * 2 + torch.stack(((b >> 2) & 1, (b >> 1) & 1, b & 1), dim=1)
        return bc, self.slots[leaf, b].to(torch.int64)

    # -- removal --------------------------------------------------------------------------------------
    def release_bricks(self, drop: torch.Tensor) -> None:
        """Free the bricks flagged in bool ``[L, 8]`` ``drop`` and prune them from the grid."""
        drop = drop & (self.slots >= 0)
        if not bool(drop.any()):
            return
        self.pool.release(self.slots[drop].to(torch.int64))
        leaf, b = drop.nonzero(as_tuple=True)
        lc = self.grid.leaf_ijk.to(torch.int64)[leaf]
        gone = lc * 2 + torch.stack(((b >> 2) & 1, (b >> 1) & 1, b & 1), dim=1)
        slots = self.slots.clone()
        slots[drop] = -1
        keep_leaf = (slots >= 0).any(dim=1)
        masks = brick_masks(slots >= 0)
        self.grid = IndexGrid._from_leaves(self.grid.leaves.keys[keep_leaf], masks[keep_leaf])
        self.slots = slots[keep_leaf].contiguous()
        self.brick_versions = self.brick_versions[keep_leaf].contiguous()
        self.version += 1
        self.removed_log.append((self.version, gone))
        if len(self.removed_log) > self.removed_log_limit:
            self.removed_log.pop(0)

    def clear(self) -> None:
        self.release_bricks(torch.ones_like(self.slots, dtype=torch.bool))

    # -- persistence ----------------------------------------------------------------------------------
    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The layer as flat tensors (compacted: only allocated bricks, in slot order of a fresh pool)."""
        bricks, slots = self.brick_table()
        out = {f"{prefix}.bricks": bricks.cpu()}
        for name in self.pool.fields:
            out[f"{prefix}.{name}"] = (
                self.pool.gather(name, slots).cpu()
                if slots.numel()
                else torch.zeros(
                    (0, BRICK_VOXELS, *self.pool.fields[name].shape), dtype=self.pool.fields[name].dtype
                )
            )
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Restore from :meth:`state_tensors` into this (empty) layer."""
        bricks = tensors[f"{prefix}.bricks"].to(self.device, torch.int64)
        if bricks.shape[0] == 0:
            return
        from .integrators.common import unique_voxels

        if unique_voxels(bricks).shape[0] != bricks.shape[0]:
            raise ValueError(f"{prefix}.bricks: duplicate bricks in the snapshot")
        slots = self.allocate(bricks)
        for name, spec in self.pool.fields.items():
            t = tensors[f"{prefix}.{name}"].to(self.device, spec.dtype)
            if tuple(t.shape) != (bricks.shape[0], BRICK_VOXELS, *spec.shape):
                raise ValueError(
                    f"{prefix}.{name}: shape {list(t.shape)} does not match {bricks.shape[0]} bricks"
                )
            self.pool.scatter(name, slots, t)

    # -- views ----------------------------------------------------------------------------------------
    def kernel_view(self, names) -> LayerView | None:
        """What a kernel reading the fields ``names`` by voxel needs (``mapper.kernels.views.LayerView``),
        or None when the layer has no bricks."""
        if self.grid.num_leaves == 0 or self.pool.capacity == 0:
            return None
        pool = self.pool
        return LayerView(
            self.grid.tiles,
            self.slots,
            pool.page_start_table(),
            len(pool.page_starts) - 1,
            {n: pool.page_table(n) for n in names},
            self.grid.num_leaves,
            pool.capacity,
        )

    def voxel_view(self, names) -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """The layer as (grid of all allocated voxels, {field: tensor [N, *C] in the grid's voxel order})."""
        g = self.grid
        if g.num_voxels == 0:
            return g, {
                n: torch.zeros(
                    (0, *self.pool.fields[n].shape), dtype=self.pool.fields[n].dtype, device=self.device
                )
                for n in names
            }
        ijk = g.ijk.to(torch.int64)
        slot, off = self.voxel_slots(ijk)
        return g, {n: self.pool.gather(n, slot, off) for n in names}

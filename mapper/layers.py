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
from .kernels import alloc
from .kernels.alloc import brick_masks
from .kernels.dispatch import compiled
from .kernels.keys import unique_voxels
from .kernels.topology import make_leaves
from .kernels.transfer import host_to_device
from .kernels.views import LayerView

BRICK_VOXELS = 64
PAGE_BRICKS = 1 << 14  # 2^20 voxels per page
# copy-on-write on CUDA: while a field's shared pages total at most this, a write copies all of them at once
# (no host sync to find the pages it touches; HBM copies ~1.5 TB/s); above it, only the touched pages
COW_ALL_BYTES = 256 << 20


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
        self._fill_values: dict[tuple, torch.Tensor] = {}  # (field, value) -> the value on the device

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
        return len(self.page_starts) > 2 and compiled(self.device)

    def gather(self, name: str, slots: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Values of ``name`` at (slot, offset) pairs (``[M, *C]``), or whole bricks (``[M, 64, *C]``)."""
        spec = self.fields[name]
        if self._triton():
            # lazy: Triton is optional (a CPU install imports this module without it)
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
            # lazy: Triton is optional (a CPU install imports this module without it)
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
            # lazy: Triton is optional (a CPU install imports this module without it)
            from .kernels.triton_paged import paged_fill

            spec = self.fields[name]
            key = (name, repr(value))  # NaN != NaN: key by its text
            v = self._fill_values.get(key)
            if v is None:  # made once per field and value: no host-to-device copy per frame
                c = 1
                for d in spec.shape:
                    c *= d
                v = self._fill_values[key] = torch.full((c,), value, dtype=spec.dtype, device=self.device)
            paged_fill(self.page_table(name), self.page_start_table(), slots, v)
            return
        for p, sel, start in self._groups(slots):
            s = slots if sel is None else slots[sel]
            # index_fill_: the scalar is a kernel argument (``page[idx] = value`` copies it from the host)
            self.pages[name][p].index_fill_(0, s - start, value)


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
        bricks), which the sorted leaf layout and the pool need on the host. The steps are the operators of
        :mod:`mapper.kernels.alloc` (five Triton launches and a sort on CUDA): existing bricks are found by
        binary search in the layer's leaf keys; the new leaves are the distinct leaf keys of the missing
        bricks (one sort of the frame's ``M`` keys, no ``torch.unique``), spliced into the sorted keys with
        the leaf tables (one pass); the k-th missing brick (input order) takes the k-th fresh slot of
        :meth:`PagedPool.alloc` and ORs its voxels into its leaf's mask. With no new leaf the keys and the
        tile index are reused and the slot table is written in place; with no new brick the grid is
        unchanged and nothing is O(leaves). What stays O(leaves) per frame: with new bricks the copy of the
        masks and the voxel offsets (the grid is immutable); with new leaves the re-layout of keys, masks,
        slot and version tables.
        """
        dev = self.device
        m = brick_ijk.shape[0]
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        if m == 0:
            return z, z
        old = self.grid.leaves
        in_old, cur, sortkey, b, missing, kept = alloc.alloc_lookup(brick_ijk, keep, old.keys, self.slots)
        sk, order = torch.sort(sortkey)
        sizes, new_keys, leaf_rank, brick_rank, rows = alloc.alloc_ranks(sk, order, missing, kept)
        n_leaves, n_bricks, n_kept = sizes.tolist()  # the one host sync of the allocation
        if n_kept == 0:
            return z, z
        slots, bver, masks = self.slots, self.brick_versions, old.masks
        keys, pos_old, pos_new = old.keys, None, z
        if n_leaves:
            keys, slots, bver, masks, pos_old, pos_new = alloc.relayout_leaves(
                old.keys, new_keys[:n_leaves], slots, bver, masks
            )
        else:
            if self._topology_shared:  # written in place below: a frozen view holds these
                slots, bver = slots.clone(), bver.clone()
            if n_bricks:  # the grid is immutable (views and derived caches hold it): new masks
                masks = masks.clone()
        self._topology_shared = False
        fresh = self.pool.alloc(n_bricks) if n_bricks else z
        self.version += 1
        slot = alloc.write_bricks(
            in_old, pos_old, pos_new, leaf_rank, b, missing, kept, cur, fresh, brick_rank, self.version,
            (slots, bver, masks),
        )  # fmt: skip
        if n_bricks:
            tiles = None if n_leaves else self.grid.cached_tiles
            self.grid = IndexGrid(make_leaves(keys, masks), tiles)
        self.slots, self.brick_versions = slots, bver
        if n_kept == m:
            return rows, slot
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

"""Marching cubes as Triton kernels over a list of bricks (imported lazily: triton is optional).

Same contract as :func:`mapper.kernels.marching.marching_cubes_torch` (the reference), in four steps:

1. ``_mc_count_kernel``: one lane per cell (64 per brick): the 8 corners through the 27-neighbour slot table
   and the paged pool, the case (0 where a corner is unobserved) and the triangle count from the case table,
   which lives in device memory.
2. an exclusive prefix sum of the counts (``torch.cumsum``); the total is the one size read back.
3. ``_mc_write_kernel``: each cell writes the edge keys of its triangles' corners at its offset, in table
   order, so the faces come out bricks-in-order, cells-in-order, as the reference's.
4. weld: ``torch.unique`` of the corner keys (the sorted keys are the vertex order; the inverse is the face
   array: vertices shared by neighbouring cells and bricks get one id), then ``_mc_vertex_kernel``: one lane
   per vertex: position (interpolated on its lattice edge), normal (TSDF gradient at both ends, central or
   one-sided differences, interpolated) and colour.

The cost is linear in the bricks passed: an incremental mesh costs what the changed bricks cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .keys import BLOCK_KEY_BIAS as BLOCK_BIAS
from .keys import BLOCK_KEY_BITS as BLOCK_BITS
from .keys import EDGE_IJ_BIAS as IJ_BIAS
from .keys import EDGE_IJ_BITS as IJ_BITS
from .keys import EDGE_K_BIAS as K_BIAS
from .keys import EDGE_K_BITS as K_BITS
from .keys import LEAF_POS_BITS, TILE_AXIS_BITS, TILE_BIAS, VOXEL_LIMIT
from .mesh_result import empty_result
from .triton_ops import _leaf_in_tile
from .triton_paged import n_iter, page_base, page_of
from .triton_query import _find_tile_loop

# No recompilation mid-stream: sizes are ``do_not_specialize`` and the binary searches run a fixed number of
# steps (extra steps are no-ops), so a growing map (more pages, more tiles) keeps the compiled kernels.
PAGE_STEPS = 17  # pages < 2^16
TILE_STEPS = 33  # tiles < 2^32
LEAF_STEPS = 24  # leaf keys < 2^23 (the graphs' copy of the grid holds 2^19)


@triton.jit(do_not_specialize=["n_pages", "n"])
def _mc_pages_kernel(
    slots_ptr, starts_ptr, n_pages, page_ptr, base_ptr, n, NP: tl.constexpr, BLOCK: tl.constexpr
):
    """Per neighbour slot: its pool page (-1 if absent) and the element index of its first voxel in that
    page, so the cell and vertex kernels address voxels without a page search."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    slot = tl.load(slots_ptr + i, mask=m, other=-1)
    has = m & (slot >= 0)
    page, start = page_of(starts_ptr, n_pages, slot, has, NP)
    tl.store(page_ptr + i, tl.where(has, page, -1), mask=m)
    tl.store(base_ptr + i, tl.where(has, (slot - start) * 64, 0), mask=m)


@triton.jit(do_not_specialize=["n"])
def _mc_changed_kernel(
    flag_ptr, pos_ptr, lkeys_ptr, out_ptr, n,
    AXB: tl.constexpr, TBIAS: tl.constexpr, LPB: tl.constexpr, BB: tl.constexpr, BBIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """For every changed (leaf, brick) entry: the block keys of its 27 neighbours at 27 * (its rank)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    ch = m & (tl.load(flag_ptr + i, mask=m, other=0) != 0)
    pos = tl.load(pos_ptr + i, mask=ch, other=1) - 1
    leaf = i // 8
    b = i % 8
    key = tl.load(lkeys_ptr + leaf, mask=ch, other=0)
    tile = key >> LPB
    am = (1 << AXB) - 1
    bx = ((((tile >> (2 * AXB)) & am) - TBIAS) * 4 + ((key >> 4) & 3)) * 2 + ((b >> 2) & 1) + BBIAS
    by = ((((tile >> AXB) & am) - TBIAS) * 4 + ((key >> 2) & 3)) * 2 + ((b >> 1) & 1) + BBIAS
    bz = (((tile & am) - TBIAS) * 4 + (key & 3)) * 2 + (b & 1) + BBIAS
    for d in tl.static_range(27):
        kx = bx + (d // 9 - 1)
        ky = by + ((d // 3) % 3 - 1)
        kz = bz + (d % 3 - 1)
        tl.store(out_ptr + pos * 27 + d, (kx << (2 * BB)) | (ky << BB) | kz, mask=ch)


def changed_neighbourhood_keys_triton(changed: torch.Tensor, leaf_keys: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`mapper.kernels.marching.changed_neighbourhood_keys_torch` (one read-back:
    the number of changed bricks)."""
    flag = changed.reshape(-1).to(torch.int32)
    n = flag.numel()
    pos = torch.cumsum(flag, 0)
    c = int(pos[-1]) if n else 0
    out = torch.empty(c * 27, dtype=torch.int64, device=changed.device)
    if c == 0:
        return out
    block = 256 if changed.device.type == "cuda" else 4096
    _mc_changed_kernel[(triton.cdiv(n, block),)](
        flag, pos, leaf_keys.contiguous(), out, n, AXB=TILE_AXIS_BITS, TBIAS=TILE_BIAS, LPB=LEAF_POS_BITS,
        BB=BLOCK_BITS, BBIAS=BLOCK_BIAS, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n", "n_tiles"])
def _mc_neighbours_kernel(
    bricks_ptr, out_ptr, n, tkeys, tmask, tstart, n_tiles, slots_ptr,
    NT: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr, AXB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Pool slot (-1 if absent) of brick ``b + d`` for every brick b and each of the 27 offsets d: tile
    binary search -> leaf -> the leaf's brick-slot table (the path of ``BrickLayer.voxel_slots``)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n * 27
    b = i // 27
    d = i % 27
    x = (tl.load(bricks_ptr + b * 3 + 0, mask=m, other=0) + d // 9 - 1) * 4
    y = (tl.load(bricks_ptr + b * 3 + 1, mask=m, other=0) + (d // 3) % 3 - 1) * 4
    z = (tl.load(bricks_ptr + b * 3 + 2, mask=m, other=0) + d % 3 - 1) * 4
    ok = m & (x >= -LIMIT) & (x < LIMIT) & (y >= -LIMIT) & (y < LIMIT) & (z >= -LIMIT) & (z < LIMIT)
    tkey = (((x >> 5) + BIAS) << (2 * AXB)) | (((y >> 5) + BIAS) << AXB) | ((z >> 5) + BIAS)
    t = _find_tile_loop(tkeys, n_tiles, tkey, ok, NT)
    pos = (((x >> 3) & 3) << 4) | (((y >> 3) & 3) << 2) | ((z >> 3) & 3)
    leaf = _leaf_in_tile(t, pos, tmask, tstart)
    has = leaf >= 0
    bi = (((x >> 2) & 1) << 2) | (((y >> 2) & 1) << 1) | ((z >> 2) & 1)
    slot = tl.load(slots_ptr + leaf * 8 + bi, mask=has, other=-1).to(tl.int64)
    tl.store(out_ptr + i, slot, mask=m)


@triton.jit
def _leaf_slot(x, y, z, ok, lkeys, n_keys, slots_ptr, NS: tl.constexpr, BIAS: tl.constexpr,
               AXB: tl.constexpr, LPB: tl.constexpr):  # fmt: skip
    """Pool slot (-1 if absent) of the bricks holding voxels (x, y, z) (multiples of 4, in range where
    ``ok``): a binary search of the sorted leaf keys, then the leaf's slot table."""
    tkey = (((x >> 5) + BIAS) << (2 * AXB)) | (((y >> 5) + BIAS) << AXB) | ((z >> 5) + BIAS)
    key = (tkey << LPB) | ((((x >> 3) & 3) << 4) | (((y >> 3) & 3) << 2) | ((z >> 3) & 3))
    leaf = _find_tile_loop(lkeys, n_keys, key, ok, NS)  # a search of sorted int64 keys: the same loop
    has = leaf >= 0
    bi = (((x >> 2) & 1) << 2) | (((y >> 2) & 1) << 1) | ((z >> 2) & 1)
    return tl.load(slots_ptr + leaf * 8 + bi, mask=has, other=-1).to(tl.int64)


@triton.jit(do_not_specialize=["c", "n_keys"])
def _mc_changed_blocks_kernel(
    cpos_ptr, out_ptr, c, lkeys, n_keys, slots_ptr,
    NS: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr, AXB: tl.constexpr, LPB: tl.constexpr,
    BB: tl.constexpr, BBIAS: tl.constexpr, PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One lane per (changed brick, neighbour offset): the neighbour's block key where it exists, else PAD
    (see :func:`changed_block_keys_triton`)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < c * 27
    row = i // 27
    d = i % 27
    cp = tl.load(cpos_ptr + row, mask=m, other=-1)
    valid = m & (cp >= 0)
    cp = tl.where(valid, cp, 0)
    b = cp % 8
    key = tl.load(lkeys + cp // 8, mask=valid, other=0)
    tile = key >> LPB
    am = (1 << AXB) - 1
    bx = ((((tile >> (2 * AXB)) & am) - BIAS) * 4 + ((key >> 4) & 3)) * 2 + ((b >> 2) & 1) + d // 9 - 1
    by = ((((tile >> AXB) & am) - BIAS) * 4 + ((key >> 2) & 3)) * 2 + ((b >> 1) & 1) + (d // 3) % 3 - 1
    bz = (((tile & am) - BIAS) * 4 + (key & 3)) * 2 + (b & 1) + d % 3 - 1
    x = bx * 4
    y = by * 4
    z = bz * 4
    ok = valid & (x >= -LIMIT) & (x < LIMIT) & (y >= -LIMIT) & (y < LIMIT) & (z >= -LIMIT) & (z < LIMIT)
    slot = _leaf_slot(x, y, z, ok, lkeys, n_keys, slots_ptr, NS, BIAS, AXB, LPB)
    bk = ((bx + BBIAS) << (2 * BB)) | ((by + BBIAS) << BB) | (bz + BBIAS)
    tl.store(out_ptr + i, tl.where(ok & (slot >= 0), bk, PAD), mask=m)


def changed_block_keys_triton(cpos: torch.Tensor, leaf_keys: torch.Tensor, slot_table: torch.Tensor):
    """Triton version of :func:`mapper.kernels.marching.changed_block_keys_torch` (same arguments; one
    launch, no read-back)."""
    c = cpos.numel()
    n_keys = min(leaf_keys.numel(), slot_table.shape[0])
    out = torch.full((27 * c,), SENTINEL, dtype=torch.int64, device=cpos.device)
    if c == 0 or n_keys == 0:
        return out
    _check_leaf_count(n_keys)
    block = 256 if cpos.device.type == "cuda" else 4096
    _mc_changed_blocks_kernel[(triton.cdiv(27 * c, block),)](
        cpos.contiguous(), out, c, leaf_keys, n_keys, slot_table.contiguous(), NS=LEAF_STEPS,
        LIMIT=VOXEL_LIMIT, BIAS=TILE_BIAS, AXB=TILE_AXIS_BITS, LPB=LEAF_POS_BITS, BB=BLOCK_BITS,
        BBIAS=BLOCK_BIAS, PAD=SENTINEL, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n", "n_keys"])
def _mc_key_neighbours_kernel(
    keys_ptr, bricks_ptr, out_ptr, n, lkeys, n_keys, slots_ptr,
    NS: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr, AXB: tl.constexpr, LPB: tl.constexpr,
    BB: tl.constexpr, BBIAS: tl.constexpr, PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One lane per (block key, neighbour offset): the neighbour's slot (-1 if absent or a PAD row); the
    lanes of offset 0 also write the decoded brick (see :func:`key_block_neighbours_triton`)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n * 27
    row = i // 27
    d = i % 27
    k = tl.load(keys_ptr + row, mask=m, other=PAD)
    bm = (1 << BB) - 1
    bx = ((k >> (2 * BB)) & bm) - BBIAS
    by = ((k >> BB) & bm) - BBIAS
    bz = (k & bm) - BBIAS
    first = m & (d == 0)
    tl.store(bricks_ptr + row * 3 + 0, bx, mask=first)
    tl.store(bricks_ptr + row * 3 + 1, by, mask=first)
    tl.store(bricks_ptr + row * 3 + 2, bz, mask=first)
    x = (bx + d // 9 - 1) * 4
    y = (by + (d // 3) % 3 - 1) * 4
    z = (bz + d % 3 - 1) * 4
    ok = m & (k != PAD) & (x >= -LIMIT) & (x < LIMIT) & (y >= -LIMIT) & (y < LIMIT) & (z >= -LIMIT)
    ok = ok & (z < LIMIT)
    slot = _leaf_slot(x, y, z, ok, lkeys, n_keys, slots_ptr, NS, BIAS, AXB, LPB)
    tl.store(out_ptr + i, tl.where(ok, slot, -1), mask=m)


def key_block_neighbours_triton(keys: torch.Tensor, leaf_keys: torch.Tensor, slot_table: torch.Tensor):
    """Triton version of :func:`mapper.kernels.marching.key_block_neighbours_torch` (same arguments; one
    launch, no read-back)."""
    m = keys.numel()
    dev = keys.device
    bricks = torch.empty((m, 3), dtype=torch.int64, device=dev)
    out = torch.full((m, 27), -1, dtype=torch.int64, device=dev)
    if m == 0:
        return bricks, out
    n_keys = min(leaf_keys.numel(), slot_table.shape[0])
    _check_leaf_count(n_keys)
    block = 256 if dev.type == "cuda" else 4096
    _mc_key_neighbours_kernel[(triton.cdiv(27 * m, block),)](
        keys.contiguous(), bricks, out, m, leaf_keys, n_keys, slot_table.contiguous(), NS=LEAF_STEPS,
        LIMIT=VOXEL_LIMIT, BIAS=TILE_BIAS, AXB=TILE_AXIS_BITS, LPB=LEAF_POS_BITS, BB=BLOCK_BITS,
        BBIAS=BLOCK_BIAS, PAD=SENTINEL, BLOCK=block,
    )  # fmt: skip
    return bricks, out


def _check_leaf_count(n_keys: int) -> None:
    if n_keys >= 1 << (LEAF_STEPS - 1):
        raise ValueError(f"leaf lookups: {n_keys} leaf keys, the search covers < 2^{LEAF_STEPS - 1}")


def neighbour_slots_triton(bricks: torch.Tensor, leaves, tiles, slot_table: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`mapper.kernels.marching.neighbour_slots_torch` (same arguments)."""
    m = bricks.shape[0]
    out = torch.empty((m, 27), dtype=torch.int64, device=bricks.device)
    if m == 0:
        return out
    if leaves.keys.numel() == 0:
        return out.fill_(-1)
    block = 256 if bricks.device.type == "cuda" else 4096
    _mc_neighbours_kernel[(triton.cdiv(m * 27, block),)](
        bricks.to(torch.int64).contiguous(), out, m, tiles.keys, tiles.masks, tiles.starts,
        tiles.keys.numel(), slot_table.contiguous(), NT=TILE_STEPS, LIMIT=VOXEL_LIMIT,
        BIAS=TILE_BIAS, AXB=TILE_AXIS_BITS, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _voxel(npage_ptr, brick, lx, ly, lz, nbase_ptr, m):
    """(present, page, element index in the page) of local voxel (lx, ly, lz) (each in [-1, 8)) of
    ``brick``, through its row of the 27-neighbour page tables (page -1: absent)."""
    n = brick * 27 + ((lx >> 2) + 1) * 9 + ((ly >> 2) + 1) * 3 + ((lz >> 2) + 1)
    page = tl.load(npage_ptr + n, mask=m, other=-1)
    has = m & (page >= 0)
    base = tl.load(nbase_ptr + n, mask=has, other=0)
    return has, page, base + (((lx & 3) << 4) | ((ly & 3) << 2) | (lz & 3))


@triton.jit
def _tsdf_obs(npage_ptr, brick, lx, ly, lz, nbase_ptr, tsdf_pt, w_pt, m):
    """(tsdf as float32, observed) of a local voxel."""
    has, page, local = _voxel(npage_ptr, brick, lx, ly, lz, nbase_ptr, m)
    t = tl.load(page_base(tsdf_pt, page, has, tl.float16) + local, mask=has, other=0.0).to(tl.float32)
    w = tl.load(page_base(w_pt, page, has, tl.float16) + local, mask=has, other=0.0).to(tl.float32)
    return t, has & (w > 0)


@triton.jit(do_not_specialize=["n_bricks"])
def _mc_count_kernel(
    npage_ptr, nbase_ptr, tsdf_pt, w_pt, count_tab_ptr, case_ptr, cnt_ptr, n_bricks,
    BB: tl.constexpr,
):  # fmt: skip
    """Case (0 unless the cell is meshed) and triangle count of the 64 cells of ``BB`` bricks per program."""
    i = tl.program_id(0).to(tl.int64) * (BB * 64) + tl.arange(0, BB * 64)
    brick = i // 64
    q = i % 64
    m = brick < n_bricks
    cx = q >> 4
    cy = (q >> 2) & 3
    cz = q & 3
    case = tl.zeros(i.shape, tl.int32)
    allobs = m
    for c in tl.static_range(8):
        t, o = _tsdf_obs(
            npage_ptr, brick, cx + (c & 1), cy + ((c >> 1) & 1), cz + ((c >> 2) & 1),
            nbase_ptr, tsdf_pt, w_pt, m,
        )  # fmt: skip
        case = case | ((t <= 0).to(tl.int32) << c)
        allobs = allobs & o
    case = tl.where(allobs & (case != 0) & (case != 255), case, 0)
    cnt = tl.load(count_tab_ptr + case, mask=m, other=0)
    tl.store(case_ptr + i, case, mask=m)
    tl.store(cnt_ptr + i, cnt, mask=m)


@triton.jit(do_not_specialize=["n_bricks"])
def _mc_write_kernel(
    bricks_ptr, case_ptr, cnt_ptr, off_ptr, tri_tab_ptr, keys_ptr, owner_ptr, n_bricks,
    T: tl.constexpr, IJB: tl.constexpr, KB: tl.constexpr, IJBIAS: tl.constexpr, KBIAS: tl.constexpr,
    BB: tl.constexpr,
):  # fmt: skip
    """Edge keys (and the writing brick) of the 3 corners of every triangle of every cell, at the cell's
    offset in the prefix sum."""
    i = tl.program_id(0).to(tl.int64) * (BB * 64) + tl.arange(0, BB * 64)
    brick = i // 64
    q = i % 64
    m = brick < n_bricks
    case = tl.load(case_ptr + i, mask=m, other=0)
    cnt = tl.load(cnt_ptr + i, mask=m, other=0)
    off = tl.load(off_ptr + i, mask=m, other=0)
    bx = tl.load(bricks_ptr + brick * 3 + 0, mask=m, other=0) * 4 + (q >> 4)
    by = tl.load(bricks_ptr + brick * 3 + 1, mask=m, other=0) * 4 + ((q >> 2) & 3)
    bz = tl.load(bricks_ptr + brick * 3 + 2, mask=m, other=0) * 4 + (q & 3)
    for t in tl.static_range(T):
        mt = m & (t < cnt)
        for j in tl.static_range(3):
            e = tl.load(tri_tab_ptr + (case * T + t) * 3 + j, mask=mt, other=0).to(tl.int64)
            axis = e >> 2
            lo = e & 1
            hi = (e >> 1) & 1
            # the edge's min corner: offset b_lo on the lower other axis, b_hi on the higher one
            vx = bx + tl.where(axis == 0, 0, lo)
            vy = by + tl.where(axis == 1, 0, tl.where(axis == 0, lo, hi))
            vz = bz + tl.where(axis == 2, 0, hi)
            key = (vx << (IJB + KB + 2)) | ((vy + IJBIAS) << (KB + 2)) | ((vz + KBIAS) << 2) | axis
            tl.store(keys_ptr + (off + t) * 3 + j, key, mask=mt)
            tl.store(owner_ptr + (off + t) * 3 + j, brick.to(tl.int32), mask=mt)


@triton.jit
def _grad_axis(npage_ptr, b, px, py, pz, tc, dx: tl.constexpr, dy: tl.constexpr, dz: tl.constexpr,
               nbase_ptr, tsdf_pt, w_pt, m):  # fmt: skip
    """One gradient component at a local voxel: central difference, or one-sided where a neighbour is
    unobserved (0 when both are)."""
    tp, op = _tsdf_obs(npage_ptr, b, px + dx, py + dy, pz + dz, nbase_ptr, tsdf_pt, w_pt, m)
    tm, om = _tsdf_obs(npage_ptr, b, px - dx, py - dy, pz - dz, nbase_ptr, tsdf_pt, w_pt, m)
    central = (tp - tm) * 0.5
    return tl.where(op & om, central, tl.where(op, tp - tc, tl.where(om, tc - tm, 0.0)))


@triton.jit
def _color_at(npage_ptr, b, px, py, pz, nbase_ptr, col_pt, cw_pt, m):
    """(r, g, b as float32, colour weight > 0) of a local voxel."""
    has, page, local = _voxel(npage_ptr, b, px, py, pz, nbase_ptr, m)
    base = page_base(col_pt, page, has, tl.uint8) + local * 3
    r = tl.load(base + 0, mask=has, other=0).to(tl.float32)
    g = tl.load(base + 1, mask=has, other=0).to(tl.float32)
    bl = tl.load(base + 2, mask=has, other=0).to(tl.float32)
    cw = tl.load(page_base(cw_pt, page, has, tl.float16) + local, mask=has, other=0.0).to(tl.float32)
    return r, g, bl, has & (cw > 0)


@triton.jit
def _round_u8(x):
    """``torch.round`` (half to even) then clamp to [0, 255] of non-negative float32."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))
    return tl.minimum(tl.maximum(r, 0.0), 255.0).to(tl.uint8)


@triton.jit(do_not_specialize=["n_vert"])
def _mc_vertex_kernel(
    keys_ptr, vb_ptr, bricks_ptr, npage_ptr, nbase_ptr, tsdf_pt, w_pt, col_pt, cw_pt, prm_ptr,
    pos_ptr, nrm_ptr, colo_ptr, n_vert,
    HAS_COLOR: tl.constexpr, IJB: tl.constexpr, KB: tl.constexpr,
    IJBIAS: tl.constexpr, KBIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Position, normal (and colour) of each welded vertex; ``vb``: a brick (index into the list) whose
    cells use the vertex (its voxels are within that brick's 27 neighbours)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_vert
    key = tl.load(keys_ptr + i, mask=m, other=0)
    b = tl.load(vb_ptr + i, mask=m, other=0).to(tl.int64)
    ax = key & 3
    vx = key >> (IJB + KB + 2)
    vy = ((key >> (KB + 2)) & ((1 << IJB) - 1)) - IJBIAS
    vz = ((key >> 2) & ((1 << KB) - 1)) - KBIAS
    gx = tl.load(bricks_ptr + b * 3 + 0, mask=m, other=0) * 4
    gy = tl.load(bricks_ptr + b * 3 + 1, mask=m, other=0) * 4
    gz = tl.load(bricks_ptr + b * 3 + 2, mask=m, other=0) * 4
    px, py, pz = vx - gx, vy - gy, vz - gz  # local coordinates of the edge's min voxel, in [0, 4]
    ex = (ax == 0).to(tl.int64)
    ey = (ax == 1).to(tl.int64)
    ez = (ax == 2).to(tl.int64)
    qx, qy, qz = px + ex, py + ey, pz + ez
    t0, _o0 = _tsdf_obs(npage_ptr, b, px, py, pz, nbase_ptr, tsdf_pt, w_pt, m)
    t1, _o1 = _tsdf_obs(npage_ptr, b, qx, qy, qz, nbase_ptr, tsdf_pt, w_pt, m)
    den = tl.where(m, t0 - t1, 1.0)
    t = t0 / den
    s = tl.load(prm_ptr)
    t64 = t.to(tl.float64)
    x = ((vx.to(tl.float64) + 0.5) + tl.where(ax == 0, t64, 0.0)) * s
    y = ((vy.to(tl.float64) + 0.5) + tl.where(ax == 1, t64, 0.0)) * s
    z = ((vz.to(tl.float64) + 0.5) + tl.where(ax == 2, t64, 0.0)) * s
    tl.store(pos_ptr + i * 3 + 0, x.to(tl.float32), mask=m)
    tl.store(pos_ptr + i * 3 + 1, y.to(tl.float32), mask=m)
    tl.store(pos_ptr + i * 3 + 2, z.to(tl.float32), mask=m)
    a0 = _grad_axis(npage_ptr, b, px, py, pz, t0, 1, 0, 0, nbase_ptr, tsdf_pt, w_pt, m)
    a1 = _grad_axis(npage_ptr, b, px, py, pz, t0, 0, 1, 0, nbase_ptr, tsdf_pt, w_pt, m)
    a2 = _grad_axis(npage_ptr, b, px, py, pz, t0, 0, 0, 1, nbase_ptr, tsdf_pt, w_pt, m)
    c0 = _grad_axis(npage_ptr, b, qx, qy, qz, t1, 1, 0, 0, nbase_ptr, tsdf_pt, w_pt, m)
    c1 = _grad_axis(npage_ptr, b, qx, qy, qz, t1, 0, 1, 0, nbase_ptr, tsdf_pt, w_pt, m)
    c2 = _grad_axis(npage_ptr, b, qx, qy, qz, t1, 0, 0, 1, nbase_ptr, tsdf_pt, w_pt, m)
    g0 = a0 + t * (c0 - a0)
    g1 = a1 + t * (c1 - a1)
    g2 = a2 + t * (c2 - a2)
    norm = tl.sqrt_rn(g0 * g0 + g1 * g1 + g2 * g2)
    inv = tl.maximum(norm, 1e-30)
    sign = tl.where(t1 > t0, 1.0, -1.0)
    ok = norm > 0
    tl.store(nrm_ptr + i * 3 + 0, tl.where(ok, tl.div_rn(g0, inv), ex.to(tl.float32) * sign), mask=m)
    tl.store(nrm_ptr + i * 3 + 1, tl.where(ok, tl.div_rn(g1, inv), ey.to(tl.float32) * sign), mask=m)
    tl.store(nrm_ptr + i * 3 + 2, tl.where(ok, tl.div_rn(g2, inv), ez.to(tl.float32) * sign), mask=m)
    if HAS_COLOR:
        r0, gg0, b0, k0 = _color_at(npage_ptr, b, px, py, pz, nbase_ptr, col_pt, cw_pt, m)
        r1, gg1, b1, k1 = _color_at(npage_ptr, b, qx, qy, qz, nbase_ptr, col_pt, cw_pt, m)
        w0 = k0.to(tl.float32) * (1.0 - t)
        w1 = k1.to(tl.float32) * t
        ws = w0 + w1
        wd = tl.maximum(ws, 1e-30)
        has = ws > 0
        cr = tl.where(has, tl.div_rn(r0 * w0 + r1 * w1, wd), 0.0)
        cg = tl.where(has, tl.div_rn(gg0 * w0 + gg1 * w1, wd), 0.0)
        cb = tl.where(has, tl.div_rn(b0 * w0 + b1 * w1, wd), 0.0)
        tl.store(colo_ptr + i * 3 + 0, _round_u8(cr), mask=m)
        tl.store(colo_ptr + i * 3 + 1, _round_u8(cg), mask=m)
        tl.store(colo_ptr + i * 3 + 2, _round_u8(cb), mask=m)


_TABLES: dict = {}
_PARAMS: dict = {}


def _param(s: float, dev: torch.device) -> torch.Tensor:
    """The voxel size as a float64 device tensor (Triton passes Python floats as float32), cached."""
    t = _PARAMS.get((s, dev))
    if t is None:
        if len(_PARAMS) > 64:
            _PARAMS.clear()
        t = _PARAMS[(s, dev)] = torch.tensor([s], dtype=torch.float64).to(dev)
    return t


def _tables(tri_table: torch.Tensor, tri_count: torch.Tensor):
    """int32 copies of the case table on its device (cached by the source tensors' identity)."""
    k = (tri_table.data_ptr(), tri_count.data_ptr(), tri_table.device)
    t = _TABLES.get(k)
    if t is None:
        t = _TABLES[k] = (
            tri_table.to(torch.int32).contiguous().reshape(-1),
            tri_count.to(torch.int32).contiguous(),
            tri_table,
            tri_count,
        )
    return t[0], t[1]


def marching_cubes_triton(
    bricks, nbr_slots, pool, tri_table, tri_count, voxel_size_m: float, with_color: bool
):
    """Triton version of :func:`mapper.kernels.marching.marching_cubes_torch` (same arguments and results).
    Reads back two sizes: the triangle total and the welded vertex count (inside ``torch.unique``)."""
    dev = bricks.device
    m = bricks.shape[0]
    if m == 0:
        return empty_result(0, dev, with_color)
    tab, cnt_tab = _tables(tri_table, tri_count)
    T = tri_table.shape[1]
    bricks = bricks.to(torch.int64).contiguous()
    nslots = nbr_slots.to(torch.int64).contiguous()
    starts = pool.page_start_table()
    n_pages = starts.numel() - 1
    if n_iter(n_pages) > PAGE_STEPS:
        raise ValueError(f"marching cubes: {n_pages} pool pages, the page search covers < 2^16")
    npage = torch.empty((m, 27), dtype=torch.int64, device=dev)
    nbase = torch.empty((m, 27), dtype=torch.int64, device=dev)
    pblock = 256 if dev.type == "cuda" else 4096
    _mc_pages_kernel[(triton.cdiv(m * 27, pblock),)](
        nslots, starts, n_pages, npage, nbase, m * 27, NP=PAGE_STEPS, BLOCK=pblock
    )
    tsdf_pt, w_pt = pool.page_table("tsdf"), pool.page_table("weight")
    case = torch.empty(m * 64, dtype=torch.int32, device=dev)
    cnt = torch.empty(m * 64, dtype=torch.int32, device=dev)
    # on the GPU a few bricks per program; in the interpreter (CPU tensors) big blocks: fewer programs
    BB = 4 if dev.type == "cuda" else 32
    grid = (triton.cdiv(m, BB),)
    _mc_count_kernel[grid](npage, nbase, tsdf_pt, w_pt, cnt_tab, case, cnt, m, BB=BB)
    csum = torch.cumsum(cnt, 0)
    n_tri = int(csum[-1])  # the one size read back before the weld
    face_counts = cnt.view(m, 64).sum(1, dtype=torch.int64)
    if n_tri == 0:
        out = empty_result(m, dev, with_color)
        return (face_counts, *out[1:])
    off = csum - cnt
    keys = torch.empty(n_tri * 3, dtype=torch.int64, device=dev)
    owner = torch.empty(n_tri * 3, dtype=torch.int32, device=dev)
    _mc_write_kernel[grid](
        bricks, case, cnt, off, tab, keys, owner, m,
        T=T, IJB=IJ_BITS, KB=K_BITS, IJBIAS=IJ_BIAS, KBIAS=K_BIAS, BB=BB,
    )  # fmt: skip
    ukeys, inv = torch.unique(keys, return_inverse=True)
    nv = ukeys.numel()
    rep = torch.empty(nv, dtype=torch.int64, device=dev)
    rep.scatter_(0, inv, torch.arange(keys.numel(), device=dev))
    vb = owner[rep]
    pos = torch.empty((nv, 3), dtype=torch.float32, device=dev)
    nrm = torch.empty((nv, 3), dtype=torch.float32, device=dev)
    col = torch.empty((nv, 3), dtype=torch.uint8, device=dev) if with_color else pos
    col_pt = pool.page_table("color") if with_color else tsdf_pt
    cw_pt = pool.page_table("color_weight") if with_color else tsdf_pt
    prm = _param(float(voxel_size_m), dev)
    block = 128 if dev.type == "cuda" else 1024
    _mc_vertex_kernel[(triton.cdiv(nv, block),)](
        ukeys, vb, bricks, npage, nbase, tsdf_pt, w_pt, col_pt, cw_pt, prm, pos, nrm, col, nv,
        HAS_COLOR=with_color, IJB=IJ_BITS, KB=K_BITS, IJBIAS=IJ_BIAS, KBIAS=K_BIAS, BLOCK=block,
    )  # fmt: skip
    return face_counts, ukeys, pos, nrm, (col if with_color else None), inv.reshape(-1, 3)


SENTINEL = (1 << 63) - 1  # sorts after every edge key


def marching_cubes_static_triton(
    bricks, nbr_slots, n_real, starts, tsdf_pt, w_pt, col_pt, cw_pt, prm, tab, cnt_tab,
    *, tri_cap: int, with_color: bool,
):  # fmt: skip
    """:func:`marching_cubes_triton` and the mesh's block bookkeeping over fixed shapes, without a host sync
    (what a CUDA graph captures; ``mapper.mesh`` replays it for short brick lists).

    Args (all on one CUDA device, or CPU tensors under the Triton interpreter):
        bricks: int64 ``[Mb, 3]``, the first ``n_real`` sorted by block key and unique; the rest ignored.
        nbr_slots: int64 ``[Mb, 27]`` (see ``marching.marching_cubes``); rows past ``n_real`` all -1.
        n_real: int64 ``[1]``: the list's length.
        starts: int64 ``[P + 1]`` the pool's page-start table, padded with values above every slot.
        tsdf_pt, w_pt, col_pt, cw_pt: int64 ``[P]`` page tables (colour ones unused without colour).
        prm: float64 ``[1]`` voxel size in metres.
        tab: int32 ``[256 * T * 3]``, cnt_tab: int32 ``[256]``: the case table.
        tri_cap: triangles the outputs hold (the faces of cells past it are not written).
        with_color: compute vertex colours.
    Returns:
        ``(face_counts int64 [Mb], keys int64 [K], pos float32 [K, 3], nrm float32 [K, 3], col uint8
        [K, 3] (``[0, 3]`` without colour), faces int64 [tri_cap, 3], blocks int64 [Mb] (rows with faces),
        offsets int64 [Mb] (their faces' end offsets), removed int64 [Mb] (rows < n_real without faces),
        sizes int64 [5])``, ``K = 3 * tri_cap``; ``sizes`` = (triangles, vertices, blocks, removed, out of
        the edge-key range). When ``sizes[0] <= tri_cap`` and ``sizes[4] == 0``, the first ``sizes[1]``
        keys / vertices and ``sizes[0]`` faces equal :func:`marching_cubes_triton`'s arrays; otherwise the
        caller must run that op (a present brick out of the key range has no cells here).
    """
    dev = bricks.device
    m = bricks.shape[0]
    n_pages = starts.numel() - 1
    T = tab.numel() // (256 * 3)
    k = 3 * tri_cap
    # the edge-key range (mapper.mesh._check_key_range): a present brick outside it meshes nothing here
    v = bricks * 4
    out_ij = (v[:, :2] < -IJ_BIAS) | (v[:, :2] + 4 >= IJ_BIAS)
    out_k = (v[:, 2] < -K_BIAS) | (v[:, 2] + 4 >= K_BIAS)
    bad = (nbr_slots[:, 13] >= 0) & (out_ij.any(1) | out_k)
    nslots = torch.where(bad[:, None], torch.full_like(nbr_slots, -1), nbr_slots)
    # one more row, brick (0, 0, 0) without neighbours: the lanes past the vertex count read there
    nslots = torch.cat((nslots, torch.full((1, 27), -1, dtype=torch.int64, device=dev)))
    ebricks = torch.cat((bricks, torch.zeros((1, 3), dtype=torch.int64, device=dev)))
    npage = torch.empty((m + 1, 27), dtype=torch.int64, device=dev)
    nbase = torch.empty((m + 1, 27), dtype=torch.int64, device=dev)
    pblock = 256 if dev.type == "cuda" else 4096
    _mc_pages_kernel[(triton.cdiv((m + 1) * 27, pblock),)](
        nslots, starts, n_pages, npage, nbase, (m + 1) * 27, NP=PAGE_STEPS, BLOCK=pblock
    )
    case = torch.empty(m * 64, dtype=torch.int32, device=dev)
    cnt = torch.empty(m * 64, dtype=torch.int32, device=dev)
    BB = 4 if dev.type == "cuda" else 32
    grid = (triton.cdiv(m, BB),)
    _mc_count_kernel[grid](npage, nbase, tsdf_pt, w_pt, cnt_tab, case, cnt, m, BB=BB)
    csum = torch.cumsum(cnt, 0)
    off = csum - cnt
    # cells whose triangles end past the capacity write none (the caller sees sizes[0] > tri_cap)
    cnt_w = torch.where(csum <= tri_cap, cnt, torch.zeros_like(cnt))
    keys = torch.full((k,), SENTINEL, dtype=torch.int64, device=dev)
    owner = torch.zeros(k, dtype=torch.int32, device=dev)
    _mc_write_kernel[grid](
        bricks, case, cnt_w, off, tab, keys, owner, m,
        T=T, IJB=IJ_BITS, KB=K_BITS, IJBIAS=IJ_BIAS, KBIAS=K_BIAS, BB=BB,
    )  # fmt: skip
    # weld without a size: sort, first of each run of equal keys, its rank = the vertex id
    sk, perm = torch.sort(keys)
    first = sk != SENTINEL
    first[1:] &= sk[1:] != sk[:-1]
    vid = torch.cumsum(first, 0) - 1
    inv = torch.empty(k, dtype=torch.int64, device=dev).scatter_(0, perm, vid)
    # lanes past the vertex count: the min voxel of the extra row's brick (a valid read, sliced off)
    safe = (IJ_BIAS << (K_BITS + 2)) | (K_BIAS << 2)
    ukeys = _compact(first, vid, sk, torch.full((k + 1,), safe, dtype=torch.int64, device=dev))
    rep = _compact(first, vid, perm, torch.zeros(k + 1, dtype=torch.int64, device=dev))
    nv = first.sum()
    lane = torch.arange(k, device=dev)
    vb = torch.where(lane < nv, owner.index_select(0, rep), torch.full_like(owner, m))
    pos = torch.empty((k, 3), dtype=torch.float32, device=dev)
    nrm = torch.empty((k, 3), dtype=torch.float32, device=dev)
    col = torch.empty((k, 3), dtype=torch.uint8, device=dev) if with_color else pos
    block = 128 if dev.type == "cuda" else 1024
    _mc_vertex_kernel[(triton.cdiv(k, block),)](
        ukeys, vb, ebricks, npage, nbase, tsdf_pt, w_pt, col_pt, cw_pt, prm, pos, nrm, col, k,
        HAS_COLOR=with_color, IJB=IJ_BITS, KB=K_BITS, IJBIAS=IJ_BIAS, KBIAS=K_BIAS, BLOCK=block,
    )  # fmt: skip
    if not with_color:
        col = torch.zeros((0, 3), dtype=torch.uint8, device=dev)
    # blocks: rows with faces (their end offsets) and rows of the list without (removed)
    face_counts = cnt.view(m, 64).sum(1, dtype=torch.int64)
    rows = torch.arange(m, device=dev)
    has = face_counts > 0
    empty = ~has & (rows < n_real)
    blocks = _compact(has, torch.cumsum(has, 0) - 1, rows, torch.zeros(m + 1, dtype=torch.int64, device=dev))
    removed = _compact(
        empty, torch.cumsum(empty, 0) - 1, rows, torch.zeros(m + 1, dtype=torch.int64, device=dev)
    )
    offsets = torch.cumsum(face_counts, 0).index_select(0, blocks)
    sizes = torch.stack((csum[-1].to(torch.int64), nv, has.sum(), empty.sum(), bad.sum()))
    return face_counts, ukeys, pos, nrm, col, inv.view(tri_cap, 3), blocks, offsets, removed, sizes


def _compact(keep, rank, values, out):
    """``values[keep]`` at the front of ``out`` (``[N + 1]``, its tail unchanged) by their ``rank``
    (exclusive count of kept lanes before): a fixed-shape ``values[keep]``. Returns ``out[:N]``."""
    n = keep.numel()
    dst = torch.where(keep, rank, torch.full_like(rank, n))  # dropped lanes write the spare last element
    return out.scatter_(0, dst, values)[:n]


def changed_mesh_static_triton(
    cpos, leaf_keys, slot_table, starts, tsdf_pt, w_pt, col_pt, cw_pt, prm, tab, cnt_tab, *, m_cap: int,
    tri_cap: int, with_color: bool,
):  # fmt: skip
    """The blocks an incremental mesh re-meshes, and :func:`marching_cubes_static_triton` over them, over
    fixed shapes without a host sync (what ``mapper.mesh`` captures for deltas of few changed bricks).

    The blocks: the 27-neighbourhoods of the changed bricks, unique, sorted by block key, those present in
    the layer (as ``mapper.mesh.mesh_since`` with no removed brick).

    Args (one CUDA device, or CPU tensors under the Triton interpreter):
        cpos: int64 ``[Cb]``: ``leaf * 8 + brick`` of each changed brick (rows of the layer's slot table);
            -1 = padding.
        leaf_keys: int64 ``[Lc]`` the grid's leaf keys, padded with ``2^63 - 1`` (the neighbours are
            found by a binary search of them: no tile index needed).
        slot_table: int32 ``[Lc, 8]`` the layer's leaf-level slot table (rows past L unused).
        starts ... cnt_tab: as :func:`marching_cubes_static_triton`.
        m_cap: blocks the outputs hold; tri_cap, with_color: as :func:`marching_cubes_static_triton`.
    Returns:
        ``marching_cubes_static_triton``'s outputs over the ``[m_cap]`` blocks, then the blocks int64
        ``[m_cap, 3]`` (block indices in its outputs refer to these rows), and ``sizes`` int64 ``[7]``:
        its five sizes, the number of blocks and 1 when that exceeds ``m_cap`` (then the caller must run
        the eager path).
    """
    dev = cpos.device
    n = 27 * cpos.numel()
    # the block keys of the changed bricks' neighbours that exist (SENTINEL elsewhere): one kernel
    keys = changed_block_keys_triton(cpos, leaf_keys, slot_table)
    # the present blocks: unique keys, sorted (padding last)
    sk, _ = torch.sort(keys)
    first = sk != SENTINEL
    first[1:] &= sk[1:] != sk[:-1]
    n_req = first.sum()
    uk = _compact(
        first, torch.cumsum(first, 0) - 1, sk, torch.full((n + 1,), SENTINEL, dtype=torch.int64, device=dev)
    )
    if m_cap > n:  # pad (a bucket never holds more blocks than its neighbourhoods)
        uk = torch.cat((uk, torch.full((m_cap - n,), SENTINEL, dtype=torch.int64, device=dev)))
    uk = uk[:m_cap]
    # the blocks and their 27 neighbours' slots (padding rows: a brick far outside the map, no slots)
    req, nreq = key_block_neighbours_triton(uk, leaf_keys, slot_table)
    out = marching_cubes_static_triton(
        req, nreq, n_req.reshape(1), starts, tsdf_pt, w_pt, col_pt, cw_pt, prm, tab, cnt_tab,
        tri_cap=tri_cap, with_color=with_color,
    )  # fmt: skip
    sizes = torch.cat((out[-1], n_req.reshape(1), (n_req > m_cap).to(torch.int64).reshape(1)))
    return (*out[:-1], req, sizes)

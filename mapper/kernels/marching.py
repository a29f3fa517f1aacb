"""Marching cubes over a list of bricks (the operation behind :mod:`mapper.mesh`): reference and dispatch.

``marching_cubes(bricks, nbr_slots, pool, tri_table, tri_count, voxel_size_m, with_color)`` meshes the 64
cells of every brick of ``bricks`` (int64 ``[M, 3]``, sorted by block key, unique) and returns the welded
result:

* ``face_counts`` int64 ``[M]``: faces per brick;
* ``keys`` int64 ``[V]``: sorted, unique edge keys of the vertices (``mapper.mesh.edge_keys`` layout);
* ``pos`` float32 ``[V, 3]``, ``nrm`` float32 ``[V, 3]``, ``col`` uint8 ``[V, 3]`` or None;
* ``faces`` int64 ``[F, 3]``: indices into ``keys``, bricks in order, inside a brick by cell, then by table.

Inputs: ``nbr_slots`` int64 ``[M, 27]``: the pool slot of brick ``b + d`` (-1 where absent) for the 27
offsets ``d`` in ``{-1, 0, 1}^3`` (index ``(dx + 1) * 9 + (dy + 1) * 3 + dz + 1``); ``pool``: an object with
``gather(name, slots, offsets)`` (torch path) and ``page_table(name)`` / ``page_start_table()`` (Triton
path) over the fields ``tsdf``, ``weight`` (and ``color``, ``color_weight``); ``tri_table`` int64
``[256, T, 3]`` / ``tri_count`` int64 ``[256]``: the case table (generated in :mod:`mapper.mesh`).

The semantics (a cell is meshed when its 8 corners have weight > 0; inside = ``tsdf <= 0``; vertices by
linear interpolation; normals = TSDF gradient, central differences, one-sided where a neighbour is
unobserved; colours blended by the interpolation weight where ``color_weight > 0``) are documented in
:mod:`mapper.mesh`. The Triton kernels (:mod:`mapper.kernels.triton_mesh`) compute the same arrays.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .dispatch import kernel
from .keys import (
    BLOCK_KEY_BIAS,
    BLOCK_KEY_BITS,
    EDGE_IJ_BIAS,
    EDGE_IJ_BITS,
    EDGE_K_BIAS,
    EDGE_K_BITS,
    VOXEL_LIMIT,
    decode_leaf_keys,
    encode_leaf_keys,
)
from .lookup import ijk_to_leaf_torch
from .mesh_result import empty_result  # noqa: F401 (re-exported)

CORE = 5  # cells of a brick read the local voxels [0, 5)^3 (+ one layer around them for the gradients)
CHUNK_BRICKS = 2048
# edge key layout (see mapper.mesh.edge_keys) and block key layout (mapper.mesh.block_keys: brick i, j, k
# + 2^20 in 21 bits each, i major): mapper.kernels.keys owns them
IJ_BITS, K_BITS = EDGE_IJ_BITS, EDGE_K_BITS
IJ_BIAS, K_BIAS = EDGE_IJ_BIAS, EDGE_K_BIAS
BLOCK_BITS, BLOCK_BIAS = BLOCK_KEY_BITS, BLOCK_KEY_BIAS


def nbr_index(d: np.ndarray) -> np.ndarray:
    """Index into the 27-neighbour table of brick offsets ``d`` (``[..., 3]`` in {-1, 0, 1})."""
    return (d[..., 0] + 1) * 9 + (d[..., 1] + 1) * 3 + (d[..., 2] + 1)


def neighbour_offsets() -> np.ndarray:
    """int64 ``[27, 3]`` brick offsets in the order of the neighbour table."""
    r = np.arange(-1, 2)
    return np.stack(np.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3).astype(np.int64)


def edge_geometry() -> tuple[np.ndarray, np.ndarray]:
    """Per cube edge ``e = 4 * axis + b_lo + 2 * b_hi``: axis (``[12]``), min-corner offset (``[12, 3]``)."""
    axes, mins = [], []
    for axis in range(3):
        u, w = (a for a in range(3) if a != axis)
        for bits in range(4):
            o = [0, 0, 0]
            o[u], o[w] = bits & 1, bits >> 1
            axes.append(axis)
            mins.append(o)
    return np.array(axes, np.int64), np.array(mins, np.int64)


def _local_points() -> tuple[np.ndarray, np.ndarray]:
    """Local voxel coordinates a brick's cells read: the core [0, 5)^3 (C order), then the 6 x 25 points with
    one coordinate at -1 or 5; and a [7, 7, 7] lookup (coordinate + 1) -> point index (-1 if not read)."""
    pts = [(a, b, c) for a in range(CORE) for b in range(CORE) for c in range(CORE)]
    for axis in range(3):
        u, w = (a for a in range(3) if a != axis)
        for v in (-1, CORE):
            for a in range(CORE):
                for b in range(CORE):
                    p = [0, 0, 0]
                    p[axis], p[u], p[w] = v, a, b
                    pts.append(tuple(p))
    pts = np.array(pts, np.int64)
    lut = np.full((CORE + 2,) * 3, -1, np.int64)
    lut[pts[:, 0] + 1, pts[:, 1] + 1, pts[:, 2] + 1] = np.arange(pts.shape[0])
    return pts, lut


def edge_keys(voxel: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """int64 key of the lattice edge from ``voxel`` (int64 ``[N, 3]``) along ``axis`` (see mapper.mesh)."""
    return (
        (voxel[:, 0] << (IJ_BITS + K_BITS + 2))
        | ((voxel[:, 1] + IJ_BIAS) << (K_BITS + 2))
        | ((voxel[:, 2] + K_BIAS) << 2)
        | axis
    )


# The torch reference reads whole bricks (one row gather per neighbour brick and field, not one per voxel):
# the 8 bricks b + {0, 1}^3 hold the core [0, 5)^3 around a brick's min corner (the cells' corners) and
# decide which bricks have cells to mesh; only those read the 12 bricks on their lower sides (the
# gradients' -1 layer). A voxel (x, y, z) in [-1, 6)^3 around the min corner has the *dense* index
# ((x + 1) * 7 + y + 1) * 7 + z + 1 (a step along an axis is a fixed stride) and its value sits in column
# ``src[dense]`` of the brick's 20 gathered bricks (``[20 * 64]``: the 8 upper ones first).
DENSE = CORE + 2
STRIDES = (DENSE * DENSE, DENSE, 1)
UPPER = [9 * (dx + 1) + 3 * (dy + 1) + dz + 1 for dx in (0, 1) for dy in (0, 1) for dz in (0, 1)]


@dataclass(frozen=True)
class _Dense:
    nbrs: torch.Tensor  # int64 [20] 27-table index of the bricks read, the 8 UPPER ones first
    src: torch.Tensor  # int64 [343] column of each dense point in the [20 * 64] values (0 where not read)
    corner_src: torch.Tensor  # int64 [8 * 64] column (in the UPPER bricks' [8 * 64]) of corner c of cell q
    nbr: torch.Tensor  # int64 [343] 27-table index of each dense point's brick
    off: torch.Tensor  # int64 [343] in-brick offset of each dense point
    cell_edge: torch.Tensor  # int64 [64, 12] edge id ((x * 5 + y) * 5 + z) * 3 + axis of cell q's edge e
    shifts: torch.Tensor  # int64 [8, 1] corner bit of the case index


@functools.cache
def _dense(device: torch.device) -> _Dense:
    pts, _ = _local_points()
    r = np.arange(-1, CORE + 1)
    grid = np.stack(np.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3)  # [343, 3] in dense order
    nbr = nbr_index(np.floor_divide(grid, 4))
    lc = grid & 3
    off = (lc[:, 0] << 4) | (lc[:, 1] << 2) | lc[:, 2]
    read = np.zeros(len(grid), bool)
    read[((pts[:, 0] + 1) * DENSE + pts[:, 1] + 1) * DENSE + pts[:, 2] + 1] = True
    used = UPPER + sorted(set(nbr[read].tolist()) - set(UPPER))
    pos = {n: i for i, n in enumerate(used)}
    src = np.array([pos[n] * 64 + o if ok else 0 for n, o, ok in zip(nbr, off, read, strict=True)], np.int64)
    axes, mins = edge_geometry()
    cell = np.array([[q >> 4, (q >> 2) & 3, q & 3] for q in range(64)], np.int64)
    corners = np.array([[c & 1, (c >> 1) & 1, (c >> 2) & 1] for c in range(8)], np.int64)
    corner = np.stack([((cell + corners[c] + 1) * np.array(STRIDES)).sum(1) for c in range(8)])
    emin = cell[:, None, :] + mins[None]  # [64, 12, 3] in [0, 5)
    cell_edge = ((emin[..., 0] * CORE + emin[..., 1]) * CORE + emin[..., 2]) * 3 + axes[None]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    return _Dense(
        nbrs=t(used),
        src=t(src),
        corner_src=t(src[corner].reshape(-1)),
        nbr=t(nbr),
        off=t(off),
        cell_edge=t(cell_edge),
        shifts=t(np.arange(8)[:, None]),
    )


def _brick_rows(pool, name: str, slots: torch.Tensor) -> torch.Tensor:
    """``[M, N * 64]`` values of ``name`` of the bricks at int64 ``[M, N]`` ``slots`` (-1: any values)."""
    m, n = slots.shape
    return pool.gather(name, slots.clamp(min=0).reshape(-1)).reshape(m, n * 64)


def _observed(pool, slots: torch.Tensor) -> torch.Tensor:
    """bool ``[M, N * 64]``: weight > 0 in the bricks at ``slots`` (False in absent ones)."""
    obs = _brick_rows(pool, "weight", slots) > 0
    return (obs.view(*slots.shape, 64) & (slots >= 0)[:, :, None]).reshape(obs.shape)


def _chunk(bricks, nbr_slots, pool, table, count, s: float, with_color: bool):
    """Chunk-welded pieces of the cells of ``bricks``: (keys, pos, nrm, col, faces into keys) or None, and
    faces per brick."""
    c = _dense(bricks.device)
    dev = bricks.device
    m = bricks.shape[0]
    n_up = len(UPPER)
    up = nbr_slots[:, c.nbrs[:n_up]]  # [M, 8]
    t_up = _brick_rows(pool, "tsdf", up)  # [M, 512]
    o_up = _observed(pool, up)
    inside = (t_up[:, c.corner_src] <= 0).view(m, 8, 64).to(torch.int64)
    case = (inside << c.shifts).sum(1)  # [M, 64]
    all_obs = o_up[:, c.corner_src].view(m, 8, 64).all(1)
    active = all_obs & (case != 0) & (case != 255)
    bi, q = active.nonzero(as_tuple=True)  # (brick, cell) order
    cs = case[bi, q]
    cnt = count[cs]
    face_counts = torch.zeros(m, dtype=torch.int64, device=dev).index_add_(0, bi, cnt)
    n_tri = int(cnt.sum())
    if n_tri == 0:
        return None, face_counts
    # the bricks with faces read their 12 lower-side bricks too: [A, 20 * 64] values, flat
    sel, bi = torch.unique_consecutive(bi, return_inverse=True)
    low = nbr_slots[sel][:, c.nbrs[n_up:]]
    width = len(c.nbrs) * 64
    tsdf = torch.cat((t_up[sel], _brick_rows(pool, "tsdf", low)), 1).to(torch.float32).reshape(-1)
    obs = torch.cat((o_up[sel], _observed(pool, low)), 1).reshape(-1)
    slot = nbr_slots[sel]
    bsel = bricks[sel]
    cell_of = torch.repeat_interleave(torch.arange(cs.numel(), device=dev), cnt)
    first = torch.cumsum(cnt, 0) - cnt
    t_in_cell = torch.arange(n_tri, device=dev) - first[cell_of]
    edges = table[cs[cell_of], t_in_cell].reshape(-1)  # [3T]
    corner_cell = cell_of.repeat_interleave(3)
    # weld inside the chunk by an edge id per brick (local min voxel in [0, 5)^3, axis): no sort
    n_e = 3 * CORE**3
    edge_id = bi[corner_cell] * n_e + c.cell_edge[q[corner_cell], edges]
    mark = torch.zeros(sel.numel() * n_e, dtype=torch.bool, device=dev)
    mark[edge_id] = True
    uid = mark.nonzero().squeeze(1)
    inv = (torch.cumsum(mark, 0) - 1)[edge_id]
    vb = uid // n_e
    e = uid % n_e
    vax = e % 3
    lin = e // 3
    vmin = torch.stack((lin // (CORE * CORE), (lin // CORE) % CORE, lin % CORE), 1)
    eax = torch.nn.functional.one_hot(vax, 3)
    stride = torch.tensor(STRIDES, dtype=torch.int64, device=dev)
    p0 = ((vmin + 1) * stride).sum(1)  # dense index of the edge's ends
    p1 = p0 + stride[vax]
    base = vb * width
    gvox = (bsel[vb] << 2) + vmin
    ukeys = edge_keys(gvox, vax)

    def at(values, p):
        return values[base + c.src[p]]

    t0, t1 = at(tsdf, p0), at(tsdf, p1)
    t = t0 / (t0 - t1)  # in [0, 1]: exactly one end is <= 0
    pos = ((gvox.to(torch.float64) + 0.5 + t.to(torch.float64)[:, None] * eax) * s).to(torch.float32)

    def gradient(p, t_c):
        g = []
        for a in range(3):
            ip, im = p + STRIDES[a], p - STRIDES[a]
            op, om = at(obs, ip), at(obs, im)
            tp, tm = at(tsdf, ip), at(tsdf, im)
            central = (tp - tm) * 0.5
            fwd, bwd = tp - t_c, t_c - tm
            zero = torch.zeros_like(t_c)
            g.append(torch.where(op & om, central, torch.where(op, fwd, torch.where(om, bwd, zero))))
        return torch.stack(g, 1)

    g0 = gradient(p0, t0)
    g1 = gradient(p1, t1)
    g = g0 + t[:, None] * (g1 - g0)
    norm = torch.sqrt(g[:, 0] * g[:, 0] + g[:, 1] * g[:, 1] + g[:, 2] * g[:, 2])
    fallback = eax.to(torch.float32) * torch.where(t1 > t0, 1.0, -1.0)[:, None]
    nrm = torch.where((norm > 0)[:, None], g / norm.clamp(min=1e-30)[:, None], fallback)

    col = None
    if with_color:
        s0 = slot[vb, c.nbr[p0]].clamp(min=0)
        s1 = slot[vb, c.nbr[p1]].clamp(min=0)
        o0, o1 = c.off[p0], c.off[p1]
        c0 = pool.gather("color", s0, o0).to(torch.float32)
        c1 = pool.gather("color", s1, o1).to(torch.float32)
        w0 = (pool.gather("color_weight", s0, o0) > 0).to(torch.float32) * (1.0 - t)
        w1 = (pool.gather("color_weight", s1, o1) > 0).to(torch.float32) * t
        wsum = w0 + w1
        blend = (c0 * w0[:, None] + c1 * w1[:, None]) / wsum.clamp(min=1e-30)[:, None]
        blend = torch.where((wsum > 0)[:, None], blend, torch.zeros_like(blend))
        col = torch.round(blend).clamp(0, 255).to(torch.uint8)
    return (ukeys, pos, nrm, col, inv.reshape(-1, 3)), face_counts


def marching_cubes_torch(
    bricks, nbr_slots, pool, tri_table, tri_count, voxel_size_m: float, with_color: bool
):
    """Torch reference of :func:`marching_cubes` (chunks of ``CHUNK_BRICKS`` bricks, then one global weld)."""
    dev = bricks.device
    m = bricks.shape[0]
    # absent bricks have no cells (their min corners are unobserved): skip them
    idx = (nbr_slots[:, 13] >= 0).nonzero().squeeze(1)
    pieces, counts = [], []
    for start in range(0, idx.numel(), CHUNK_BRICKS):
        sl = idx[start : start + CHUNK_BRICKS]
        piece, fc = _chunk(bricks[sl], nbr_slots[sl], pool, tri_table, tri_count, voxel_size_m, with_color)
        if piece is not None:
            pieces.append(piece)
        counts.append(fc)
    if not pieces:
        return empty_result(m, dev, with_color)
    face_counts = torch.zeros(m, dtype=torch.int64, device=dev)
    face_counts[idx] = torch.cat(counts)
    keys = torch.cat([p[0] for p in pieces])
    gkeys, ginv = torch.unique(keys, return_inverse=True)
    rep = torch.empty(gkeys.numel(), dtype=torch.int64, device=dev)
    rep.scatter_(0, ginv, torch.arange(keys.numel(), device=dev))
    base, faces = 0, []
    for p in pieces:
        faces.append(ginv[base + p[4]])
        base += p[0].numel()
    pos = torch.cat([p[1] for p in pieces])[rep]
    nrm = torch.cat([p[2] for p in pieces])[rep]
    col = torch.cat([p[3] for p in pieces])[rep] if with_color else None
    return face_counts, gkeys, pos, nrm, col, torch.cat(faces)


@functools.cache
def _offsets_t(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(neighbour_offsets()).to(device)


def neighbour_slots_torch(bricks: torch.Tensor, leaves, tiles, slot_table: torch.Tensor) -> torch.Tensor:
    """int64 ``[M, 27]``: pool slot of brick ``b + d`` (-1 where absent) for the bricks ``b`` (int64
    ``[M, 3]``) and the 27 offsets ``d`` (neighbour-table order) of a brick layer given by its grid's
    ``leaves`` / ``tiles`` and its leaf-level slot table (int32 ``[L, 8]``)."""
    m = bricks.shape[0]
    if m == 0 or leaves.keys.numel() == 0:
        return torch.full((m, 27), -1, dtype=torch.int64, device=bricks.device)
    d = _offsets_t(bricks.device)
    v = (bricks[:, None, :].to(torch.int64) + d[None]).reshape(-1, 3) << 2
    leaf = ijk_to_leaf_torch(leaves, v)
    b = (((v[:, 0] >> 2) & 1) << 2) | (((v[:, 1] >> 2) & 1) << 1) | ((v[:, 2] >> 2) & 1)
    slot = torch.where(leaf >= 0, slot_table[leaf.clamp(min=0), b].to(torch.int64), torch.full_like(leaf, -1))
    return slot.reshape(m, 27)


def leaf_neighbour_slots_torch(bricks: torch.Tensor, leaf_keys: torch.Tensor, slot_table: torch.Tensor):
    """:func:`neighbour_slots_torch` by a binary search of the grid's sorted leaf keys instead of its tile
    index (what the incremental mesh's CUDA graph runs: it needs no tiles, so a frame that added leaves
    does not build them): ``leaf_keys`` int64 ``[>= L]``, sorted, entries past the grid's any key above
    every leaf key (the graph's buffer is padded with ``2^63 - 1``); ``slot_table`` int32 ``[>= L, 8]``.
    Bricks with a voxel outside ``[-VOXEL_LIMIT, VOXEL_LIMIT)`` have no slot."""
    m = bricks.shape[0]
    d = _offsets_t(bricks.device)
    v = (bricks[:, None, :].to(torch.int64) + d[None]).reshape(-1, 3) << 2
    ok = ((v >= -VOXEL_LIMIT) & (v < VOXEL_LIMIT)).all(1)
    q = encode_leaf_keys(torch.where(ok[:, None], v, torch.zeros_like(v)) >> 3)
    if leaf_keys.numel() == 0 or slot_table.shape[0] == 0:
        return torch.full((m, 27), -1, dtype=torch.int64, device=bricks.device)
    i = torch.searchsorted(leaf_keys, q).clamp(max=leaf_keys.numel() - 1)
    has = ok & (leaf_keys[i] == q)
    b = (((v[:, 0] >> 2) & 1) << 2) | (((v[:, 1] >> 2) & 1) << 1) | ((v[:, 2] >> 2) & 1)
    row = slot_table[i.clamp(max=slot_table.shape[0] - 1), b].to(torch.int64)
    slot = torch.where(has, row, torch.full_like(i, -1))
    return slot.reshape(m, 27)


KEY_PAD = (1 << 63) - 1  # pads fixed-shape lists of block keys (sorts after every key)


def changed_block_keys_torch(cpos: torch.Tensor, leaf_keys: torch.Tensor, slot_table: torch.Tensor):
    """int64 ``[27 * C]``: block key of brick ``b + d`` for each changed brick ``b`` and the 27 offsets ``d``
    (neighbour-table order) where that brick exists, ``KEY_PAD`` where not (and for padding rows).

    ``cpos``: int64 ``[C]`` ``leaf * 8 + brick`` of the changed bricks (rows of the slot table), -1 =
    padding; ``leaf_keys`` / ``slot_table``: as :func:`leaf_neighbour_slots_torch`. (The incremental mesh's
    graph: the present blocks of the changed bricks' neighbourhoods, before their sort.)"""
    c = cpos.numel()
    valid = cpos >= 0
    cp = cpos.clamp(min=0)
    b = cp % 8
    if leaf_keys.numel() == 0:
        return torch.full((27 * c,), KEY_PAD, dtype=torch.int64, device=cpos.device)
    lc = decode_leaf_keys(leaf_keys[(cp // 8).clamp(max=leaf_keys.numel() - 1)])
    bc = lc * 2 + torch.stack(((b >> 2) & 1, (b >> 1) & 1, b & 1), dim=1)
    slots = leaf_neighbour_slots_torch(bc, leaf_keys, slot_table)
    v = (bc[:, None, :] + _offsets_t(bc.device)[None]).reshape(-1, 3) + BLOCK_BIAS
    keys = (v[:, 0] << (2 * BLOCK_BITS)) | (v[:, 1] << BLOCK_BITS) | v[:, 2]
    keep = ((slots >= 0) & valid[:, None]).reshape(-1)
    return torch.where(keep, keys, torch.full_like(keys, KEY_PAD))


def key_block_neighbours_torch(keys: torch.Tensor, leaf_keys: torch.Tensor, slot_table: torch.Tensor):
    """(int64 ``[M, 3]`` bricks, int64 ``[M, 27]`` neighbour slots) of int64 ``[M]`` block keys: the keys
    decoded (``mapper.mesh.block_keys`` layout; ``KEY_PAD`` decodes to a brick far outside every map) and
    :func:`leaf_neighbour_slots_torch` of them, all -1 for ``KEY_PAD`` rows."""
    bm = (1 << BLOCK_BITS) - 1
    bricks = (
        torch.stack(((keys >> (2 * BLOCK_BITS)) & bm, (keys >> BLOCK_BITS) & bm, keys & bm), 1) - BLOCK_BIAS
    )
    slots = leaf_neighbour_slots_torch(bricks, leaf_keys, slot_table)
    return bricks, torch.where((keys != KEY_PAD)[:, None], slots, torch.full_like(slots, -1))


def changed_neighbourhood_keys_torch(changed: torch.Tensor, leaf_keys: torch.Tensor) -> torch.Tensor:
    """int64 ``[27 * C]``: block keys of the 27 bricks ``b + d`` around each changed brick ``b``.

    ``changed``: bool ``[L, 8]`` (leaf, brick in leaf) of a brick layer; ``leaf_keys``: its grid's int64
    ``[L]`` leaf keys. Changed bricks in (leaf, brick) order, the 27 offsets in neighbour-table order."""
    leaf, b = changed.nonzero(as_tuple=True)
    lc = decode_leaf_keys(leaf_keys[leaf])
    bc = lc * 2 + torch.stack(((b >> 2) & 1, (b >> 1) & 1, b & 1), dim=1)
    v = (bc[:, None, :] + _offsets_t(bc.device)[None]).reshape(-1, 3) + BLOCK_BIAS
    return (v[:, 0] << (2 * BLOCK_BITS)) | (v[:, 1] << BLOCK_BITS) | v[:, 2]


def changed_neighbourhood_keys(changed: torch.Tensor, leaf_keys: torch.Tensor) -> torch.Tensor:
    """See :func:`changed_neighbourhood_keys_torch`; its Triton twin where Triton runs."""
    if changed.shape[0] == 0:
        return changed_neighbourhood_keys_torch(changed, leaf_keys)
    impl = kernel(
        changed.device, changed_neighbourhood_keys_torch, "triton_mesh:changed_neighbourhood_keys_triton"
    )
    return impl(changed, leaf_keys)


def neighbour_slots(bricks: torch.Tensor, leaves, tiles, slot_table: torch.Tensor) -> torch.Tensor:
    """See :func:`neighbour_slots_torch`: its Triton twin where Triton runs (``dispatch.kernel``)."""
    if bricks.shape[0] == 0 or leaves.keys.numel() == 0:
        return neighbour_slots_torch(bricks, leaves, tiles, slot_table)
    impl = kernel(bricks.device, neighbour_slots_torch, "triton_mesh:neighbour_slots_triton")
    return impl(bricks, leaves, tiles, slot_table)


def marching_cubes(bricks, nbr_slots, pool, tri_table, tri_count, voxel_size_m: float, with_color: bool):
    """See the module docstring: the Triton kernels where Triton runs (``dispatch.kernel``), else the torch
    reference."""
    impl = marching_cubes_torch
    if bricks.shape[0]:
        impl = kernel(bricks.device, marching_cubes_torch, "triton_mesh:marching_cubes_triton")
    return impl(bricks, nbr_slots, pool, tri_table, tri_count, voxel_size_m, with_color)

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
    decode_leaf_keys,
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


@dataclass(frozen=True)
class _Consts:
    edge_axis: torch.Tensor  # int64 [12]
    edge_min: torch.Tensor  # int64 [12, 3]
    point_nbr: torch.Tensor  # int64 [P] index into the 27-neighbour table of each local point
    point_off: torch.Tensor  # int64 [P] in-brick offset of each local point
    lut: torch.Tensor  # int64 [7 * 7 * 7] local point index of (x + 1, y + 1, z + 1), -1 if not read
    corner_idx: torch.Tensor  # int64 [8, 64] core index of corner c of cell q
    cell_xyz: torch.Tensor  # int64 [64, 3]


@functools.cache
def _consts(device: torch.device) -> _Consts:
    pts, lut = _local_points()
    axes, mins = edge_geometry()
    t = torch.from_numpy
    lc = pts & 3
    off = (lc[:, 0] << 4) | (lc[:, 1] << 2) | lc[:, 2]
    cell = np.array([[q >> 4, (q >> 2) & 3, q & 3] for q in range(64)], np.int64)
    corners = np.array([[c & 1, (c >> 1) & 1, (c >> 2) & 1] for c in range(8)], np.int64)
    corner_idx = np.stack([((cell + corners[c]) * np.array([CORE * CORE, CORE, 1])).sum(1) for c in range(8)])
    return _Consts(
        edge_axis=t(axes).to(device),
        edge_min=t(mins).to(device),
        point_nbr=t(nbr_index(np.floor_divide(pts, 4))).to(device),
        point_off=t(off).to(device),
        lut=t(lut.reshape(-1)).to(device),
        corner_idx=t(corner_idx).to(device),
        cell_xyz=t(cell).to(device),
    )


def _lut_index(c: _Consts, xyz: torch.Tensor) -> torch.Tensor:
    n = CORE + 2
    return c.lut[((xyz[:, 0] + 1) * n + (xyz[:, 1] + 1)) * n + (xyz[:, 2] + 1)]


def edge_keys(voxel: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """int64 key of the lattice edge from ``voxel`` (int64 ``[N, 3]``) along ``axis`` (see mapper.mesh)."""
    return (
        (voxel[:, 0] << (IJ_BITS + K_BITS + 2))
        | ((voxel[:, 1] + IJ_BIAS) << (K_BITS + 2))
        | ((voxel[:, 2] + K_BIAS) << 2)
        | axis
    )


def _chunk(bricks, nbr_slots, pool, table, count, s: float, with_color: bool):
    """Chunk-welded pieces of the cells of ``bricks``: (keys, pos, nrm, col, faces into keys) or None, and
    faces per brick."""
    c = _consts(bricks.device)
    dev = bricks.device
    m = bricks.shape[0]
    slot = nbr_slots[:, c.point_nbr]  # [M, P]
    found = slot >= 0
    flat = slot.clamp(min=0).reshape(-1)
    offs = c.point_off.expand(m, -1).reshape(-1)
    tsdf = pool.gather("tsdf", flat, offs).reshape(m, -1).to(torch.float32)
    obs = found & (pool.gather("weight", flat, offs).reshape(m, -1) > 0)

    core_in = (tsdf[:, : CORE**3] <= 0).to(torch.int64)
    core_obs = obs[:, : CORE**3]
    case = torch.zeros((m, 64), dtype=torch.int64, device=dev)
    all_obs = torch.ones((m, 64), dtype=torch.bool, device=dev)
    for k in range(8):
        case |= core_in[:, c.corner_idx[k]] << k
        all_obs &= core_obs[:, c.corner_idx[k]]
    active = all_obs & (case != 0) & (case != 255)
    bi, q = active.nonzero(as_tuple=True)  # (brick, cell) order
    cs = case[bi, q]
    cnt = count[cs]
    n_tri = int(cnt.sum())
    face_counts = torch.zeros(m, dtype=torch.int64, device=dev).index_add_(0, bi, cnt)
    if n_tri == 0:
        return None, face_counts
    cell_of = torch.repeat_interleave(torch.arange(cs.numel(), device=dev), cnt)
    first = torch.cumsum(cnt, 0) - cnt
    t_in_cell = torch.arange(n_tri, device=dev) - first[cell_of]
    edges = table[cs[cell_of], t_in_cell].reshape(-1)  # [3T]
    corner_cell = cell_of.repeat_interleave(3)
    local_min = c.cell_xyz[q[corner_cell]] + c.edge_min[edges]  # [3T, 3] local min voxel of the edge
    brick_of = bi[corner_cell]
    axis = c.edge_axis[edges]
    keys = edge_keys((bricks[brick_of] << 2) + local_min, axis)
    ukeys, inv = torch.unique(keys, return_inverse=True)
    rep = torch.empty(ukeys.numel(), dtype=torch.int64, device=dev)
    rep.scatter_(0, inv, torch.arange(keys.numel(), device=dev))
    vb, vmin, vax = brick_of[rep], local_min[rep], axis[rep]
    eax = torch.nn.functional.one_hot(vax, 3)
    p0 = _lut_index(c, vmin)
    p1 = _lut_index(c, vmin + eax)
    t0, t1 = tsdf[vb, p0], tsdf[vb, p1]
    t = t0 / (t0 - t1)  # in [0, 1]: exactly one end is <= 0

    gvox = ((bricks[vb] << 2) + vmin).to(torch.float64) + 0.5
    pos = ((gvox + t.to(torch.float64)[:, None] * eax) * s).to(torch.float32)

    def gradient(p_local, p_idx):
        t_c = tsdf[vb, p_idx]
        g = []
        for a in range(3):
            e = torch.zeros(3, dtype=torch.int64, device=dev)
            e[a] = 1
            ip, im = _lut_index(c, p_local + e), _lut_index(c, p_local - e)
            op, om = obs[vb, ip], obs[vb, im]
            tp, tm = tsdf[vb, ip], tsdf[vb, im]
            central = (tp - tm) * 0.5
            fwd, bwd = tp - t_c, t_c - tm
            zero = torch.zeros_like(t_c)
            g.append(torch.where(op & om, central, torch.where(op, fwd, torch.where(om, bwd, zero))))
        return torch.stack(g, 1)

    g0 = gradient(vmin, p0)
    g1 = gradient(vmin + eax, p1)
    g = g0 + t[:, None] * (g1 - g0)
    norm = torch.sqrt(g[:, 0] * g[:, 0] + g[:, 1] * g[:, 1] + g[:, 2] * g[:, 2])
    fallback = eax.to(torch.float32) * torch.where(t1 > t0, 1.0, -1.0)[:, None]
    nrm = torch.where((norm > 0)[:, None], g / norm.clamp(min=1e-30)[:, None], fallback)

    col = None
    if with_color:
        s0 = slot[vb, p0].clamp(min=0)
        s1 = slot[vb, p1].clamp(min=0)
        o0, o1 = c.point_off[p0], c.point_off[p1]
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

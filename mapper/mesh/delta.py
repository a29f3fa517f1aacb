"""Patching a mesh with a delta: ``apply_delta(prev, mesh_since(...))`` equals a full extraction."""

from __future__ import annotations

import torch

from ..errors import Conflict, InvalidArgument
from .keys import _sorted_unique_blocks, block_keys
from .types import Mesh, _check_mesh, empty_mesh


def _member(sorted_keys: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(found bool ``[N]``, index into ``sorted_keys``) of int64 queries ``q``."""
    if sorted_keys.numel() == 0:
        return torch.zeros_like(q, dtype=torch.bool), torch.zeros_like(q)
    i = torch.searchsorted(sorted_keys, q).clamp(max=sorted_keys.numel() - 1)
    return sorted_keys[i] == q, i


def _merge_positions(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the elements of two sorted, disjoint int64 arrays in their sorted merge."""
    pa = torch.arange(a.numel(), device=a.device) + torch.searchsorted(b, a)
    pb = torch.arange(b.numel(), device=b.device) + torch.searchsorted(a, b)
    return pa, pb


def apply_delta(prev: Mesh, delta: Mesh) -> Mesh:
    """``prev`` with the blocks of ``delta`` replaced: prev's faces in ``delta.blocks`` and
    ``delta.removed_blocks`` are dropped, the delta's are added, vertices re-welded by edge key.

    A full ``delta`` is returned as is. ``prev`` must be at least as new as the delta's ``since_version``
    (``Conflict`` otherwise); the result has the delta's version and equals :func:`extract_mesh` at that
    version when ``prev`` was a full mesh.
    """
    _check_mesh("prev", prev)
    _check_mesh("delta", delta)
    if delta.full:
        return delta
    _check_compatible(prev, delta)
    dev = prev.device
    delta = delta.to(dev)
    keep, pa, pb, blocks, offsets = _merged_blocks(prev, delta)
    out = empty_mesh(dev, prev.colors is not None, delta.version, delta.voxel_size_m or prev.voxel_size_m)
    out.full = prev.full
    out.since_version = None if prev.full else prev.since_version
    # vertices: the delta's (fresh) plus prev's still used by kept faces and not in the delta, merged by key
    face_block = prev.face_blocks()
    kept_faces = keep[face_block].nonzero().squeeze(1)
    pf = prev.faces[kept_faces].to(torch.int64)
    prev_map, vb = _merge_vertices(prev, delta, pf, out)
    # faces: each block's faces move as a run to the block's new offset
    faces = torch.empty((int(offsets[-1]), 3), dtype=torch.int32, device=dev)
    p_shift = torch.zeros(prev.blocks.shape[0], dtype=torch.int64, device=dev)
    p_shift[keep] = offsets[pa] - prev.block_face_offsets[:-1][keep]
    faces[kept_faces + p_shift[face_block[kept_faces]]] = prev_map[pf].to(torch.int32)
    d_shift = offsets[pb] - delta.block_face_offsets[:-1]
    d_dest = torch.arange(delta.num_faces, device=dev) + d_shift[delta.face_blocks()]
    faces[d_dest] = vb[delta.faces.to(torch.int64)].to(torch.int32)
    out.faces = faces
    out.blocks = blocks
    out.block_face_offsets = offsets
    if not prev.full:  # a patch of patches: blocks the result covers without faces
        removed = torch.cat((prev.removed_blocks, delta.removed_blocks))
        rk = block_keys(removed)
        removed = removed[~torch.isin(rk, block_keys(blocks))]
        out.removed_blocks = _sorted_unique_blocks(removed)
    return out


def _check_compatible(prev: Mesh, delta: Mesh) -> None:
    """``Conflict`` when ``prev`` is older than the delta's base, ``InvalidArgument`` on a different voxel
    size or colours in one mesh only."""
    if delta.since_version is not None and prev.version < delta.since_version:
        raise Conflict(
            f"delta: made since version {delta.since_version}, but prev shows version {prev.version}"
        )
    if prev.voxel_size_m and delta.voxel_size_m and prev.voxel_size_m != delta.voxel_size_m:
        raise InvalidArgument(f"delta: voxel size {delta.voxel_size_m} != prev's {prev.voxel_size_m}")
    if (prev.colors is None) != (delta.colors is None):
        raise InvalidArgument("delta: colours present in one mesh but not the other")


def _merged_blocks(prev: Mesh, delta: Mesh) -> tuple[torch.Tensor, ...]:
    """Blocks: prev's minus the delta's (and its removed ones), merged with the delta's by key. Returns (bool
    ``[B_prev]`` prev's kept blocks, positions of the kept and of the delta's blocks in the merge, the merged
    int64 ``[B, 3]`` blocks, their int64 ``[B + 1]`` face offsets)."""
    dev = prev.device
    z1 = torch.zeros(1, dtype=torch.int64, device=dev)
    drop = torch.unique(block_keys(torch.cat((delta.blocks, delta.removed_blocks))))
    pk, dk = block_keys(prev.blocks), block_keys(delta.blocks)
    keep = ~_member(drop, pk)[0]
    p_counts = prev.block_face_offsets[1:] - prev.block_face_offsets[:-1]
    d_counts = delta.block_face_offsets[1:] - delta.block_face_offsets[:-1]
    pa, pb = _merge_positions(pk[keep], dk)
    nb = pa.numel() + pb.numel()
    blocks = torch.empty((nb, 3), dtype=torch.int64, device=dev)
    blocks[pa], blocks[pb] = prev.blocks[keep], delta.blocks
    counts = torch.empty(nb, dtype=torch.int64, device=dev)
    counts[pa], counts[pb] = p_counts[keep], d_counts
    offsets = torch.cat((z1, torch.cumsum(counts, 0)))
    return keep, pa, pb, blocks, offsets


def _merge_vertices(prev: Mesh, delta: Mesh, pf: torch.Tensor, out: Mesh) -> tuple[torch.Tensor, ...]:
    """Write into ``out`` the delta's vertices plus prev's used by the kept faces ``pf`` (int64 ``[F', 3]``)
    and not in the delta, merged by edge key (keys, positions, normals, colours). Returns (int64
    ``[V_prev]`` prev's vertex -> merged index, -1 where dropped; int64 ``[V_delta]`` the delta's)."""
    dev = prev.device
    used = torch.zeros(prev.num_vertices, dtype=torch.bool, device=dev)
    used[pf.reshape(-1)] = True
    in_d, d_idx = _member(delta.vertex_keys, prev.vertex_keys)
    take = used & ~in_d
    va, vb = _merge_positions(prev.vertex_keys[take], delta.vertex_keys)
    prev_map = torch.full((prev.num_vertices,), -1, dtype=torch.int64, device=dev)
    prev_map[take] = va
    prev_map[in_d] = vb[d_idx[in_d]]
    nv = va.numel() + vb.numel()

    def merged(a, b):
        res = torch.empty((nv, *a.shape[1:]), dtype=a.dtype, device=dev)
        res[va], res[vb] = a[take], b
        return res

    out.vertex_keys = merged(prev.vertex_keys, delta.vertex_keys)
    out.vertices = merged(prev.vertices, delta.vertices)
    out.normals = merged(prev.normals, delta.normals)
    if prev.colors is not None:
        out.colors = merged(prev.colors, delta.colors)
    return prev_map, vb

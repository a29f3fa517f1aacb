"""The browser map viewer: its static files (``static/``, three.js vendored) and the compact binary mesh
format it reads (``GET /v1/maps/{id}/mesh/blocks``).

**Block mesh format** (``application/x-mapper-blocks``, little-endian, every section starts on a 4-byte
boundary so a browser views it with typed arrays without copying):

=========  ===================  =====================================================================
offset     type                 field
=========  ===================  =====================================================================
0          4 bytes              magic ``b"MVB1"``
4          uint32               flags: bit 0 full mesh (replace everything), bit 1 has colours
8          float64              version (the TSDF layer version the mesh shows)
16         float64              since_version of a delta, -1 for a full mesh
24         float64              voxel_size_m
32         uint32 x 4           B blocks, R removed blocks, V vertices, F faces
48         int32 [B, 3]         blocks (brick coordinates; a brick is 4 voxels a side)
..         int32 [R, 3]         removed_blocks (drop what you had there)
..         uint32 [B + 1]       vertex offsets: the vertices of block b are ``[voff[b], voff[b + 1])``
..         uint32 [B + 1]       face offsets: the faces of block b are ``[foff[b], foff[b + 1])``
..         float32 [V, 3]       positions (m)
..         int8 [V, 3]          unit normals x 127
..         uint8 [V, 3]         RGB colours (only with flag bit 1)
..         uint16 [F, 3]        faces, vertex indices local to their block
=========  ===================  =====================================================================

Each block is self-contained (vertices on a block boundary are repeated in both blocks), so a viewer
replaces a block's triangles without touching its neighbours: a delta carries only the changed blocks.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidArgumentType
from ..mesh import Mesh

STATIC_DIR = Path(__file__).parent / "static"
MEDIA_TYPE = "application/x-mapper-blocks"
MAGIC = b"MVB1"
_HEADER = struct.Struct("<4sIdddIIII")


def _pad4(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def split_blocks(mesh: Mesh) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Re-index a block-structured mesh per block.

    Returns: (global vertex index of each block-local vertex int64 ``[V']``, vertex offsets int64
    ``[B + 1]``, faces with block-local indices int64 ``[F, 3]``, face offsets int64 ``[B + 1]``); the
    vertices of block b are ``[voff[b], voff[b + 1])``, in increasing global index.
    """
    if not isinstance(mesh, Mesh):
        raise InvalidArgumentType(f"mesh: expected a Mesh, got {type(mesh).__name__}")
    faces = mesh.faces.detach().cpu().to(torch.int64)
    foff = mesh.block_face_offsets.detach().cpu().to(torch.int64)
    nb, nv = mesh.blocks.shape[0], max(mesh.num_vertices, 1)
    counts = foff[1:] - foff[:-1]
    fb = torch.repeat_interleave(torch.arange(nb), counts)  # block of each face
    keys = (fb[:, None] * nv + faces).reshape(-1)  # (block, vertex) pairs, sorted by block first
    uk, inv = torch.unique(keys, return_inverse=True)
    vb = uk // nv
    voff = torch.zeros(nb + 1, dtype=torch.int64)
    voff[1:] = torch.cumsum(torch.bincount(vb, minlength=nb), 0)
    local = inv.reshape(-1, 3) - voff[fb][:, None]
    return (uk % nv).numpy(), voff.numpy(), local.numpy(), foff.numpy()


def mesh_to_blocks_bytes(mesh: Mesh) -> bytes:
    """The mesh (full or delta) in the block format above."""
    gv, voff, local, foff = split_blocks(mesh)
    if local.size and local.max() >= 1 << 16:  # a 4^3-voxel block has a few hundred vertices at most
        raise ValueError("a block has more than 65535 vertices")
    v = mesh.vertices.detach().cpu().numpy()[gv]
    n = mesh.normals.detach().cpu().numpy()[gv]
    has_color = mesh.colors is not None
    flags = (1 if mesh.full else 0) | (2 if has_color else 0)
    since = -1.0 if mesh.since_version is None else float(mesh.since_version)
    blocks = mesh.blocks.detach().cpu().numpy().astype("<i4")
    removed = mesh.removed_blocks.detach().cpu().numpy().astype("<i4")
    parts = [
        _HEADER.pack(
            MAGIC,
            flags,
            float(mesh.version),
            since,
            float(mesh.voxel_size_m),
            blocks.shape[0],
            removed.shape[0],
            gv.shape[0],
            local.shape[0],
        ),
        blocks.tobytes(),
        removed.tobytes(),
        voff.astype("<u4").tobytes(),
        foff.astype("<u4").tobytes(),
        v.astype("<f4").tobytes(),
        _pad4(np.clip(np.round(np.nan_to_num(n) * 127), -127, 127).astype(np.int8).tobytes()),
    ]
    if has_color:
        parts.append(_pad4(mesh.colors.detach().cpu().numpy()[gv].astype(np.uint8).tobytes()))
    parts.append(_pad4(local.astype("<u2").tobytes()))
    return b"".join(parts)


def blocks_from_bytes(data: bytes) -> dict:
    """Parse the block format (the reference decoder the browser's mirrors; tests use it).

    Returns: dict with ``full``, ``version``, ``since_version`` (None for a full mesh), ``voxel_size_m``,
    ``blocks`` int32 ``[B, 3]``, ``removed_blocks`` ``[R, 3]``, ``vertex_offsets``, ``face_offsets``
    (``[B + 1]``), ``positions`` float32 ``[V, 3]``, ``normals`` float32 ``[V, 3]``, ``colors`` uint8
    ``[V, 3]`` or None, ``faces`` (block-local) int64 ``[F, 3]``.
    """
    magic, flags, version, since, vs, nb, nr, nv, nf = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"not a block mesh (magic {magic!r})")
    off = _HEADER.size

    def take(dtype, count, shape):
        nonlocal off
        a = np.frombuffer(data, dtype=dtype, count=count, offset=off).reshape(shape)
        off += a.nbytes + (-a.nbytes % 4)
        return a

    out = {"full": bool(flags & 1), "version": int(version), "voxel_size_m": vs}
    out["since_version"] = None if since < 0 else int(since)
    out["blocks"] = take("<i4", nb * 3, (nb, 3))
    out["removed_blocks"] = take("<i4", nr * 3, (nr, 3))
    out["vertex_offsets"] = take("<u4", nb + 1, (nb + 1,)).astype(np.int64)
    out["face_offsets"] = take("<u4", nb + 1, (nb + 1,)).astype(np.int64)
    out["positions"] = take("<f4", nv * 3, (nv, 3))
    out["normals"] = take("i1", nv * 3, (nv, 3)).astype(np.float32) / 127
    out["colors"] = take("u1", nv * 3, (nv, 3)) if flags & 2 else None
    out["faces"] = take("<u2", nf * 3, (nf, 3)).astype(np.int64)
    if off != len(data):
        raise ValueError(f"block mesh: {len(data) - off} trailing bytes")
    return out

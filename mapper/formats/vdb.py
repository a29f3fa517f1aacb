"""A map layer as an OpenVDB ``.vdb`` file: a ``FloatGrid`` (tree 5-4-3) with the voxel-size transform.

Written in NumPy from OpenVDB's file format (``openvdb/io/Archive.cc``, ``GridDescriptor.cc``,
``tree/RootNode.h``, ``InternalNode.h``, ``LeafNode.h``, ``io/Compression.h``; file format version 224,
read by OpenVDB 10 and later):

* header: magic ``0x56444220`` (int64), file version (uint32), library major/minor (uint32), "has grid
  offsets" (1 byte), the archive's UUID (36 ASCII characters); the archive's metadata (int32 count 0);
  the grid count (int32);
* per grid: its descriptor (name, type ``Tree_float_5_4_3``, instance parent: int32-length strings; then
  int64 grid / block / end positions), the compression flags (uint32), the grid metadata (``class``,
  ``name``), the transform (``ScaleTranslateMap``: voxel ``(i, j, k)`` has its centre at
  ``(i + 0.5, j + 0.5, k + 0.5) * voxel_size_m``, mapper's convention), the topology (int32 buffer count 1;
  root: background, tile count 0, child count, then per upper node (32^3 children of 4096^3 voxels) its
  origin, child and value masks and tile values; per lower node (16^3 children of 128^3 voxels) the
  same; per leaf (8^3 voxels) its value mask) and the buffers (per leaf: value mask, then the 512
  values). Node values go through ``writeCompressedValues`` without mask compression (one metadata byte
  ``6`` = all values follow), zlib-compressed (``COMPRESS_ZIP``: int64 byte count, negative when stored
  raw) or raw.

Active voxels are the layer's observed voxels; every other value (inactive voxels, tiles) is the
background (the TSDF's truncation distance, the ESDF's maximum distance). See
:mod:`mapper.formats.nanovdb` for the
NanoVDB ``.nvdb`` export of the same voxels.
"""

from __future__ import annotations

import io
import struct
import uuid as uuid_mod
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument

MAGIC = 0x56444220
FILE_VERSION = 224  # OPENVDB_FILE_VERSION_MULTIPASS_IO
LIBRARY_VERSION = (10, 0)
GRID_TYPE = "Tree_float_5_4_3"
COMPRESS_NONE, COMPRESS_ZIP = 0, 1
NO_MASK_AND_ALL_VALS = 6
LOG2 = (5, 4, 3)  # upper, lower, leaf node dimensions (log2 of children / voxels per axis)
SHIFT_UPPER, SHIFT_LOWER, SHIFT_LEAF = 12, 7, 3  # log2 of the voxels per axis a node covers
MAX_COORD = 2**31 - 2**12  # index coordinates stay in int32 with whole upper nodes


@dataclass(frozen=True)
class VoxelGrid:
    """The active voxels of one grid, as the writers take them.

    Attributes:
        name: the grid's name in the file.
        ijk: int64 ``[N, 3]`` voxel indices (unique), voxel ``ijk`` centred at ``(ijk + 0.5) * voxel_size_m``.
        values: float32 ``[N]`` values of those voxels.
        background: the value of every other voxel.
        voxel_size_m: the voxel edge in metres.
        grid_class: ``"level set"`` (a narrow-band signed distance: the TSDF) or ``"unknown"``.
    """

    name: str
    ijk: np.ndarray
    values: np.ndarray
    background: float
    voxel_size_m: float
    grid_class: str = "unknown"

    @classmethod
    def from_arrays(cls, name, ijk, values, background, voxel_size_m, grid_class="unknown") -> VoxelGrid:
        """Validated arrays (any integer / float dtype, CPU NumPy or array-likes)."""
        ijk = np.asarray(ijk)
        values = np.asarray(values)
        if ijk.ndim != 2 or ijk.shape[1] != 3 or not np.issubdtype(ijk.dtype, np.integer):
            raise InvalidArgument(f"ijk: expected an integer [N, 3] array, got {ijk.dtype} {list(ijk.shape)}")
        if values.shape != (ijk.shape[0],):
            raise InvalidArgument(f"values: expected shape [{ijk.shape[0]}], got {list(values.shape)}")
        ijk = ijk.astype(np.int64)
        if ijk.size and (np.abs(ijk).max() >= MAX_COORD):
            raise InvalidArgument(f"ijk: voxel indices beyond +-{MAX_COORD} do not fit a VDB tree")
        if not (np.isfinite(voxel_size_m) and voxel_size_m > 0):
            raise InvalidArgument(f"voxel_size_m: expected a positive number, got {voxel_size_m!r}")
        values = values.astype(np.float32)
        if not np.isfinite(values).all():
            raise InvalidArgument("values: expected finite values (leave unknown voxels out)")
        if not name or "\0" in name:
            raise InvalidArgument(f"name: expected a non-empty grid name, got {name!r}")
        return cls(name, ijk, values, float(background), float(voxel_size_m), grid_class)


def map_layer_grid(m, layer: str) -> VoxelGrid:
    """The observed voxels of a :class:`~mapper.Map`'s ``layer`` (``"tsdf"``: weight > 0, values in metres,
    background the truncation distance; ``"esdf"``: observed voxels, background ``esdf_max_distance_m``)."""
    if layer not in ("tsdf", "esdf"):
        raise InvalidArgument(f"layer: expected 'tsdf' or 'esdf', got {layer!r}")
    if layer not in m.layers:
        raise InvalidArgument(f"layer: the map has no {layer!r} layer (it has {', '.join(m.layers)})")
    if layer == "esdf" and m.esdf_dirty and not getattr(m, "read_only", False):
        m.update_esdf()  # (the service's reads bring the ESDF up to date before they run)
    grid, data = m.layer(layer)
    ijk = grid.ijk.cpu().numpy()
    if layer == "tsdf":
        keep = data["weight"].cpu().numpy() > 0
        values = data["tsdf"].cpu().numpy()
        trunc = m.tsdf_config.truncation_vox * m.voxel_size_m
        return VoxelGrid.from_arrays("tsdf", ijk[keep], values[keep], trunc, m.voxel_size_m, "level set")
    keep = data["observed"].cpu().numpy().astype(bool)
    values = data["esdf"].cpu().numpy()
    keep &= np.isfinite(values)
    return VoxelGrid.from_arrays(
        "esdf", ijk[keep], values[keep], m.esdf_max_distance_m, m.esdf_voxel_size_m, "unknown"
    )


# ------------------------------------------------------------------------------------- tree layout
@dataclass
class Tree:
    """The 5-4-3 topology of a grid's active voxels, every node list in file (depth-first) order.

    ``upper`` int64 ``[U, 3]`` origins; ``lower`` ``[L, 3]`` origins and ``lower_parent`` ``[L]`` their upper
    node; ``leaf`` ``[F, 3]`` origins and ``leaf_parent`` ``[F]`` their lower node; ``leaf_mask`` bool
    ``[F, 512]`` active voxels and ``leaf_values`` float32 ``[F, 512]`` (background where inactive).
    """

    upper: np.ndarray
    lower: np.ndarray
    lower_parent: np.ndarray
    leaf: np.ndarray
    leaf_parent: np.ndarray
    leaf_mask: np.ndarray
    leaf_values: np.ndarray
    voxel_ijk: np.ndarray  # int64 [N, 3], the active voxels in node order
    voxel_values: np.ndarray  # float32 [N]
    voxel_node: tuple[np.ndarray, np.ndarray, np.ndarray]  # int64 [N] leaf, lower and upper node of each


def _group(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of sorted ``keys`` ``[N, K]``: (first row of each run of equal rows, run id of every row)."""
    if keys.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    new = np.ones(keys.shape[0], bool)
    new[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    return np.flatnonzero(new), np.cumsum(new) - 1


def build_tree(g: VoxelGrid) -> Tree:
    """The node lists of ``g`` in OpenVDB's order: upper nodes by origin (x, then y, then z: the root's
    ``std::map<Coord>``), children inside a node by their linear index (x-major), voxels by
    ``(x & 7) << 6 | (y & 7) << 3 | (z & 7)``."""
    ijk = g.ijk
    up, lo, lf = ijk >> SHIFT_UPPER, ijk >> SHIFT_LOWER, ijk >> SHIFT_LEAF
    order = np.lexsort(
        (lf[:, 2], lf[:, 1], lf[:, 0], lo[:, 2], lo[:, 1], lo[:, 0], up[:, 2], up[:, 1], up[:, 0])
    )
    ijk, values = ijk[order], g.values[order]
    up, lo, lf = up[order], lo[order], lf[order]
    if ijk.shape[0] > 1 and not (ijk[1:] != ijk[:-1]).any(axis=1).all():
        raise InvalidArgument("ijk: the voxel indices are not unique")
    u_first, u_of_voxel = _group(up)
    l_first, l_of_voxel = _group(lo)
    f_first, f_of_voxel = _group(lf)
    off = ((ijk[:, 0] & 7) << 6) | ((ijk[:, 1] & 7) << 3) | (ijk[:, 2] & 7)
    n_leaf = f_first.shape[0]
    mask = np.zeros((n_leaf, 512), bool)
    vals = np.full((n_leaf, 512), np.float32(g.background), np.float32)
    mask[f_of_voxel, off] = True
    vals[f_of_voxel, off] = values
    return Tree(
        upper=up[u_first] << SHIFT_UPPER,
        lower=lo[l_first] << SHIFT_LOWER,
        lower_parent=u_of_voxel[l_first],
        leaf=lf[f_first] << SHIFT_LEAF,
        leaf_parent=l_of_voxel[f_first],
        leaf_mask=mask,
        leaf_values=vals,
        voxel_ijk=ijk,
        voxel_values=values,
        voxel_node=(f_of_voxel, l_of_voxel, u_of_voxel),
    )


def child_index(child_origin: np.ndarray, log2_child: int, log2_dim: int) -> np.ndarray:
    """Linear index of children (origins int64 ``[N, 3]``) in their parent: ``x << 2d | y << d | z`` of
    the local child coordinates."""
    loc = (child_origin >> log2_child) & ((1 << log2_dim) - 1)
    return (loc[:, 0] << (2 * log2_dim)) | (loc[:, 1] << log2_dim) | loc[:, 2]


def mask_words(bits: np.ndarray) -> np.ndarray:
    """A node mask (bool ``[..., n]``) as OpenVDB's uint64 words (bit ``i`` in word ``i >> 6``, LSB first)."""
    b = np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little")
    return b.view("<u8")


# ------------------------------------------------------------------------------------------ writer
def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<i", len(b)) + b


def _values(arr: np.ndarray, compress: int) -> bytes:
    """``io::writeCompressedValues`` without mask compression: metadata byte 6, then the values (zipped
    with an int64 size, or raw)."""
    raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    out = bytes([NO_MASK_AND_ALL_VALS])
    if compress & COMPRESS_ZIP:
        z = zlib.compress(raw, 6)  # OpenVDB's ZIP_COMPRESSION_LEVEL: Z_DEFAULT_COMPRESSION
        if len(z) < len(raw):
            return out + struct.pack("<q", len(z)) + z
        return out + struct.pack("<q", -len(raw)) + raw
    return out + raw


def _meta(entries: list[tuple[str, str]]) -> bytes:
    """A MetaMap of string entries: int32 count; per entry its name, type name and int32-sized value."""
    out = struct.pack("<i", len(entries))
    for k, v in entries:
        out += _string(k) + _string("string") + _string(v)
    return out


def _transform(voxel_size_m: float) -> bytes:
    """``ScaleTranslateMap``: translation, scale, voxel size, 1/scale, 1/scale^2, 1/(2 scale) (Vec3d each)."""
    s = float(voxel_size_m)
    vecs = [s / 2, s, s, 1 / s, 1 / (s * s), 1 / (2 * s)]
    return _string("ScaleTranslateMap") + b"".join(struct.pack("<3d", v, v, v) for v in vecs)


def _topology(t: Tree, background: float, compress: int) -> bytes:
    out = io.BytesIO()
    w = out.write
    w(struct.pack("<i", 1))  # buffer count
    w(struct.pack("<f", background))
    w(struct.pack("<II", 0, t.upper.shape[0]))  # tiles, children
    lower_of = np.searchsorted(t.lower_parent, np.arange(t.upper.shape[0] + 1))
    leaf_of = np.searchsorted(t.leaf_parent, np.arange(t.lower.shape[0] + 1))
    upper_tiles = np.full(32**3, np.float32(background), np.float32)
    lower_tiles = np.full(16**3, np.float32(background), np.float32)
    off_mask_u, off_mask_l = np.zeros(32**3, bool), np.zeros(16**3, bool)
    for u in range(t.upper.shape[0]):
        w(struct.pack("<3i", *t.upper[u].tolist()))
        lo0, lo1 = lower_of[u], lower_of[u + 1]
        child = off_mask_u.copy()
        child[child_index(t.lower[lo0:lo1], SHIFT_LOWER, LOG2[0])] = True
        w(mask_words(child).tobytes())
        w(mask_words(off_mask_u).tobytes())  # value mask: no active tiles
        vals = np.where(child, np.float32(0), upper_tiles)  # child slots are written as zero
        w(_values(vals, compress))
        for li in range(lo0, lo1):
            f0, f1 = leaf_of[li], leaf_of[li + 1]
            child = off_mask_l.copy()
            child[child_index(t.leaf[f0:f1], SHIFT_LEAF, LOG2[1])] = True
            w(mask_words(child).tobytes())
            w(mask_words(off_mask_l).tobytes())
            w(_values(np.where(child, np.float32(0), lower_tiles), compress))
            w(mask_words(t.leaf_mask[f0:f1]).tobytes())  # the leaves' value masks
    return out.getvalue()


def _buffers(t: Tree, compress: int) -> bytes:
    masks = mask_words(t.leaf_mask)
    parts = []
    for f in range(t.leaf.shape[0]):
        parts.append(masks[f].tobytes())
        parts.append(_values(t.leaf_values[f], compress))
    return b"".join(parts)


def vdb_bytes(grids: list[VoxelGrid], compress: bool = True, file_uuid: str | None = None) -> bytes:
    """The ``.vdb`` file of ``grids`` (see the module docstring); ``compress``: zlib node values."""
    if not grids:
        raise InvalidArgument("grids: expected at least one grid")
    flags = COMPRESS_ZIP if compress else COMPRESS_NONE
    u = file_uuid or str(uuid_mod.uuid4())
    out = bytearray()
    out += struct.pack("<qIII", MAGIC, FILE_VERSION, *LIBRARY_VERSION)
    out += b"\x01"  # has grid offsets
    out += u.encode()[:36].ljust(36, b"0")
    out += _meta([])  # the archive's metadata
    out += struct.pack("<i", len(grids))
    for g in grids:
        t = build_tree(g)
        out += _string(g.name) + _string(GRID_TYPE) + _string("")
        pos_at = len(out)
        out += bytes(24)  # grid, block and end positions, filled in below
        grid_pos = len(out)
        out += struct.pack("<I", flags)
        out += _meta([("class", g.grid_class), ("name", g.name)])
        out += _transform(g.voxel_size_m)
        out += _topology(t, g.background, flags)
        block_pos = len(out)
        out += _buffers(t, flags)
        end_pos = len(out)
        out[pos_at : pos_at + 24] = struct.pack("<3q", grid_pos, block_pos, end_pos)
    return bytes(out)


def write_vdb(path, grids: list[VoxelGrid], compress: bool = True) -> Path:
    """Write ``grids`` to an OpenVDB file at ``path`` (see :func:`vdb_bytes`)."""
    path = Path(path)
    path.write_bytes(vdb_bytes(grids, compress))
    return path

"""A map layer as a NanoVDB ``.nvdb`` file: a float grid (32^3 -> 16^3 -> 8^3 nodes), written in NumPy from
NanoVDB's documented buffer layout (``nanovdb/NanoVDB.h`` and ``nanovdb/util/IO.h``, version 32.4, the
NanoVDB of OpenVDB 10; readable by later versions of major 32).

File (one segment per grid, codec NONE): ``Header`` (16 B: magic ``"NanoVDB0"``, version, grid count,
codec), ``MetaData`` (176 B: grid and file size, name hash, voxel count, type, class, world and index
bounding boxes, voxel size, name size, node and tile counts, codec, version) and the NUL-terminated name,
then the grid buffer:

``GridData`` (672 B: magic, checksum (disabled: all bits on), version, flags, index, count, size, name,
the affine ``Map`` in float and double, world bbox, voxel size, class, type, blind data) | ``TreeData``
(64 B: byte offsets from the tree to the first leaf, lower, upper node and the root; node counts; tile
counts; voxel count) | ``RootData`` (64 B: index bbox, table size, background, min, max, average, standard
deviation) and one 32 B tile per upper node (64-bit key, byte offset from the root to the child, state,
value) | upper nodes (270400 B each: bbox, flags, value and child masks of 32^3 bits, statistics, then
32768 8-byte slots: a child's byte offset from the node, or a tile value) | lower nodes (33856 B each, the
same with 16^3) | leaves (2144 B each: bbox min, bbox extent (3 bytes), flags, value mask of 512 bits,
statistics, 512 float32 values). Every node is 32 B aligned; each level is laid out in order
(breadth-first), children in the order of their parent's child index. The statistics (min, max, average,
standard deviation of the active values, bounding boxes) are filled in as ``nanovdb::gridStats`` does.

The transform matches :mod:`mapper.formats.vdb`: voxel ``(i, j, k)`` has its centre at
``(ijk + 0.5) * voxel_size_m``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument
from .vdb import SHIFT_LEAF, SHIFT_LOWER, SHIFT_UPPER, VoxelGrid, build_tree, child_index, mask_words

MAGIC = 0x304244566F6E614E  # "NanoVDB0"
VERSION = (32 << 21) | (4 << 10) | 2
CHECKSUM_DISABLED = 0xFFFFFFFFFFFFFFFF
GRID_TYPE_FLOAT = 1
GRID_CLASS = {"unknown": 0, "level set": 1, "fog volume": 2}
FLAGS = 2 | 4 | 8 | 16 | 32  # HasBBox, HasMinMax, HasAverage, HasStdDeviation, IsBreadthFirst
GRID_SIZE, TREE_SIZE, ROOT_SIZE, TILE_SIZE = 672, 64, 64, 32
UPPER_SIZE, LOWER_SIZE, LEAF_SIZE = 270400, 33856, 2144
UPPER_TABLE, LOWER_TABLE = 8256, 1088  # byte offset of the child/tile table in an upper / lower node
LEAF_VALUES = 96
NODE_FLAG_BBOX = 2


def name_hash(name: str) -> int:
    """``nanovdb::io::stringHash``: the MetaData's name key."""
    h = 0
    for c in name.encode():
        overflow = h >> 56
        h = (h * 67 + c + overflow) & 0xFFFFFFFFFFFFFFFF
    return h


def _stats(values: np.ndarray, ijk: np.ndarray, group: np.ndarray, n: int):
    """Per group (``group`` sorted int64 ``[N]`` in ``[0, n)``, every group non-empty): min, max, average,
    standard deviation (float32 ``[n]`` each) and the bbox (int32 ``[n, 2, 3]``)."""
    starts = np.searchsorted(group, np.arange(n))
    v = values.astype(np.float64)
    cnt = np.diff(np.append(starts, values.shape[0])).astype(np.float64)
    mean = np.add.reduceat(v, starts) / cnt
    var = np.maximum(np.add.reduceat(v * v, starts) / cnt - mean * mean, 0.0)
    bbox = np.stack((np.minimum.reduceat(ijk, starts), np.maximum.reduceat(ijk, starts)), axis=1)
    return (
        np.minimum.reduceat(values, starts),
        np.maximum.reduceat(values, starts),
        mean.astype(np.float32),
        np.sqrt(var).astype(np.float32),
        bbox.astype(np.int32),
    )


def _map(voxel_size_m: float) -> bytes:
    """``nanovdb::Map``: 3x3 matrix, inverse, translation, taper in float, then in double (264 B)."""
    s = float(voxel_size_m)
    mat, inv, vec = np.eye(3) * s, np.eye(3) / s, np.full(3, s / 2)
    parts = [np.concatenate((mat.ravel(), inv.ravel(), vec, [1.0]))]
    return parts[0].astype("<f4").tobytes() + parts[0].astype("<f8").tobytes()


def grid_buffer(g: VoxelGrid, grid_index: int = 0, grid_count: int = 1) -> tuple[bytes, dict]:
    """The grid buffer of ``g`` (see the module docstring) and the numbers its file MetaData repeats."""
    name = g.name.encode()
    if len(name) >= 256:
        raise InvalidArgument(f"name: NanoVDB grid names are shorter than 256 bytes, got {len(name)}")
    t = build_tree(g)
    nu, nl, nf = t.upper.shape[0], t.lower.shape[0], t.leaf.shape[0]
    root_at = GRID_SIZE + TREE_SIZE
    upper_at = root_at + ROOT_SIZE + TILE_SIZE * nu
    lower_at = upper_at + UPPER_SIZE * nu
    leaf_at = lower_at + LOWER_SIZE * nl
    size = leaf_at + LEAF_SIZE * nf
    buf = bytearray(size)
    bg = np.float32(g.background)
    leaf_id, lower_id, upper_id = t.voxel_node
    ijk, vals = t.voxel_ijk, t.voxel_values
    n_vox = int(vals.shape[0])

    # leaves
    if nf:
        mn, mx, avg, std, bb = _stats(vals, ijk, leaf_id, nf)
        rec = np.zeros(nf, dtype=[("bmin", "<i4", 3), ("dif", "u1", 3), ("flags", "u1"), ("mask", "<u8", 8),
                                  ("stats", "<f4", 4), ("values", "<f4", 512)])  # fmt: skip
        rec["bmin"], rec["dif"] = bb[:, 0], (bb[:, 1] - bb[:, 0]).astype(np.uint8)
        rec["flags"] = NODE_FLAG_BBOX
        rec["mask"] = mask_words(t.leaf_mask)
        rec["stats"] = np.stack((mn, mx, avg, std), axis=1)
        rec["values"] = t.leaf_values
        buf[leaf_at:size] = rec.tobytes()

    def internal(count, at, node_size, table_at, dim, child_at, child_size, child_origin, child_parent,
                 child_shift, group):  # fmt: skip
        if not count:
            return
        mn, mx, avg, std, bb = _stats(vals, ijk, group, count)
        n_slots = 1 << (3 * dim)
        first = np.searchsorted(child_parent, np.arange(count + 1))
        idx = child_index(child_origin, child_shift, dim)
        mask_bytes = n_slots // 8
        for i in range(count):
            o = at + i * node_size
            struct.pack_into("<6iQ", buf, o, *bb[i, 0].tolist(), *bb[i, 1].tolist(), NODE_FLAG_BBOX)
            c0, c1 = first[i], first[i + 1]
            child = np.zeros(n_slots, bool)
            child[idx[c0:c1]] = True
            buf[o + 32 + mask_bytes : o + 32 + 2 * mask_bytes] = mask_words(child).tobytes()  # value mask: 0
            struct.pack_into("<4f", buf, o + 32 + 2 * mask_bytes, mn[i], mx[i], avg[i], std[i])
            table = np.zeros(n_slots, "<i8")
            table.view("<f4").reshape(-1, 2)[:, 0] = bg  # tile values in the low 4 bytes of a slot
            table[idx[c0:c1]] = child_at + np.arange(c0, c1, dtype=np.int64) * child_size - o
            buf[o + table_at : o + node_size] = table.tobytes()

    internal(nl, lower_at, LOWER_SIZE, LOWER_TABLE, 4, leaf_at, LEAF_SIZE, t.leaf, t.leaf_parent, SHIFT_LEAF,
             lower_id)  # fmt: skip
    internal(nu, upper_at, UPPER_SIZE, UPPER_TABLE, 5, lower_at, LOWER_SIZE, t.lower, t.lower_parent,
             SHIFT_LOWER, upper_id)  # fmt: skip

    # root and its tiles
    if n_vox:
        mn, mx, avg, std, bb = _stats(vals, ijk, np.zeros(n_vox, np.int64), 1)
        rmin, rmax, ravg, rstd, rbb = mn[0], mx[0], avg[0], std[0], bb[0]
    else:
        rmin = rmax = ravg = rstd = np.float32(0)
        rbb = np.array([[2**31 - 1] * 3, [-(2**31)] * 3], np.int32)  # an empty CoordBBox
    struct.pack_into(
        "<6iI5f", buf, root_at, *rbb[0].tolist(), *rbb[1].tolist(), nu, bg, rmin, rmax, ravg, rstd
    )
    for i, origin in enumerate(t.upper.tolist()):
        u = [(c & 0xFFFFFFFF) >> SHIFT_UPPER for c in origin]
        key = u[2] | (u[1] << 21) | (u[0] << 42)
        child = upper_at + i * UPPER_SIZE - root_at
        struct.pack_into("<QqIf", buf, root_at + ROOT_SIZE + i * TILE_SIZE, key, child, 0, 0.0)

    # tree
    offsets = [
        leaf_at - GRID_SIZE if nf else 0,
        lower_at - GRID_SIZE if nl else 0,
        upper_at - GRID_SIZE if nu else 0,
        ROOT_SIZE,
    ]
    struct.pack_into("<4Q3I3IQ", buf, GRID_SIZE, *offsets, nf, nl, nu, 0, 0, 0, n_vox)

    # grid
    s = g.voxel_size_m
    if n_vox:  # as nanovdb::gridStats: the map of the index bbox corners, max + 1
        wmin = (rbb[0].astype(np.float64) + 0.5) * s
        wmax = (rbb[1].astype(np.float64) + 1.5) * s
    else:
        wmin, wmax = np.full(3, np.inf), np.full(3, -np.inf)
    head = struct.pack("<QQIIIIQ", MAGIC, CHECKSUM_DISABLED, VERSION, FLAGS, grid_index, grid_count, size)
    head += name.ljust(256, b"\0") + _map(s)
    head += struct.pack("<6d3d", *wmin, *wmax, s, s, s)
    head += struct.pack("<IIqIIQQ", GRID_CLASS.get(g.grid_class, 0), GRID_TYPE_FLOAT, 0, 0, 0, 0, 0)
    buf[:GRID_SIZE] = head
    meta = {
        "voxels": n_vox,
        "class": GRID_CLASS.get(g.grid_class, 0),
        "world_bbox": (wmin, wmax),
        "index_bbox": rbb,
        "nodes": (nf, nl, nu),
    }
    return bytes(buf), meta


def nvdb_bytes(grids: list[VoxelGrid]) -> bytes:
    """The ``.nvdb`` file of ``grids``: one uncompressed segment per grid."""
    if not grids:
        raise InvalidArgument("grids: expected at least one grid")
    out = bytearray()
    for g in grids:
        buf, m = grid_buffer(g)  # a segment per grid: each buffer holds one grid (index 0 of 1)
        name = g.name.encode() + b"\0"
        out += struct.pack("<QIHH", MAGIC, VERSION, 1, 0)  # Header: one grid, codec NONE
        out += struct.pack(
            "<QQQQII", len(buf), len(buf), name_hash(g.name), m["voxels"], GRID_TYPE_FLOAT, m["class"]
        )
        out += struct.pack("<6d", *m["world_bbox"][0], *m["world_bbox"][1])
        out += struct.pack("<6i", *m["index_bbox"][0].tolist(), *m["index_bbox"][1].tolist())
        out += struct.pack("<3dI", g.voxel_size_m, g.voxel_size_m, g.voxel_size_m, len(name))
        out += struct.pack("<4I3IHHI", *m["nodes"], 1, 0, 0, 0, 0, 0, VERSION)
        out += name + buf
    return bytes(out)


def write_nvdb(path, grids: list[VoxelGrid]) -> Path:
    """Write ``grids`` to a NanoVDB file at ``path`` (see :func:`nvdb_bytes`)."""
    path = Path(path)
    path.write_bytes(nvdb_bytes(grids))
    return path

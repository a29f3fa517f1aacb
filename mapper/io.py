"""Mesh files and wire formats: PLY (binary little-endian out; binary or ASCII in) and msgpack-ready dicts.

Written PLY: ``x y z`` float, ``nx ny nz`` float, ``red green blue`` uchar (when the mesh has colours),
faces as ``list uchar int vertex_indices``. Read PLY: any vertex properties (positions required; normals,
colours and alpha optional, others skipped), faces with any list count/index types (polygons are
triangulated as fans). Meshes read from files carry no block structure (``vertex_keys`` -1, no blocks);
missing normals are computed (area-weighted face normals).
"""

from __future__ import annotations

import io as _io
import os
from pathlib import Path

import numpy as np
import torch

from .errors import InvalidArgument, InvalidArgumentType
from .mesh import Mesh

_PLY_TYPES = {
    "char": "i1",
    "int8": "i1",
    "uchar": "u1",
    "uint8": "u1",
    "short": "i2",
    "int16": "i2",
    "ushort": "u2",
    "uint16": "u2",
    "int": "i4",
    "int32": "i4",
    "uint": "u4",
    "uint32": "u4",
    "float": "f4",
    "float32": "f4",
    "double": "f8",
    "float64": "f8",
}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise InvalidArgumentType(f"mesh: expected a Mesh, got {type(mesh).__name__}")


# ------------------------------------------------------------------------------------------------ write
def mesh_to_ply_bytes(mesh: Mesh) -> bytes:
    """The mesh as a binary little-endian PLY file (bytes), e.g. for an HTTP response."""
    _check_mesh(mesh)
    v = mesh.num_vertices
    fields = [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("nx", "<f4"), ("ny", "<f4"), ("nz", "<f4")]
    if mesh.colors is not None:
        fields += [("red", "u1"), ("green", "u1"), ("blue", "u1")]
    vert = np.empty(v, dtype=np.dtype(fields))
    pos, nrm = _np(mesh.vertices).astype(np.float32), _np(mesh.normals).astype(np.float32)
    for i, a in enumerate("xyz"):
        vert[a] = pos[:, i]
        vert["n" + a] = nrm[:, i]
    if mesh.colors is not None:
        col = _np(mesh.colors).astype(np.uint8)
        for i, a in enumerate(("red", "green", "blue")):
            vert[a] = col[:, i]
    face = np.empty(mesh.num_faces, dtype=np.dtype([("n", "u1"), ("v", "<i4", (3,))]))
    face["n"] = 3
    face["v"] = _np(mesh.faces).astype(np.int32)
    props = "".join(f"property {'float' if t == '<f4' else 'uchar'} {n}\n" for n, t in fields)
    header = (
        "ply\nformat binary_little_endian 1.0\n"
        f"comment mapper mesh version {mesh.version} voxel_size_m {mesh.voxel_size_m!r}\n"
        f"element vertex {v}\n{props}"
        f"element face {mesh.num_faces}\nproperty list uchar int vertex_indices\nend_header\n"
    )
    return header.encode("ascii") + vert.tobytes() + face.tobytes()


def write_ply(path: str | os.PathLike, mesh: Mesh) -> None:
    """Write ``mesh`` as a binary little-endian PLY file (positions, normals, colours when present)."""
    data = mesh_to_ply_bytes(mesh)
    with open(path, "wb") as f:
        f.write(data)


MESH_SUFFIXES = (".ply", ".obj", ".glb")


def check_mesh_path(path: str | os.PathLike) -> str:
    """The mesh file format of ``path`` by its extension (``"ply"``, ``"obj"`` or ``"glb"``); raises
    :class:`~mapper.errors.InvalidArgument` for any other."""
    suffix = Path(path).suffix.lower()
    if suffix not in MESH_SUFFIXES:
        raise InvalidArgument(
            f"path: cannot write a mesh as {suffix or 'a file without extension'!r} ({path}); "
            f"use one of {', '.join(MESH_SUFFIXES)}"
        )
    return suffix[1:]


def write_mesh(path: str | os.PathLike, mesh: Mesh) -> str:
    """Write ``mesh`` in the format of ``path``'s extension: ``.ply`` (binary PLY, :func:`write_ply`),
    ``.obj`` (Wavefront, positions + normals; colours as vertex colours) or ``.glb`` (binary glTF, with
    vertex colours), the last two through trimesh. Returns the format written."""
    _check_mesh(mesh)
    fmt = check_mesh_path(path)
    if fmt == "ply":
        write_ply(path, mesh)
        return fmt
    # lazy: trimesh (large) loads only for a mesh export
    import trimesh

    tm = trimesh.Trimesh(
        vertices=_np(mesh.vertices).astype(np.float64),
        faces=_np(mesh.faces).astype(np.int64),
        vertex_normals=_np(mesh.normals).astype(np.float64),
        vertex_colors=None if mesh.colors is None else _np(mesh.colors).astype(np.uint8),
        process=False,
    )
    data = tm.export(file_type=fmt)
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return fmt


# ------------------------------------------------------------------------------------------------- read
class _Element:
    def __init__(self, name: str, count: int):
        self.name, self.count = name, count
        self.props: list[tuple[str, str, str | None]] = []  # (name, value type, list count type or None)


def _parse_header(f) -> tuple[str, list[_Element]]:
    if f.readline().strip() != b"ply":
        raise InvalidArgument("ply: not a PLY file (no 'ply' magic)")
    fmt, elements = None, []
    while True:
        line = f.readline()
        if not line:
            raise InvalidArgument("ply: header has no end_header")
        words = line.decode("ascii", "replace").split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "end_header":
            break
        if words[0] == "format":
            fmt = words[1]
        elif words[0] == "element":
            elements.append(_Element(words[1], int(words[2])))
        elif words[0] == "property":
            if not elements:
                raise InvalidArgument("ply: property before any element")
            if words[1] == "list":
                count_t, val_t, name = words[2], words[3], words[4]
                for t in (count_t, val_t):
                    if t not in _PLY_TYPES:
                        raise InvalidArgument(f"ply: unknown property type {t!r}")
                elements[-1].props.append((name, val_t, count_t))
            else:
                if words[1] not in _PLY_TYPES:
                    raise InvalidArgument(f"ply: unknown property type {words[1]!r}")
                elements[-1].props.append((words[2], words[1], None))
    if fmt not in ("ascii", "binary_little_endian", "binary_big_endian"):
        raise InvalidArgument(f"ply: unsupported format {fmt!r}")
    return fmt, elements


def _read_binary_element(buf: memoryview, pos: int, el: _Element, endian: str):
    """(dict of property -> array (lists: list of arrays or [N, k] array), new position)."""
    if all(c is None for _, _, c in el.props):
        dt = np.dtype([(n, endian + _PLY_TYPES[t]) for n, t, _ in el.props])
        arr = np.frombuffer(buf, dtype=dt, count=el.count, offset=pos)
        return {n: arr[n] for n, _, _ in el.props}, pos + dt.itemsize * el.count
    # lists: try the common fixed-size layout (every list has the first row's length), else walk rows
    if el.count == 0:
        return {n: np.zeros((0, 3), np.int64) for n, _, _ in el.props}, pos
    fields, p = [], pos
    for n, t, c in el.props:
        if c is None:
            fields.append((n, endian + _PLY_TYPES[t]))
            p += np.dtype(_PLY_TYPES[t]).itemsize
        else:
            k = int(np.frombuffer(buf, dtype=endian + _PLY_TYPES[c], count=1, offset=p)[0])
            fields.append((n + "#n", endian + _PLY_TYPES[c]))
            fields.append((n, endian + _PLY_TYPES[t], (k,)))
            p += np.dtype(_PLY_TYPES[c]).itemsize + k * np.dtype(_PLY_TYPES[t]).itemsize
    dt = np.dtype(fields)
    if pos + dt.itemsize * el.count <= len(buf):
        arr = np.frombuffer(buf, dtype=dt, count=el.count, offset=pos)
        ok = all(
            (arr[n + "#n"] == arr[n].shape[1]).all() if arr[n].ndim == 2 else (arr[n + "#n"] == 0).all()
            for n, _, c in el.props
            if c is not None
        )
        if ok:
            return {n: arr[n] for n, _, _ in el.props}, pos + dt.itemsize * el.count
    out: dict[str, list] = {n: [] for n, _, _ in el.props}
    p = pos
    for _ in range(el.count):
        for n, t, c in el.props:
            if c is None:
                out[n].append(np.frombuffer(buf, dtype=endian + _PLY_TYPES[t], count=1, offset=p)[0])
                p += np.dtype(_PLY_TYPES[t]).itemsize
            else:
                k = int(np.frombuffer(buf, dtype=endian + _PLY_TYPES[c], count=1, offset=p)[0])
                p += np.dtype(_PLY_TYPES[c]).itemsize
                out[n].append(np.frombuffer(buf, dtype=endian + _PLY_TYPES[t], count=k, offset=p))
                p += k * np.dtype(_PLY_TYPES[t]).itemsize
    return out, p


def _read_ascii_element(lines, el: _Element):
    out: dict[str, list] = {n: [] for n, _, _ in el.props}
    for _ in range(el.count):
        words = next(lines).split()
        i = 0
        for n, t, c in el.props:
            conv = float if _PLY_TYPES[t].startswith("f") else int
            if c is None:
                out[n].append(conv(words[i]))
                i += 1
            else:
                k = int(words[i])
                out[n].append(np.array([conv(w) for w in words[i + 1 : i + 1 + k]]))
                i += 1 + k
    return out


def _triangles(lists) -> np.ndarray:
    """int64 ``[T, 3]`` fan triangles of the polygons (``[N, k]`` array or a list of index arrays)."""
    if not (isinstance(lists, np.ndarray) and lists.ndim == 2):
        polys = [np.asarray(p, np.int64) for p in lists]
        if any(p.shape[0] < 3 for p in polys):
            raise InvalidArgument("ply: faces with fewer than 3 vertices")
        if polys and all(p.shape[0] == polys[0].shape[0] for p in polys):
            lists = np.stack(polys)
        else:
            tris = [(p[0], p[i], p[i + 1]) for p in polys for i in range(1, len(p) - 1)]
            return np.array(tris, np.int64).reshape(-1, 3)
    k = lists.shape[1]
    if lists.shape[0] and k < 3:
        raise InvalidArgument("ply: faces with fewer than 3 vertices")
    lists = lists.astype(np.int64)
    if k <= 3:
        return lists.reshape(-1, 3)
    fan = [np.stack((lists[:, 0], lists[:, i], lists[:, i + 1]), 1) for i in range(1, k - 1)]
    return np.stack(fan, 1).reshape(-1, 3)  # polygon-major


def _face_normals_to_vertices(v: np.ndarray, f: np.ndarray) -> np.ndarray:
    n = np.zeros_like(v, dtype=np.float64)
    if f.shape[0]:
        p = v.astype(np.float64)
        fn = np.cross(p[f[:, 1]] - p[f[:, 0]], p[f[:, 2]] - p[f[:, 0]])  # length = 2 * area
        for i in range(3):
            np.add.at(n, f[:, i], fn)
    length = np.linalg.norm(n, axis=1, keepdims=True)
    return np.where(length > 0, n / np.where(length > 0, length, 1), 0).astype(np.float32)


def _read_elements(data: bytes) -> dict[str, dict]:
    f = _io.BytesIO(data)
    fmt, elements = _parse_header(f)
    pos = f.tell()
    values: dict[str, dict] = {}
    if fmt == "ascii":
        lines = iter(data[pos:].decode("ascii").splitlines())
        lines = (ln for ln in lines if ln.strip())
        for el in elements:
            values[el.name] = _read_ascii_element(lines, el)
    else:
        endian = "<" if fmt == "binary_little_endian" else ">"
        buf = memoryview(data)
        for el in elements:
            values[el.name], pos = _read_binary_element(buf, pos, el, endian)
    return values


def read_ply(path_or_bytes, device: str | torch.device = "cpu") -> Mesh:
    """Read a PLY mesh (binary little/big-endian or ASCII) from a path or bytes.

    Returns a :class:`Mesh` (float32 positions, int32 triangles, normals from the file or computed, uint8
    RGB colours when the file has ``red green blue``; alpha is dropped) with no block structure.
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
    elif isinstance(path_or_bytes, (str, os.PathLike)):
        data = Path(path_or_bytes).read_bytes()
    else:
        raise InvalidArgumentType(
            f"path_or_bytes: expected a path or bytes, got {type(path_or_bytes).__name__}"
        )
    try:
        values = _read_elements(data)
    except InvalidArgument:
        raise
    except (ValueError, IndexError, StopIteration, UnicodeDecodeError) as e:
        raise InvalidArgument(f"ply: malformed or truncated data ({e})") from None
    if "vertex" not in values or not all(a in values["vertex"] for a in "xyz"):
        raise InvalidArgument("ply: no vertex element with x, y, z")
    vx = values["vertex"]
    verts = np.stack([np.asarray(vx[a], np.float64) for a in "xyz"], 1).astype(np.float32)
    faces = np.zeros((0, 3), np.int64)
    if "face" in values:
        name = next((n for n in ("vertex_indices", "vertex_index") if n in values["face"]), None)
        if name is None:
            raise InvalidArgument("ply: face element without vertex_indices")
        faces = _triangles(values["face"][name])
    if faces.shape[0] and (faces.min() < 0 or faces.max() >= verts.shape[0]):
        raise InvalidArgument("ply: face indices out of range")
    if all(n in vx for n in ("nx", "ny", "nz")):
        normals = np.stack([np.asarray(vx[n], np.float32) for n in ("nx", "ny", "nz")], 1)
    else:
        normals = _face_normals_to_vertices(verts, faces)
    colors = None
    if all(n in vx for n in ("red", "green", "blue")):
        colors = np.stack([np.asarray(vx[n]) for n in ("red", "green", "blue")], 1)
        if colors.dtype.kind == "f":  # some writers store 0..1 floats
            colors = np.round(np.clip(colors, 0, 1) * 255)
        colors = colors.astype(np.uint8)
    dev = torch.device(device)
    n = verts.shape[0]
    return Mesh(
        vertices=torch.from_numpy(verts).to(dev),
        faces=torch.from_numpy(faces.astype(np.int32)).to(dev),
        normals=torch.from_numpy(np.ascontiguousarray(normals, np.float32)).to(dev),
        colors=None if colors is None else torch.from_numpy(colors).to(dev),
        vertex_keys=torch.full((n,), -1, dtype=torch.int64, device=dev),
        blocks=torch.zeros((0, 3), dtype=torch.int64, device=dev),
        block_face_offsets=torch.zeros(1, dtype=torch.int64, device=dev),
        removed_blocks=torch.zeros((0, 3), dtype=torch.int64, device=dev),
        version=0,
        full=True,
    )


# ---------------------------------------------------------------------------------------------- msgpack
_ARRAYS = {  # field -> wire dtype name (the service's array convention, mapper.wire)
    "vertices": "float32",
    "faces": "int32",
    "normals": "float32",
    "colors": "uint8",
    "vertex_keys": "int64",
    "blocks": "int64",
    "block_face_offsets": "int64",
    "removed_blocks": "int64",
}
_NP = {
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "int64": np.dtype("<i8"),
}


def mesh_to_msgpack_dict(mesh: Mesh) -> dict:
    """Plain dict for msgpack: scalars, and every array as ``{"dtype": "float32"|"int32"|"uint8"|"int64",
    "shape": [..], "data": bytes}`` (little-endian, C order, as in :mod:`mapper.wire`); ``colors`` is None
    when the mesh has none."""
    _check_mesh(mesh)
    out = {
        "version": int(mesh.version),
        "full": bool(mesh.full),
        "since_version": mesh.since_version,
        "voxel_size_m": float(mesh.voxel_size_m),
    }
    for name, dt in _ARRAYS.items():
        t = getattr(mesh, name)
        if t is None:
            out[name] = None
            continue
        a = np.ascontiguousarray(_np(t).astype(_NP[dt]))
        out[name] = {"dtype": dt, "shape": list(a.shape), "data": a.tobytes()}
    return out


def mesh_from_msgpack_dict(d: dict, device: str | torch.device = "cpu") -> Mesh:
    """Inverse of :func:`mesh_to_msgpack_dict`."""
    if not isinstance(d, dict):
        raise InvalidArgumentType(f"d: expected a dict, got {type(d).__name__}")
    dev = torch.device(device)
    arrays = {}
    try:
        for name, dt in _ARRAYS.items():
            entry = d[name]
            if entry is None:
                arrays[name] = None
                continue
            if entry["dtype"] != dt:
                raise ValueError(f"{name}: expected dtype {dt}, got {entry['dtype']}")
            a = np.frombuffer(entry["data"], dtype=_NP[dt]).reshape(entry["shape"])
            arrays[name] = torch.from_numpy(a.astype(a.dtype.newbyteorder("="))).to(dev)
        return Mesh(
            **arrays,
            version=int(d["version"]),
            full=bool(d["full"]),
            since_version=d["since_version"],
            voxel_size_m=float(d["voxel_size_m"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgument(f"d: not a mesh dict: {e}") from None


def mesh_to_msgpack(mesh: Mesh) -> bytes:
    """:func:`mesh_to_msgpack_dict` packed with msgpack (an optional dependency, imported here)."""
    # lazy: `import mapper` stays free of the wire libraries
    import msgpack

    return msgpack.packb(mesh_to_msgpack_dict(mesh), use_bin_type=True)


def mesh_from_msgpack(data: bytes, device: str | torch.device = "cpu") -> Mesh:
    # lazy: `import mapper` stays free of the wire libraries
    import msgpack

    return mesh_from_msgpack_dict(msgpack.unpackb(data, raw=False), device)

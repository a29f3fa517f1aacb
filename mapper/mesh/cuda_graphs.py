"""Triangle meshes of a TSDF layer by marching cubes: sparse, vectorised, incremental by brick.

**Cells.** A cell is the cube between 8 voxel centres ``(i..i+1, j..j+1, k..k+1)``; it belongs to the
*block* (= brick, ``min corner >> 2``) of its min corner and is meshed only when all 8 corners are observed
(weight > 0). A corner is *inside* when ``tsdf <= 0`` (the sign rule of :mod:`mapper.surface`).

**The case table** is generated here, not copied: for each of the 256 inside/outside patterns, every cube
face gets marching-squares segments between its sign-changing edges. A face with two inside corners on a
diagonal is ambiguous; the fixed, face-local rule is to **cut off the face's corners (0, 0) and (1, 1)**
(face-local axes = the two other world axes in increasing order), whatever their sign. Both cells sharing
the face see the same corners, so they make the same choice (no cracks), and the rule does not depend on
the sign, so complementary cases give the same surface with opposite orientation. Each segment is directed
so that the surface normal points to the outside (``tsdf > 0``, free space); the directed segments chain
into closed loops and each loop is triangulated as a fan from the lowest-numbered vertex whose diagonals
do not lie in a cube face.

**Vertices** sit on lattice edges (linear interpolation between the two voxel centres) and are welded by an
int64 *edge key* of (min voxel, axis), so the mesh is watertight where the surface is. Normals are the
TSDF gradient (central differences, one-sided where a neighbour is unobserved) at both voxel centres,
interpolated along the edge and normalised; colours are interpolated the same way when the layer has them.

**Canonical order.** Blocks sorted by block key (brick i, j, k), faces inside a block by cell (in-brick
offset order), then by the table; vertices sorted by edge key. Equal surfaces give equal arrays, which is
what makes ``apply_delta(prev, mesh_since(...))`` checkable against a full :func:`extract_mesh`.

**Incremental.** A cell reads its 8 corners and, for the normals, the 6-neighbours of its edges' end
voxels: up to 2 voxels below and 1 above its min corner on each axis. So a change in brick ``b`` can alter
the cells of the 27 bricks ``b + {-1, 0, 1}^3`` (not only the lower neighbours); :func:`mesh_since`
re-meshes exactly those blocks.

**Key ranges.** An edge key has 64 bits for (i, j, k, axis): i and j get 21 bits, k 20, the axis 2. Meshing
works for voxel coordinates ``-2^20 <= i, j < 2^20 - 4`` (the whole map range) and ``-2^19 <= k < 2^19 - 4``
(z is up in this project's worlds; ``InvalidArgument`` otherwise).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

from .. import graphs
from ..errors import Conflict, InvalidArgument, InvalidArgumentType
from ..kernels.dispatch import compiled, triton_twin
from ..kernels.marching import (
    BLOCK_BIAS,
    BLOCK_BITS,
    IJ_BIAS,
    IJ_BITS,
    K_BIAS,
    K_BITS,
    changed_neighbourhood_keys,
    marching_cubes,
)
from ..kernels.marching import neighbour_slots as nbr_slots_op
from ..layers import BrickLayer

# ----------------------------------------------------------------------------------------------------
# cube geometry: corner c sits at offset (c & 1, (c >> 1) & 1, (c >> 2) & 1) from the cell's min corner;
# edge e = 4 * axis + (bit of the lower other axis) + 2 * (bit of the higher other axis)

CORNER_OFFSETS = np.array([[c & 1, (c >> 1) & 1, (c >> 2) & 1] for c in range(8)], dtype=np.int64)


def _other_axes(axis: int) -> tuple[int, int]:
    u, w = (a for a in range(3) if a != axis)
    return u, w


def _edge_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    corners, axes, mins = [], [], []
    for axis in range(3):
        u, w = _other_axes(axis)
        for bits in range(4):
            o = [0, 0, 0]
            o[u], o[w] = bits & 1, bits >> 1
            c0 = o[0] | (o[1] << 1) | (o[2] << 2)
            corners.append((c0, c0 | (1 << axis)))
            axes.append(axis)
            mins.append(o)
    return np.array(corners, np.int64), np.array(axes, np.int64), np.array(mins, np.int64)


EDGE_CORNERS, EDGE_AXIS, EDGE_MIN_OFFSET = _edge_table()  # [12, 2], [12], [12, 3]


def _edge_between(c0: int, c1: int) -> int:
    a, b = min(c0, c1), max(c0, c1)
    for e in range(12):
        if EDGE_CORNERS[e, 0] == a and EDGE_CORNERS[e, 1] == b:
            return e
    raise ValueError(f"corners {c0}, {c1} are not adjacent")


def _corner_at(o) -> int:
    return int(o[0]) | (int(o[1]) << 1) | (int(o[2]) << 2)


@functools.cache
def _faces() -> list[tuple[np.ndarray, list[int], list[int]]]:
    """The 6 cube faces: (outward normal, corners at face-local (0,0), (1,0), (0,1), (1,1), edges in order
    (0,0)-(1,0), (0,1)-(1,1), (0,0)-(0,1), (1,0)-(1,1))."""
    out = []
    for n in range(3):
        u, w = _other_axes(n)
        for side in range(2):
            normal = np.zeros(3)
            normal[n] = 2 * side - 1
            cs = []
            for b in range(2):
                for a in range(2):
                    o = [0, 0, 0]
                    o[n], o[u], o[w] = side, a, b
                    cs.append(_corner_at(o))
            c00, c10, c01, c11 = cs
            edges = [_edge_between(c00, c10), _edge_between(c01, c11), _edge_between(c00, c01)]
            edges.append(_edge_between(c10, c11))
            out.append((normal, cs, edges))
    return out


def _edge_midpoint(e: int) -> np.ndarray:
    p = EDGE_MIN_OFFSET[e].astype(np.float64)
    p[EDGE_AXIS[e]] += 0.5
    return p


def _face_segments(case: int) -> list[tuple[int, int]]:
    """Directed segments (edge -> edge) of all 6 faces of a case; the surface lies to the left of a segment
    seen from outside the cube, with its normal towards the outside corners."""
    inside = [(case >> c) & 1 for c in range(8)]
    segs = []
    for normal, cs, edges in _faces():
        c00, c10, c01, c11 = cs
        e_bottom, e_top, e_left, e_right = edges
        crossing = [e for e in edges if inside[EDGE_CORNERS[e, 0]] != inside[EDGE_CORNERS[e, 1]]]
        if len(crossing) == 2:
            pairs = [tuple(crossing)]
        elif len(crossing) == 4:  # ambiguous: cut off the corners (0, 0) and (1, 1)
            pairs = [(e_bottom, e_left), (e_top, e_right)]
        else:
            pairs = []
        for e1, e2 in pairs:
            g = np.zeros(3)  # in-face direction from the inside side to the outside side
            for e in (e1, e2):
                a, b = EDGE_CORNERS[e]
                d = (CORNER_OFFSETS[b] - CORNER_OFFSETS[a]).astype(np.float64)
                g += d if inside[a] else -d
            t = np.cross(g, normal)
            if float(t @ (_edge_midpoint(e2) - _edge_midpoint(e1))) < 0:
                e1, e2 = e2, e1
            segs.append((e1, e2))
    return segs


def _loops(case: int) -> list[list[int]]:
    """Closed, directed loops of edges, each starting at its lowest edge."""
    succ: dict[int, int] = {}
    pred: dict[int, int] = {}
    for a, b in _face_segments(case):
        if a in succ or b in pred:
            raise AssertionError(f"case {case}: edge used twice in one direction")
        succ[a], pred[b] = b, a
    if set(succ) != set(pred):
        raise AssertionError(f"case {case}: open segment chain")
    loops, seen = [], set()
    for start in sorted(succ):
        if start in seen:
            continue
        loop, e = [], start
        while e not in seen:
            seen.add(e)
            loop.append(e)
            e = succ[e]
        if e != start:
            raise AssertionError(f"case {case}: chain does not close")
        loops.append(loop)
    return loops


_FACE_EDGE_SETS = [frozenset(edges) for _, _, edges in _faces()]


def _share_face(a: int, b: int) -> bool:
    return any(a in s and b in s for s in _FACE_EDGE_SETS)


def _fan(loop: list[int]) -> list[tuple[int, int, int]]:
    """Fan triangles of a loop from the lowest-numbered apex whose diagonals all cross the cube's interior
    (a diagonal between two vertices of one face would lie in that face and could be shared with the
    neighbouring cell). The choice does not depend on the loop's direction."""
    n = len(loop)
    ok = [r for r in range(n) if not any(_share_face(loop[r], loop[(r + i) % n]) for i in range(2, n - 1))]
    apex = min(ok, key=lambda r: loop[r]) if ok else loop.index(min(loop))
    lo = loop[apex:] + loop[:apex]
    return [(lo[0], lo[i], lo[i + 1]) for i in range(1, n - 1)]


@functools.cache
def case_table() -> tuple[np.ndarray, np.ndarray]:
    """The generated marching-cubes table: (int8 ``[256, T, 3]`` edge triples, -1 padded; int64 ``[256]``
    triangle counts). Triangles are counter-clockwise seen from the outside (``tsdf > 0``) side."""
    tris = [[t for loop in _loops(c) for t in _fan(loop)] for c in range(256)]
    width = max(len(t) for t in tris)
    table = np.full((256, width, 3), -1, np.int8)
    for c, ts in enumerate(tris):
        if ts:
            table[c, : len(ts)] = ts
    return table, np.array([len(t) for t in tris], np.int64)


# ----------------------------------------------------------------------------------------------------
# keys

_BLOCK_BITS, _BLOCK_BIAS = BLOCK_BITS, BLOCK_BIAS
_IJ_BITS, _K_BITS = IJ_BITS, K_BITS  # the edge key layout lives in mapper.kernels.keys
_IJ_BIAS, _K_BIAS = IJ_BIAS, K_BIAS
VOXEL_RANGE_IJ = (-IJ_BIAS, IJ_BIAS)  # lattice points edge keys can hold, per axis: [lo, hi)
VOXEL_RANGE_K = (-K_BIAS, K_BIAS)


def block_keys(blocks: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]`` sortable keys (i major) of int64 ``[B, 3]`` brick coordinates."""
    b = blocks + _BLOCK_BIAS
    return (b[:, 0] << (2 * _BLOCK_BITS)) | (b[:, 1] << _BLOCK_BITS) | b[:, 2]


def decode_block_keys(keys: torch.Tensor) -> torch.Tensor:
    m = (1 << _BLOCK_BITS) - 1
    return (
        torch.stack(((keys >> (2 * _BLOCK_BITS)) & m, (keys >> _BLOCK_BITS) & m, keys & m), 1) - _BLOCK_BIAS
    )


def edge_keys(voxel: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` key of the lattice edge from voxel ``voxel`` (int64 ``[N, 3]``) to ``voxel + e_axis``.

    Layout: signed i in the top 21 bits, then j + 2^20 (21 bits), k + 2^19 (20 bits), axis (2 bits); the
    signed order of the keys is the lexicographic order of (i, j, k, axis)."""
    return (
        (voxel[:, 0] << (_IJ_BITS + _K_BITS + 2))
        | ((voxel[:, 1] + _IJ_BIAS) << (_K_BITS + 2))
        | ((voxel[:, 2] + _K_BIAS) << 2)
        | axis
    )


def decode_edge_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`edge_keys`: (int64 ``[N, 3]`` min voxel, int64 ``[N]`` axis)."""
    i = keys >> (_IJ_BITS + _K_BITS + 2)
    j = ((keys >> (_K_BITS + 2)) & ((1 << _IJ_BITS) - 1)) - _IJ_BIAS
    k = ((keys >> 2) & ((1 << _K_BITS) - 1)) - _K_BIAS
    return torch.stack((i, j, k), 1), keys & 3


# ----------------------------------------------------------------------------------------------------
# the mesh


ARRAY_FIELDS = (
    "vertices",
    "faces",
    "normals",
    "colors",
    "vertex_keys",
    "blocks",
    "block_face_offsets",
    "removed_blocks",
)


@dataclass(eq=False)
class Mesh:
    """A triangle mesh of the TSDF zero level set, or a delta of one (see :func:`mesh_since`).

    Tensors live on the layer's device.

    Attributes:
        vertices: float32 ``[V, 3]`` positions in metres.
        faces: int32 ``[F, 3]`` vertex indices, counter-clockwise seen from free space.
        normals: float32 ``[V, 3]`` unit normals pointing to free space.
        colors: uint8 ``[V, 3]`` RGB, or None when the layer has no colour.
        vertex_keys: int64 ``[V]`` edge key of each vertex (sorted; -1 for meshes read from files).
        blocks: int64 ``[B, 3]`` bricks that own at least one face, sorted by block key.
        block_face_offsets: int64 ``[B + 1]``: the faces of block b are ``faces[off[b]:off[b + 1]]``.
        removed_blocks: int64 ``[R, 3]`` bricks covered by this mesh that have no face (a delta's consumer
            drops what it had there); empty for full meshes.
        version: the layer version the mesh shows.
        full: True when the mesh covers the whole layer (replace, don't patch).
        since_version: for a delta, the version it is relative to; None otherwise.
        voxel_size_m: voxel edge in metres (0.0 when unknown).
    """

    vertices: torch.Tensor
    faces: torch.Tensor
    normals: torch.Tensor
    colors: torch.Tensor | None
    vertex_keys: torch.Tensor
    blocks: torch.Tensor
    block_face_offsets: torch.Tensor
    removed_blocks: torch.Tensor
    version: int = 0
    full: bool = True
    since_version: int | None = None
    voxel_size_m: float = 0.0

    @property
    def num_vertices(self) -> int:
        return int(self.vertices.shape[0])

    @property
    def num_faces(self) -> int:
        return int(self.faces.shape[0])

    @property
    def device(self) -> torch.device:
        return self.vertices.device

    @property
    def has_blocks(self) -> bool:
        """Whether the faces are partitioned into blocks (meshes from files are not)."""
        return int(self.block_face_offsets[-1]) == self.num_faces

    def face_blocks(self) -> torch.Tensor:
        """int64 ``[F]``: the index (into ``blocks``) of each face's block."""
        counts = self.block_face_offsets[1:] - self.block_face_offsets[:-1]
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def to(self, device: str | torch.device) -> Mesh:
        dev = torch.device(device)
        return replace(
            self, **{k: None if (t := getattr(self, k)) is None else t.to(dev) for k in ARRAY_FIELDS}
        )

    def equals(self, other: Mesh) -> bool:
        """Exact equality of every array (bitwise for floats; ``colors`` None on both or equal) and of the
        version."""
        if not isinstance(other, Mesh) or self.version != other.version:
            return False
        for k in ARRAY_FIELDS:
            a, b = getattr(self, k), getattr(other, k)
            if a is None or b is None:
                if a is not b:
                    return False
            elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b.to(a.device)):
                return False
        return True

    def __repr__(self) -> str:
        kind = "full" if self.full else f"delta since {self.since_version}"
        return (
            f"Mesh(vertices={self.num_vertices}, faces={self.num_faces}, blocks={self.blocks.shape[0]}, "
            f"removed_blocks={self.removed_blocks.shape[0]}, version={self.version}, {kind})"
        )


def empty_mesh(device: torch.device, with_color: bool, version: int = 0, voxel_size_m: float = 0.0) -> Mesh:
    z = torch.zeros
    return Mesh(
        vertices=z((0, 3), dtype=torch.float32, device=device),
        faces=z((0, 3), dtype=torch.int32, device=device),
        normals=z((0, 3), dtype=torch.float32, device=device),
        colors=z((0, 3), dtype=torch.uint8, device=device) if with_color else None,
        vertex_keys=z(0, dtype=torch.int64, device=device),
        blocks=z((0, 3), dtype=torch.int64, device=device),
        block_face_offsets=z(1, dtype=torch.int64, device=device),
        removed_blocks=z((0, 3), dtype=torch.int64, device=device),
        version=version,
        voxel_size_m=voxel_size_m,
    )


# ----------------------------------------------------------------------------------------------------
# extraction (the per-brick work is ``mapper.kernels.marching``: a Triton kernel or its torch reference)


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The case table on ``device`` (int64 ``[256, T, 3]``, int64 ``[256]``)."""
    table, count = case_table()
    return torch.from_numpy(table.astype(np.int64)).to(device), torch.from_numpy(count).to(device)


def neighbour_slots(layer: BrickLayer, bricks: torch.Tensor) -> torch.Tensor:
    """int64 ``[M, 27]``: pool slot of each brick's 27 neighbours (``mapper.kernels.marching`` order), -1
    where absent."""
    g = layer.grid
    tiles = g.tiles if g.num_leaves else None
    return nbr_slots_op(bricks, g.leaves, tiles, layer.slots)


def _check_layer(layer) -> None:
    if not isinstance(layer, BrickLayer):
        raise InvalidArgumentType(f"layer: expected a BrickLayer, got {type(layer).__name__}")
    for f in ("tsdf", "weight"):
        if f not in layer.pool.fields:
            raise InvalidArgument(f"layer: not a TSDF layer (no {f!r} field)")


def _check_voxel_size(voxel_size_m) -> float:
    if isinstance(voxel_size_m, bool) or not isinstance(voxel_size_m, (int, float)):
        raise InvalidArgumentType(f"voxel_size_m: expected a number, got {type(voxel_size_m).__name__}")
    s = float(voxel_size_m)
    if not np.isfinite(s) or s <= 0:
        raise InvalidArgument(f"voxel_size_m: expected a finite value > 0, got {voxel_size_m}")
    return s


def _sorted_unique_blocks(blocks: torch.Tensor) -> torch.Tensor:
    if blocks.shape[0] == 0:
        return blocks.reshape(0, 3)
    return decode_block_keys(torch.unique(block_keys(blocks)))


@functools.cache
def _range_t(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    limits = (VOXEL_RANGE_IJ, VOXEL_RANGE_IJ, VOXEL_RANGE_K)
    return (
        torch.tensor([mn for mn, _ in limits], device=device),
        torch.tensor([mx for _, mx in limits], device=device),
    )


def _check_key_range(bricks: torch.Tensor, present: torch.Tensor) -> None:
    """Edge keys hold voxel i, j in [-2^20, 2^20) and k in [-2^19, 2^19); cells reach 4 voxels up. Checks
    the present bricks (one read-back)."""
    if bricks.shape[0] == 0:
        return
    limits = (VOXEL_RANGE_IJ, VOXEL_RANGE_IJ, VOXEL_RANGE_K)
    lo, hi = _range_t(bricks.device)
    v = bricks << 2
    bad = (present[:, None] & ((v < lo) | (v + 4 >= hi))).any(0).tolist()
    for axis, (mn, mx) in enumerate(limits):
        if bad[axis]:
            a = int(v[present, axis].min())
            b = int(v[present, axis].max()) + 4
            raise InvalidArgument(
                f"layer: meshing supports voxel coordinates in [{mn}, {mx - 4}) on axis {'ijk'[axis]} "
                f"(edge key range); the layer reaches [{a}, {b - 1}]"
            )


def _assemble(result, bricks, dev, with_color, version, s, partial: bool) -> Mesh:
    """The mesh of a :func:`~mapper.kernels.marching.marching_cubes` result over ``bricks``, with its block
    bookkeeping (one read-back: the number of blocks with faces)."""
    face_counts, keys, pos, nrm, col, faces = result
    has = face_counts > 0
    idx = has.nonzero().squeeze(1)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    if partial:  # requested blocks without faces: the consumer drops what it had there
        n_empty = bricks.shape[0] - idx.numel()
        try:  # no read-back: the size is known
            removed = bricks[torch.nonzero_static(~has, size=n_empty).squeeze(1)]
        except (AttributeError, NotImplementedError, RuntimeError):  # pragma: no cover - older torch
            removed = bricks[~has]
    else:
        removed = torch.zeros((0, 3), dtype=torch.int64, device=dev)
    return Mesh(
        vertices=pos,
        faces=faces.to(torch.int32),
        normals=nrm,
        colors=col,
        vertex_keys=keys,
        blocks=bricks[idx],
        block_face_offsets=torch.cat((zero, torch.cumsum(face_counts, 0)[idx])),
        removed_blocks=removed,
        version=version,
        full=not partial,
        voxel_size_m=s,
    )


def extract_mesh(layer: BrickLayer, voxel_size_m: float, bricks=None) -> Mesh:
    """Marching-cubes mesh of a TSDF layer's zero level set.

    Args:
        layer: a TSDF :class:`~mapper.layers.BrickLayer` (fields ``tsdf``, ``weight``; ``color`` and
            ``color_weight`` give vertex colours).
        voxel_size_m: voxel edge in metres.
        bricks: optional integer ``[M, 3]`` brick coordinates (``voxel >> 2``): mesh only the cells whose
            min corner lies in them (duplicates and absent bricks are fine). None = every allocated brick.
    Returns:
        A :class:`Mesh` on the layer's device. With ``bricks`` the mesh is a patch for those blocks
        (``full=False``; requested bricks without faces are listed in ``removed_blocks``).
    """
    _check_layer(layer)
    s = _check_voxel_size(voxel_size_m)
    dev = layer.device
    with_color = "color" in layer.pool.fields and "color_weight" in layer.pool.fields
    if bricks is None:
        req = _sorted_unique_blocks(layer.brick_table()[0])
    else:
        if not isinstance(bricks, torch.Tensor):
            bricks = torch.as_tensor(np.asarray(bricks))
        if bricks.dtype not in (torch.int32, torch.int64) or bricks.dim() != 2 or bricks.shape[1] != 3:
            raise InvalidArgument(
                f"bricks: expected an integer tensor [M, 3], got {list(bricks.shape)} {bricks.dtype}"
            )
        req = _sorted_unique_blocks(bricks.to(dev, torch.int64))
        lim = _BLOCK_BIAS >> 2
        if req.shape[0] and bool(((req < -lim) | (req >= lim)).any()):
            raise InvalidArgument(f"bricks: coordinates must lie in [-{lim}, {lim})")
    return _mesh_blocks(layer, s, req, with_color, partial=bricks is not None)


def _mesh_blocks(layer: BrickLayer, s: float, req: torch.Tensor, with_color: bool, partial: bool) -> Mesh:
    """The mesh of the cells of ``req`` (int64 ``[M, 3]``, sorted by block key, unique; absent bricks have
    no cells: their min corners are unobserved)."""
    dev = layer.device
    nbr = neighbour_slots(layer, req)
    mesh = _mesh_graphed(layer, s, req, nbr, with_color, partial)
    if mesh is not None:
        return mesh
    _check_key_range(req, nbr[:, 13] >= 0)
    table, count = _tables(dev)
    result = marching_cubes(req, nbr, layer.pool, table, count, s, with_color)
    return _assemble(result, req, dev, with_color, layer.version, s, partial)


# ----------------------------------------------------------------------------------------------------
# CUDA graphs (mapper.graphs): a short brick list (an incremental mesh) is launch-bound, so its marching
# cubes replays one graph per power-of-two bucket of the list; longer lists (full meshes) run eagerly

GRAPH_MIN_BRICKS = 64  # the smallest bucket
GRAPH_MAX_BRICKS = 2048  # longer lists run eagerly (GPU-bound there; bounds the graphs' memory)
GRAPH_TRI_PER_BRICK = 32  # triangle capacity per bucket brick; a list with more runs eagerly
GRAPH_PAGES = 1024  # pool pages a graph's tables hold (2^24 bricks at 16 k per page); more run eagerly
# deltas: one graph from the changed bricks to the mesh, per bucket of the changed-brick count
GRAPH_MAX_CHANGED = 2048  # more changed bricks: the eager path (a depth frame at 5 cm: 700-1100)
# capacities per changed brick of a bucket (a room's depth frame at 5 cm: ~3 blocks and ~23 triangles per
# changed brick); a delta that does not fit replays the next bucket (twice the capacity)
GRAPH_BLOCKS_PER_CHANGED = 4  # blocks (the 27-neighbourhoods, present and unique)
GRAPH_TRI_PER_CHANGED = 32  # triangles
GRAPH_LEAVES = 1 << 19  # grid leaves the graphs' copy of the grid holds (shared by the buckets)
_BIG = 1 << 62
_SENTINEL = (1 << 63) - 1


def _mc_graph_inputs(key, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A bucket's static inputs, holding an empty list (no cell reads a page)."""
    mb, _with_color = key
    table, count = _tables(dev)
    i64 = torch.int64
    return (
        torch.zeros((mb, 3), dtype=i64, device=dev),
        torch.full((mb, 27), -1, dtype=i64, device=dev),
        torch.zeros(1, dtype=i64, device=dev),
        torch.full((GRAPH_PAGES + 1,), _BIG, dtype=i64, device=dev),
        *(torch.zeros(GRAPH_PAGES, dtype=i64, device=dev) for _ in range(4)),
        torch.ones(1, dtype=torch.float64, device=dev),
        table.to(torch.int32).reshape(-1).contiguous(),
        count.to(torch.int32).contiguous(),
    )


def _mc_graph_fn(key, *inputs):
    mb, with_color = key
    fn = triton_twin("triton_mesh:marching_cubes_static_triton")
    out = fn(*inputs, tri_cap=mb * GRAPH_TRI_PER_BRICK, with_color=with_color)
    return _mesh_outputs(out, inputs[0], torch.zeros(2, dtype=torch.int64, device=inputs[0].device))


MC_GRAPHS = graphs.GraphedOp("marching_cubes", _mc_graph_fn, _mc_graph_inputs, max_graphs=16)


@functools.cache
def _grid_buffers(dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The delta graphs' copy of a layer's grid and slot table (shared by every bucket: replays take turns
    under the op's lock, each filling it first): leaf keys (padded with the largest key: the graph finds
    leaves by a binary search of them, no tile index), slot table."""
    return (
        torch.full((GRAPH_LEAVES,), _SENTINEL, dtype=torch.int64, device=dev),
        torch.full((GRAPH_LEAVES, 8), -1, dtype=torch.int32, device=dev),
    )


def _delta_graph_inputs(key, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A delta bucket's static inputs, holding no changed brick."""
    cb, with_color = key
    return (
        torch.full((cb,), -1, dtype=torch.int64, device=dev),
        *_grid_buffers(dev),
        *_mc_graph_inputs((1, with_color), dev)[3:],
    )


def _delta_graph_fn(key, *inputs):
    cb, with_color = key
    fn = triton_twin("triton_mesh:changed_mesh_static_triton")
    out = fn(
        *inputs,
        m_cap=cb * GRAPH_BLOCKS_PER_CHANGED,
        tri_cap=cb * GRAPH_TRI_PER_CHANGED,
        with_color=with_color,
    )
    return _delta_outputs(out)


def _delta_outputs(out) -> tuple[torch.Tensor, ...]:
    """``changed_mesh_static_triton``'s outputs as :func:`_mesh_outputs`' (inside the graph)."""
    *mc, req, sizes = out
    return _mesh_outputs((*mc, sizes[:5]), req, sizes[5:])


DELTA_GRAPHS = graphs.GraphedOp("mesh_delta", _delta_graph_fn, _delta_graph_inputs, max_graphs=16)


def _graph_buckets(largest: int = GRAPH_MAX_BRICKS) -> list[int]:
    b, out = GRAPH_MIN_BRICKS, []
    while b <= largest:
        out.append(b)
        b *= 2
    return out


def warm_graphs(layer: BrickLayer) -> int:
    """Capture the marching-cubes graphs a TSDF layer's meshes use (every bucket; called by the map's
    warm-up, so no capture happens mid-sequence); returns how many are ready (0 where graphs don't apply)."""
    dev = layer.device
    if not (graphs.enabled(dev) and compiled(dev)):
        return 0
    with_color = "color" in layer.pool.fields and "color_weight" in layer.pool.fields
    n = sum(MC_GRAPHS.warm((mb, with_color), dev) for mb in _graph_buckets())
    return n + sum(DELTA_GRAPHS.warm((cb, with_color), dev) for cb in _graph_buckets(GRAPH_MAX_CHANGED))


def _mesh_graphed(layer, s: float, req: torch.Tensor, nbr: torch.Tensor, with_color: bool, partial: bool):
    """The mesh of ``req`` (as ``_mesh_blocks``) from a graph replay of the marching cubes and the block
    bookkeeping (one read-back: the sizes), or None where graphs do not apply (CPU, interpreter,
    ``MAPPER_CUDA_GRAPHS=0``, a list outside the buckets, too many pages, more triangles than the bucket
    holds, a brick out of the edge-key range): the caller runs the eager op (and raises on the range)."""
    dev = req.device
    m = req.shape[0]
    if not (0 < m <= GRAPH_MAX_BRICKS and graphs.enabled(dev) and compiled(dev)):
        return None
    pool = layer.pool
    if pool.page_start_table().numel() - 1 > GRAPH_PAGES:
        return None
    mb = graphs.bucket(m, GRAPH_MIN_BRICKS)

    def fill(inp):
        inp[0][:m].copy_(req)
        inp[1][:m].copy_(nbr)
        inp[1][m:].fill_(-1)
        inp[2].fill_(m)
        _fill_pool(inp[3:9], pool, s, with_color)

    with MC_GRAPHS.run((mb, with_color), dev, fill) as out:
        return _graph_mesh(out, layer, s, with_color, partial, mb * GRAPH_TRI_PER_BRICK)


def _graph_mesh(out, layer, s: float, with_color: bool, partial: bool, tri_cap: int, since=None, sizes=None):
    """The :class:`Mesh` of a mesh graph's outputs (:func:`_mesh_outputs`: the arrays packed over a bucket,
    then the sizes), copied out of the static buffers in four copies; None when they overflowed (more
    triangles than ``tri_cap``, or more blocks than a delta bucket holds) or a brick is outside the
    edge-key range (the caller runs the eager path, which raises on the range). One read-back: ``sizes``
    (as a list, read here if None). Serves both graphs: the marching cubes over a brick list and the delta
    from changed bricks. The arrays are views of the copies (each contiguous)."""
    i64, pn, col, faces, sizes_t = out
    n_tri, nv, nb, nr, bad, _n_req, over = sizes_t.tolist() if sizes is None else sizes
    if over or bad or n_tri > tri_cap:
        return None
    mb = (i64.numel() - pn.shape[1] - 1) // 7  # blocks 3 mb, offsets mb + 1, removed 3 mb, then the keys
    head = 7 * mb + 1
    ints = i64[: head + nv].clone()
    pn = pn[:, :nv].clone()
    removed = ints[4 * mb + 1 : 4 * mb + 1 + 3 * (nr if partial else 0)].view(-1, 3)
    return Mesh(
        vertices=pn[0],
        faces=faces[:n_tri].clone(),
        normals=pn[1],
        colors=col[:nv].clone() if with_color else None,
        vertex_keys=ints[head:],
        blocks=ints[: 3 * nb].view(nb, 3),
        block_face_offsets=ints[3 * mb : 3 * mb + nb + 1],
        removed_blocks=removed,
        version=layer.version,
        full=not partial,
        since_version=since,
        voxel_size_m=s,
    )


def _mesh_outputs(mc_out, req: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inside a graph: ``marching_cubes_static_triton``'s outputs over the ``[Mb]`` blocks ``req`` packed
    for :func:`_graph_mesh` (few copies out): int64 ``[7 Mb + 1 + K]`` = block coordinates ``[Mb, 3]``
    (rows with faces), face offsets from 0 ``[Mb + 1]``, removed block coordinates ``[Mb, 3]``, edge keys
    ``[K]`` (last: a copy of the first ``7 Mb + 1 + V`` entries holds them all); float32 ``[2, K, 3]``
    positions and normals; uint8 ``[K, 3]`` colours; int32 ``[F, 3]`` faces; int64 ``[7]`` sizes:
    triangles, vertices, blocks, removed blocks, out of the key range, then ``extra`` (int64 ``[2]``: a
    delta's block count and overflow flag; zeros otherwise)."""
    _fc, keys, pos, nrm, col, faces, blocks, offsets, removed, sizes = mc_out
    zero = torch.zeros(1, dtype=torch.int64, device=req.device)
    i64 = torch.cat(
        (
            req.index_select(0, blocks).reshape(-1),
            zero,
            offsets,
            req.index_select(0, removed).reshape(-1),
            keys,
        )
    )
    return i64, torch.stack((pos, nrm)), col, faces.to(torch.int32), torch.cat((sizes, extra))


class _FillCache:
    """What was last written into graph input buffers (by identity), so a replay refills only what
    changed: a pool's page tables change when it grows (new tensors, never written in place), the voxel
    size never; a buffer of leaf keys keeps the padding above the longest grid written so far. Bounded
    (the eager fallback fills fresh buffers each call)."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._d: dict[int, tuple] = {}

    def same(self, buf: torch.Tensor, what: tuple) -> bool:
        """True when ``buf`` last got ``what`` (compared element by element with ``is`` / ``==``)."""
        got = self._d.get(id(buf))
        if got is None or got[0] is not buf or len(got[1]) != len(what):
            return False
        return all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(got[1], what, strict=True)
        )

    def put(self, buf: torch.Tensor, what: tuple) -> None:
        if len(self._d) >= self.limit:
            self._d.clear()
        self._d[id(buf)] = (buf, what)

    def clear(self) -> None:
        self._d.clear()


_FILLED = _FillCache()


def _fill_pool(inp, pool, s: float, with_color: bool) -> None:
    """Write a pool's page-start table (padded), page tables and the voxel size into a graph's inputs,
    unless they hold them already (the pool did not grow since this bucket's last fill)."""
    starts = pool.page_start_table()
    names = ("tsdf", "weight", "color", "color_weight") if with_color else ("tsdf", "weight")
    tables = tuple(pool.page_table(name) for name in names)
    what = (starts, *tables, float(s))
    if _FILLED.same(inp[0], what):
        return
    n_pages = starts.numel() - 1
    inp[0][: n_pages + 1].copy_(starts)
    inp[0][n_pages + 1 :].fill_(_BIG)
    for i, t in enumerate(tables):
        inp[1 + i][:n_pages].copy_(t)
    inp[5].fill_(s)
    _FILLED.put(inp[0], what)


def _mesh_since_graphed(layer, s: float, since: int, changed: torch.Tensor, with_color: bool):
    """``mesh_since`` (no brick removed since ``since``; ``changed``: bool ``[L, 8]``) from one graph replay:
    the changed bricks' neighbourhoods, their lookup, marching cubes and the block bookkeeping. Reads back
    the changed-brick count and, after the replay, the sizes. None where graphs do not apply (see
    :func:`_mesh_graphed`; also more than ``GRAPH_MAX_CHANGED`` changed bricks, more blocks or triangles
    than the bucket holds, a grid over the graphs' copy): the caller runs the eager path."""
    dev = layer.device
    if not (graphs.enabled(dev) and compiled(dev)):
        return None
    n_leaves = layer.grid.num_leaves
    if n_leaves == 0 or n_leaves > GRAPH_LEAVES or layer.pool.page_start_table().numel() - 1 > GRAPH_PAGES:
        return None
    cpos = changed.reshape(-1).nonzero().squeeze(1)  # the changed-brick count: one read-back
    c = cpos.numel()
    if not 0 < c <= GRAPH_MAX_CHANGED:
        return None
    cb = graphs.bucket(c, GRAPH_MIN_BRICKS)
    fill = _delta_fill(layer, s, cpos, with_color)
    while True:
        with DELTA_GRAPHS.run((cb, with_color), dev, fill) as out:
            sizes = out[-1].tolist()  # the one read-back after the replay
            mesh = _graph_mesh(out, layer, s, with_color, True, cb * GRAPH_TRI_PER_CHANGED, since, sizes)
        if mesh is not None or sizes[4] or cb >= GRAPH_MAX_CHANGED:
            return mesh  # None: a brick outside the key range (the eager path raises) or too big
        cb *= 2  # more blocks or triangles than the bucket holds: the next one holds twice as many


def _delta_fill(layer, s: float, cpos: torch.Tensor, with_color: bool):
    """The ``fill`` of a delta graph's inputs: changed bricks (padded with -1), the grid's leaf keys (padded
    with the largest key), its slot table, the pool (:func:`_fill_pool`)."""
    grid, c = layer.grid, cpos.numel()
    n_leaves = grid.num_leaves

    def fill(inp):
        inp[0][:c].copy_(cpos)
        inp[0][c:].fill_(-1)
        keys = inp[1]
        keys[:n_leaves].copy_(grid.leaves.keys)
        prev = _LEAF_FILL.get(id(keys))
        written = keys.numel() if prev is None or prev[0] is not keys else prev[1]
        if written > n_leaves:  # rows a longer grid wrote (or unknown): the padding again
            keys[n_leaves:written].fill_(_SENTINEL)
        if len(_LEAF_FILL) > 16:
            _LEAF_FILL.clear()
        _LEAF_FILL[id(keys)] = (keys, n_leaves)
        inp[2][:n_leaves].copy_(layer.slots)
        _fill_pool(inp[3:9], layer.pool, s, with_color)

    return fill


# a leaf-key buffer's id -> (the buffer, leaves written into it): the rows past them hold the padding
_LEAF_FILL: dict[int, tuple[torch.Tensor, int]] = {}


# ----------------------------------------------------------------------------------------------------
# incremental


def affected_blocks(bricks: torch.Tensor) -> torch.Tensor:
    """Blocks whose cells can read a voxel of the given bricks: ``bricks + {-1, 0, 1}^3``, unique, sorted
    by block key (int64 ``[M, 3]`` -> int64 ``[A, 3]``)."""
    if bricks.shape[0] == 0:
        return bricks.reshape(0, 3).to(torch.int64)
    d = _offsets27(bricks.device)
    return _sorted_unique_blocks((bricks[:, None, :].to(torch.int64) + d[None]).reshape(-1, 3))


@functools.cache
def _offsets27(device: torch.device) -> torch.Tensor:
    r = torch.arange(-1, 2)
    return torch.stack(torch.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3).to(device)


def mesh_since(layer: BrickLayer, voxel_size_m: float, since_version: int) -> Mesh:
    """The blocks that may have changed since layer version ``since_version``, re-meshed.

    Changed = bricks written or removed after that version (``layer.changed_since``) and their 26
    neighbours. Returns a delta (``full=False``, ``since_version`` set; ``removed_blocks`` = re-meshed
    blocks without faces) for :func:`apply_delta`, or a full mesh (``full=True``) when the layer's removal
    log no longer reaches back to ``since_version``.
    """
    _check_layer(layer)
    if isinstance(since_version, bool) or not isinstance(since_version, (int, np.integer)):
        raise InvalidArgumentType(f"since_version: expected an int, got {type(since_version).__name__}")
    since = int(since_version)
    if since < 0 or since > layer.version:
        raise InvalidArgument(f"since_version: expected a version in [0, {layer.version}], got {since}")
    removed = layer.removed_since(since)
    if removed is None:
        return extract_mesh(layer, voxel_size_m)
    s = _check_voxel_size(voxel_size_m)
    with_color = "color" in layer.pool.fields and "color_weight" in layer.pool.fields
    # keys of the changed bricks' 27-neighbourhoods (one kernel), and of the removed bricks'
    changed = (layer.slots >= 0) & (layer.brick_versions > since)
    if removed.shape[0] == 0:  # a CUDA graph for short deltas (mapper.graphs), else the eager path
        mesh = _mesh_since_graphed(layer, s, since, changed, with_color)
        if mesh is not None:
            return mesh
    keys = changed_neighbourhood_keys(changed, layer.grid.leaves.keys)
    if removed.shape[0]:
        keys = torch.cat(
            (keys, block_keys((removed[:, None, :] + _offsets27(removed.device)[None]).reshape(-1, 3)))
        )
    req = decode_block_keys(torch.unique(keys)) if keys.numel() else removed.reshape(0, 3)
    # only bricks that exist now can have cells, and only those or the removed ones can have had faces in
    # the consumer's mesh (a brick absent now and not removed since was absent then): the rest of the
    # neighbourhoods (most of it, around a LiDAR scan's sparse bricks) is neither meshed nor listed
    if req.shape[0]:
        present = layer.voxel_slots(req << 2)[0] >= 0
        if removed.shape[0]:
            present |= torch.isin(block_keys(req), block_keys(removed))
        req = req[present]
    mesh = _mesh_blocks(layer, s, req, with_color, partial=True)
    mesh.since_version = since
    return mesh


def _check_mesh(name: str, m) -> None:
    if not isinstance(m, Mesh):
        raise InvalidArgumentType(f"{name}: expected a Mesh, got {type(m).__name__}")
    if not m.has_blocks:
        raise InvalidArgument(f"{name}: the mesh has no block structure (read from a file?)")


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
    if delta.since_version is not None and prev.version < delta.since_version:
        raise Conflict(
            f"delta: made since version {delta.since_version}, but prev shows version {prev.version}"
        )
    if prev.voxel_size_m and delta.voxel_size_m and prev.voxel_size_m != delta.voxel_size_m:
        raise InvalidArgument(f"delta: voxel size {delta.voxel_size_m} != prev's {prev.voxel_size_m}")
    if (prev.colors is None) != (delta.colors is None):
        raise InvalidArgument("delta: colours present in one mesh but not the other")
    dev = prev.device
    delta = delta.to(dev)
    z1 = torch.zeros(1, dtype=torch.int64, device=dev)
    # blocks: prev's minus the delta's (and its removed ones), merged with the delta's by key
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
    # vertices: the delta's (fresh) plus prev's still used by kept faces and not in the delta, merged by key
    face_block = prev.face_blocks()
    kept_faces = keep[face_block].nonzero().squeeze(1)
    pf = prev.faces[kept_faces].to(torch.int64)
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
        out = torch.empty((nv, *a.shape[1:]), dtype=a.dtype, device=dev)
        out[va], out[vb] = a[take], b
        return out

    out = empty_mesh(dev, prev.colors is not None, delta.version, delta.voxel_size_m or prev.voxel_size_m)
    out.full = prev.full
    out.since_version = None if prev.full else prev.since_version
    out.vertex_keys = merged(prev.vertex_keys, delta.vertex_keys)
    out.vertices = merged(prev.vertices, delta.vertices)
    out.normals = merged(prev.normals, delta.normals)
    if prev.colors is not None:
        out.colors = merged(prev.colors, delta.colors)
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

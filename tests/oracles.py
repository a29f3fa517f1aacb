"""Independent oracles and input factories for the ``IndexGrid`` tests.

Pure NumPy / SciPy on purpose: nothing here imports ``mapper`` (or torch), so a bug in the library cannot
leak into the expected values. Voxel sets are int64 ``[N, 3]`` arrays; :func:`canon` turns any of them into
the sorted unique form that the comparisons use.
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy import ndimage

VOXEL_LIMIT = 1 << 22  # documented range of a coordinate: [-2^22, 2^22)
REFINE_LIMIT = 1 << 21  # voxels whose children stay representable: [-2^21, 2^21)
LEAF_BOUNDARY = (-33, -32, -9, -8, -1, 0, 7, 8, 15, 16, 31, 32)
CONNECTIVITY_RANK = {6: 1, 18: 2, 26: 3}
CHILD_OFFSETS = np.array(list(itertools.product((0, 1), repeat=3)), dtype=np.int64)


# ---------------------------------------------------------------------------------------------- sets
def canon(ijk) -> np.ndarray:
    """Sorted (lexicographic) unique int64 ``[N, 3]`` rows of a voxel array."""
    a = np.asarray(ijk, dtype=np.int64).reshape(-1, 3)
    return np.unique(a, axis=0)


def as_set(ijk) -> set[tuple[int, int, int]]:
    return {tuple(int(c) for c in row) for row in np.asarray(ijk, dtype=np.int64).reshape(-1, 3)}


def union(*sets) -> np.ndarray:
    return canon(np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1, 3) for s in sets]))


def is_subset(a, b) -> bool:
    return as_set(a) <= as_set(b)


def coarsen(ijk) -> np.ndarray:
    """2:1 coarsening: floor division by two on every axis."""
    return canon(np.floor_divide(np.asarray(ijk, dtype=np.int64).reshape(-1, 3), 2))


def refine(ijk) -> np.ndarray:
    """1:2 refinement: every voxel -> its 8 children ``2v + {0, 1}^3``."""
    a = np.asarray(ijk, dtype=np.int64).reshape(-1, 3)
    return canon((2 * a)[:, None, :] + CHILD_OFFSETS[None, :, :])


def index_of(grid_ijk, queries) -> np.ndarray:
    """Position of every query row in ``grid_ijk`` (unique rows, the grid's own order), -1 where absent."""
    g = np.asarray(grid_ijk, dtype=np.int64).reshape(-1, 3)
    q = np.asarray(queries, dtype=np.int64).reshape(-1, 3)
    if g.shape[0] == 0 or q.shape[0] == 0:
        return np.full(q.shape[0], -1, dtype=np.int64)
    _, inv = np.unique(np.concatenate([g, q]), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    pos = np.full(int(inv.max()) + 1, -1, dtype=np.int64)
    pos[inv[: g.shape[0]]] = np.arange(g.shape[0])
    return pos[inv[g.shape[0] :]]


def inject(src_ijk, values: np.ndarray, dst_ijk, fill) -> np.ndarray:
    """Rows of ``values`` (aligned with ``src_ijk``) re-laid out for ``dst_ijk``; ``fill`` where absent."""
    idx = index_of(src_ijk, dst_ijk)
    out = np.full((idx.shape[0], *values.shape[1:]), fill, dtype=values.dtype)
    has = idx >= 0
    out[has] = values[idx[has]]
    return out


# --------------------------------------------------------------------------------- voxel order
def nanovdb_offset(ijk) -> np.ndarray:
    """In-leaf offset ``((i mod 8) * 64) + ((j mod 8) * 8) + (k mod 8)`` (mod is floor mod: -1 -> 7)."""
    m = np.mod(np.asarray(ijk, dtype=np.int64).reshape(-1, 3), 8)
    return m[:, 0] * 64 + m[:, 1] * 8 + m[:, 2]


def leaves_in_order(ijk) -> np.ndarray:
    """Leaf coordinates (floor(v / 8)) in order of first appearance in ``ijk``."""
    leaf = np.floor_divide(np.asarray(ijk, dtype=np.int64).reshape(-1, 3), 8)
    if leaf.shape[0] == 0:
        return leaf
    new = np.ones(leaf.shape[0], dtype=bool)
    new[1:] = (leaf[1:] != leaf[:-1]).any(axis=1)
    return leaf[new]


def order_violations(ijk) -> list[str]:
    """Why ``ijk`` (in a grid's voxel order) is not voxel-sequential: [] when it is.

    Voxel-sequential: no duplicate; the voxels of one leaf are contiguous; inside a leaf they ascend by the
    NanoVDB offset.
    """
    a = np.asarray(ijk, dtype=np.int64).reshape(-1, 3)
    problems = []
    if canon(a).shape[0] != a.shape[0]:
        problems.append("duplicate voxels")
    runs = leaves_in_order(a)
    if canon(runs).shape[0] != runs.shape[0]:
        problems.append("a leaf's voxels are not contiguous")
    if a.shape[0] > 1:
        leaf = np.floor_divide(a, 8)
        same = (leaf[1:] == leaf[:-1]).all(axis=1)
        off = nanovdb_offset(a)
        if not (off[1:][same] > off[:-1][same]).all():
            problems.append("voxels not ascending by NanoVDB offset inside a leaf")
    return problems


# ---------------------------------------------------------------------------------- morphology
def structure(connectivity: int) -> np.ndarray:
    return ndimage.generate_binary_structure(3, CONNECTIVITY_RANK[connectivity])


def split_clusters(ijk: np.ndarray, gap: int) -> list[np.ndarray]:
    """Split a voxel array into groups whose coordinates are more than ``gap`` apart along some axis.

    Two groups split this way are farther apart than ``gap`` in the max-norm, so a stencil operation of
    reach < gap / 2 treats them independently; each group then fits a small dense crop.
    """
    out, stack = [], [np.asarray(ijk, dtype=np.int64).reshape(-1, 3)]
    while stack:
        p = stack.pop()
        for ax in range(3):
            order = np.argsort(p[:, ax], kind="stable")
            q = p[order]
            cut = np.nonzero(np.diff(q[:, ax]) > gap)[0]
            if cut.size:
                stack.extend(np.split(q, cut + 1))
                break
        else:
            out.append(p)
    return out


def dense_morphology(ijk, radius: int, connectivity: int, erode: bool, max_cells: int = 1 << 25):
    """Dilation / erosion of a voxel set by ``radius`` iterations of the scipy stencil, on dense crops.

    Each cluster is copied into a dense bool crop padded by ``radius + 1`` and run through
    ``scipy.ndimage.binary_dilation`` / ``binary_erosion`` (``border_value=0``: outside is inactive).
    """
    pts = canon(ijk)
    if pts.shape[0] == 0:
        return pts
    st = structure(connectivity)
    pad = radius + 1
    found = []
    for c in split_clusters(pts, 2 * radius + 2):
        lo = c.min(axis=0) - pad
        shape = c.max(axis=0) - lo + pad + 1
        assert int(np.prod(shape)) <= max_cells, f"dense crop too large: {shape}"
        vol = np.zeros(tuple(int(s) for s in shape), dtype=bool)
        vol[tuple((c - lo).T)] = True
        if erode:
            res = ndimage.binary_erosion(vol, structure=st, iterations=radius, border_value=0)
        else:
            res = ndimage.binary_dilation(vol, structure=st, iterations=radius)
        found.append(np.argwhere(res).astype(np.int64) + lo)
    return canon(np.concatenate(found))


def dilate(ijk, radius: int, connectivity: int) -> np.ndarray:
    return dense_morphology(ijk, radius, connectivity, erode=False)


def erode(ijk, radius: int, connectivity: int) -> np.ndarray:
    return dense_morphology(ijk, radius, connectivity, erode=True)


# ----------------------------------------------------------------------------------- factories
def scatter(rng: np.random.Generator, n: int, lo: int = -40, hi: int = 40) -> np.ndarray:
    """Uniform random voxels in ``[lo, hi)^3`` (duplicates possible)."""
    return rng.integers(lo, hi, size=(n, 3), dtype=np.int64)


def ball(centre, r: float) -> np.ndarray:
    ri = int(np.ceil(r))
    d = np.array(list(itertools.product(range(-ri, ri + 1), repeat=3)), dtype=np.int64)
    return d[(d * d).sum(axis=1) <= r * r] + np.asarray(centre, dtype=np.int64)


def box(lo, size) -> np.ndarray:
    s = np.broadcast_to(np.asarray(size, dtype=np.int64), (3,))
    g = np.stack(np.meshgrid(*(np.arange(n) for n in s), indexing="ij"), axis=-1).reshape(-1, 3)
    return g + np.asarray(lo, dtype=np.int64)


def blobs(rng: np.random.Generator, n_blobs: int, max_r: int = 5, lo: int = -30, hi: int = 30, holes=0.1):
    """Clustered voxels: random balls, with a fraction ``holes`` of their voxels removed."""
    parts = []
    for _ in range(n_blobs):
        b = ball(rng.integers(lo, hi, size=3), float(rng.integers(1, max_r + 1)))
        parts.append(b[rng.random(b.shape[0]) >= holes])
    return canon(np.concatenate(parts))


def shell(centre, r_out: float, thickness: float = 1.5) -> np.ndarray:
    """Thin spherical shell: voxels with ``r_out - thickness < |d| <= r_out``."""
    b = ball(centre, r_out) - np.asarray(centre, dtype=np.int64)
    d2 = (b * b).sum(axis=1)
    return b[d2 > (r_out - thickness) ** 2] + np.asarray(centre, dtype=np.int64)


def leaf_boundary_points(rng: np.random.Generator, n: int = 60) -> np.ndarray:
    """Voxels whose coordinates all sit on leaf (and tile) boundaries, negatives included."""
    c = np.array(LEAF_BOUNDARY, dtype=np.int64)
    return canon(c[rng.integers(0, c.size, size=(n, 3))])


def straddling_boxes(rng: np.random.Generator, n: int = 6, size: int = 5) -> np.ndarray:
    """Small solid boxes that straddle leaf boundaries (so morphology crosses leaves)."""
    c = np.array(LEAF_BOUNDARY, dtype=np.int64)
    parts = [box(c[rng.integers(0, c.size, size=3)] - size // 2, size) for _ in range(n)]
    return canon(np.concatenate(parts))


def far_blobs(rng: np.random.Generator, scale: int = 1 << 20, r: int = 3, n: int = 4) -> np.ndarray:
    """Balls around ``n`` (<= 4) centres of magnitude ~``scale`` in mixed signs (leaf-aligned and not)."""
    centres = [
        (scale, -scale, 5),
        (-scale - 3, scale + 7, -scale),
        (scale - 1, scale, scale + 1),
        (-scale, -scale, -scale - 9),
    ]
    return canon(np.concatenate([ball(c, r) for c in centres[:n]]))


def corner_boxes(limit: int = VOXEL_LIMIT, margin: int = 0, size: int = 4, n: int = 4) -> np.ndarray:
    """``n`` (<= 4) boxes whose outer corner sits ``margin`` voxels inside corners of ``[-limit, limit)^3``.

    With the defaults the boxes touch ``2^22 - 1`` and ``-2^22``, the extremes of the valid range.
    """
    hi = limit - 1 - margin
    lo = -limit + margin
    parts = []
    for signs in ((1, 1, 1), (-1, -1, -1), (1, -1, 1), (-1, 1, -1))[:n]:
        corner = [hi - size + 1 if s > 0 else lo for s in signs]
        parts.append(box(corner, size))
    return canon(np.concatenate(parts))

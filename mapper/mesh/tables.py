"""The marching-cubes case table, generated from the cube's geometry (see :mod:`mapper.mesh`: the face rule
for ambiguous faces, the loops and their fans), and its copy on a device."""

from __future__ import annotations

import functools

import numpy as np
import torch

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


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The case table on ``device`` (int64 ``[256, T, 3]``, int64 ``[256]``)."""
    table, count = case_table()
    return torch.from_numpy(table.astype(np.int64)).to(device), torch.from_numpy(count).to(device)

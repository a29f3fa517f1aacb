"""Marching-cubes meshes: the generated case table, geometry against analytic surfaces, watertightness,
partial observation, incremental deltas == full extraction, PLY/msgpack I/O (open3d as a second reader)
and a CPU speed sanity check.

Oracles are independent of ``mapper.mesh``: cube corners/edges and face areas are re-derived here from the
documented conventions; surfaces are analytic (sphere, box); topology checks count edges and faces.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from mapper import Conflict, InvalidArgument, InvalidArgumentType, Map, NotFound, sim
from mapper import mesh as mm
from mapper.io import (
    mesh_from_msgpack,
    mesh_from_msgpack_dict,
    mesh_to_msgpack,
    mesh_to_msgpack_dict,
    mesh_to_ply_bytes,
    read_ply,
    write_ply,
)
from mapper.mesh import Mesh, apply_delta, extract_mesh, mesh_since
from mapper.surface import zero_crossings

# --------------------------------------------------------------------------------- cube oracle
# documented: corner c at (c & 1, (c >> 1) & 1, (c >> 2) & 1); edge e = 4 * axis + b_lo + 2 * b_hi where
# b_lo, b_hi are the edge's coordinates on the two other axes (lower axis first)
CORNERS = np.array([[c & 1, (c >> 1) & 1, (c >> 2) & 1] for c in range(8)])


def _edges_oracle():
    out = []
    for axis in range(3):
        lo, hi = (a for a in range(3) if a != axis)
        for bits in range(4):
            p = np.zeros(3, int)
            p[lo], p[hi] = bits & 1, bits >> 1
            q = p.copy()
            q[axis] = 1
            c0 = int((CORNERS == p).all(1).argmax())
            c1 = int((CORNERS == q).all(1).argmax())
            out.append((c0, c1))
    return np.array(out)


EDGES = _edges_oracle()
MIDPOINTS = (CORNERS[EDGES[:, 0]] + CORNERS[EDGES[:, 1]]) / 2.0


def _face_edges(axis: int, side: int) -> list[int]:
    return [e for e in range(12) if (MIDPOINTS[e, axis] == side)]


FACES = [(axis, side) for axis in range(3) for side in (0, 1)]


def _crossing(case: int) -> set[int]:
    inside = [(case >> c) & 1 for c in range(8)]
    return {e for e in range(12) if inside[EDGES[e, 0]] != inside[EDGES[e, 1]]}


def _inside_face_area(case: int, axis: int, side: int) -> float:
    """Area of the inside part of a unit face cut at edge midpoints, with the documented rule for ambiguous
    faces (the face-local corners (0, 0) and (1, 1) are cut off)."""
    lo, hi = (a for a in range(3) if a != axis)
    ins = {}
    for c in range(8):
        if CORNERS[c, axis] == side:
            ins[(CORNERS[c, lo], CORNERS[c, hi])] = (case >> c) & 1
    k = sum(ins.values())
    if k in (0, 1, 3, 4):
        return {0: 0.0, 1: 1 / 8, 3: 7 / 8, 4: 1.0}[k]
    if ins[(0, 0)] == ins[(1, 1)]:  # diagonal pair
        return 0.25 if ins[(0, 0)] else 0.75
    return 0.5


def _tris(case: int) -> list[tuple[int, int, int]]:
    table, count = mm.case_table()
    return [tuple(int(x) for x in t) for t in table[case, : count[case]]]


def _canon_tri(t):
    i = t.index(min(t))
    return t[i:] + t[:i]


def test_table_conventions_match_the_documented_cube():
    np.testing.assert_array_equal(mm.CORNER_OFFSETS, CORNERS)
    np.testing.assert_array_equal(mm.EDGE_CORNERS, EDGES)
    table, count = mm.case_table()
    assert table.shape[0] == 256 and count.shape == (256,)
    assert ((table == -1).all(2).sum(1) == table.shape[1] - count).all()  # padding after the triangles


def test_table_known_triangle_counts():
    _, count = mm.case_table()
    assert count[0] == 0 and count[255] == 0
    for c in range(8):  # one corner in, or one corner out: a single triangle
        assert count[1 << c] == 1 and count[255 ^ (1 << c)] == 1
    for c0, c1 in EDGES:  # two adjacent corners: one quad
        assert count[(1 << c0) | (1 << c1)] == 2
    for axis, side in FACES:  # a whole face inside: one quad (a plane)
        case = sum(1 << c for c in range(8) if CORNERS[c, axis] == side)
        assert count[case] == 2
        for drop in range(8):  # three corners of a face: a pentagon
            if case >> drop & 1:
                assert count[case & ~(1 << drop)] == 3
    for c in range(8):  # two opposite corners of the cube: two separate triangles
        assert count[(1 << c) | (1 << (7 - c))] == 2
    # every case: vertices = sign-changing edges, triangles = sum over loops of (length - 2)
    for case in range(256):
        used = {e for t in _tris(case) for e in t}
        assert used == _crossing(case), case
    assert count.max() <= 12


def test_table_loops_closed_and_edges_used_consistently():
    for case in range(256):
        directed = Counter()
        for a, b, c in _tris(case):
            assert len({a, b, c}) == 3
            for u, v in ((a, b), (b, c), (c, a)):
                directed[(u, v)] += 1
        assert max(directed.values(), default=1) == 1, case  # no edge twice in one direction
        out_deg, in_deg = Counter(), Counter()
        per_face = Counter()
        for (u, v), _ in directed.items():
            shared = [f for f in FACES if u in _face_edges(*f) and v in _face_edges(*f)]
            if (v, u) in directed:  # an interior diagonal: must not lie in a cube face
                assert not shared, (case, u, v)
            else:  # a boundary segment: lies in exactly one cube face
                assert len(shared) == 1, (case, u, v)
                per_face[shared[0]] += 1
                out_deg[u] += 1
                in_deg[v] += 1
        crossing = _crossing(case)
        assert set(out_deg) == crossing and set(in_deg) == crossing, case
        assert all(out_deg[e] == 1 and in_deg[e] == 1 for e in crossing), case  # closed loops
        for f in FACES:
            n_cross = len(crossing & set(_face_edges(*f)))
            assert per_face[f] == n_cross // 2, (case, f)


def test_table_complementary_cases_reverse_orientation():
    for case in range(256):
        a = {_canon_tri(t) for t in _tris(case)}
        b = {_canon_tri((t[0], t[2], t[1])) for t in _tris(255 - case)}
        assert a == b, case


def test_table_orientation_closes_with_the_inside_face_polygons():
    """Triangles (at edge midpoints) + the inside parts of the cube faces bound the inside region: their
    area vectors, with the triangles facing outside and the faces facing out of the cube, sum to zero."""
    for case in range(256):
        total = np.zeros(3)
        for a, b, c in _tris(case):
            total += 0.5 * np.cross(MIDPOINTS[b] - MIDPOINTS[a], MIDPOINTS[c] - MIDPOINTS[a])
        for axis, side in FACES:
            total[axis] += (2 * side - 1) * _inside_face_area(case, axis, side)
        np.testing.assert_allclose(total, 0.0, atol=1e-12, err_msg=f"case {case}")
    # single corner 0 inside: the normal points away from it
    ((a, b, c),) = _tris(1)
    n = np.cross(MIDPOINTS[b] - MIDPOINTS[a], MIDPOINTS[c] - MIDPOINTS[a])
    assert (n > 0).all()


# ---------------------------------------------------------------------------- analytic TSDFs
LOCAL = torch.stack(torch.meshgrid(*(torch.arange(4),) * 3, indexing="ij"), -1).reshape(64, 3)


def write_sdf(m: Map, sdf_fn, lo_m, hi_m, trunc_vox: float = 3.0, color_fn=None, union: bool = True):
    """Write exact signed distances (truncated to +-trunc voxels, weight 1) into the bricks of the box
    whose voxels come within the truncation; with ``union`` the values are min'ed with observed ones."""
    s, layer = m.voxel_size_m, m._tsdf
    tau = trunc_vox * s
    blo = np.floor(np.asarray(lo_m, float) / s / 4).astype(int)
    bhi = np.floor(np.asarray(hi_m, float) / s / 4).astype(int)
    rng = [torch.arange(blo[a], bhi[a] + 1) for a in range(3)]
    bricks = torch.stack(torch.meshgrid(*rng, indexing="ij"), -1).reshape(-1, 3)
    vox = bricks[:, None, :] * 4 + LOCAL[None]
    d = sdf_fn((vox.double() + 0.5).reshape(-1, 3) * s).reshape(-1, 64)
    keep = (d.abs() < tau).any(1)
    bricks, vox, d = bricks[keep], vox[keep], d[keep].clamp(-tau, tau)
    if union and layer.num_bricks:
        slot, off = layer.voxel_slots(vox.reshape(-1, 3))
        ok = slot >= 0
        old = torch.full((slot.numel(),), math.inf, dtype=torch.float64)
        w = layer.pool.gather("weight", slot[ok], off[ok]).double()
        old[ok] = torch.where(w > 0, layer.pool.gather("tsdf", slot[ok], off[ok]).double(), math.inf)
        d = torch.minimum(d, old.reshape(-1, 64))
    slots = layer.allocate(bricks)
    layer.pool.scatter("tsdf", slots, d.float())
    layer.pool.scatter("weight", slots, torch.ones_like(d).float())
    if color_fn is not None:
        layer.pool.scatter("color", slots, color_fn((vox.double() + 0.5) * s))
        layer.pool.scatter("color_weight", slots, torch.ones_like(d).float())
    return bricks


def sphere_sdf(c, r):
    c = torch.as_tensor(c, dtype=torch.float64)
    return lambda p: torch.linalg.vector_norm(p - c, dim=1) - r


def box_sdf(c, h, R):
    """Exact SDF of a box (centre c, half extents h, rotation R: world = R @ local)."""
    c, h, R = (torch.as_tensor(x, dtype=torch.float64) for x in (c, h, R))

    def f(p):
        q = (p - c) @ R
        d = q.abs() - h
        return torch.linalg.vector_norm(d.clamp(min=0), dim=1) + d.max(dim=1).values.clamp(max=0)

    return f


def rot(yaw, pitch):
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    Rz = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    Ry = np.array([[cp, 0, sp], [0, 1, 0], [-sp, 0, cp]])
    return Rz @ Ry


def topology(mesh: Mesh) -> dict:
    f = mesh.faces.long().numpy()
    e = np.concatenate([f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]]])
    und = np.sort(e, axis=1)
    _, per_edge = np.unique(und, axis=0, return_counts=True)
    n_directed = np.unique(e, axis=0).shape[0]
    return {
        "edge_face_counts": set(per_edge.tolist()),
        "winding_consistent": n_directed == e.shape[0],
        "euler": mesh.num_vertices - per_edge.shape[0] + mesh.num_faces,
        "unused_vertices": mesh.num_vertices - np.unique(f).shape[0],
    }


def area_volume(mesh: Mesh) -> tuple[float, float]:
    v = mesh.vertices.double().numpy()
    f = mesh.faces.long().numpy()
    a, b, c = v[f[:, 0]], v[f[:, 1]], v[f[:, 2]]
    cr = np.cross(b - a, c - a)
    return 0.5 * np.linalg.norm(cr, axis=1).sum(), (a * np.cross(b, c)).sum() / 6.0


def assert_closed(mesh: Mesh, genus: int = 0):
    t = topology(mesh)
    assert t["edge_face_counts"] == {2}, t
    assert t["winding_consistent"], t
    assert t["unused_vertices"] == 0, t
    assert t["euler"] == 2 - 2 * genus, t


@pytest.fixture(scope="module")
def sphere_map():
    s = 0.05
    m = Map(s, layers=("tsdf", "color"), device="cpu")
    c, r = (0.013, 0.021, -0.007), 0.6
    write_sdf(
        m,
        sphere_sdf(c, r),
        np.subtract(c, r + 0.3),
        np.add(c, r + 0.3),
        color_fn=lambda p: (((p - torch.tensor(c)) / r + 1) * 100).round().clamp(0, 255).to(torch.uint8),
    )
    return m, c, r


def test_sphere_vertices_normals_area(sphere_map):
    m, c, r = sphere_map
    s = m.voxel_size_m
    mesh = extract_mesh(m._tsdf, s)
    assert mesh.full and mesh.num_faces > 1000
    v = mesh.vertices.double()
    ctr = torch.tensor(c, dtype=torch.float64)
    err = (torch.linalg.vector_norm(v - ctr, dim=1) - r).abs() / s
    assert float(err.max()) < 0.1, float(err.max())
    assert_closed(mesh)
    n_true = (v - ctr) / torch.linalg.vector_norm(v - ctr, dim=1, keepdim=True)
    dots = (n_true * mesh.normals.double()).sum(1)
    assert float(dots.mean()) > 0.99 and float(dots.min()) > 0.9, (float(dots.mean()), float(dots.min()))
    np.testing.assert_allclose(torch.linalg.vector_norm(mesh.normals, dim=1).numpy(), 1.0, atol=1e-5)
    area, vol = area_volume(mesh)
    assert abs(area / (4 * math.pi * r * r) - 1) < 0.01, area
    assert abs(vol / (4 / 3 * math.pi * r**3) - 1) < 0.01, vol  # > 0: faces wind outward
    # colours: the linear colour field interpolated along the edges
    expect = ((v - ctr) / r + 1) * 100
    assert mesh.colors is not None
    assert float((mesh.colors.double() - expect).abs().max()) <= 3.0


def test_sphere_vertices_are_the_tsdf_zero_crossings(sphere_map):
    """The vertex set equals mapper.surface's 6-neighbour zero crossings (same sign rule, same edges)."""
    m, _, _ = sphere_map
    mesh = extract_mesh(m._tsdf, m.voxel_size_m)
    g, d = m.layer("tsdf")
    pts, _ = zero_crossings(g, d["tsdf"], d["weight"], m.voxel_size_m)
    a = np.unique(np.round(mesh.vertices.double().numpy() / m.voxel_size_m * 2**12), axis=0)
    b = np.unique(np.round(pts.numpy() / m.voxel_size_m * 2**12), axis=0)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= 1


def test_matches_skimage_marching_cubes(sphere_map):
    """Optional second implementation (scikit-image is not a dependency): same vertices, same area."""
    measure = pytest.importorskip("skimage.measure")
    m, c, r = sphere_map
    s = m.voxel_size_m
    mesh = extract_mesh(m._tsdf, s)
    g, d = m.layer("tsdf")
    ijk = g.ijk.long().numpy()
    lo = ijk.min(0) - 1
    shape = tuple(ijk.max(0) - lo + 2)
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"), -1).reshape(-1, 3) + lo
    # voxels outside the allocated band: the analytic truncated value (no crossings there)
    vol = sphere_sdf(c, r)(torch.from_numpy((grid + 0.5) * s)).clamp(-3 * s, 3 * s).numpy().reshape(shape)
    vol[tuple((ijk - lo).T)] = d["tsdf"].numpy()
    verts, faces, _, _ = measure.marching_cubes(vol.astype(np.float32), level=0.0)
    verts = (verts + lo + 0.5) * s
    ours = np.unique(np.round(mesh.vertices.double().numpy() / s * 2**10), axis=0)
    theirs = np.unique(np.round(verts / s * 2**10), axis=0)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1
    a, b, cc = verts[faces[:, 0]], verts[faces[:, 1]], verts[faces[:, 2]]
    their_area = 0.5 * np.linalg.norm(np.cross(b - a, cc - a), axis=1).sum()
    assert abs(area_volume(mesh)[0] / their_area - 1) < 0.005


@pytest.mark.parametrize("rotated", [False, True])
def test_box_is_closed_with_the_right_area(rotated):
    s = 0.02
    m = Map(s, layers=("tsdf",), device="cpu")
    c, h = (0.313, -0.171, 0.057), (0.5, 0.3, 0.22)
    R = rot(0.4, 0.3) if rotated else np.eye(3)
    f = box_sdf(c, h, R)
    write_sdf(m, f, np.subtract(c, 1.0), np.add(c, 1.0))
    mesh = extract_mesh(m._tsdf, s)
    assert_closed(mesh)
    area, vol = area_volume(mesh)
    true_area = 8 * (h[0] * h[1] + h[1] * h[2] + h[0] * h[2])
    true_vol = 8 * h[0] * h[1] * h[2]
    assert abs(area / true_area - 1) < 0.03, (area, true_area)
    assert abs(vol / true_vol - 1) < 0.02, (vol, true_vol)
    err = f(mesh.vertices.double()).abs().numpy() / s
    # exact on the faces; near the box's edges and corners the SDF is not linear along lattice edges
    assert np.median(err) < 0.01 and err.max() < 0.35, (np.median(err), err.max())


def test_random_fields_are_watertight_with_consistent_winding():
    """Random values (every ambiguous configuration shows up) inside a positive shell: a closed, consistently
    wound surface of some genus; exact +-1 values put vertices at edge midpoints."""
    s = 0.1
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        m = Map(s, layers=("tsdf",), device="cpu")
        bricks = torch.stack(torch.meshgrid(*(torch.arange(-1, 2),) * 3, indexing="ij"), -1).reshape(-1, 3)
        slots = m._tsdf.allocate(bricks)
        vox = bricks[:, None, :] * 4 + LOCAL[None]
        vals = torch.randn(vox.shape[:2], generator=gen)
        if seed % 2:
            vals = torch.sign(vals)
        vals[((vox <= -3) | (vox >= 6)).any(-1)] = 1.0
        m._tsdf.pool.scatter("tsdf", slots, vals)
        m._tsdf.pool.scatter("weight", slots, torch.ones_like(vals))
        mesh = extract_mesh(m._tsdf, s)
        t = topology(mesh)
        assert t["edge_face_counts"] == {2} and t["winding_consistent"] and t["unused_vertices"] == 0, t
        assert t["euler"] % 2 == 0
        _, vol = area_volume(mesh)
        n_in = int((vals <= 0).sum())
        assert 0.3 * n_in * s**3 < vol < 1.5 * n_in * s**3, (vol, n_in * s**3)


def _face_cells(mesh: Mesh, s: float) -> np.ndarray:
    """Min corner of the cell of every face (its centroid lies inside the cell)."""
    v = mesh.vertices.double().numpy()
    f = mesh.faces.long().numpy()
    cen = v[f].mean(1)
    return np.floor(cen / s - 0.5).astype(np.int64)


def test_partially_observed_cells_are_not_meshed():
    s = 0.05
    c, r = (0.0, 0.0, 0.0), 0.5
    full_map = Map(s, layers=("tsdf",), device="cpu")
    write_sdf(full_map, sphere_sdf(c, r), np.subtract(c, 0.8), np.add(c, 0.8))
    part_map = Map(s, layers=("tsdf",), device="cpu")
    write_sdf(part_map, sphere_sdf(c, r), np.subtract(c, 0.8), np.add(c, 0.8))
    # unobserve voxels with centre x > 0.12 or (a hole) centre near the +z pole
    bricks, slots = part_map._tsdf.brick_table()
    cen = ((bricks[:, None, :] * 4 + LOCAL[None]).double() + 0.5) * s

    def unobserved(p):
        return (p[..., 0] > 0.12) | (torch.linalg.vector_norm(p - torch.tensor([0.0, 0.0, r]), dim=-1) < 0.15)

    w = torch.where(unobserved(cen), 0.0, 1.0)
    part_map._tsdf.pool.scatter("weight", slots, w)
    full = extract_mesh(full_map._tsdf, s)
    part = extract_mesh(part_map._tsdf, s)
    assert 0 < part.num_faces < full.num_faces
    cells = _face_cells(part, s)
    corners = (cells[:, None, :] + CORNERS[None]).reshape(-1, 3)
    assert not unobserved(torch.from_numpy((corners + 0.5) * s)).any()
    # and every fully observed cell keeps exactly its triangles of the fully observed sphere
    fc = _face_cells(full, s)
    fcorners = torch.from_numpy(((fc[:, None, :] + CORNERS[None]) + 0.5) * s)
    keep = ~unobserved(fcorners).any(1).numpy()
    full_keys = full.vertex_keys[full.faces.long()].numpy()[keep]
    part_keys = part.vertex_keys[part.faces.long()].numpy()
    np.testing.assert_array_equal(part_keys, full_keys)
    t = topology(part)
    assert t["edge_face_counts"] == {1, 2} and t["winding_consistent"]  # open at the unobserved cut


def test_bricks_argument_selects_cells_by_min_corner(sphere_map):
    m, _, _ = sphere_map
    s = m.voxel_size_m
    full = extract_mesh(m._tsdf, s)
    some = full.blocks[::3]
    part = extract_mesh(m._tsdf, s, bricks=torch.cat((some, some[:5], torch.tensor([[999, 999, 999]]))))
    assert not part.full
    torch.testing.assert_close(part.blocks, some)
    cells = _face_cells(part, s)
    want = {tuple(b) for b in some.tolist()}
    assert {tuple(b) for b in (cells >> 2).tolist()} == want
    assert [999, 999, 999] in part.removed_blocks.tolist()
    with pytest.raises(InvalidArgument, match="bricks"):
        extract_mesh(m._tsdf, s, bricks=torch.zeros((3, 2), dtype=torch.int64))
    with pytest.raises(InvalidArgument, match="voxel_size_m"):
        extract_mesh(m._tsdf, -1.0)
    with pytest.raises(InvalidArgumentType, match="layer"):
        extract_mesh("tsdf", s)


@pytest.mark.parametrize("brick_k, ok", [((1 << 17) - 1, False), ((1 << 17) - 2, True), (-(1 << 17), True)])
def test_k_range_is_checked(brick_k, ok):
    m = Map(0.1, layers=("tsdf",), device="cpu")
    slots = m._tsdf.allocate(torch.tensor([[0, 0, brick_k]]))
    m._tsdf.pool.scatter("weight", slots, torch.ones(1, 64))
    m._tsdf.pool.scatter("tsdf", slots, torch.where(LOCAL[:, 2] < 2, -1.0, 1.0)[None])
    if ok:
        mesh = extract_mesh(m._tsdf, 0.1)
        assert mesh.num_faces == 2 * 9  # a plane through the 3 x 3 cells inside the brick
        torch.testing.assert_close(
            mm.decode_edge_keys(mesh.vertex_keys)[0][:, 2] >> 2, torch.full((16,), brick_k)
        )
    else:
        with pytest.raises(InvalidArgument, match="axis k"):
            extract_mesh(m._tsdf, 0.1)


def test_edge_keys_round_trip_and_order():
    rng = np.random.default_rng(0)
    v = torch.from_numpy(
        np.stack(
            [
                rng.integers(-(1 << 20), 1 << 20, 500),
                rng.integers(-(1 << 20), 1 << 20, 500),
                rng.integers(-(1 << 19), (1 << 19) - 8, 500),
            ],
            1,
        )
    )
    a = torch.from_numpy(rng.integers(0, 3, 500))
    k = mm.edge_keys(v, a)
    v2, a2 = mm.decode_edge_keys(k)
    torch.testing.assert_close(v2, v)
    torch.testing.assert_close(a2, a)
    lex = np.lexsort((a.numpy(), v[:, 2].numpy(), v[:, 1].numpy(), v[:, 0].numpy()))
    np.testing.assert_array_equal(np.argsort(k.numpy(), kind="stable"), lex)


# ---------------------------------------------------------------------------------- incremental
def assert_mesh_equal(a: Mesh, b: Mesh):
    for name in ("vertex_keys", "faces", "blocks", "block_face_offsets", "vertices", "normals"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, (name, x.shape, y.shape)
        assert torch.equal(x, y), name
    assert (a.colors is None) == (b.colors is None)
    if a.colors is not None:
        assert torch.equal(a.colors, b.colors)
    assert a.version == b.version
    assert a.equals(b)


def test_incremental_edits_equal_full_extraction():
    s = 0.05
    m = Map(s, layers=("tsdf", "color"), device="cpu")
    red = lambda p: torch.tensor([200, 30, 30], dtype=torch.uint8).expand(*p.shape[:-1], 3)  # noqa: E731
    write_sdf(m, sphere_sdf((0, 0, 0), 0.4), (-0.6,) * 3, (0.6,) * 3, color_fn=red)
    layer = m._tsdf
    v1 = extract_mesh(layer, s)
    cur = v1

    def step(cur):
        delta = mesh_since(layer, s, cur.version)
        assert not delta.full and delta.since_version == cur.version
        new = apply_delta(cur, delta)
        assert_mesh_equal(new, extract_mesh(layer, s))
        return new, delta

    # 1. a second object overlapping the first (union), coloured differently
    blue = lambda p: torch.tensor([20, 40, 220], dtype=torch.uint8).expand(*p.shape[:-1], 3)  # noqa: E731
    write_sdf(
        m,
        box_sdf((0.45, 0.1, 0.0), (0.2, 0.15, 0.25), np.eye(3)),
        (-0.1, -0.4, -0.5),
        (1.0, 0.6, 0.5),
        color_fn=blue,
    )
    cur, d = step(cur)
    assert d.num_faces < cur.num_faces
    # 2. change values in a few bricks (shift the surface) without allocation
    bricks, slots = layer.brick_table()
    sel = torch.arange(0, bricks.shape[0], 17)
    t = layer.pool.gather("tsdf", slots[sel]).float()
    layer.pool.scatter("tsdf", slots[sel], t - 0.3 * s)
    layer.touch(bricks[sel])
    cur, _ = step(cur)
    # 3. clear a box (partly clears bricks, frees whole ones)
    m.clear((0.1, -1.0, -1.0), (1.0, 1.0, 0.1))
    cur, d = step(cur)
    assert d.removed_blocks.shape[0] > 0
    # 4. nothing changed: an empty delta
    cur, d = step(cur)
    assert d.num_faces == 0 and d.blocks.shape[0] == 0
    # 5. chained from v1 in one go, and the Conflict when prev is older than the delta's base
    direct = apply_delta(v1, mesh_since(layer, s, v1.version))
    assert_mesh_equal(direct, cur)
    late = mesh_since(layer, s, cur.version)
    older = extract_mesh(Map(s, layers=("tsdf", "color"))._tsdf, s)
    with pytest.raises(Conflict):
        apply_delta(older, late)
    # 6. two deltas composed into one, applied to v1
    v_mid = cur
    write_sdf(m, sphere_sdf((-0.5, 0.2, 0.1), 0.15), (-0.8, -0.1, -0.2), (-0.2, 0.5, 0.4))
    d1 = mesh_since(layer, s, v_mid.version)
    m.clear((-1.0, 0.25, -1.0), (0.0, 1.0, 1.0))
    d2 = mesh_since(layer, s, d1.version)
    both = apply_delta(d1, d2)
    assert not both.full and both.since_version == v_mid.version
    cur = apply_delta(v_mid, both)
    assert_mesh_equal(cur, extract_mesh(layer, s))
    # 7. everything cleared
    m.clear()
    cur, d = step(cur)
    assert cur.num_faces == 0 and cur.blocks.shape[0] == 0


def test_incremental_depth_frames_equal_full_extraction():
    scene = sim.indoor_scene(0)
    cam = sim.PinholeCamera(160, 120, 125.0, 125.0, 79.5, 59.5)
    m = Map(0.05, layers=("tsdf", "color"), device="cpu")
    poses = sim.orbit_trajectory(5, scene=scene)
    layer, s = m._tsdf, m.voxel_size_m
    cur = None
    for i, T in enumerate(poses):
        depth = cam.render_depth(scene, T)
        rgb = torch.full((120, 160, 3), 40 * i, dtype=torch.uint8)
        m.integrate_depth(depth, cam.K, T, color=rgb)
        if cur is None:
            cur = extract_mesh(layer, s)
            continue
        delta = mesh_since(layer, s, cur.version)
        cur = apply_delta(cur, delta)
        assert_mesh_equal(cur, extract_mesh(layer, s))
    assert cur.num_faces > 1000
    # accuracy against the scene: vertices near the true surface
    err = scene.sdf(cur.vertices.double()).abs().numpy() / s
    assert np.median(err) < 0.2, np.median(err)
    # a decay step (weights shrink, some voxels die) is tracked too
    m.decay(0.5, threshold=0.6)
    cur = apply_delta(cur, mesh_since(layer, s, cur.version))
    assert_mesh_equal(cur, extract_mesh(layer, s))


def _bricks_of(layer, since=None) -> set[tuple[int, int, int]]:
    """Present bricks (written after ``since`` when given), from the layer's tables, as a set."""
    leaf, b = (layer.slots >= 0).nonzero(as_tuple=True)
    if since is not None:
        ok = layer.brick_versions[leaf, b] > since
        leaf, b = leaf[ok], b[ok]
    lc = layer.grid.leaf_ijk.to(torch.int64)[leaf] * 2
    bc = lc + torch.stack(((b >> 2) & 1, (b >> 1) & 1, b & 1), 1)
    return set(map(tuple, bc.tolist()))


def test_lidar_deltas_cover_exactly_the_present_neighbourhood():
    """A moving LiDAR's scans touch sparse bricks: a delta re-meshes (blocks + removed_blocks) exactly the
    present bricks around the changed ones plus the removed ones, not the absent rest of the
    neighbourhoods, and still chains to the full extraction bit for bit."""
    lidar = sim.SpinningLidar(n_beams=8, n_azimuth=360, fov_up_deg=10, fov_down_deg=-20, max_range_m=30)
    m = Map(0.2, layers=("tsdf",), device="cpu", keep_radius_m=25.0)
    layer, s = m._tsdf, m.voxel_size_m
    cur = None
    around = [(dx, dy, dz) for dx in (-1, 0, 1) for dy in (-1, 0, 1) for dz in (-1, 0, 1)]
    removed_any = False
    for points, T in sim.lidar_sequence(4, lidar=lidar, extent_m=80.0, speed_mps=40.0):
        m.integrate_lidar(points, T)
        if cur is None:
            cur = extract_mesh(layer, s)
            continue
        present = _bricks_of(layer)
        changed = _bricks_of(layer, since=cur.version)
        # removed since (by the radius policy; some allocated and freed within the frame)
        gone = set(map(tuple, layer.removed_since(cur.version).tolist()))
        removed_any |= bool(gone)
        hood = {(x + a, y + b, z + c) for x, y, z in changed | gone for a, b, c in around}
        want = (hood & present) | gone
        delta = mesh_since(layer, s, cur.version)
        got = set(map(tuple, torch.cat((delta.blocks, delta.removed_blocks)).tolist()))
        assert got == want
        assert len(hood) > 2 * len(want)  # the absent part of the neighbourhoods is most of it
        cur = apply_delta(cur, delta)
        assert_mesh_equal(cur, extract_mesh(layer, s))
    assert removed_any and cur.num_faces > 100


def test_too_old_version_gives_a_full_mesh():
    s = 0.05
    m = Map(s, layers=("tsdf",), device="cpu")
    layer = m._tsdf
    layer.removed_log_limit = 2
    write_sdf(m, sphere_sdf((0, 0, 0), 0.3), (-0.5,) * 3, (0.5,) * 3)
    v1 = extract_mesh(layer, s)
    for x in (0.2, 0.0, -0.2):  # three removals, the log keeps two
        m.clear((x, -1, -1), (1, 1, 1))
    assert layer.changed_since(v1.version) is None
    delta = mesh_since(layer, s, v1.version)
    assert delta.full
    assert_mesh_equal(apply_delta(v1, delta), extract_mesh(layer, s))
    with pytest.raises(InvalidArgument, match="since_version"):
        mesh_since(layer, s, layer.version + 1)
    with pytest.raises(InvalidArgumentType, match="since_version"):
        mesh_since(layer, s, 1.5)


@pytest.mark.skipif(not hasattr(Map, "mesh"), reason="Map.mesh not added yet")
def test_map_mesh_method():
    s = 0.05
    m = Map(s, layers=("tsdf",), device="cpu")
    write_sdf(m, sphere_sdf((0, 0, 0), 0.3), (-0.5,) * 3, (0.5,) * 3)
    full = m.mesh()
    assert_mesh_equal(full, extract_mesh(m._tsdf, s))
    write_sdf(m, sphere_sdf((0.5, 0, 0), 0.2), (0.1, -0.4, -0.4), (0.9, 0.4, 0.4))
    assert_mesh_equal(apply_delta(full, m.mesh(since_version=full.version)), m.mesh())
    with pytest.raises(NotFound):
        Map(s, layers=("occupancy",)).mesh()


# -------------------------------------------------------------------------------------------- I/O
def test_ply_round_trip(sphere_map, tmp_path):
    m, _, _ = sphere_map
    mesh = extract_mesh(m._tsdf, m.voxel_size_m)
    p = tmp_path / "sphere.ply"
    write_ply(p, mesh)
    assert p.read_bytes() == mesh_to_ply_bytes(mesh)
    back = read_ply(p)
    for name in ("vertices", "normals", "colors"):
        assert torch.equal(getattr(back, name), getattr(mesh, name)), name
    assert torch.equal(back.faces, mesh.faces)
    assert not back.has_blocks
    data = p.read_bytes()
    with pytest.raises(InvalidArgument, match="truncated"):
        read_ply(data[: len(data) - 100])
    with pytest.raises(InvalidArgument, match="no block structure"):
        apply_delta(back, mesh)


def test_ply_reads_ascii_and_polygons():
    text = b"""ply
format ascii 1.0
comment a unit square and a triangle
element vertex 5
property double x
property double y
property double z
property uchar red
property uchar green
property uchar blue
property uchar alpha
element face 2
property list uchar uint vertex_indices
end_header
0 0 0 255 0 0 255
1 0 0 0 255 0 255
1 1 0 0 0 255 255
0 1 0 9 9 9 255
0 0 1 1 2 3 4
4 0 1 2 3
3 0 1 4
"""
    mesh = read_ply(text)
    assert mesh.num_vertices == 5
    assert mesh.faces.tolist() == [[0, 1, 2], [0, 2, 3], [0, 1, 4]]
    assert mesh.colors[3].tolist() == [9, 9, 9]
    np.testing.assert_allclose(mesh.normals[2].numpy(), [0, 0, 1], atol=1e-6)  # computed from faces
    with pytest.raises(InvalidArgument, match="not a PLY"):
        read_ply(b"solid stl\n")
    # the same as binary big-endian, with an extra vertex property and quads stored as such
    head = (
        b"ply\nformat binary_big_endian 1.0\nelement vertex 5\nproperty float x\nproperty float y\n"
        b"property float z\nproperty short extra\nelement face 2\nproperty list uchar int vertex_indices\n"
        b"end_header\n"
    )
    vdt = np.dtype([("x", ">f4"), ("y", ">f4"), ("z", ">f4"), ("extra", ">i2")])
    vert = np.zeros(5, vdt)
    for a, col in zip("xyz", mesh.vertices.numpy().T, strict=True):
        vert[a] = col
    faces = np.array([(4, (0, 1, 2, 3)), (4, (0, 1, 4, 3))], np.dtype([("n", "u1"), ("v", ">i4", (4,))]))
    big = read_ply(head + vert.tobytes() + faces.tobytes())
    assert torch.equal(big.vertices, mesh.vertices) and big.colors is None
    assert big.faces.tolist() == [[0, 1, 2], [0, 2, 3], [0, 1, 4], [0, 4, 3]]


def test_read_replica_reference_mesh(shared_data):
    path = shared_data / "replica_office0" / "office0_mesh.ply"
    if not path.exists():
        pytest.skip("office0_mesh.ply not found")
    mesh = read_ply(path)
    assert mesh.num_vertices == 25149 and mesh.num_faces == 50000
    assert mesh.colors is not None and mesh.colors.shape == (25149, 3)
    assert len(torch.unique(mesh.colors.long() @ torch.tensor([65536, 256, 1]))) > 100
    assert int(mesh.faces.min()) >= 0 and int(mesh.faces.max()) < mesh.num_vertices
    ext = (mesh.vertices.max(0).values - mesh.vertices.min(0).values).numpy()
    assert (ext > 1.0).all() and (ext < 20.0).all()  # a room, in metres
    o3d = pytest.importorskip("open3d")
    ref = o3d.io.read_triangle_mesh(str(path))
    np.testing.assert_array_equal(np.asarray(ref.vertices).astype(np.float32), mesh.vertices.numpy())
    np.testing.assert_array_equal(np.asarray(ref.triangles), mesh.faces.numpy())


def test_open3d_reads_our_ply(sphere_map, tmp_path):
    o3d = pytest.importorskip("open3d")
    m, _, _ = sphere_map
    mesh = extract_mesh(m._tsdf, m.voxel_size_m)
    p = tmp_path / "sphere.ply"
    write_ply(p, mesh)
    o = o3d.io.read_triangle_mesh(str(p))
    assert len(o.vertices) == mesh.num_vertices and len(o.triangles) == mesh.num_faces
    np.testing.assert_array_equal(np.asarray(o.vertices).astype(np.float32), mesh.vertices.numpy())
    np.testing.assert_array_equal(np.asarray(o.triangles), mesh.faces.numpy())
    np.testing.assert_allclose(np.asarray(o.vertex_normals), mesh.normals.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(o.vertex_colors) * 255, mesh.colors.numpy(), atol=1e-3)
    assert o.is_watertight() and o.is_orientable()


def test_msgpack_dict_round_trip(sphere_map):
    m, _, _ = sphere_map
    mesh = extract_mesh(m._tsdf, m.voxel_size_m, bricks=m._tsdf.brick_table()[0][:50])
    d = mesh_to_msgpack_dict(mesh)
    back = mesh_from_msgpack_dict(d)
    assert back.equals(mesh) and back.full == mesh.full and back.voxel_size_m == mesh.voxel_size_m
    assert d["vertices"]["dtype"] == "float32" and d["vertex_keys"]["dtype"] == "int64"
    with pytest.raises(InvalidArgument, match="not a mesh dict"):
        mesh_from_msgpack_dict({"vertices": d["vertices"]})
    bad = dict(d, faces=dict(d["faces"], dtype="float32"))
    with pytest.raises(InvalidArgument, match="faces"):
        mesh_from_msgpack_dict(bad)
    pytest.importorskip("msgpack")
    assert mesh_from_msgpack(mesh_to_msgpack(mesh)).equals(mesh)


# ------------------------------------------------------------------------------------ speed (CPU)
def test_speed_one_million_voxels():
    s = 0.01
    m = Map(s, layers=("tsdf",), device="cpu")
    write_sdf(m, sphere_sdf((0.013, 0.021, -0.007), 1.0), (-1.1,) * 3, (1.1,) * 3)
    n_vox = m._tsdf.grid.num_voxels
    assert n_vox > 1_000_000
    t0 = time.perf_counter()
    mesh = extract_mesh(m._tsdf, s)
    t_full = time.perf_counter() - t0
    bricks, slots = m._tsdf.brick_table()
    m._tsdf.touch(bricks[:1])
    t0 = time.perf_counter()
    delta = mesh_since(m._tsdf, s, mesh.version)
    apply_delta(mesh, delta)
    t_inc = time.perf_counter() - t0
    print(
        f"\n{n_vox} voxels: full mesh {t_full:.2f} s ({mesh.num_faces} faces), one-brick update {t_inc:.3f} s"
    )
    assert t_full < 60.0  # loose: ~0.4 s on an idle 2-core machine; shared CPUs vary 10x+

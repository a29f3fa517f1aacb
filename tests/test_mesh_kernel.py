"""The marching-cubes Triton kernels (``mapper.kernels.triton_mesh``) against the torch reference
(``mapper.kernels.marching.marching_cubes_torch``), and the meshes they make against analytic surfaces.

Maps use small pool pages, so the kernels' page lookups cross pages; fields are written directly (exact
signed distances, random values, partially unobserved voxels) so every case and the one-sided gradients show
up. Under ``TRITON_INTERPRET=1`` (CPU) the kernels run in the interpreter; on a GPU they are compiled.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mapper import InvalidArgument, Map
from mapper.kernels.marching import marching_cubes_torch
from mapper.mesh import _tables, apply_delta, extract_mesh, mesh_since, neighbour_slots

LOCAL = torch.stack(torch.meshgrid(*(torch.arange(4),) * 3, indexing="ij"), -1).reshape(64, 3)


def small_map(s: float, device, color: bool = True) -> Map:
    m = Map(s, layers=("tsdf", "color") if color else ("tsdf",), device=device)
    m._tsdf.pool.first_page_bricks = 16
    m._tsdf.pool.page_bricks = 64
    return m


def write_field(m: Map, fn, lo_m, hi_m, trunc_vox=3.0, color_fn=None, weight_fn=None):
    """Exact values of ``fn`` (metres -> metres) truncated to +-trunc voxels, min'ed with what is observed,
    in the bricks of the box that come within the truncation."""
    s, layer, dev = m.voxel_size_m, m._tsdf, m.device
    tau = trunc_vox * s
    blo = np.floor(np.asarray(lo_m, float) / s / 4).astype(int)
    bhi = np.floor(np.asarray(hi_m, float) / s / 4).astype(int)
    rng = [torch.arange(blo[a], bhi[a] + 1) for a in range(3)]
    bricks = torch.stack(torch.meshgrid(*rng, indexing="ij"), -1).reshape(-1, 3)
    vox = bricks[:, None, :] * 4 + LOCAL[None]
    p = (vox.double() + 0.5) * s
    d = fn(p.reshape(-1, 3)).reshape(-1, 64)
    keep = (d.abs() < tau).any(1)
    bricks, vox, p, d = bricks[keep], vox[keep], p[keep], d[keep].clamp(-tau, tau)
    if layer.num_bricks:
        slot, off = layer.voxel_slots(vox.reshape(-1, 3).to(dev))
        ok = slot >= 0
        old = torch.full((slot.numel(),), math.inf, dtype=torch.float64, device=dev)
        w = layer.pool.gather("weight", slot[ok], off[ok]).double()
        old[ok] = torch.where(w > 0, layer.pool.gather("tsdf", slot[ok], off[ok]).double(), math.inf)
        d = torch.minimum(d, old.reshape(-1, 64).cpu())
    slots = layer.allocate(bricks.to(dev))
    layer.pool.scatter("tsdf", slots, d.float().to(dev))
    w = torch.ones_like(d) if weight_fn is None else weight_fn(p)
    layer.pool.scatter("weight", slots, w.float().to(dev))
    if color_fn is not None:
        layer.pool.scatter("color", slots, color_fn(p).to(dev))
        layer.pool.scatter("color_weight", slots, torch.ones_like(d).float().to(dev))
    return bricks


def sphere(c, r):
    c = torch.as_tensor(c, dtype=torch.float64)
    return lambda p: torch.linalg.vector_norm(p - c, dim=1) - r


def colour_of(p):
    return ((p * 97.0).remainder(1.0) * 255).round().to(torch.uint8)


def assert_same_mesh(a, b, exact: bool):
    for name in ("vertex_keys", "faces", "blocks", "block_face_offsets", "removed_blocks"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and torch.equal(x, y.to(x.device)), name
    if exact:
        assert a.equals(b)
        return
    torch.testing.assert_close(a.vertices, b.vertices, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.normals, b.normals, rtol=0, atol=2e-6)
    assert (a.colors is None) == (b.colors is None)
    if a.colors is not None:
        assert int((a.colors.int() - b.colors.int()).abs().max()) <= 1


def with_kernels(mode: str, fn, *args):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAPPER_KERNELS", mode)
        return fn(*args)


_PATCHY: dict = {}


def patchy_map(device) -> Map:
    """Two spheres and a box-ish random region, some voxels unobserved, colours: on several pages."""
    if str(device) in _PATCHY:
        return _PATCHY[str(device)]
    m = small_map(0.1, device)
    write_field(m, sphere((0.01, 0.02, -0.01), 0.5), (-0.8,) * 3, (0.8,) * 3, color_fn=colour_of)
    gen = torch.Generator().manual_seed(3)

    def holes(p):  # unobserved voxels: a slab and random ones
        keep = (p[..., 0] < 0.9) & (torch.rand(p.shape[:-1], generator=gen, dtype=torch.float64) > 0.08)
        return keep.double()

    write_field(m, sphere((0.75, 0.1, 0.0), 0.35), (0.3, -0.4, -0.5), (1.3, 0.6, 0.5), weight_fn=holes)
    layer = m._tsdf
    bricks, slots = layer.brick_table()
    sel = slots[::5]
    vals = (torch.randn((sel.numel(), 64), generator=gen) * 0.1).to(device)
    layer.pool.scatter("tsdf", sel, vals)  # random values: every case, ambiguous faces
    assert len(layer.pool.page_starts) > 3
    _PATCHY[str(device)] = m
    return m


def test_mesh_kernels_match_torch_reference(device, backend):
    if backend != "triton":
        pytest.skip("compares the Triton kernels with the torch reference")
    m = patchy_map(device)
    layer, s = m._tsdf, m.voxel_size_m
    ref = with_kernels("torch", extract_mesh, layer, s)
    got = extract_mesh(layer, s)
    assert ref.num_faces > 1000 and ref.colors is not None
    assert_same_mesh(got, ref, exact=False)
    # the op itself, on an unsorted subset with absent bricks (same contract as the reference)
    bricks = layer.brick_table()[0]
    sub = torch.cat((bricks[7::3], torch.tensor([[50, 50, 50]], device=device)))
    nbr = neighbour_slots(layer, sub)
    table, count = _tables(sub.device)
    from mapper.kernels.triton_mesh import marching_cubes_triton

    a = marching_cubes_triton(sub, nbr, layer.pool, table, count, s, True)
    b = marching_cubes_torch(sub, nbr, layer.pool, table, count, s, True)
    for name, x, y in zip(
        ("face_counts", "keys", "faces"), (a[0], a[1], a[5]), (b[0], b[1], b[5]), strict=True
    ):
        assert torch.equal(x, y), name
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[3], b[3], rtol=0, atol=2e-6)
    assert int((a[4].int() - b[4].int()).abs().max()) <= 1
    # the neighbour-slot kernel against its reference, with absent and out-of-range neighbours
    from mapper.kernels.marching import neighbour_slots_torch
    from mapper.kernels.triton_mesh import neighbour_slots_triton

    far = torch.tensor([[(1 << 20) - 1, 0, 0], [-(1 << 20), 5, -3]], device=device)
    q = torch.cat((sub, far))
    g = layer.grid
    ns = neighbour_slots_triton(q, g.leaves, g.tiles, layer.slots)
    assert torch.equal(ns, neighbour_slots_torch(q, g.leaves, g.tiles, layer.slots))
    assert bool((ns[-3:] == -1).all()) and int((ns >= 0).sum()) > 300
    # the changed-neighbourhood kernel against its reference (every third brick changed)
    from mapper.kernels.marching import changed_neighbourhood_keys_torch
    from mapper.kernels.triton_mesh import changed_neighbourhood_keys_triton

    changed = layer.slots >= 0
    changed[::3] = False
    k1 = changed_neighbourhood_keys_triton(changed, g.leaves.keys)
    assert k1.numel() == 27 * int(changed.sum()) > 0
    assert torch.equal(k1, changed_neighbourhood_keys_torch(changed, g.leaves.keys))
    none = torch.zeros_like(changed)
    assert changed_neighbourhood_keys_triton(none, g.leaves.keys).numel() == 0
    # no colour fields: no colours
    a = marching_cubes_triton(sub, nbr, layer.pool, table, count, s, False)
    assert a[4] is None and torch.equal(a[1], b[1])


def test_leaf_search_lookups_equal_the_tile_lookup(device, backend):
    """The lookups of the delta graph (a binary search of the grid's leaf keys: no tile index) against the
    tile-index lookup (``neighbour_slots_torch``, an independent path), over a padded copy of the grid as
    the graph holds it (keys padded with 2^63 - 1, slot rows past the grid's set to a slot that must never
    come back): present, absent and out-of-range neighbours; the changed bricks' present neighbour blocks
    (keys, padding rows ignored) and the blocks' neighbour slots from their keys (padding rows: none)."""
    from mapper.kernels import marching as mk
    from mapper.mesh import block_keys

    m = patchy_map(device)
    layer, g = m._tsdf, m._tsdf.grid
    bricks = layer.brick_table()[0]
    far = torch.tensor([[(1 << 20) - 1, 0, 0], [-(1 << 20), 5, -3], [0, (1 << 19) + 7, 0]], device=device)
    q = torch.cat((bricks[1::2], bricks[::7] + torch.tensor([3, -2, 1], device=device), far))
    want = mk.neighbour_slots_torch(q, g.leaves, g.tiles, layer.slots)
    assert int((want >= 0).sum()) > 500 and int((want == -1).sum()) > 100 and bool((want[-3:] == -1).all())
    n, pad = g.num_leaves, mk.KEY_PAD
    keys = torch.full((n + 37,), pad, dtype=torch.int64, device=device)
    keys[:n] = g.leaves.keys
    slots = torch.full((n + 37, 8), 12345, dtype=torch.int32, device=device)
    slots[:n] = layer.slots
    got = mk.leaf_neighbour_slots_torch(q, keys, slots)
    assert torch.equal(got, want) and torch.equal(
        mk.leaf_neighbour_slots_torch(q, g.leaves.keys, layer.slots), want
    )
    assert bool((mk.leaf_neighbour_slots_torch(q, keys[:0], slots[:0]) == -1).all())
    changed_blocks, key_neighbours = mk.changed_block_keys_torch, mk.key_block_neighbours_torch
    if backend == "triton":
        from mapper.kernels.triton_mesh import changed_block_keys_triton as changed_blocks
        from mapper.kernels.triton_mesh import key_block_neighbours_triton as key_neighbours
    # changed bricks: every third (leaf, brick) with a slot, two padding rows
    leaf, b = (layer.slots >= 0).nonzero(as_tuple=True)
    cpos = torch.cat(((leaf * 8 + b)[::3], torch.full((2,), -1, device=device)))
    ck = changed_blocks(cpos, keys, slots)
    ref = mk.changed_block_keys_torch(cpos, keys, slots)
    assert torch.equal(ck, ref) and ck.numel() == 27 * cpos.numel()
    lc = layer.grid.leaf_ijk.to(torch.int64)[leaf[::3]]
    cb = lc * 2 + torch.stack(((b[::3] >> 2) & 1, (b[::3] >> 1) & 1, b[::3] & 1), 1)
    nb = (cb[:, None, :] + mk._offsets_t(cb.device)[None]).reshape(-1, 3)
    present = (mk.neighbour_slots_torch(cb, g.leaves, g.tiles, layer.slots) >= 0).reshape(-1)
    expect = torch.where(present, block_keys(nb), torch.full_like(present, pad, dtype=torch.int64))
    assert torch.equal(ck[: expect.numel()], expect) and bool((ck[expect.numel() :] == pad).all())
    assert 0 < int(present.sum()) < present.numel()
    # blocks from keys (a padding row among them): decoded bricks and their neighbour slots
    bk = torch.cat((block_keys(q[:-3]), torch.full((1,), pad, device=device)))
    qb, qs = key_neighbours(bk, keys, slots)
    rb, rs = mk.key_block_neighbours_torch(bk, keys, slots)
    assert torch.equal(qb[:-1], q[:-3]) and torch.equal(qb, rb) and torch.equal(qs, rs)
    assert torch.equal(qs[:-1], want[:-3]) and bool((qs[-1] == -1).all())
    assert changed_blocks(cpos[:0], keys, slots).numel() == 0 and key_neighbours(bk[:0], keys, slots)[
        1
    ].shape == (0, 27)


def test_mesh_plane_and_sphere_are_on_the_analytic_surface(device, backend):
    """A tilted plane: every vertex on the plane, normals = the plane's normal, closed strip of cells; a
    sphere: vertices within 0.1 voxel of the sphere, outward unit normals, welded and watertight."""
    s = 0.1
    m = small_map(s, device, color=False)
    n = torch.tensor([0.2, -0.3, 1.0], dtype=torch.float64)
    n = n / torch.linalg.vector_norm(n)
    write_field(m, lambda p: p @ n - 0.137, (-0.8, -0.8, -0.6), (0.8, 0.8, 0.8))
    mesh = extract_mesh(m._tsdf, s).to("cpu")
    assert mesh.num_faces > 200
    v = mesh.vertices.double()
    assert float((v @ n - 0.137).abs().max()) < 1e-5
    torch.testing.assert_close(mesh.normals.double(), n.expand(mesh.num_vertices, 3), rtol=0, atol=1e-3)

    m = small_map(s, device, color=False)
    c, r = torch.tensor([0.03, -0.02, 0.01], dtype=torch.float64), 0.45
    write_field(m, sphere(c, r), (-0.7,) * 3, (0.7,) * 3)
    mesh = extract_mesh(m._tsdf, s).to("cpu")
    v = mesh.vertices.double()
    d = torch.linalg.vector_norm(v - c, dim=1)
    assert float((d - r).abs().max()) < 0.1 * s
    dots = ((v - c) / d[:, None] * mesh.normals.double()).sum(1)
    assert float(dots.min()) > 0.9
    # welded: one vertex per position, each edge of the closed surface shared by exactly 2 faces
    assert torch.unique(mesh.vertex_keys).numel() == mesh.num_vertices
    assert torch.unique(mesh.vertices, dim=0).shape[0] == mesh.num_vertices
    f = mesh.faces.long()
    e = torch.cat((f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]])).sort(1).values
    _, per_edge = torch.unique(e, dim=0, return_counts=True)
    assert set(per_edge.tolist()) == {2}
    assert mesh.num_vertices - per_edge.numel() + mesh.num_faces == 2  # a sphere
    # faces span brick borders: the welded ids are shared across blocks
    fb = mesh.face_blocks().repeat_interleave(3)
    lo = torch.full((mesh.num_vertices,), 1 << 40).scatter_reduce(0, f.reshape(-1), fb, "amin")
    hi = torch.full((mesh.num_vertices,), -1).scatter_reduce(0, f.reshape(-1), fb, "amax")
    shared = lo != hi
    assert int(shared.sum()) > 50


def test_incremental_mesh_equals_full_after_random_frames(device, backend):
    """Random edits (spheres unioned in, values shifted, boxes cleared, weights decayed); after each, the
    previous mesh + the delta is exactly the full extraction, and matches the other backend's."""
    s = 0.05
    m = Map(s, layers=("tsdf", "color"), device=device)
    gen = torch.Generator().manual_seed(11)
    layer = m._tsdf
    cur = extract_mesh(layer, s)
    for step in range(4):
        kind = step % 3
        if kind == 0 or layer.num_bricks == 0:
            c = (torch.rand(3, generator=gen, dtype=torch.float64) - 0.5) * 0.4
            r = 0.08 + 0.1 * float(torch.rand(1, generator=gen))
            write_field(m, sphere(c, r), (c - r - 0.2).tolist(), (c + r + 0.2).tolist(), color_fn=colour_of)
        elif kind == 1:
            bricks, slots = layer.brick_table()
            sel = torch.randperm(bricks.shape[0], generator=gen)[:5].to(device)
            t = layer.pool.gather("tsdf", slots[sel]).float()
            layer.pool.scatter("tsdf", slots[sel], t - 0.4 * s)
            layer.touch(bricks[sel])
        else:
            lo = (torch.rand(3, generator=gen, dtype=torch.float64) - 0.5) * 0.3
            m.clear(tuple(lo.tolist()), tuple((lo + 0.2).tolist()))
        delta = mesh_since(layer, s, cur.version)
        assert not delta.full
        cur = apply_delta(cur, delta)
        full = extract_mesh(layer, s)
        assert_same_mesh(cur, full, exact=True)
        other = with_kernels("torch" if backend == "triton" else "triton", extract_mesh, layer, s)
        assert_same_mesh(full, other, exact=False)
    assert cur.num_faces > 100


def test_mesh_bad_input_and_empty(device, backend):
    m = small_map(0.05, device)
    empty = extract_mesh(m._tsdf, 0.05)
    assert empty.num_faces == 0 and empty.num_vertices == 0 and empty.colors.shape == (0, 3)
    write_field(m, sphere((0, 0, 0), 0.2), (-0.3,) * 3, (0.3,) * 3)
    slots = m._tsdf.brick_table()[1]
    m._tsdf.pool.scatter("weight", slots, torch.zeros(slots.numel(), 64, device=device))  # nothing observed
    assert extract_mesh(m._tsdf, 0.05).num_faces == 0
    d = mesh_since(m._tsdf, 0.05, 0)
    assert d.num_faces == 0 and d.removed_blocks.shape[0] > 0
    with pytest.raises(InvalidArgument, match="bricks"):
        extract_mesh(m._tsdf, 0.05, bricks=torch.zeros((2, 4), dtype=torch.int64))
    with pytest.raises(InvalidArgument, match="voxel_size_m"):
        extract_mesh(m._tsdf, float("nan"))

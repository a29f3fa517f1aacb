"""CUDA graphs (``mapper.graphs``) and the graphed incremental mesh.

On the CPU only the fallback and the capturable (fixed-shape, sync-free) marching cubes can be checked: the
latter runs under the Triton interpreter and must give the eager op's arrays. The ``gpu`` tests capture and
replay for real (the GPU suite on the H200): graph == eager, meshes equal the reference extraction,
incremental == full, and no capture after the map's warm-up.
"""

from __future__ import annotations

import pytest
import torch
from test_mesh_kernel import (
    assert_same_mesh,
    colour_of,
    patchy_map,
    sphere,
    with_kernels,
    write_field,
)

from mapper import Map, graphs
from mapper.kernels.marching import marching_cubes_torch
from mapper.mesh import (
    DELTA_GRAPHS,
    GRAPH_BLOCKS_PER_CHANGED,
    GRAPH_MAX_BRICKS,
    GRAPH_TRI_PER_BRICK,
    GRAPH_TRI_PER_CHANGED,
    MC_GRAPHS,
    _assemble,
    _delta_fill,
    _delta_graph_inputs,
    _delta_outputs,
    _graph_mesh,
    _mc_graph_fn,
    _mc_graph_inputs,
    _tables,
    apply_delta,
    extract_mesh,
    mesh_since,
    neighbour_slots,
)

gpu = pytest.mark.gpu


def test_bucket_and_switch(monkeypatch):
    assert [graphs.bucket(n) for n in (0, 1, 64, 65, 128, 1000)] == [64, 64, 64, 128, 128, 1024]
    assert graphs.bucket(3, minimum=1) == 4 and graphs.bucket(4, minimum=1) == 4
    assert not graphs.enabled("cpu")
    monkeypatch.setenv(graphs.ENV, "0")
    assert not graphs.enabled("cuda")


def _double_op(max_graphs: int = 16) -> graphs.GraphedOp:
    """y = 2 x + cumsum(x) over a bucket; the size (sum of x) comes back as a tensor."""

    def fn(key, x):
        return x * 2 + torch.cumsum(x, 0), x.sum().reshape(1)

    return graphs.GraphedOp("double", fn, lambda key, dev: (torch.zeros(key, device=dev),), max_graphs)


def test_graphed_op_falls_back_to_eager_on_cpu():
    op = _double_op()
    before = graphs.stats()
    x = torch.arange(5, dtype=torch.float32)

    def fill(inp):
        inp[0].zero_()
        inp[0][:5].copy_(x)

    with op.run(8, "cpu", fill) as (y, total):
        expect = torch.cat((x * 2 + torch.cumsum(x, 0), torch.full((3,), 10.0)))
        assert torch.equal(y, expect) and float(total) == 10.0
    after = graphs.stats()
    assert after["eager"] == before["eager"] + 1 and after["captures"] == before["captures"]
    assert not op.warm(8, "cpu") and op.captured() == []


def _padded_inputs(m_map, mb: int):
    """The marching-cubes static inputs of bucket ``mb`` filled with every brick of a map (as the graphed
    path fills them), and the unpadded (bricks, neighbour slots)."""
    layer = m_map._tsdf
    dev = layer.device
    with_color = "color" in layer.pool.fields
    req = torch.unique(layer.brick_table()[0], dim=0)  # sorted by (i, j, k) = by block key
    nbr = neighbour_slots(layer, req)
    inp = _mc_graph_inputs((mb, with_color), dev)
    m, starts = req.shape[0], layer.pool.page_start_table()
    inp[0][:m], inp[1][:m] = req, nbr
    inp[2].fill_(m)
    inp[3][: starts.numel()] = starts
    names = ("tsdf", "weight", "color", "color_weight") if with_color else ("tsdf", "weight")
    for i, name in enumerate(names):
        inp[4 + i][: starts.numel() - 1] = layer.pool.page_table(name)
    inp[8].fill_(m_map.voxel_size_m)
    return inp, req, nbr


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_static_marching_cubes_equals_eager_op(device):
    """The fixed-shape op (what a graph captures) over a padded list = the eager Triton op, its block
    bookkeeping and the torch reference; a capacity too small or a brick out of the key range is reported
    in ``sizes``, never written past."""
    import os

    from mapper.kernels.triton_mesh import marching_cubes_static_triton, marching_cubes_triton

    dev = torch.device(device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    m = patchy_map(dev)
    layer = m._tsdf
    n = torch.unique(layer.brick_table()[0], dim=0).shape[0]
    mb = graphs.bucket(n + 5)
    inp, req, nbr = _padded_inputs(m, mb)
    table, count = _tables(dev)
    s = m.voxel_size_m
    eager = marching_cubes_triton(req, nbr, layer.pool, table, count, s, True)
    ref = marching_cubes_torch(req, nbr, layer.pool, table, count, s, True)
    mesh = _assemble(eager, req, dev, True, layer.version, s, partial=True)
    n_tri = eager[5].shape[0]
    assert n_tri > 200 and mesh.removed_blocks.shape[0] > 10
    out = marching_cubes_static_triton(*inp, tri_cap=n_tri + 37, with_color=True)
    fc, keys, pos, nrm, col, faces, blocks, offsets, removed, sizes = out
    nt, nv, nb, nr, bad = sizes.tolist()
    assert (nt, nv, nb, nr, bad) == (
        n_tri,
        eager[1].numel(),
        mesh.blocks.shape[0],
        mesh.removed_blocks.shape[0],
        0,
    )
    assert torch.equal(fc[:n], eager[0]) and int(fc[n:].abs().sum()) == 0
    for got, want in zip((keys[:nv], pos[:nv], nrm[:nv], col[:nv], faces[:nt]), eager[1:], strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(req[blocks[:nb]], mesh.blocks) and torch.equal(req[removed[:nr]], mesh.removed_blocks)
    assert torch.equal(offsets[:nb], mesh.block_face_offsets[1:])
    assert torch.equal(keys[:nv], ref[1]) and torch.equal(faces[:nt], ref[5])
    torch.testing.assert_close(pos[:nv], ref[2], rtol=0, atol=1e-6)
    # what the brick-list graph returns, through the one Mesh builder: the eager op's mesh exactly
    packed = _mc_graph_fn((mb, True), *inp)
    got = _graph_mesh(packed, layer, s, True, True, mb * GRAPH_TRI_PER_BRICK)
    assert got is not None and got.equals(mesh) and got.faces.dtype == torch.int32
    full = _graph_mesh(packed, layer, s, True, False, mb * GRAPH_TRI_PER_BRICK)
    assert full.full and full.removed_blocks.shape == (0, 3) and torch.equal(full.faces, mesh.faces)
    # too small a capacity: the count says so, nothing is written past it
    small = marching_cubes_static_triton(*inp, tri_cap=n_tri // 3, with_color=True)
    assert small[9].tolist()[0] == n_tri and small[5].shape == (n_tri // 3, 3)
    # a present brick past the edge-key range (k >= 2^19 - 4): flagged, and it meshes nothing
    inp[0][n] = torch.tensor([0, 0, (1 << 17) - 1])
    inp[1][n] = nbr[int(eager[0].argmax())]
    inp[2].fill_(n + 1)
    out = marching_cubes_static_triton(*inp, tri_cap=n_tri + 37, with_color=True)
    assert out[9].tolist()[:2] == [n_tri, nv] and out[9].tolist()[4] == 1 and int(out[0][n]) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_static_delta_mesh_equals_mesh_since(device, monkeypatch):
    """The fixed-shape delta op (changed bricks -> neighbourhoods -> lookup -> marching cubes -> blocks)
    gives exactly the eager ``mesh_since``; too small a block capacity is reported (and declined)."""
    import os

    from mapper.kernels.triton_mesh import changed_mesh_static_triton

    dev = torch.device(device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    monkeypatch.setenv(graphs.ENV, "0")
    monkeypatch.setenv("MAPPER_KERNELS", "triton")  # the eager Triton path (interpreted on the CPU)
    m = Map(0.05, layers=("tsdf", "color"), device=dev, warmup=False)  # several small pages
    m._tsdf.pool.first_page_bricks, m._tsdf.pool.page_bricks = 16, 64
    s = m.voxel_size_m
    write_field(m, sphere((0.01, 0.02, -0.01), 0.3), (-0.4,) * 3, (0.4,) * 3, color_fn=colour_of)
    layer = m._tsdf
    v = layer.version
    write_field(m, sphere((0.3, 0.1, 0.0), 0.12), (0.1, -0.1, -0.2), (0.5, 0.3, 0.2), color_fn=colour_of)
    eager = mesh_since(layer, s, v)
    assert eager.num_faces > 100 and eager.removed_blocks.shape[0] > 0 and len(layer.pool.page_starts) > 3
    changed = (layer.slots >= 0) & (layer.brick_versions > v)
    cpos = changed.reshape(-1).nonzero().squeeze(1)
    cb = graphs.bucket(cpos.numel())
    inp = _delta_graph_inputs((cb, True), dev)
    _delta_fill(layer, s, cpos, True)(inp)
    out = changed_mesh_static_triton(
        *inp, m_cap=cb * GRAPH_BLOCKS_PER_CHANGED, tri_cap=cb * GRAPH_TRI_PER_CHANGED, with_color=True
    )
    tri_cap = cb * GRAPH_TRI_PER_CHANGED
    got = _graph_mesh(_delta_outputs(out), layer, s, True, True, tri_cap, since=v)
    assert got is not None and got.equals(eager) and got.since_version == v
    assert_same_mesh(got, with_kernels("torch", mesh_since, layer, s, v), exact=False)
    n_req = out[-1].tolist()[5]
    assert n_req == eager.blocks.shape[0] + eager.removed_blocks.shape[0]
    small = changed_mesh_static_triton(
        *inp, m_cap=n_req - 1, tri_cap=cb * GRAPH_TRI_PER_CHANGED, with_color=True
    )
    assert small[-1].tolist()[6] == 1
    assert _graph_mesh(_delta_outputs(small), layer, s, True, True, tri_cap, since=v) is None


@gpu
def test_graphed_op_replays_equal_eager_and_counts_captures(monkeypatch):
    dev = torch.device("cuda")
    op = _double_op(max_graphs=2)
    before = graphs.stats()
    assert op.warm(16, dev)  # a warm-up capture
    mid = graphs.stats()
    assert mid["captures"] == before["captures"] + 1 and mid["late_captures"] == before["late_captures"]
    for n in (3, 16, 9):
        x = torch.rand(n, device=dev)

        def fill(inp, x=x):
            inp[0].zero_()
            inp[0][: x.numel()].copy_(x)

        with op.run(16, dev, fill) as (y, total):
            got = (y[: x.numel()].clone(), float(total))
        assert torch.equal(got[0], x * 2 + torch.cumsum(x, 0))
        assert got[1] == pytest.approx(float(x.sum()), rel=1e-6)
    after = graphs.stats()
    assert after["replays"] == mid["replays"] + 3 and after["captures"] == mid["captures"]
    with op.run(32, dev, lambda inp: inp[0].fill_(1.0)) as (y, _):  # a late capture: counted
        assert float(y[-1]) == 2.0 + 32.0
    assert graphs.stats()["late_captures"] == after["late_captures"] + 1
    with op.run(64, dev, lambda inp: inp[0].fill_(1.0)) as (y, _):  # over the cap: eager
        assert float(y[-1]) == 2.0 + 64.0
    assert len(op.captured(dev)) == 2 and graphs.stats()["eager"] == after["eager"] + 1
    monkeypatch.setenv(graphs.ENV, "0")
    with op.run(16, dev, lambda inp: inp[0].fill_(1.0)) as (y, _):
        assert float(y[-1]) == 2.0 + 16.0
    assert graphs.stats()["replays"] == after["replays"] + 1  # the late capture's call only


def _frames(m: Map, n: int, seed: int):
    """``n`` edits of a map like a sensor's frames: spheres unioned in, a box cleared now and then."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(n):
        if step % 4 == 3:
            lo = (torch.rand(3, generator=gen, dtype=torch.float64) - 0.5) * 0.6
            m.clear(tuple(lo.tolist()), tuple((lo + 0.15).tolist()))
        else:
            c = (torch.rand(3, generator=gen, dtype=torch.float64) - 0.5) * 0.8
            r = 0.05 + 0.1 * float(torch.rand(1, generator=gen))
            write_field(m, sphere(c, r), (c - r - 0.1).tolist(), (c + r + 0.1).tolist(), color_fn=colour_of)
        yield step


@gpu
def test_graphed_incremental_mesh_equals_eager_reference_and_full(monkeypatch):
    """After the map's warm-up: incremental meshes replayed from graphs are exactly the eager ones
    (``MAPPER_CUDA_GRAPHS=0``), patch to the full extraction, match the torch reference, and no graph is
    captured after the warm-up."""
    dev = torch.device("cuda")
    before = graphs.stats()
    # a configuration of its own: its warm-up runs here and captures the mesh buckets (if not yet) before
    # its own meshes
    m = Map(0.05, layers=("tsdf", "color"), device=dev, max_range_m=7.5)
    assert len(MC_GRAPHS.captured(m._tsdf.device)) >= 6 and len(DELTA_GRAPHS.captured(m._tsdf.device)) >= 5
    layer = m._tsdf
    cur = extract_mesh(layer, m.voxel_size_m)
    deltas = DELTA_GRAPHS.replays
    for _ in _frames(m, 8, seed=5):
        delta = m.mesh(since_version=cur.version)
        with monkeypatch.context() as mp:
            mp.setenv(graphs.ENV, "0")
            eager = m.mesh(since_version=cur.version)
        assert delta.equals(eager) and not delta.full
        cur = apply_delta(cur, delta)
        full = extract_mesh(layer, m.voxel_size_m)
        assert_same_mesh(cur, full, exact=True)
        assert_same_mesh(full, with_kernels("torch", extract_mesh, layer, m.voxel_size_m), exact=False)
    after = graphs.stats()
    assert cur.num_faces > 500
    assert after["late_captures"] == before["late_captures"] and after["failed"] == before["failed"]
    assert after["replays"] >= before["replays"] + 16  # each delta and each full mesh of <= 2048 bricks
    assert DELTA_GRAPHS.replays >= deltas + 6  # the deltas without a removed brick: changed bricks -> mesh


@gpu
def test_graphed_mesh_over_capacity_and_big_lists_run_eagerly():
    """A list past the largest bucket and a bucket with more triangles than it holds give the eager op's
    mesh (the graphed path declines them)."""
    dev = torch.device("cuda")
    m = Map(0.02, layers=("tsdf",), device=dev)
    # a dense field of small spheres: many triangles per brick (over GRAPH_TRI_PER_BRICK on average)
    f = lambda p: torch.cos(p * (2 * torch.pi / 0.08)).sum(1) * 0.01  # noqa: E731
    write_field(m, f, (-0.3, -0.3, -0.3), (0.3, 0.3, 0.3), trunc_vox=6.0)
    layer = m._tsdf
    n = torch.unique(layer.brick_table()[0], dim=0).shape[0]
    assert n <= GRAPH_MAX_BRICKS
    before = graphs.stats()
    mesh = extract_mesh(layer, m.voxel_size_m)
    assert mesh.num_faces > GRAPH_TRI_PER_BRICK * graphs.bucket(n)
    assert graphs.stats()["replays"] == before["replays"] + 1  # replayed, found too many, then eager
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(graphs.ENV, "0")
        assert mesh.equals(extract_mesh(layer, m.voxel_size_m))
    big = Map(0.02, layers=("tsdf",), device=dev, warmup=False)
    write_field(big, sphere((0, 0, 0), 0.9), (-1.0,) * 3, (1.0,) * 3)
    assert big._tsdf.num_bricks > GRAPH_MAX_BRICKS
    r0 = graphs.stats()["replays"]
    full = extract_mesh(big._tsdf, 0.02)
    assert graphs.stats()["replays"] == r0 and full.num_faces > 10000
    delta = mesh_since(big._tsdf, 0.02, big._tsdf.version)
    assert delta.num_faces == 0


def test_graph_fills_write_what_changed_and_keep_the_padding():
    """A delta graph's fill copies the leaf keys and slots every call, rewrites the padding of the leaf keys
    where a longer grid left keys behind, and writes the pool's page tables only when the pool grew (new
    tables): the buffers then equal a fresh fill's (CPU tensors: the fill itself is device-agnostic)."""
    import math

    def fresh_map(r):
        m = Map(0.05, layers=("tsdf", "color"), device="cpu", warmup=False)
        m._tsdf.pool.first_page_bricks, m._tsdf.pool.page_bricks = 16, 64
        write_field(m, sphere((0, 0, 0), r), (-r - 0.1,) * 3, (r + 0.1,) * 3, color_fn=colour_of)
        return m

    big, small = fresh_map(0.4), fresh_map(0.15)
    sent = (1 << 63) - 1

    def check(m, inp):
        layer = m._tsdf
        n, pool = layer.grid.num_leaves, layer.pool
        assert torch.equal(inp[1][:n], layer.grid.leaves.keys) and bool((inp[1][n:] == sent).all())
        assert torch.equal(inp[2][:n], layer.slots)
        p = len(pool.page_starts) - 1
        assert torch.equal(inp[3][: p + 1], pool.page_start_table()) and bool(
            (inp[3][p + 1 :] > 1 << 60).all()
        )
        for i, name in enumerate(("tsdf", "weight", "color", "color_weight")):
            assert torch.equal(inp[4 + i][:p], pool.page_table(name))
        assert math.isclose(float(inp[8]), m.voxel_size_m)

    inp = _delta_graph_inputs((64, True), torch.device("cpu"))
    cpos = torch.arange(5)
    for m in (big, small, big):  # a shorter grid after a longer one: its tail is padding again
        _delta_fill(m._tsdf, m.voxel_size_m, cpos, True)(inp)
        check(m, inp)
        assert torch.equal(inp[0][:5], cpos) and bool((inp[0][5:] == -1).all())
    # same pool, same tables: not written again (a marker survives); the pool grows: written
    inp[4][0] = -7
    _delta_fill(big._tsdf, big.voxel_size_m, cpos, True)(inp)
    assert int(inp[4][0]) == -7
    write_field(big, sphere((0.9, 0, 0), 0.3), (0.5, -0.4, -0.4), (1.3, 0.4, 0.4), color_fn=colour_of)
    _delta_fill(big._tsdf, big.voxel_size_m, cpos, True)(inp)
    check(big, inp)
    # another voxel size: written
    inp[4][0] = -7
    _delta_fill(big._tsdf, 0.07, cpos, True)(inp)
    assert int(inp[4][0]) != -7 and math.isclose(float(inp[8]), 0.07)

"""The per-frame path without host syncs (issue 12): the sync-free merge and allocation against plain
references, the free walk's stride on the device against the host rule, the tiered growth bound against
the tightest bound, and (GPU) no Triton compilation inside a sequence once it has started."""

from __future__ import annotations

import math

import pytest
import torch
from sync_count import SyncCounter, cuda_syncs

from mapper import Map, budget, sim
from mapper.grid import IndexGrid
from mapper.integrators import free as free_space
from mapper.integrators.tsdf import (
    TsdfConfig,
    depth_band_bricks,
    depth_band_bricks_compact,
    depth_band_bricks_keyed,
    pixel_rays,
)
from mapper.kernels.setops import merge_with_positions_torch
from mapper.kernels.topology import build_tiles, make_leaves
from mapper.layers import BrickLayer, FieldSpec


def _leaves(keys, device):
    k = torch.tensor(sorted(set(keys)), dtype=torch.int64, device=device)
    masks = torch.randint(1, 1 << 20, (k.numel(), 8), dtype=torch.int64, device=device)
    return make_leaves(k, masks)


@pytest.mark.parametrize(
    "ka,kb",
    [
        ([], []),
        ([], [3, 7]),
        ([3, 7], []),
        ([1, 5, 9], [5]),  # b inside a
        ([1, 5, 9], [0, 2, 10, 11]),  # disjoint, before / between / after
        (list(range(0, 200, 3)), list(range(1, 300, 7))),  # mixed
    ],
)
def test_merge_positions_match_a_sorted_union(ka, kb, device):
    torch.manual_seed(0)
    a, b = _leaves(ka, device), _leaves(kb, device)
    out, pa, pb = merge_with_positions_torch(a, b)
    union = sorted(set(ka) | set(kb))  # reference: plain Python
    assert out.keys.tolist() == union
    assert pa.tolist() == [union.index(k) for k in sorted(set(ka))]
    assert pb.tolist() == [union.index(k) for k in sorted(set(kb))]
    expect = torch.zeros((len(union), 8), dtype=torch.int64)
    for leaves, pos in ((a, pa), (b, pb)):
        for i, p in enumerate(pos.tolist()):
            expect[p] |= leaves.masks[i].cpu()
    assert torch.equal(out.masks.cpu(), expect)
    assert out.offsets[-1].item() == sum(bin(int(x) & (2**64 - 1)).count("1") for x in expect.reshape(-1))


def test_allocate_hands_out_slots_like_a_free_list(device):
    """Existing bricks keep their slots; the k-th new brick (input order) takes the k-th slot of the pool's
    allocation (free list from its end first, then the high-water mark), as a dict-based reference does."""
    g = torch.Generator().manual_seed(1)
    layer = BrickLayer({"v": FieldSpec(torch.float32, (), 0.0)}, device, page_bricks=64)
    ref: dict[tuple, int] = {}
    free: list[int] = []
    high = 0
    for step in range(6):
        bricks = torch.unique(torch.randint(-6, 6, (40, 3), generator=g), dim=0)
        bricks = bricks[torch.randperm(bricks.shape[0], generator=g)]  # input order matters
        got = layer.allocate(bricks.to(device)).cpu().tolist()
        new = [tuple(x) for x in bricks.tolist() if tuple(x) not in ref]
        take = min(len(new), len(free))
        fresh = free[len(free) - take :] + list(range(high, high + len(new) - take))
        free, high = free[: len(free) - take], high + len(new) - take
        ref.update(zip(new, fresh, strict=True))
        assert got == [ref[tuple(x)] for x in bricks.tolist()]
        if step % 2 == 1:  # release a third of the bricks: their slots go to the free list
            drop = torch.zeros_like(layer.slots, dtype=torch.bool)
            drop[::3] = True
            table, slots = layer.brick_table()
            gone = drop[(layer.slots >= 0)]
            layer.release_bricks(drop)
            for bc, s in zip(table[gone].tolist(), slots[gone].tolist(), strict=True):
                del ref[tuple(bc)]
                free.append(s)
    assert len(set(ref.values())) == len(ref)  # no slot handed out twice


def test_depth_free_walk_stride_equals_the_host_rule(device):
    """The free walk subsamples pixels with a stride computed on the device; same rays as the host rule
    (``free.depth_stride`` on the largest valid depth) give the same free record."""
    cam = sim.PinholeCamera(96, 72, 300.0, 300.0, 48.0, 36.0)
    scene = sim.indoor_scene(0, device=device)
    T = sim.orbit_trajectory(1, scene=scene)[0].to(device)
    depth = cam.render_depth(scene, T, 10.0)
    depth[5:9, 7:30] = 0.0  # holes
    m = Map(0.05, layers=("tsdf", "esdf"), device=device, esdf_voxel_size_m=0.2)
    m.integrate_depth(depth, cam.K, T)
    # reference: the host rule
    ok = torch.isfinite(depth) & (depth > 0)
    st = free_space.depth_stride(float(depth[ok].max()), min(cam.fx, cam.fy), m.esdf_voxel_size_m)
    assert st > 1  # the case exercises a real stride
    sub = torch.zeros_like(ok)
    sub[::st, ::st] = True
    sparse = torch.where(sub, depth, torch.zeros_like(depth))
    ref = BrickLayer(free_space.free_fields(), m.device)
    _, origin, dirs, rng = pixel_rays(sparse, cam.K.to(device), T.to(torch.float64), m.max_range_m)
    gap = free_space.free_gap(m.tsdf_config.tau, m.esdf_voxel_size_m)
    free_space.integrate_free(ref, origin, dirs, rng - gap, m.esdf_voxel_size_m)
    got_b, got_s = m._free.brick_table()
    ref_b, ref_s = ref.brick_table()
    assert torch.equal(got_b, ref_b)
    for name in ref.pool.fields:
        a, b = m._free.pool.gather(name, got_s), ref.pool.gather(name, ref_s)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _lidar_frame(n_beams=8):
    lidar = sim.SpinningLidar(n_beams=n_beams, n_azimuth=400)
    return next(iter(sim.lidar_sequence(1, lidar=lidar)))


def test_growth_tiers_never_undercut_the_tightest_bound():
    """With room, the bound may stop at a cheaper (looser) tier, but only when that tier fits: every tier is
    >= the tightest bound, and a frame that does not fit gets the tightest bound (the same refusals)."""
    pts, T = _lidar_frame()
    m = Map(0.1, layers=("tsdf", "occupancy", "esdf"), max_range_m=60.0)
    tight = budget.lidar_growth(m, pts, T)
    total = tight.bytes + tight.transient
    for room in (1e18, 4 * total, 1.5 * total, total, 0.5 * total, 0):
        g = budget.lidar_growth(m, pts, T, room)
        assert all(g.bricks[k] >= n for k, n in tight.bricks.items()), (room, g.bricks, tight.bricks)
        if g.bytes + g.transient > room:  # the same refusals: the tightest bound does not fit either
            same = g.bricks == tight.bricks and g.bytes == tight.bytes
            assert tight.bytes + tight.transient > room or same
    # the coarse bitmap bounds the fine one from above
    ends = torch.floor((pts.double() @ T[:3, :3].T + T[:3, 3]) / 0.4).to(torch.int64)
    for radius in (1, 3, 9):
        fine = budget._dilated_bricks(ends, radius)
        coarse = budget._dilated_bricks(ends, radius, budget.COARSE_CELLS)
        assert coarse >= fine > 0


def test_growth_with_room_skips_the_fine_dilation(monkeypatch):
    """The per-frame cost of the admission check: when a coarse tier fits, the fine bitmap is never built."""
    pts, T = _lidar_frame()
    m = Map(0.1, layers=("tsdf", "esdf"), max_range_m=60.0)
    tight = budget.lidar_growth(m, pts, T)
    calls = []
    orig = budget._dilated_bricks

    def spy(bricks, radius, max_cells=budget.FINE_CELLS):
        calls.append(max_cells)
        return orig(bricks, radius, max_cells)

    monkeypatch.setattr(budget, "_dilated_bricks", spy)
    budget.lidar_growth(m, pts, T, room=1000 * (tight.bytes + tight.transient))
    assert budget.FINE_CELLS not in calls


@pytest.mark.gpu
def test_no_triton_compile_inside_a_sequence():
    """Once a configuration has run a few frames, frames of other sizes (point counts, bricks, a growing
    map and pool) compile nothing: sizes are not specialised and search depths come in one bucket. The
    one exception: the occupancy coarse walk's loop bound is a power-of-two bucket of the frame's longest
    ray (a constexpr: the interpreter cannot run a runtime loop bound), at most one variant per bucket."""
    triton = pytest.importorskip("triton")
    dev = torch.device("cuda")
    frames = list(sim.lidar_sequence(14, device=dev, lidar=sim.SpinningLidar(n_beams=16, dropout_prob=0.3)))
    cam = sim.PinholeCamera.kinect()
    depth = list(sim.depth_sequence(10, cam, device=dev))
    warm_l, warm_d = (
        Map(0.1, layers=("tsdf", "occupancy"), device=dev),
        Map(0.02, layers=("tsdf",), device=dev),
    )
    for p, T in frames[:3]:
        warm_l.integrate_lidar(p, T, track=False)
    for d, K, T in depth[:3]:
        warm_d.integrate_depth(d, K, T)
    names = []
    prev = triton.knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        names.append(str(getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", fn)))

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        ml, md = Map(0.1, layers=("tsdf", "occupancy"), device=dev), Map(0.02, layers=("tsdf",), device=dev)
        for i, (p, T) in enumerate(frames[3:]):
            ml.integrate_lidar(p[: p.shape[0] - 37 * i], T, track=False)  # sizes not seen before
        for d, K, T in depth[3:]:
            md.integrate_depth(d, K, T)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = prev
    assert ml.bricks["tsdf"] > 0 and md.bricks["tsdf"] > 0
    assert all("_coarse_kernel" in n for n in names), names
    assert math.isfinite(float(ml.stats()["layers"]["tsdf"]["voxels"]))


def _grid_of_bricks(bricks: torch.Tensor, device) -> IndexGrid:
    """Reference: the grid of every voxel of the bricks (int64 ``[B, 3]``), built from scratch."""
    local = torch.stack(torch.meshgrid(*[torch.arange(4)] * 3, indexing="ij"), dim=-1).reshape(64, 3)
    return IndexGrid.from_ijk((bricks.cpu()[:, None, :] * 4 + local).reshape(-1, 3), device=device)


def test_allocate_kept_allocates_only_the_kept_bricks(device):
    """``allocate_kept``: kept bricks get slots (existing ones keep theirs, new ones in input order take
    the pool's next slots), dropped ones are not allocated and not marked written; the grid equals one
    built from scratch from all allocated bricks, its tile index included (reused when no leaf is new)."""
    g = torch.Generator().manual_seed(3)
    layer = BrickLayer({"v": FieldSpec(torch.float32, (), 0.0)}, device, page_bricks=64)
    ref: dict[tuple, int] = {}
    written: dict[tuple, int] = {}
    for step in range(6):
        lo = -6 if step < 4 else -2  # the last frames stay inside known leaves
        bricks = torch.unique(torch.randint(lo, -lo, (50, 3), generator=g), dim=0)
        bricks = bricks[torch.randperm(bricks.shape[0], generator=g)]
        keep = torch.rand(bricks.shape[0], generator=g) < 0.6
        if step == 5:
            keep[:] = False  # nothing kept: nothing changes
        assert layer.grid.tiles is not None  # built now: reused or rebuilt below
        v0 = layer.version
        rows, slots = layer.allocate_kept(bricks.to(device), keep.to(device))
        exp_rows = keep.nonzero().squeeze(1).tolist()
        assert rows.cpu().tolist() == exp_rows
        kept = [tuple(x) for x in bricks[keep].tolist()]
        new = [x for x in kept if x not in ref]
        ref.update(zip(new, range(len(ref), len(ref) + len(new)), strict=True))
        assert slots.cpu().tolist() == [ref[x] for x in kept]
        if kept:
            assert layer.version == v0 + 1
            written.update(dict.fromkeys(kept, layer.version))
        else:
            assert layer.version == v0
        table, tslots = layer.brick_table()
        assert {tuple(x): s for x, s in zip(table.tolist(), tslots.tolist(), strict=True)} == ref
        expect = _grid_of_bricks(torch.tensor(list(ref)), device)
        assert torch.equal(layer.grid.leaves.keys, expect.leaves.keys)
        assert torch.equal(layer.grid.leaves.masks, expect.leaves.masks)
        assert torch.equal(layer.grid.leaves.offsets, expect.leaves.offsets)
        for a, b in zip(layer.grid.tiles, build_tiles(expect.leaves.keys), strict=True):
            assert torch.equal(a, b)
        leaf, bi = (layer.slots >= 0).nonzero(as_tuple=True)
        lc = layer.grid.leaf_ijk.to(torch.int64)[leaf]
        bc = lc * 2 + torch.stack(((bi >> 2) & 1, (bi >> 1) & 1, bi & 1), dim=1)
        vers = layer.brick_versions[leaf, bi]
        assert {tuple(x): int(w) for x, w in zip(bc.tolist(), vers.tolist(), strict=True)} == written


@pytest.mark.parametrize("case", ["new_leaves", "new_bricks_in_known_leaves", "nothing_new"])
def test_allocate_reads_one_size_vector(case, device):
    """The allocation's host syncs: one read (the sizes), whatever is new. CPU: counted on the torch calls
    that sync on a GPU (tests/sync_count.py); CUDA: as the driver reports them, after the same calls on a
    throwaway layer (steady state: the process's one-time initialisations done)."""
    bricks = {
        "new_leaves": [[20, 0, 0], [21, 0, 0], [0, 0, 1]],
        "new_bricks_in_known_leaves": [[0, 0, 1], [8, 9, 9]],
        "nothing_new": [[0, 0, 0], [9, 9, 9]],
    }[case]
    b = torch.tensor(bricks, device=device)
    keep = torch.tensor([True] * (len(bricks) - 1) + [False], device=device)
    for counted in (False, True):
        layer = BrickLayer({"v": FieldSpec(torch.float32, (), 0.0)}, device)
        layer.allocate(torch.tensor([[0, 0, 0], [9, 9, 9]], device=device))
        for args in ((b, keep), (b,)):
            if not counted:
                layer.allocate_kept(*args)
            elif device.type == "cuda":
                with cuda_syncs() as sites:
                    layer.allocate_kept(*args)
                assert sum(sites.values()) == 1, sites
            else:
                with SyncCounter() as c:
                    layer.allocate_kept(*args)
                assert c.total == 1, c.sites


@pytest.mark.parametrize("voxel_m", [0.02, 0.05])
def test_depth_band_bricks_keyed_equal_the_compacting_path(voxel_m, device):
    """The depth grow without compaction (every pixel walked, invalid ones keyed -1) finds exactly the
    bricks of the previous implementation (valid pixels and cells compacted, then ``unique_voxels``):
    holes, NaN, +-inf, negative and out-of-range depths, one frame far from the origin."""
    cam = sim.PinholeCamera(96, 72, 80.0, 80.0, 48.0, 36.0)
    scene = sim.indoor_scene(1, device=device)
    T = sim.orbit_trajectory(2, scene=scene)[1].to(device).to(torch.float64)
    depth = cam.render_depth(scene, T, 10.0)
    depth[3:9, 5:40] = 0.0
    depth[20, 20:30] = float("nan")
    depth[21, 20:25] = float("inf")
    depth[22, 20:25] = -float("inf")
    depth[23, 20:25] = -1.0
    depth[24, 20:25] = 12.0  # beyond max_range_m
    cfg = TsdfConfig(voxel_m)
    K = cam.K.to(device).to(torch.float64)
    got = depth_band_bricks_keyed(depth, K, T, cfg, 10.0)
    ref = depth_band_bricks_compact(depth, K, T, cfg, 10.0)
    assert ref.shape[0] > 100
    assert torch.equal(got, ref)
    far = T.clone()
    far[:3, 3] += torch.tensor([1.0e4 * voxel_m, 0.0, 0.0], dtype=torch.float64, device=device)
    assert torch.equal(
        depth_band_bricks_keyed(depth, K, far, cfg, 10.0), depth_band_bricks_compact(depth, K, far, cfg, 10.0)
    )
    none = torch.zeros_like(depth)
    assert depth_band_bricks_keyed(none, K, T, cfg, 10.0).shape == (0, 3)
    assert torch.equal(depth_band_bricks(depth, K, T, cfg, 10.0), ref)  # the dispatch


def test_depth_band_bricks_keyed_reads_two_sizes():
    """The keyed depth grow's host syncs (counted on the torch calls that sync on a GPU): the bricks' box
    and their count, nothing per pixel or per cell."""
    cam = sim.PinholeCamera(64, 48, 50.0, 50.0, 32.0, 24.0)
    scene = sim.indoor_scene(1)
    T = sim.orbit_trajectory(2, scene=scene)[1].to(torch.float64)
    depth = cam.render_depth(scene, T, 10.0)
    depth[4:9, 3:30] = 0.0
    with SyncCounter() as c:
        bricks = depth_band_bricks_keyed(depth, cam.K.to(torch.float64), T, TsdfConfig(0.02), 10.0)
    assert bricks.shape[0] > 50
    assert c.total == 2, c.sites

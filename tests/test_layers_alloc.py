"""The brick allocation (``BrickLayer.allocate_kept``) in few launches: each step of ``mapper.kernels.alloc``
(Triton twin against the torch reference, exactly), and whole allocation sequences (new leaves, new bricks
in known leaves, nothing new, dropped bricks, releases, frozen views) against a dict-based reference and a
grid built from scratch, on both backends."""

from __future__ import annotations

import pytest
import torch

from mapper.grid import IndexGrid
from mapper.kernels import alloc
from mapper.kernels.dispatch import triton_twin
from mapper.layers import BrickLayer, FieldSpec


def _triton_ok() -> bool:
    import os

    from mapper.kernels.dispatch import triton_available

    return triton_available() and (
        torch.cuda.is_available()
        or os.environ.get("TRITON_INTERPRET") == "1"
        or os.environ.get("MAPPER_TRITON_SM90") == "1"
    )


def _expected_grid(bricks: list[tuple], device) -> IndexGrid:
    """Reference: the grid of every voxel of the bricks, built from scratch (``IndexGrid.from_ijk``)."""
    if not bricks:
        return IndexGrid.empty(device)
    local = torch.stack(torch.meshgrid(*[torch.arange(4)] * 3, indexing="ij"), dim=-1).reshape(64, 3)
    b = torch.tensor(bricks, dtype=torch.int64)
    return IndexGrid.from_ijk((b[:, None, :] * 4 + local).reshape(-1, 3), device=device)


def _table(layer: BrickLayer) -> dict[tuple, int]:
    bricks, slots = layer.brick_table()
    return {tuple(x): s for x, s in zip(bricks.cpu().tolist(), slots.cpu().tolist(), strict=True)}


def _versions(layer: BrickLayer) -> dict[tuple, int]:
    leaf, bi = (layer.slots >= 0).nonzero(as_tuple=True)
    lc = layer.grid.leaf_ijk.to(torch.int64)[leaf]
    bc = lc * 2 + torch.stack(((bi >> 2) & 1, (bi >> 1) & 1, bi & 1), dim=1)
    return {
        tuple(x): int(v)
        for x, v in zip(bc.cpu().tolist(), layer.brick_versions[leaf, bi].cpu().tolist(), strict=True)
    }


def test_allocation_sequence_matches_a_dict_reference(device, backend):
    """Random frames (new leaves, bricks in known leaves, revisits, dropped rows, far-apart and negative
    coordinates), releases in between, a frozen view taken mid-way: slots follow a free-list reference
    (the k-th new brick of the frame takes the k-th fresh slot), versions mark exactly the kept bricks,
    the grid equals one built from scratch, and the frozen view keeps its contents."""
    g = torch.Generator().manual_seed(7)
    layer = BrickLayer({"v": FieldSpec(torch.float32, (), 0.0)}, device, page_bricks=64)
    ref: dict[tuple, int] = {}
    written: dict[tuple, int] = {}
    free: list[int] = []
    high = 0
    view = view_table = None
    for step in range(8):
        span = 8 if step % 3 else 2  # every third frame stays near the origin: mostly known leaves
        bricks = torch.unique(torch.randint(-span, span, (40, 3), generator=g), dim=0)
        if step == 4:  # far away: a new tile, keys at the other end of the sorted order
            bricks = torch.cat((bricks, torch.tensor([[40000, -50000, 3], [-70000, 2, 2]])))
        bricks = bricks[torch.randperm(bricks.shape[0], generator=g)]
        keep = None if step % 4 == 0 else torch.rand(bricks.shape[0], generator=g) < 0.7
        if step == 7:
            keep[:] = False  # nothing kept: nothing changes
        v0 = layer.version
        rows, slots = layer.allocate_kept(bricks.to(device), None if keep is None else keep.to(device))
        k = torch.ones(bricks.shape[0], dtype=torch.bool) if keep is None else keep
        assert rows.cpu().tolist() == k.nonzero().squeeze(1).tolist()
        kept = [tuple(x) for x in bricks[k].tolist()]
        new = [x for x in kept if x not in ref]
        take = min(len(new), len(free))
        fresh = free[len(free) - take :] + list(range(high, high + len(new) - take))
        free, high = free[: len(free) - take], high + len(new) - take
        ref.update(zip(new, fresh, strict=True))
        assert slots.cpu().tolist() == [ref[x] for x in kept]
        assert layer.version == (v0 + 1 if kept else v0)
        written.update(dict.fromkeys(kept, layer.version))
        assert _table(layer) == ref
        assert _versions(layer) == written
        expect = _expected_grid(list(ref), device)
        for a, b in zip(layer.grid.leaves, expect.leaves, strict=True):
            assert torch.equal(a, b)
        if view is not None:  # the frozen view answers for its version
            assert _table(view) == view_table
        if step == 3:
            view, view_table = layer.frozen(), dict(ref)
        if step in (2, 5, 8):  # release a third of the bricks: their slots go to the free list
            drop = torch.rand(layer.slots.shape, generator=g).to(device) < 0.33
            gone = (drop & (layer.slots >= 0)).nonzero(as_tuple=True)
            freed = layer.slots[gone].to(torch.int64).cpu().tolist()
            layer.release_bricks(drop)
            free += freed
            ref = {x: s for x, s in ref.items() if s not in set(freed)}
            written = {x: v for x, v in written.items() if x in ref}


@pytest.mark.parametrize("case", ["empty_layer", "new_leaves", "known_leaves", "nothing_new", "none_kept"])
def test_alloc_ops_triton_match_torch(case, device):
    """Each step's Triton twin returns exactly what its torch reference does (and writes the same tables)."""
    if not _triton_ok():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(11)
    layer = BrickLayer({"v": FieldSpec(torch.float32, (), 0.0)}, torch.device("cpu"))
    if case != "empty_layer":
        layer.allocate(torch.unique(torch.randint(-5, 5, (300, 3), generator=g), dim=0))
    span = {"empty_layer": 9, "new_leaves": 9, "known_leaves": 5, "nothing_new": 5, "none_kept": 9}[case]
    bricks = torch.unique(torch.randint(-span, span, (500, 3), generator=g), dim=0)
    if case == "nothing_new":
        bricks, _ = layer.brick_table()
    bricks = bricks[torch.randperm(bricks.shape[0], generator=g)]
    keep = torch.rand(bricks.shape[0], generator=g) < (0.0 if case == "none_kept" else 0.8)
    dev = device
    old = layer.grid.leaves
    for kp in (None, keep):
        args = (bricks.to(dev), None if kp is None else kp.to(dev), old.keys.to(dev), layer.slots.to(dev))
        ref = alloc.alloc_lookup_torch(*args)
        got = triton_twin("triton_alloc:alloc_lookup_triton")(*args)
        for a, b in zip(ref, got, strict=True):
            assert torch.equal(a.cpu(), b.cpu())
    in_old, cur, sortkey, b, missing, kept = ref
    sk, order = torch.sort(sortkey)
    ref = alloc.alloc_ranks_torch(sk, order, missing, kept)
    got = triton_twin("triton_alloc:alloc_ranks_triton")(sk, order, missing, kept)
    n_leaves, n_bricks, n_kept = ref[0].tolist()
    assert got[0].tolist() == [n_leaves, n_bricks, n_kept]
    assert n_kept == int(kept.sum()) and n_bricks == int(missing.sum())  # independent counts
    assert torch.equal(ref[1][:n_leaves].cpu(), got[1][:n_leaves].cpu())
    new_leaf = missing & (in_old < 0)
    assert ref[1][:n_leaves].cpu().tolist() == sorted(set(sortkey[new_leaf].cpu().tolist()))
    for a, b_, sel in ((ref[2], got[2], new_leaf), (ref[3], got[3], missing)):
        assert torch.equal(a[sel].cpu(), b_[sel].cpu())
    assert torch.equal(ref[4][:n_kept].cpu(), got[4][:n_kept].cpu())
    assert ref[4][:n_kept].cpu().tolist() == kept.nonzero().squeeze(1).cpu().tolist()
    if n_kept == 0:  # the caller stops here (write_bricks needs a kept brick)
        return
    _, new_keys, leaf_rank, brick_rank, _ = ref
    tables = (layer.slots.to(dev), layer.brick_versions.to(dev), old.masks.to(dev))
    pos_old, pos_new = None, torch.zeros(0, dtype=torch.int64, device=dev)
    if n_leaves:
        keys = (old.keys.to(dev), new_keys[:n_leaves].to(dev))
        r = alloc.relayout_leaves_torch(*keys, *tables)
        t = triton_twin("triton_alloc:relayout_leaves_triton")(*keys, *tables)
        for a, b_ in zip(r, t, strict=True):
            assert torch.equal(a.cpu(), b_.cpu())
        assert r[0].cpu().tolist() == sorted(old.keys.tolist() + new_keys[:n_leaves].cpu().tolist())
        tables, pos_old, pos_new = r[1:4], r[4], r[5]
    fresh = torch.arange(1000, 1000 + n_bricks, dtype=torch.int64, device=dev)
    outs = []
    for impl in (alloc.write_bricks_torch, triton_twin("triton_alloc:write_bricks_triton")):
        tab = tuple(x.clone() for x in tables)
        out = impl(in_old, pos_old, pos_new, leaf_rank, b, missing, kept, cur, fresh, brick_rank, 77, tab)
        outs.append((out[kept].cpu(), *(x.cpu() for x in tab)))
    for a, b_ in zip(*outs, strict=True):
        assert torch.equal(a, b_)
    if n_bricks:  # the masks written are those of the slot table (independent: from the present bricks)
        assert torch.equal(outs[0][3], alloc.brick_masks(outs[0][1] >= 0))


def test_alloc_ops_reject_nothing_silently_on_empty(device, backend):
    """Zero bricks: no allocation, no version bump, empty results of the right dtype."""
    layer = BrickLayer({"v": FieldSpec(torch.float32, (), 0.0)}, device)
    rows, slots = layer.allocate_kept(torch.zeros((0, 3), dtype=torch.int64, device=device))
    assert rows.numel() == 0 and slots.numel() == 0 and rows.dtype == torch.int64
    assert layer.version == 0 and layer.grid.num_leaves == 0

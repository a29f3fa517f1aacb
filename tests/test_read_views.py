"""Copy-on-write read views (``Map.read_view``, ``PagedPool.freeze``): a view keeps answering for its
version while the map goes on integrating, equal to a map built independently up to that version."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_service_helpers import scan

from mapper import Map
from mapper.layers import FieldSpec, PagedPool


@pytest.mark.parametrize("copy_all_below", [0, 1 << 30])
def test_frozen_pool_keeps_its_pages_and_copies_only_touched_pages(
    device, backend, copy_all_below, monkeypatch
):
    monkeypatch.setattr("mapper.layers.COW_ALL_BYTES", copy_all_below)
    precise = device.type == "cpu" or copy_all_below == 0  # CUDA, small field: all shared pages, no sync
    page = 4 * 64 * 4  # 4 bricks x 64 float32
    pool = PagedPool({"a": FieldSpec(torch.float32)}, device, page_bricks=4, first_page_bricks=4)
    slots = pool.alloc(12)  # 3 pages of 4 bricks
    pool.scatter("a", slots, torch.arange(12, dtype=torch.float32, device=device)[:, None].expand(12, 64))
    view = pool.freeze()
    before = view.gather("a", slots).clone()
    pool.scatter("a", slots[5:6], torch.full((1, 64), -1.0, device=device))  # page 1 only
    assert torch.equal(view.gather("a", slots), before)  # the view is unchanged
    after = pool.gather("a", slots)
    assert torch.equal(after[5], torch.full((64,), -1.0, device=device)) and torch.equal(
        after[:5], before[:5]
    )
    assert pool.cow_bytes == (page if precise else 3 * page)  # the touched page (or all three) copied
    assert (view.pages["a"][0] is pool.pages["a"][0]) == precise == (view.pages["a"][2] is pool.pages["a"][2])
    assert view.pages["a"][1] is not pool.pages["a"][1]
    pool.scatter(
        "a", slots[6:7], torch.zeros((1, 64), device=device)
    )  # page 1 is private now: no second copy
    assert pool.cow_bytes == (page if precise else 3 * page)
    with pytest.raises(RuntimeError, match="read-only"):
        view.scatter("a", slots[:1], torch.zeros((1, 64), device=device))
    # a freed slot reused for a new brick copies its page too (alloc fills it)
    view2 = pool.freeze()
    pool.release(slots[:1])
    fresh = pool.alloc(1)
    assert int(fresh) == int(slots[0])
    assert torch.equal(view2.gather("a", slots[:1]), before[:1])


def _layers_equal(a: Map, b: Map, atol: float = 0.0) -> None:
    """Same voxels, same values (bit for bit at atol=0; GPU float atomics need a few ulp)."""
    for name in a.layers:
        ga, da = a.layer(name)
        gb, db = b.layer(name)
        assert torch.equal(ga.ijk, gb.ijk), name
        for k in da:
            x, y = (da[k], db[k]) if da[k].is_floating_point() else (da[k].float(), db[k].float())
            torch.testing.assert_close(x, y, rtol=0, atol=atol, equal_nan=True, msg=f"{name}.{k}")


@pytest.mark.parametrize("layers", [("tsdf", "esdf"), ("tsdf", "occupancy", "esdf")])
def test_view_is_the_version_it_was_taken_at(layers, device):
    atol = 0.0 if device.type == "cpu" else 1e-4
    m = Map(0.25, layers=layers, device=device)
    ref = Map(0.25, layers=layers, device=device)
    for i in range(2):
        m.integrate_lidar(*scan(i))
        ref.integrate_lidar(*scan(i))
    m.update_esdf()
    ref.update_esdf()
    v = m.read_view()
    assert v.version == m.version == 2 and v.read_only
    q = np.random.default_rng(0).uniform([-5, -5, -0.5], [5, 5, 2], (2000, 3))
    d0 = v.query_distance(q)
    mesh0 = v.mesh()
    for i in range(2, 6):  # the map moves on: new bricks, updates of old ones, an ESDF update, a clear
        m.integrate_lidar(*scan(i))
    m.update_esdf()
    m.clear([-1, -1, -1], [1, 1, 1])
    assert m.version > v.version == 2
    _layers_equal(v, ref, atol)  # the map at version 2 (bit for bit on the CPU)
    d1 = v.query_distance(q)
    for x, y in zip(d0, d1, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)

    def rows(mesh):  # vertex set (the GPU extraction's order depends on atomics)
        return np.unique(mesh.vertices.cpu().numpy(), axis=0)

    np.testing.assert_array_equal(rows(v.mesh()), rows(mesh0))  # the same view: the same answer
    assert v.trajectory()[0].shape[0] == 2 and m.trajectory()[0].shape[0] == 6
    with pytest.raises(RuntimeError, match="read_view"):
        v.integrate_lidar(*scan(9))
    # and the live map equals a map built without views in between
    for i in range(2, 6):
        ref.integrate_lidar(*scan(i))
    ref.update_esdf()
    ref.clear([-1, -1, -1], [1, 1, 1])
    _layers_equal(m, ref, atol)


def test_old_version_pages_are_freed_when_no_reader_holds_them():
    import gc
    import weakref

    pool = PagedPool({"a": FieldSpec(torch.float32)}, torch.device("cpu"), page_bricks=4, first_page_bricks=4)
    slots = pool.alloc(8)
    view = pool.freeze()
    old = weakref.ref(view.pages["a"][0])
    pool.scatter("a", slots[:1], torch.ones((1, 64)))  # page 0 copied: the old page lives in the view only
    assert old() is not None and old() is not pool.pages["a"][0]
    del view
    gc.collect()
    assert old() is None  # freed with the last reader's view: memory back to the map's own pages

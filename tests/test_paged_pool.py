"""PagedPool access: the Triton gather/scatter through the page table (one launch, no host sync) against
the torch per-page path and against a dense NumPy copy of the same data, over pools of many pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper.layers import FieldSpec, PagedPool

FIELDS = {
    "tsdf": FieldSpec(torch.float16, (), 0.0),
    "log_odds": FieldSpec(torch.float16, (), float("nan")),
    "color": FieldSpec(torch.uint8, (3,), 7),
    "esdf": FieldSpec(torch.float32, (), 2.5),
}


def _pool(device, n_slots: int, seed: int):
    """A pool with small pages (2, 4, 8, then 8-brick pages) filled with random data, and the dense truth."""
    pool = PagedPool(FIELDS, device, page_bricks=8, first_page_bricks=2)
    slots = pool.alloc(n_slots)
    g = torch.Generator().manual_seed(seed)
    truth = {}
    for name, spec in FIELDS.items():
        if spec.dtype == torch.uint8:
            v = torch.randint(0, 256, (n_slots, 64, *spec.shape), generator=g, dtype=torch.uint8)
        else:
            v = torch.randn((n_slots, 64, *spec.shape), generator=g).to(spec.dtype)
        truth[name] = v.numpy().copy()
        pool.scatter(name, slots, v.to(device))
    return pool, slots, truth


def test_gather_scatter_match_dense_truth(device, backend):
    n = 53  # 2 + 4 + 8 + 8 ... : 8 pages
    pool, slots, truth = _pool(device, n, 0)
    assert len(pool.page_starts) > 4
    g = torch.Generator().manual_seed(1)
    pick = torch.randint(0, n, (500,), generator=g)
    off = torch.randint(0, 64, (500,), generator=g)
    s = slots.cpu()[pick]
    for name in FIELDS:
        got = pool.gather(name, s.to(device), off.to(device)).cpu().numpy()
        want = truth[name][s.numpy(), off.numpy()]
        np.testing.assert_array_equal(got, want)
        whole = pool.gather(name, s[:40].to(device)).cpu().numpy()
        np.testing.assert_array_equal(whole, truth[name][s[:40].numpy()])
    # scatter at unique pairs, then read everything back
    key = torch.unique(s * 64 + off)
    us, uo = key // 64, key % 64
    new = torch.arange(key.numel(), dtype=torch.float32)
    pool.scatter("esdf", us.to(device), new.to(device), uo.to(device))
    truth["esdf"][us.numpy(), uo.numpy()] = new.numpy()
    sn = slots.cpu().numpy()
    np.testing.assert_array_equal(pool.gather("esdf", slots).cpu().numpy(), truth["esdf"][sn])
    # whole-brick scatter of a multi-channel field and fill
    rgb = torch.randint(0, 256, (3, 64, 3), generator=g, dtype=torch.uint8)
    pool.scatter("color", slots[-3:], rgb.to(device))
    truth["color"][slots[-3:].cpu().numpy()] = rgb.numpy()
    pool.fill_slots("log_odds", slots[:5], float("nan"))
    truth["log_odds"][slots[:5].cpu().numpy()] = np.nan
    for name in ("color", "log_odds"):
        np.testing.assert_array_equal(pool.gather(name, slots).cpu().numpy(), truth[name][sn])


def test_fresh_slots_get_fill_values(device, backend):
    pool = PagedPool(FIELDS, device, page_bricks=4, first_page_bricks=1)
    a = pool.alloc(9)
    pool.scatter("esdf", a, torch.ones((9, 64), device=device))
    pool.release(a[2:6])
    b = pool.alloc(11)  # 4 reused + 7 fresh across new pages
    got = pool.gather("esdf", b).cpu()
    assert torch.equal(got, torch.full((11, 64), 2.5))
    assert torch.equal(pool.gather("color", b).cpu(), torch.full((11, 64, 3), 7, dtype=torch.uint8))


@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single(device, backend, n):
    pool, slots, truth = _pool(device, 20, 2)
    s = slots[:n]
    assert pool.gather("tsdf", s, torch.zeros(n, dtype=torch.int64, device=device)).shape == (n,)
    assert pool.gather("color", s).shape == (n, 64, 3)

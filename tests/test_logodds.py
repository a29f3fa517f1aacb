"""The log-odds flag update (``mapper.kernels.logodds``): a hand-computed case, the Triton kernel against
the torch reference on a many-page pool (bit-equal fp16), copy-on-write of published views, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mapper.errors import InvalidArgument, InvalidArgumentType
from mapper.kernels.logodds import flags_update
from mapper.layers import FieldSpec, PagedPool

NAN = float("nan")
FIELDS = {"log_odds": FieldSpec(torch.float16, (), NAN)}


def _pool(n_slots: int, device, page_bricks: int = 4) -> tuple[PagedPool, torch.Tensor]:
    pool = PagedPool(FIELDS, device, page_bricks=page_bricks, first_page_bricks=2)  # pages of 2, 4, 4, ...
    return pool, pool.alloc(n_slots)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp16 bits (NaN included)."""
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_hand_computed_brick(device, backend):
    pool, slots = _pool(3, device)
    sl = slots[1:2]  # the middle slot: its neighbours must not change
    before = np.array([NAN, 0.5, 3.4, -1.9, 1.0, NAN, -0.25, 2.0] + [NAN] * 56, dtype=np.float32)
    pool.scatter("log_odds", sl, torch.tensor(before, device=device).reshape(1, 64))
    flags = torch.zeros(64, dtype=torch.uint8, device=device)
    flags[:7] = torch.tensor([2, 1, 2, 1, 0, 0, 1], dtype=torch.uint8)
    known = torch.zeros(1, dtype=torch.uint8, device=device)
    flags_update(pool, "log_odds", sl, flags, 0.85, -0.4, -2.0, 3.5, known)
    got = pool.gather("log_odds", sl).float().cpu().numpy().reshape(-1)
    # unknown + hit = 0.85; 0.5 + miss = 0.1; 3.4 + hit clamps to 3.5; -1.9 + miss clamps to -2; flag 0 keeps
    # 1.0 and NaN; -0.25 + miss = -0.65; 2.0 without a flag stays (index 7), the rest stays unknown
    want = np.array([0.85, 0.5 - 0.4, 3.5, -2.0, 1.0, NAN, -0.25 - 0.4, 2.0], dtype=np.float32)
    # the input itself was stored as fp16 first: compute in float32 from those fp16 values, as the map does
    b16 = before.astype(np.float16).astype(np.float32)
    want[1], want[6] = b16[1] + np.float32(-0.4), b16[6] + np.float32(-0.4)
    np.testing.assert_array_equal(got[:8], want.astype(np.float16).astype(np.float32))
    assert np.isnan(got[8:]).all()
    assert known.tolist() == [1]  # voxel 0 was unknown and flagged
    assert torch.isnan(pool.gather("log_odds", slots[[0, 2]]).float()).all()  # neighbours untouched


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("with_known", [False, True])
def test_triton_equals_torch_on_many_pages(device, backend, with_known, monkeypatch):
    g = torch.Generator().manual_seed(3)
    n = 23  # pages of 2, 4, 4, 4, 4, 4, 4 bricks: every lane searches its page
    start = torch.rand((n, 64), generator=g) * 8 - 4
    start[torch.rand((n, 64), generator=g) < 0.3] = NAN
    start[0, :5] = torch.tensor([3.49, -1.99, 65504.0, -65504.0, 0.0])  # clamps at both ends, huge values
    order = torch.randperm(n, generator=g)[:17]  # a subset, shuffled
    flags = torch.randint(0, 3, (order.numel(), 64), generator=g, dtype=torch.uint8)
    flags[-1] = 0  # a brick without a flag
    out = []
    for impl in ("torch", "triton"):
        monkeypatch.setenv("MAPPER_KERNELS", impl)
        pool, slots = _pool(n, device)
        pool.scatter("log_odds", slots, start.to(device))
        known = torch.zeros(order.numel(), dtype=torch.uint8, device=device) if with_known else None
        sl = slots[order.to(device)]
        flags_update(pool, "log_odds", sl, flags.to(device), 0.85, -0.4, -2.0, 3.5, known)
        out.append((pool.gather("log_odds", slots), known))
    assert len(pool.page_starts) > 5
    assert _same(out[0][0], out[1][0])
    assert not _same(out[0][0], start.to(torch.float16))  # it did change something
    if with_known:
        assert torch.equal(out[0][1], out[1][1])
        s16 = start.to(torch.float16)[order]
        assert out[0][1].cpu().bool().tolist() == ((flags > 0) & torch.isnan(s16)).any(dim=1).tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_free_record_rule_without_upper_clamp(device, backend):
    """The free record's use: every flag a miss, clamp below only (``math.inf`` above)."""
    pool, slots = _pool(2, device)
    pool.scatter("log_odds", slots[:1], torch.full((1, 64), 5.0, device=device))
    flags = torch.ones(128, dtype=torch.uint8, device=device)
    known = torch.zeros(2, dtype=torch.uint8, device=device)
    flags_update(pool, "log_odds", slots, flags, -0.4, -0.4, -2.0, math.inf, known)
    lo = pool.gather("log_odds", slots).float().cpu()
    assert torch.equal(lo[0], torch.full((64,), float(np.float16(np.float32(5.0) + np.float32(-0.4)))))
    assert torch.equal(lo[1], torch.full((64,), float(np.float16(-0.4))))
    assert known.tolist() == [0, 1]


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_a_published_view_keeps_its_values(device, backend):
    pool, slots = _pool(6, device)
    pool.scatter("log_odds", slots, torch.zeros((6, 64), device=device))
    view = pool.freeze()
    flags_update(
        pool, "log_odds", slots, torch.full((6 * 64,), 2, dtype=torch.uint8, device=device), 1, -1, -2, 3
    )
    assert torch.equal(view.gather("log_odds", slots).float().cpu(), torch.zeros((6, 64)))
    assert torch.equal(pool.gather("log_odds", slots).float().cpu(), torch.ones((6, 64)))


def test_bad_input(device):
    pool, slots = _pool(2, device)
    with pytest.raises(InvalidArgument, match="64 per brick"):
        flags_update(pool, "log_odds", slots, torch.zeros(64, dtype=torch.uint8, device=device), 1, -1, -2, 3)
    p32 = PagedPool({"x": FieldSpec(torch.float32, (), 0.0)}, device)
    with pytest.raises(InvalidArgumentType, match="float16"):
        flags_update(p32, "x", p32.alloc(1), torch.zeros(64, dtype=torch.uint8, device=device), 1, -1, -2, 3)

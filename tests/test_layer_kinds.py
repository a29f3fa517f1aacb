"""Layer kinds (mapper.layer_kinds) against hand-computed values, the integrators' contract (the bricks an
integrator returns are exactly the bricks whose voxels it wrote), and the ESDF brick queue."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_service_helpers import scan

from mapper import Map
from mapper.integrators import base
from mapper.integrators.base import BrickQueue, LidarFrame
from mapper.integrators.free import FreeSpaceIntegrator
from mapper.integrators.occupancy import OccupancyConfig, OccupancyIntegrator
from mapper.integrators.tsdf import TsdfConfig, TsdfIntegrator
from mapper.layer_kinds import ObservedRecord, OccupancyLayer, TsdfLayer

CPU = torch.device("cpu")


def _one_brick(layer, field: str, values: list[float]):
    slots = layer.allocate(torch.tensor([[0, 0, 0]]))
    v = torch.tensor(values + [values[-1]] * (64 - len(values)), dtype=torch.float32)
    layer.pool.scatter(field, slots, v[None])
    return slots


def test_tsdf_decay_by_hand():
    layer = TsdfLayer(CPU, 0.1, with_color=True)
    slots = _one_brick(layer, "weight", [1.0, 0.25, 0.0, 0.5])
    layer.pool.scatter("tsdf", slots, torch.full((1, 64), 0.05))
    layer.pool.scatter("color_weight", slots, torch.full((1, 64), 2.0))
    died, alive = layer.decay_bricks(slots, 0.5, 0.15)
    w = layer.pool.gather("weight", slots)[0].float()
    t = layer.pool.gather("tsdf", slots)[0].float()
    cw = layer.pool.gather("color_weight", slots)[0].float()
    assert w[:4].tolist() == [0.5, 0.0, 0.0, 0.25]  # 0.125 < 0.15 dies; 0 stays unobserved
    assert died[0, :4].tolist() == [False, True, False, False]  # only observed voxels "die"
    assert t[1].item() == 0.0 and t[0].item() == pytest.approx(0.05, abs=1e-4)
    assert cw[0].item() == 1.0 and cw[1].item() == 0.0
    assert alive.tolist() == [True]
    died, alive = layer.decay_bricks(slots, 0.1, 0.15)  # everything falls below the threshold
    assert alive.tolist() == [False] and int(died.sum()) == 62  # voxels 0 and 3..63 were observed


def test_occupancy_decay_reset_and_views_by_hand():
    layer = OccupancyLayer(CPU, 0.1)
    nan = float("nan")
    slots = _one_brick(layer, "log_odds", [2.0, 0.2, nan, -1.0])
    died, alive = layer.decay_bricks(slots, 0.5, 0.15)
    lo = layer.pool.gather("log_odds", slots)[0].float()
    assert lo[0].item() == 1.0 and math.isnan(lo[1].item()) and math.isnan(lo[2].item())
    assert lo[3].item() == -0.5
    assert died[0, :4].tolist() == [False, True, False, False] and alive.tolist() == [True]
    layer.reset_voxels(slots[:1], torch.tensor([0]))
    assert math.isnan(layer.pool.gather("log_odds", slots)[0, 0].item())
    g, keep = layer.occupied()
    assert int(keep.sum()) == 0  # the only positive voxel was reset
    g, d = layer.view("occupancy")
    assert g.num_voxels == 64 and d["log_odds"].dtype == torch.float32
    assert ObservedRecord(CPU, 0.2).views == () and ObservedRecord.kind == "free"


def test_tsdf_reset_views_and_occupied_by_hand():
    layer = TsdfLayer(CPU, 0.1, with_color=True)
    slots = _one_brick(layer, "weight", [1.0])
    tsdf = torch.full((1, 64), 0.2)
    tsdf[0, 5] = 0.04  # within half a voxel of the surface
    layer.pool.scatter("tsdf", slots, tsdf)
    g, keep = layer.occupied()
    assert keep.sum().item() == 1 and g.ijk[keep].tolist() == [[0, 1, 1]]  # offset 5 = (0, 1, 1)
    layer.reset_voxels(slots.expand(2), torch.tensor([5, 6]))
    g, d = layer.view("tsdf")
    assert set(d) == {"tsdf", "weight"} and int((d["weight"] == 0).sum()) == 2
    assert layer.occupied()[1].sum().item() == 0
    g, d = layer.view("color")
    assert set(d) == {"color", "weight"} and d["color"].dtype == torch.uint8
    assert layer.views == ("tsdf", "color") and TsdfLayer(CPU, 0.1).views == ("tsdf",)


def _written_bricks(layer, run):
    """Run ``run()``; the set of bricks whose stored voxels differ afterwards (or were allocated)."""

    def state():
        bricks, slots = layer.brick_table()
        out = {}
        for i, b in enumerate(bricks.tolist()):
            out[tuple(b)] = torch.cat(
                [layer.pool.gather(f, slots[i : i + 1]).float().reshape(-1) for f in layer.pool.fields]
            )
        return out

    before = state()
    returned = run()
    after = state()
    changed = {
        b
        for b, v in after.items()
        if b not in before or not torch.equal(torch.nan_to_num(v, 7.0), torch.nan_to_num(before[b], 7.0))
    }
    return {tuple(b) for b in returned.tolist()}, changed


@pytest.mark.parametrize("kind", ["tsdf", "occupancy"])
def test_integrators_return_the_bricks_they_write(kind):
    s = 0.2
    pts, T = scan(0, 800)
    T = torch.tensor(T)
    world = torch.tensor(pts, dtype=torch.float64) @ T[:3, :3].T + T[:3, 3]
    frame = LidarFrame(T[:3, 3].clone(), world)
    if kind == "tsdf":
        layer, integ = TsdfLayer(CPU, s), TsdfIntegrator(TsdfConfig(s))
    else:
        layer, integ = OccupancyLayer(CPU, s), OccupancyIntegrator(OccupancyConfig(s))
    for i in range(2):  # the second frame updates existing bricks too
        returned, changed = _written_bricks(layer, lambda: integ.integrate(frame, layer))
        assert len(returned) > 10
        # every written brick is returned; a returned brick was allocated for the frame (it may be unchanged
        # only where the running average of equal observations gives the same fp16 value)
        assert changed <= returned, (i, len(changed - returned))
        assert len(changed) >= 0.5 * len(returned)


def test_free_space_integrator_returns_the_bricks_that_became_known():
    s = 0.4
    record = ObservedRecord(CPU, s)
    integ = FreeSpaceIntegrator(s, tau_m=0.3)
    pts, T = scan(0, 500)
    T = torch.tensor(T)
    world = torch.tensor(pts, dtype=torch.float64) @ T[:3, :3].T + T[:3, 3]
    frame = LidarFrame(T[:3, 3].clone(), world)

    def known():
        bricks, slots = record.brick_table()
        lo = record.pool.gather("log_odds", slots) if slots.numel() else torch.zeros(0, 64)
        counts = (~torch.isnan(lo.float())).sum(1).tolist()
        return {tuple(b) for b, k in zip(bricks.tolist(), counts, strict=True) if k}

    new = {tuple(b) for b in integ.integrate(frame, record).tolist()}
    assert new == known() and len(new) > 5
    again = integ.integrate(frame, record)  # the same rays: nothing becomes known
    assert again.shape == (0, 3)
    assert integ.gap_m == pytest.approx(max(0.3, math.sqrt(3) / 2 * s))


def test_brick_queue_compacts_to_unique_rows(monkeypatch):
    monkeypatch.setattr(base, "DIRTY_COMPACT_ROWS", 8)
    q = BrickQueue()
    assert not q
    q.push(torch.zeros((0, 3), dtype=torch.int64))
    assert not q  # push skips empty parts, push_always keeps them
    q.push_always(torch.zeros((0, 3), dtype=torch.int64))
    assert q and q.drain() and not q
    rows = torch.tensor([[1, 2, 3], [0, 0, 0], [1, 2, 3], [-5, 7, 2]])
    for _ in range(3):
        q.push(rows)
    q.compact()  # 12 rows > max(8, 2 * 4): merged
    assert len(q.parts) == 1 and q.parts[0].tolist() == [[-5, 7, 2], [0, 0, 0], [1, 2, 3]]
    q.push(rows)
    q.compact()  # 7 rows <= max(8, 6): kept as they are
    assert len(q.parts) == 2


def test_map_bounds_use_each_layers_voxel():
    """The free record has the ESDF's voxel: its extent in metres scales with that voxel, not the map's."""
    m = Map(0.1, layers=("tsdf", "esdf"), esdf_voxel_size_m=0.4, device="cpu", max_range_m=10.0)
    m.integrate_lidar(*scan(0, 600))
    b = m.bounds()
    assert set(b) == {"tsdf", "free"}
    for name, s in (("tsdf", 0.1), ("free", 0.4)):
        bricks = m._require("tsdf").brick_table()[0] if name == "tsdf" else m._free.brick_table()[0]
        lo = bricks.min(0).values.double() * 4 * s
        np.testing.assert_allclose(b[name][0], lo.tolist())
    # the record reaches the sensor's neighbourhood and the TSDF the walls: both within the 6 m room
    assert max(abs(x) for x in b["free"][0] + b["free"][1]) < 8.0

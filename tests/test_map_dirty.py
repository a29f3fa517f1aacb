"""A map whose ESDF is not read keeps its pending dirty bricks bounded (merged into unique rows), and the
ESDF computed from the merged list equals the one from the full list."""

from __future__ import annotations

import torch
from test_service_helpers import scan

from mapper.integrators import base
from mapper.map import Map


def _build(monkeypatch, compact_rows: int, frames: int = 24):
    monkeypatch.setattr(base, "DIRTY_COMPACT_ROWS", compact_rows)
    m = Map(voxel_size_m=0.3, layers=["tsdf", "esdf"], max_range_m=10.0)
    pending = []
    for i in range(frames):  # three scans replayed at the same poses: the same bricks again and again
        pts, T = scan(i % 3, 1500)
        m.integrate_lidar(pts, T)
        pending.append(sum(int(t.shape[0]) for t in m._surface_queue.parts))
    return m, pending


def test_pending_dirty_bricks_stay_bounded_and_give_the_same_esdf(monkeypatch):
    full, rows_full = _build(monkeypatch, 1 << 40)  # never merged
    distinct = torch.unique(torch.cat(full._surface_queue.parts), dim=0).shape[0]
    assert rows_full[-1] >= 8 * distinct  # without merging, every frame's bricks pile up
    merged, rows = _build(monkeypatch, 64)
    per_frame = max(b - a for a, b in zip(rows_full, rows_full[1:], strict=False))
    assert max(rows) <= 2 * distinct + per_frame, (max(rows), distinct, per_frame)
    assert len(merged._surface_queue.parts) < len(full._surface_queue.parts)
    assert torch.equal(
        torch.unique(torch.cat(merged._surface_queue.parts), dim=0),
        torch.unique(torch.cat(full._surface_queue.parts), dim=0),
    )
    full.update_esdf()
    merged.update_esdf()
    (g1, v1), (g2, v2) = full._esdf.view(), merged._esdf.view()
    assert g1.num_voxels == g2.num_voxels > 0
    for k in v1:
        assert torch.equal(torch.nan_to_num(v1[k].float(), 99.0), torch.nan_to_num(v2[k].float(), 99.0)), k

"""Write-ahead log and snapshots: torn tails, CRC, atomic snapshots, pruning."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mapper import InvalidArgument, Map
from mapper.persistence import (
    HEADER,
    DataDir,
    MapDir,
    WalWriter,
    load_snapshot_bytes,
    load_snapshot_file,
    read_wal,
)


def test_wal_round_trip(tmp_path):
    w = WalWriter(tmp_path / "wal-0000000000000001.log")
    payloads = [os.urandom(n) for n in (0, 1, 100, 10_000)]
    for i, p in enumerate(payloads, 1):
        w.append(i, p)
    w.sync()
    w.close()
    assert list(read_wal(w.path)) == list(enumerate(payloads, 1))


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size, HEADER.size + 50])
def test_torn_tail_is_truncated(tmp_path, cut):
    path = tmp_path / "wal-0000000000000001.log"
    w = WalWriter(path)
    w.append(1, b"a" * 100)
    w.append(2, b"b" * 100)
    w.close()
    good = HEADER.size + 100
    with open(path, "r+b") as f:
        f.truncate(good + cut)
    assert [s for s, _ in read_wal(path, repair=True)] == [1]
    assert path.stat().st_size == good
    w = WalWriter(path)  # appends continue after the repaired tail
    w.append(2, b"c")
    w.close()
    assert [p for _, p in read_wal(path)] == [b"a" * 100, b"c"]


def test_corrupt_record_stops_reading(tmp_path):
    path = tmp_path / "wal-0000000000000001.log"
    w = WalWriter(path)
    for i in range(1, 4):
        w.append(i, bytes([i]) * 10)
    w.close()
    data = bytearray(path.read_bytes())
    data[HEADER.size + 10 + HEADER.size + 3] ^= 0xFF  # payload of record 2
    path.write_bytes(bytes(data))
    assert [s for s, _ in read_wal(path)] == [1]


def _map_with_data():
    m = Map(0.25, layers=("tsdf",), device="cpu")
    pts = np.random.default_rng(1).normal(size=(2000, 3)).astype(np.float32) * 4
    m.integrate_lidar(pts, np.eye(4))
    return m


def test_snapshot_round_trip_and_prune(tmp_path):
    d = MapDir(tmp_path / "m1")
    d.write_info({"id": "m1", "name": "x", "config": {}})
    m = _map_with_data()
    tensors, meta = m.state_dict()
    for seq in (3, 7, 9):
        d.write_snapshot(seq, tensors, meta)
    for first in (1, 4, 8, 10):
        WalWriter(d.root / f"wal-{first:016d}.log").close()
    d.prune(9, keep=2)
    assert d.snapshots() == [7, 9]
    assert [f for f, _ in d.wal_segments()] == [10]
    snap = d.latest_snapshot()
    assert snap.seq == 9 and snap.meta["wal_seq"] == 9
    t2, meta2 = load_snapshot_file(snap.path)
    assert meta2["config"] == m.config()
    m2 = Map.from_state_dict(t2, meta2, device="cpu")
    g1, s1 = m.layer("tsdf")
    g2, s2 = m2.layer("tsdf")
    assert torch.equal(g1.ijk, g2.ijk) and torch.equal(s1["tsdf"], s2["tsdf"])
    assert load_snapshot_bytes(snap.path.read_bytes())[1]["wal_seq"] == 9


def test_uncommitted_snapshot_is_ignored(tmp_path):
    d = MapDir(tmp_path / "m1")
    d.root.mkdir()
    tensors, meta = _map_with_data().state_dict()
    d.write_snapshot(1, tensors, meta)
    (d.root / "snapshot-0000000000000005.safetensors").write_bytes(b"partial")  # no .json: not committed
    assert d.latest_snapshot().seq == 1


@pytest.mark.parametrize("data", [b"", b"garbage" * 10, b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "])
def test_bad_snapshot_bytes(data):
    with pytest.raises(InvalidArgument, match="snapshot"):
        load_snapshot_bytes(data)


def test_data_dir_lists_maps(tmp_path):
    dd = DataDir(tmp_path)
    dd.map_dir("a").write_info({"id": "a"})
    (tmp_path / "maps" / "junk").mkdir()
    assert dd.map_ids() == ["a"]
    dd.map_dir("a").remove()
    assert dd.map_ids() == []

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
    SnapshotDamaged,
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


def test_corrupt_record_in_the_middle_is_skipped_not_cut(tmp_path):
    """A damaged record with intact records after it is damage, not a torn tail: reading resumes at the
    next intact record (the file is not truncated, even with ``repair``) and the damaged range is reported."""
    path = tmp_path / "wal-0000000000000001.log"
    w = WalWriter(path)
    for i in range(1, 4):
        w.append(i, bytes([i]) * 10)
    w.close()
    rec = HEADER.size + 10
    for where in (rec + HEADER.size + 3, rec, rec + 4):  # payload, magic, length field of record 2
        data = bytearray(path.read_bytes())
        data[where] ^= 0xFF
        bad = tmp_path / f"bad-{where}.log"
        bad.write_bytes(bytes(data))
        seen = []
        got = [s for s, _ in read_wal(bad, repair=True, on_damage=lambda *a, seen=seen: seen.append(a[:4]))]
        assert got == [1, 3]
        assert len(seen) == 1 and seen[0][:2] == (rec, 2 * rec) and seen[0][3] is False
        assert bad.stat().st_size == 3 * rec  # nothing cut


def test_resync_finds_records_after_a_huge_length_field(tmp_path):
    path = tmp_path / "wal-0000000000000001.log"
    w = WalWriter(path)
    payloads = [os.urandom(50 + i) for i in range(6)]
    for i, p in enumerate(payloads, 1):
        w.append(i, p)
    w.close()
    data = bytearray(path.read_bytes())
    off = HEADER.size + len(payloads[0])
    data[off + 4 : off + 8] = (0x7FFFFFF0).to_bytes(4, "little")  # record 2's length: past the end
    path.write_bytes(bytes(data))
    assert [p for _, p in read_wal(path, repair=True)] == [payloads[0], *payloads[2:]]


def test_map_dir_quarantines_wal_damage_and_cuts_only_a_torn_tail(tmp_path):
    d = MapDir(tmp_path / "m1")
    d.root.mkdir()
    w = d.open_wal(1)
    for i in range(1, 11):
        w.append(i, bytes([i]) * 40)
    w.close()
    seg = d.wal_segments()[0][1]
    data = bytearray(seg.read_bytes())
    rec = HEADER.size + 40
    data[4 * rec + HEADER.size + 1] ^= 0x10  # record 5's payload
    data += data[: HEADER.size + 7]  # plus a torn tail: a header and 7 payload bytes of an append cut short
    seg.write_bytes(bytes(data))
    damage: list = []
    assert [s for s, _ in d.replay(0, damage)] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert seg.stat().st_size == 10 * rec  # the tail cut, the damage in the middle kept in place
    assert len(damage) == 1
    note = damage[0]
    assert note["kind"] == "wal" and note["offset"] == 4 * rec and note["bytes"] == rec
    assert note["after_seq"] == 4 and note["error"] == "CRC mismatch"
    kept = d.root / "quarantine" / f"wal-{1:016d}-{4 * rec:012d}.bin"
    assert kept.read_bytes() == bytes(data[4 * rec : 5 * rec])
    assert [n.get("kind") for n in d.quarantined()] == ["wal"]
    # a complete record with a bad CRC at the very end is quarantined before it is cut
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0x01
    seg.write_bytes(bytes(data))
    damage = []
    assert [s for s, _ in d.replay(0, damage)] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert [n["offset"] for n in damage] == [4 * rec, 9 * rec] and seg.stat().st_size == 9 * rec


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
    # the log is kept from the previous snapshot (7) on: 7 plus segment 8 rebuild 9 should 9 be damaged
    assert [f for f, _ in d.wal_segments()] == [8, 10]
    snap = d.latest_snapshot()
    assert snap.seq == 9 and snap.meta["wal_seq"] == 9
    t2, meta2 = load_snapshot_file(snap.path)
    assert meta2["config"] == m.config()
    m2 = Map.from_state_dict(t2, meta2, device="cpu")
    g1, s1 = m.layer("tsdf")
    g2, s2 = m2.layer("tsdf")
    assert torch.equal(g1.ijk, g2.ijk) and torch.equal(s1["tsdf"], s2["tsdf"])
    assert load_snapshot_bytes(snap.path.read_bytes())[1]["wal_seq"] == 9


@pytest.mark.parametrize("damage", ["tensor byte", "header byte", "data deleted", "manifest", "manifest seq"])
def test_damaged_snapshot_is_detected_and_the_previous_one_used(tmp_path, damage):
    d = MapDir(tmp_path / "m1")
    d.root.mkdir()
    tensors, meta = _map_with_data().state_dict()
    d.write_snapshot(3, tensors, meta)
    d.write_snapshot(7, tensors, meta)
    path, manifest = d.snapshot_path(7), d.root / f"snapshot-{7:016d}.json"
    data = bytearray(path.read_bytes())
    if damage == "tensor byte":
        data[-5] ^= 0x01  # safetensors alone would load it without noticing
        path.write_bytes(bytes(data))
    elif damage == "header byte":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "data deleted":
        path.unlink()
    elif damage == "manifest":
        manifest.write_bytes(manifest.read_bytes()[:-9])
    else:  # valid JSON, one digit changed: the manifest's own check catches it
        manifest.write_text(manifest.read_text().replace('"bytes": ', '"bytes": 1', 1))
    with pytest.raises(SnapshotDamaged):
        d.open_snapshot(7)
    assert d.snapshots() == [3, 7] and d.latest_snapshot().seq == 3
    note = d.quarantine_snapshot(7, "test")
    assert note == {"kind": "snapshot", "seq": 7, "error": "test"}
    assert d.snapshots() == [3] and [n.get("kind") for n in d.quarantined()] == ["snapshot"]
    assert (d.root / "quarantine" / f"snapshot-{7:016d}.manifest").exists()


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

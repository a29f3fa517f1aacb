"""The object-store backend (``MAPPER_STORE=s3://...``, ``mapper/objstore.py``) against a real S3 API: moto's
server on 127.0.0.1 (``moto[server]``). The references are independent of the backend: maps fed the same
frames in this process, the records as appended, the object keys the layout documents."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from crash_helpers import (
    StreamThread,
    answer_within,
    assert_same_tsdf,
    check_recovered,
    rebuilt,
    served_map,
    wait_until,
)
from test_service_helpers import S3_TEST_ENV, TOKEN, Server, frame_bytes, scan, wait_ready

from mapper import Map, cli, wire
from mapper.client import MapperClient
from mapper.errors import InvalidArgument
from mapper.persistence import load_snapshot_file
from mapper.settings import Settings
from mapper.store import recover_map
from mapper.store_backends import open_store

boto3 = pytest.importorskip("boto3", reason="the object-store backend needs boto3 (pip install 'mapper[s3]')")
moto_server = pytest.importorskip("moto.server", reason="moto[server] runs the S3 API for these tests")


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 (a free port) and test credentials in the environment (also for the
    ``mapper serve`` subprocesses; the Ray map workers had them from the start of Ray, see conftest.py)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_TEST_ENV.items():
            mp.setenv(k, v)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def bucket(s3):
    name = f"maps-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=name)
    return name


def keys(s3, bucket, prefix="") -> list[str]:
    c = boto3.client("s3", endpoint_url=s3)
    out = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def store_settings(tmp_path: Path, s3: str, bucket: str, **kw) -> Settings:
    base = dict(
        data_dir=tmp_path / "data",
        store=f"s3://{bucket}/fleet",
        s3_endpoint_url=s3,
        device="cpu",
        snapshot_interval_s=0,
        warmup=False,
    )
    base.update(kw)
    return Settings(**base)


def wal_key(map_id: str, first: int, last: int) -> str:
    return f"fleet/maps/{map_id}/wal-{first:016d}-{last:016d}.log"


# ------------------------------------------------------------------------------------- the backend
def test_wal_is_one_object_per_sync_and_replays_in_order(tmp_path, s3, bucket):
    data = open_store(store_settings(tmp_path, s3, bucket))
    md = data.map_dir("m1")
    wal = md.open_wal(1)
    recs = [(i, f"record {i}".encode() * i) for i in range(1, 8)]
    for seq, p in recs[:3]:
        wal.append(seq, p)
    wal.sync()
    wal.sync()  # nothing appended: no object
    wal.append(*recs[3])
    wal.sync()
    assert keys(s3, bucket) == [wal_key("m1", 1, 3), wal_key("m1", 4, 4)]
    assert list(md.replay(0)) == recs[:4]
    assert list(md.replay(2)) == recs[2:4]

    # a failed PUT fails the sync and drops its records: a later batch never carries them
    put = md.objects.put

    def refuse(key, data):
        raise md.objects._fail("PUT", key, ConnectionError("network down"))

    md.objects.put = refuse
    wal.append(*recs[4])
    with pytest.raises(OSError, match=r"PUT s3://.*wal-0000000000000005-0000000000000005\.log failed"):
        wal.sync()
    md.objects.put = put
    wal.append(*recs[5])
    wal.append(*recs[6])
    wal.close()
    assert keys(s3, bucket)[-1] == wal_key("m1", 6, 7)
    assert [s for s, _ in md.replay(0)] == [1, 2, 3, 4, 6, 7]
    assert md.wal_bytes() == sum(
        len(boto3.client("s3", endpoint_url=s3).get_object(Bucket=bucket, Key=k)["Body"].read())
        for k in keys(s3, bucket)
    )

    # a corrupt record is skipped to the next intact one (an object cannot be torn: the damage is kept in
    # quarantine/ and reported); the records after it in its object and later objects replay
    c = boto3.client("s3", endpoint_url=s3)
    raw = bytearray(c.get_object(Bucket=bucket, Key=wal_key("m1", 1, 3))["Body"].read())
    second = 20 + len(recs[0][1])  # header (20 bytes) + payload of record 1: record 2 starts here
    raw[second + 25] ^= 0xFF  # a payload byte of record 2: its CRC fails
    c.put_object(Bucket=bucket, Key=wal_key("m1", 1, 3), Body=bytes(raw))
    damage: list = []
    assert [s for s, _ in md.replay(0, damage)] == [1, 3, 4, 6, 7]
    size = 20 + len(recs[1][1])
    assert [(n["offset"], n["bytes"], n["after_seq"]) for n in damage] == [(second, size, 1)]
    qkey = f"fleet/maps/m1/quarantine/wal-{1:016d}-{3:016d}-{second:012d}.bin"
    assert c.get_object(Bucket=bucket, Key=qkey)["Body"].read() == bytes(raw[second : second + size])
    assert [n["kind"] for n in md.quarantined()] == ["wal"]


def test_replay_prefetch_keeps_the_order(tmp_path, s3, bucket, monkeypatch):
    """More WAL objects than GETs in flight, of random sizes: replay yields every record once, in order."""
    from mapper import objstore

    monkeypatch.setattr(objstore, "REPLAY_PREFETCH", 3)
    md = open_store(store_settings(tmp_path, s3, bucket)).map_dir("m3")
    wal = md.open_wal(1)
    rng = np.random.default_rng(1)
    want, seq = [], 0
    for _ in range(23):
        for _ in range(int(rng.integers(1, 4))):
            seq += 1
            rec = (seq, rng.bytes(int(rng.integers(1, 5000))))
            want.append(rec)
            wal.append(*rec)
        wal.sync()
    assert len(keys(s3, bucket)) == 23
    assert list(md.replay(0)) == want
    assert list(md.replay(want[30][0])) == want[31:]


def test_snapshot_manifest_publishes_prune_and_cache(tmp_path, s3, bucket):
    data = open_store(store_settings(tmp_path, s3, bucket))
    md = data.map_dir("m2")
    wal = md.open_wal(1)
    for seq in range(1, 7):
        wal.append(seq, b"r%d" % seq)
        wal.sync()
    t1 = {"a": torch.arange(10, dtype=torch.float32)}
    md.write_snapshot(3, t1, {"config": {"voxel_size_m": 0.1}})
    # an uploaded snapshot without its manifest (a crash before the manifest PUT) is not published
    c = boto3.client("s3", endpoint_url=s3)
    c.put_object(Bucket=bucket, Key="fleet/maps/m2/snapshot-0000000000000005.safetensors", Body=b"junk")
    assert md.snapshots() == [3]
    snap = md.latest_snapshot()
    assert snap.seq == 3 and snap.meta["wal_seq"] == 3
    tensors, meta = load_snapshot_file(snap.path)
    assert torch.equal(tensors["a"], t1["a"]) and meta["config"] == {"voxel_size_m": 0.1}

    t2 = {"a": torch.full((4,), 7.0)}
    md.write_snapshot(5, t2, {"config": {"voxel_size_m": 0.1}})
    md.prune(5, keep=1)  # keeps the previous snapshot (3) and the WAL after it: the fallback should 5 fail
    names = [k.rsplit("/", 1)[1] for k in keys(s3, bucket, "fleet/maps/m2/")]
    assert names == [
        "snapshot-0000000000000003.json",
        "snapshot-0000000000000003.safetensors",
        "snapshot-0000000000000005.json",
        "snapshot-0000000000000005.safetensors",
        *[f"wal-{i:016d}-{i:016d}.log" for i in (4, 5, 6)],
    ]
    md.write_snapshot(6, t2, {"config": {"voxel_size_m": 0.1}})
    md.prune(6, keep=1)
    names = [k.rsplit("/", 1)[1] for k in keys(s3, bucket, "fleet/maps/m2/")]
    assert names == [
        "snapshot-0000000000000005.json",
        "snapshot-0000000000000005.safetensors",
        "snapshot-0000000000000006.json",
        "snapshot-0000000000000006.safetensors",
        f"wal-{6:016d}-{6:016d}.log",
    ]
    assert list(md.replay(5)) == [(6, b"r6")]
    assert sorted(p.name for p in md.root.iterdir()) == [
        "snapshot-0000000000000005.safetensors",
        "snapshot-0000000000000006.safetensors",
    ]

    # another node (an empty cache) downloads the published snapshot
    other = open_store(store_settings(tmp_path / "node2", s3, bucket)).map_dir("m2")
    assert not other.root.exists()
    s2 = other.latest_snapshot()
    assert s2.seq == 6 and s2.path.parent == other.root
    assert torch.equal(load_snapshot_file(s2.path)[0]["a"], t2["a"])

    md.remove()
    assert keys(s3, bucket, "fleet/maps/m2/") == [] and not md.root.exists()


def test_a_corrupt_snapshot_falls_back_to_the_older_one(tmp_path, s3, bucket):
    """The manifest's CRC32 checks a snapshot end to end: a download that differs (same size, one byte
    flipped in the store) is refused and the older published snapshot is used; a stale cache file too."""
    md = open_store(store_settings(tmp_path, s3, bucket)).map_dir("m5")
    md.write_snapshot(2, {"a": torch.zeros(1000)}, {"config": {}})
    md.write_snapshot(4, {"a": torch.ones(1000)}, {"config": {}})
    c = boto3.client("s3", endpoint_url=s3)
    key = "fleet/maps/m5/snapshot-0000000000000004.safetensors"
    good = c.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[-5] ^= 0x01  # a tensor byte: safetensors would load it without noticing
    c.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    other = open_store(store_settings(tmp_path / "node2", s3, bucket)).map_dir("m5")
    snap = other.latest_snapshot()
    assert snap.seq == 2 and torch.equal(load_snapshot_file(snap.path)[0]["a"], torch.zeros(1000))
    assert not other.snapshot_path(4).exists()  # the refused download is not kept
    c.put_object(Bucket=bucket, Key=key, Body=good)
    md.snapshot_path(4).write_bytes(bytes(bad))  # a stale cache file of the right size is not trusted
    snap = md.latest_snapshot()
    assert snap.seq == 4 and torch.equal(load_snapshot_file(snap.path)[0]["a"], torch.ones(1000))


def test_recovery_quarantines_a_bad_record_in_the_store(tmp_path, s3, bucket):
    """A record that fails on replay is kept aside under quarantine/ in the store and replay goes on."""
    from mapper import store

    data = open_store(store_settings(tmp_path, s3, bucket))
    md = data.map_dir("m4")
    config = dict(voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)
    info = {"id": "m4", "name": "poisoned", "created": "2026-12-01T00:00:00", "config": config}
    md.write_info(info)
    wal = md.open_wal(1)
    frames = [wire.parse_frame(wire.unpackb(frame_bytes(i))) for i in range(3)]
    wal.append(1, store.encode_record("frame", frames[0]))
    wal.append(2, wire.packb({"op": "decay", "factor": "not a number"}))  # fails in apply
    wal.append(3, store.encode_record("frame", frames[1]))
    wal.sync()
    wal.append(4, store.encode_record("frame", frames[2]))
    wal.close()
    quarantined: list = []
    m, got_info, snap, last, replayed = recover_map(md, "cpu", quarantined)
    assert (got_info, snap, last, replayed) == (info, None, 4, 4)
    assert [seq for seq, _ in quarantined] == [2]
    assert keys(s3, bucket, "fleet/maps/m4/quarantine/") == [
        f"fleet/maps/m4/quarantine/{2:016d}.json",
        f"fleet/maps/m4/quarantine/{2:016d}.msgpack",
    ]
    notes = md.quarantined()
    assert len(notes) == 1 and notes[0]["seq"] == 2 and notes[0]["error"] == quarantined[0][1]
    ref = rebuilt(config, 3)
    assert_same_tsdf(m, ref)
    c = boto3.client("s3", endpoint_url=s3)
    c.put_object(Bucket=bucket, Key="fleet/maps/.x/info.json", Body=b"{}")  # not a map id
    c.put_object(Bucket=bucket, Key="fleet/maps/half/snapshot-0000000000000000.json", Body=b"{}")  # no info
    assert data.map_ids() == ["m4"] and data.owners() == {"m4": None}


def test_recovery_on_s3_falls_back_past_a_damaged_snapshot_and_skips_a_damaged_record(tmp_path, s3, bucket):
    """Issue 29 on the object store: snapshot 4's object damaged in the store (a tensor byte) and WAL object
    6 damaged: recovery on another node uses the map as created + the kept WAL (frames 1-4 are not lost)
    and skips only record 6; both are moved to quarantine/ and reported."""
    from mapper import store

    config = dict(voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)
    md = open_store(store_settings(tmp_path, s3, bucket)).map_dir("m6")
    info = {"id": "m6", "name": "yard", "created": "2026-12-01T00:00:00", "config": config}
    md.write_info(info)
    wal = md.open_wal(1)
    live = Map(**config, device="cpu")
    for seq in range(1, 9):
        wal.append(
            seq, store.encode_record("frame", wire.parse_frame(wire.unpackb(frame_bytes(seq - 1, 300))))
        )
        wal.sync()  # one object per record
        live.integrate_lidar(*scan(seq - 1, 300))
        if seq == 4:
            tensors, meta = live.state_dict()
            md.write_snapshot(4, tensors, {**meta, "info": info})
            md.prune(4, keep=2)
    c = boto3.client("s3", endpoint_url=s3)
    for key, at in (("fleet/maps/m6/snapshot-0000000000000004.safetensors", -9), (wal_key("m6", 6, 6), 40)):
        raw = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[at] ^= 0x04
        c.put_object(Bucket=bucket, Key=key, Body=bytes(raw))

    other = open_store(store_settings(tmp_path / "node2", s3, bucket)).map_dir("m6")
    damage: list = []
    m, _, snap, last, replayed = recover_map(other, "cpu", damage=damage)
    assert (snap, last, replayed, m.frames_integrated) == (None, 8, 7, 7)
    want = [0, 1, 2, 3, 4, 6, 7]
    assert_same_tsdf(m, rebuilt(config, len(want), lambda k: scan(want[k], 300)))
    assert [(n["kind"], n.get("seq", n.get("after_seq"))) for n in damage] == [("snapshot", 4), ("wal", 5)]
    assert other.snapshots() == []
    q = [k.rsplit("/", 1)[1] for k in keys(s3, bucket, "fleet/maps/m6/quarantine/")]
    assert q == [
        "snapshot-0000000000000004.manifest",
        "snapshot-0000000000000004.note.json",
        "snapshot-0000000000000004.safetensors",
        f"wal-{6:016d}-{6:016d}-{0:012d}.bin",
        f"wal-{6:016d}-{6:016d}-{0:012d}.json",
    ]
    assert sorted(n["kind"] for n in other.quarantined()) == ["snapshot", "wal"]


# --------------------------------------------------------------------------- the service on S3
def _post_frame(c, mid: str, i: int) -> dict:
    r = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(i), headers={"content-type": wire.MSGPACK})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_failed_put_on_s3_refuses_the_frame_and_reloads_the_map(tmp_path, s3, bucket):
    """The group commit's PUT fails (the store is down for one batch) after the frame entered the live map:
    that frame gets 503 and no WAL object, the map is reloaded from the store (= the acked frames), the next
    frames take the failed one's seq and the map equals its replay from the store."""
    from fastapi.testclient import TestClient

    from mapper.api import create_app

    config = dict(voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)
    app = create_app(store_settings(tmp_path, s3, bucket))
    with TestClient(app) as c:
        wait_ready(c)
        mid = c.post("/v1/maps", json={"name": "flaky", **config}).json()["id"]
        acks = [_post_frame(c, mid, i) for i in range(2)]
        entry = c.app.state.service.maps[mid]
        objects = entry.wal.objects
        real_put, calls = objects.put, []

        def failing_put(key, data):
            calls.append(key)
            if len(calls) == 1:
                raise OSError(5, "the store is unreachable (injected)")
            real_put(key, data)

        objects.put = failing_put
        try:
            r = c.post(
                f"/v1/maps/{mid}/frames", content=frame_bytes(2), headers={"content-type": wire.MSGPACK}
            )
            assert r.status_code == 503 and "write-ahead log failed" in r.json()["detail"], r.text
            assert entry.broken is None and entry.last_seq == 2
            acks += [_post_frame(c, mid, i) for i in (3, 4)]
        finally:
            objects.put = real_put
        assert [a["seq"] for a in acks] == [1, 2, 3, 4]
        wal = sorted(k.rsplit("/", 1)[1] for k in keys(s3, bucket, f"fleet/maps/{mid}/wal-"))
        assert wal == [f"wal-{i:016d}-{i:016d}.log" for i in range(1, 5)]
        live = entry.map
        other = open_store(store_settings(tmp_path / "node2", s3, bucket))
        replayed, _, _, last, _ = recover_map(other.map_dir(mid), "cpu")
        assert last == 4
        ref = Map(**config, device="cpu")
        for i in (0, 1, 3, 4):  # frame 2 was refused: in neither
            ref.integrate_lidar(*scan(i))
        assert_same_tsdf(live, ref)
        assert_same_tsdf(replayed, ref)


def test_service_on_s3_snapshot_wal_tail_import_export(tmp_path, s3, bucket, monkeypatch):
    from fastapi.testclient import TestClient

    from mapper.api import create_app

    config = dict(voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)
    app = create_app(store_settings(tmp_path, s3, bucket))
    with TestClient(app) as c:
        wait_ready(c)
        mid = c.post("/v1/maps", json={"name": "yard", **config}).json()["id"]
        acks = [_post_frame(c, mid, i) for i in range(3)]
        snap = c.post(f"/v1/maps/{mid}/snapshot").json()
        assert snap["seq"] == 3 and snap["bytes"] > 0
        acks += [_post_frame(c, mid, i) for i in range(3, 5)]
        assert [a["seq"] for a in acks] == [1, 2, 3, 4, 5]
        names = [k.rsplit("/", 1)[1] for k in keys(s3, bucket, f"fleet/maps/{mid}/")]
        assert "info.json" in names and "snapshot-0000000000000003.json" in names
        wal = [n for n in names if n.startswith("wal-")]
        # the first snapshot: the WAL is kept from the previous one (none: the map as created) on
        assert [int(n[4:20]) for n in wal] == [1, 2, 3, 4, 5]
        assert not (tmp_path / "data" / "maps").exists()  # nothing of the map on the local filesystem

        # recovery from the store alone (another node's empty cache): snapshot 3 + WAL tail 4..5
        other = open_store(store_settings(tmp_path / "node2", s3, bucket))
        m, info, snap_, last, replayed = recover_map(other.map_dir(mid), "cpu")
        assert (snap_.seq, last, replayed, info["name"]) == (3, 5, 2, "yard")
        ref = rebuilt(config, 5)
        assert_same_tsdf(m, ref)

        exported = c.get(f"/v1/maps/{mid}/export").content
        imp = c.post("/v1/maps/import?name=copy", content=exported)
        assert imp.status_code in (200, 201), imp.text
        copy_id = imp.json()["id"]
        again = c.get(f"/v1/maps/{copy_id}/export").content
        assert c.get(f"/v1/maps/{copy_id}").json()["frames_integrated"] == 5
        gone = c.post("/v1/maps", json={"name": "gone", **config}).json()["id"]
        assert c.delete(f"/v1/maps/{gone}").status_code == 204
        assert keys(s3, bucket, f"fleet/maps/{gone}/") == []

    t_a, _ = wire_tensors(exported)
    t_b, _ = wire_tensors(again)
    assert t_a.keys() == t_b.keys() and all(torch.equal(t_a[k], t_b[k]) for k in t_a)

    # offline: `mapper export --store` recovers the map from the store alone
    monkeypatch.setenv("MAPPER_S3_ENDPOINT_URL", s3)
    out = tmp_path / "offline.safetensors"
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", "--store", f"s3://{bucket}/fleet", "--map", "yard", "--snapshot", str(out)])
    assert exc.value.code == 0
    offline = Map.from_state_dict(*load_snapshot_file(out), device="cpu")
    assert offline.frames_integrated == 5
    assert_same_tsdf(offline, ref)

    # a restart on a fresh local data dir serves both maps from the store
    app = create_app(store_settings(tmp_path, s3, bucket, data_dir=tmp_path / "fresh"))
    with TestClient(app) as c:
        wait_ready(c)
        maps = {m["name"]: m for m in c.get("/v1/maps").json()["maps"]}
        assert set(maps) == {"yard", "copy"}
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 5
        assert _post_frame(c, mid, 5)["seq"] == 6


def wire_tensors(data: bytes):
    from mapper.persistence import load_snapshot_bytes

    return load_snapshot_bytes(data)


N_FRAMES = 30
WINDOW = 4


def test_sigkill_on_s3_loses_no_acknowledged_frame(tmp_path, s3, bucket):
    """``mapper serve`` on the S3 store, SIGKILL mid-stream, restarted on a fresh local data dir: every
    acknowledged frame is in the map, which equals one rebuilt from the recovered prefix."""
    env = dict(
        MAPPER_STORE=f"s3://{bucket}/fleet",
        MAPPER_S3_ENDPOINT_URL=s3,
        MAPPER_SNAPSHOT_INTERVAL_S="0.5",  # recovery = snapshot + WAL tail, not the WAL alone
        MAPPER_WARMUP="false",
    )
    server = Server(tmp_path / "a", tmp_path / "a.log", **env).start()
    try:
        with MapperClient(server.url) as c:
            mid = c.create_map(name="crash", voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)["id"]
            config = c.get_map(mid)["config"]

        def published() -> bool:
            return any(k.endswith(".json") for k in keys(s3, bucket, f"fleet/maps/{mid}/snap"))

        def hold(i: int) -> None:  # after 10 frames, until a snapshot of the stream is published
            if i == 10:
                wait_until(published, 90)

        stream = StreamThread(server.url, mid, N_FRAMES, window=WINDOW, timestamps=True, before_send=hold)
        stream.start().kill_after(14, server.kill)
    finally:
        server.stop()
    n_acked = len(stream.acks)
    assert 14 <= n_acked < N_FRAMES
    assert [a["seq"] for a in stream.acks] == list(range(1, n_acked + 1))
    names = [k.rsplit("/", 1)[1] for k in keys(s3, bucket, f"fleet/maps/{mid}/")]
    snaps = [int(n[9:25]) for n in names if n.startswith("snapshot-") and n.endswith(".json")]
    assert snaps, names  # the kill left a published snapshot (taken while streaming)
    tail = [int(n[4:20]) for n in names if n.startswith("wal-") and int(n[21:37]) > max(snaps)]
    wal = [int(n[4:20]) for n in names if n.startswith("wal-")]
    base = sorted(snaps)[-2] if len(snaps) > 1 else 0  # the WAL is kept from the previous snapshot on
    assert all(first > base for first in wal)

    with Server(tmp_path / "b", tmp_path / "b.log", **env) as s2, MapperClient(s2.url) as c:
        recovered, served = check_recovered(c, mid, n_acked, WINDOW, tmp_path / "after.safetensors")
        # snapshot + WAL tail (empty only when a snapshot landed between the last PUT and the kill)
        assert tail or recovered == max(snaps)
    ref = rebuilt(config, recovered)
    assert_same_tsdf(served, ref)
    assert served.frames_integrated == ref.frames_integrated == recovered


# ---------------------------------------------------------------------------- errors at the start
@pytest.mark.parametrize(
    "url, message",
    [
        ("mapper-bucket/x", r"not an s3://bucket/prefix URL"),
        ("s3://", r"'' in 's3://' is not a bucket name"),
        ("s3://Bad_Bucket/x", r"'Bad_Bucket' .* is not a bucket name"),
        ("s3://ok-bucket/a//b", r"prefix 'a//b' has an empty"),
        ("s3://ok-bucket/../b", r"prefix '../b' has an empty, '.' or '..' part"),
    ],
)
def test_bad_store_urls_are_refused(tmp_path, url, message):
    with pytest.raises(InvalidArgument, match=message):
        open_store(Settings(data_dir=tmp_path, store=url))


def test_missing_bucket_unreachable_endpoint_and_no_credentials(tmp_path, s3, monkeypatch):
    with pytest.raises(
        InvalidArgument, match=r"bucket 'no-such-bucket' does not exist at http://127\.0\.0\.1"
    ):
        open_store(store_settings(tmp_path, s3, "no-such-bucket"))
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    t = time.monotonic()
    with pytest.raises(
        InvalidArgument, match=r"cannot reach http://127\.0\.0\.1:\d+ \(MAPPER_S3_ENDPOINT_URL\)"
    ):
        open_store(store_settings(tmp_path, dead, "any-bucket"))
    assert time.monotonic() - t < 30
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(
        InvalidArgument, match=r"no credentials for s3://any-bucket/fleet \(set AWS_ACCESS_KEY_ID"
    ):
        open_store(store_settings(tmp_path, s3, "any-bucket"))


def test_wrong_credentials_are_refused_at_start(tmp_path, s3, bucket, monkeypatch, capsys):
    """moto checks signatures once its auth is on: an unknown access key gets 403, named at start (the
    library call, ``mapper serve --store`` exiting 2, and the app's lifespan refusing to start)."""
    httpx.post(f"{s3}/moto-api/reset-auth", content=b"0").raise_for_status()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(
            InvalidArgument,
            match=rf"access to bucket '{bucket}' at {s3} denied \(403\): check AWS_ACCESS_KEY_ID",
        ):
            open_store(store_settings(tmp_path, s3, bucket))
        monkeypatch.setenv("MAPPER_S3_ENDPOINT_URL", s3)
        monkeypatch.setenv("MAPPER_DATA_DIR", str(tmp_path / "d"))
        with pytest.raises(SystemExit) as exc:
            cli.main(["serve", "--store", f"s3://{bucket}/fleet", "--device", "cpu", "--port", "1"])
        assert exc.value.code == 2
        assert f"mapper serve: store: access to bucket '{bucket}'" in capsys.readouterr().err

        from fastapi.testclient import TestClient

        from mapper.api import create_app

        with (
            pytest.raises(InvalidArgument, match="denied"),
            TestClient(create_app(store_settings(tmp_path, s3, bucket))),
        ):
            pass
    finally:
        httpx.post(f"{s3}/moto-api/reset-auth", content=b"inf").raise_for_status()


# ------------------------------------------------------------------------------ cluster workers
def test_workers_move_a_map_by_owner_and_restart_with_their_own(tmp_path, s3, bucket):
    """Two map workers (the Ray actor's class, run here without Ray) on one S3 store: a map created on w0
    moves to w1 by its owner object (nothing copied), answers there with every frame, and each worker's
    restart recovers exactly the maps it owns."""
    from mapper.cluster.worker import MapWorker

    ref = Map(voxel_size_m=0.25, layers=["tsdf"], device="cpu")
    for i in range(5):
        ref.integrate_lidar(*scan(i))
    surface = torch.from_numpy(scan(0)[0][:40])  # frame 0's hits (its pose is the identity)
    tsdf, weight = ref.query_tsdf(surface)
    seen = weight > 0
    assert seen.sum() >= 20
    pts, tsdf, weight = surface[seen], tsdf[seen], weight[seen]

    values = store_settings(tmp_path, s3, bucket).model_dump(mode="json")
    w0 = MapWorker(0, str(tmp_path / "root"), values, TOKEN, 0.25)
    w1 = MapWorker(1, str(tmp_path / "root"), values, TOKEN, 0.25)
    workers = [w0, w1]
    try:
        auth = {"authorization": f"Bearer {TOKEN}"}
        url0, url1 = w0.address()[0], w1.address()[0]
        with httpx.Client(headers=auth, timeout=60) as h:
            mid = h.post(
                url0 + "/v1/maps", json={"name": "robot", "voxel_size_m": 0.25, "layers": ["tsdf"]}
            ).json()["id"]
            for i in range(4):
                r = h.post(
                    f"{url0}/v1/maps/{mid}/frames",
                    content=frame_bytes(i),
                    headers={"content-type": wire.MSGPACK},
                )
                assert r.status_code == 200, r.text
            s3c = boto3.client("s3", endpoint_url=s3)

            def owner() -> bytes:
                return s3c.get_object(Bucket=bucket, Key=f"fleet/maps/{mid}/owner")["Body"].read()

            assert owner() == b"w0"
            assert w0.detach(mid) == 4
            summary = w1.attach(mid, w0.map_path(mid))
            assert summary["id"] == mid and owner() == b"w1"
            assert w0.map_ids() == [] and w1.map_ids() == [mid]
            r = h.post(
                f"{url1}/v1/maps/{mid}/frames", content=frame_bytes(4), headers={"content-type": wire.MSGPACK}
            )
            assert r.json()["seq"] == 5
            got = h.post(f"{url1}/v1/maps/{mid}/query/tsdf", json={"points": pts.tolist()})
            assert got.status_code == 200, got.text
        np.testing.assert_allclose(np.asarray(got.json()["tsdf"], np.float32), tsdf.numpy(), atol=1e-4)
        np.testing.assert_allclose(np.asarray(got.json()["weight"], np.float32), weight.numpy(), atol=1e-3)

        for w in workers:
            w.stop()
        workers = [MapWorker(0, str(tmp_path / "root"), values, TOKEN, 0.25)]
        workers.append(MapWorker(1, str(tmp_path / "root"), values, TOKEN, 0.25))
        assert workers[0].map_ids() == [] and workers[1].map_ids() == [mid]
        assert workers[1].info()["maps"] == [mid]
    finally:
        for w in workers:
            w.stop()


def test_filesystem_stays_the_default(tmp_path):
    from mapper.persistence import DataDir

    data = open_store(Settings(data_dir=tmp_path / "d"))
    assert isinstance(data, DataDir) and (tmp_path / "d" / "maps").is_dir()
    assert Settings(_env_file=None).model_dump(mode="json")["store"] is None


# --------------------------------------------------------------------------- mapper serve --ray on S3
RAY_WATCHDOG_S = 420


@pytest.mark.slow
@pytest.mark.ray  # on the session's local Ray (conftest.py: local_ray), beside tests/test_cluster_ray.py
def test_ray_cluster_on_s3_adopts_moves_and_survives_sigkill(tmp_path, s3, bucket, local_ray):
    """``mapper serve --ray --store s3://...`` (the ingress app, 2 CPU workers as Ray actors on a local Ray):
    a map of a plain ``mapper serve --store`` (no owner) is adopted, a map moves by its owner object, and a
    worker killed with SIGKILL comes back with every acknowledged frame (from the store). Bounded by a
    watchdog."""
    import faulthandler
    import signal

    from mapper.cluster.ingress import create_cluster_app
    from mapper.cluster.local import serve_in_thread
    from mapper.store import save_new_map

    config = dict(voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)
    legacy = Map(**config, device="cpu")
    for i in range(2):
        legacy.integrate_lidar(*scan(i + 50))
    legacy_id = save_new_map(open_store(store_settings(tmp_path, s3, bucket)), legacy, name="legacy")["id"]
    s3c = boto3.client("s3", endpoint_url=s3)

    def owner(map_id: str) -> bytes:
        return s3c.get_object(Bucket=bucket, Key=f"fleet/maps/{map_id}/owner")["Body"].read()

    faulthandler.dump_traceback_later(RAY_WATCHDOG_S, exit=True)  # never hang CI
    settings = store_settings(
        tmp_path, s3, bucket, data_dir=tmp_path / "root", api_tokens=[TOKEN], query_threads=1, malloc_trim_s=0
    )
    try:
        with (
            serve_in_thread(create_cluster_app(settings, workers=2)) as url,
            MapperClient(url, token=TOKEN) as c,
        ):
            h = {"Authorization": f"Bearer {TOKEN}"}
            workers = httpx.get(f"{url}/v1/cluster", headers=h, timeout=30).json()["workers"]
            assert len(workers) == 2
            assert c.get_map(legacy_id)["frames_integrated"] == 2
            assert owner(legacy_id) in (b"w0", b"w1")  # adopted: claimed by a worker

            mid = c.create_map(name="robot", **config)["id"]
            for i in range(4):
                c.send_lidar(mid, *scan(i))
            first = owner(mid).decode()
            other = 1 - int(first[1:])
            r = httpx.post(f"{url}/v1/maps/{mid}/move", json={"worker": other}, headers=h, timeout=120)
            assert r.status_code == 200, r.text
            assert owner(mid) == f"w{other}".encode()
            for i in range(4, 6):
                assert c.send_lidar(mid, *scan(i))["seq"] == i + 1

            victim = next(w for w in workers if w["worker"] == other)
            os.kill(victim["pid"], signal.SIGKILL)
            # Ray restarts the worker; it recovers the maps it owns from the store
            m = answer_within(lambda: c.get_map(mid), time.monotonic())
            assert m["last_seq"] == m["frames_integrated"] == 6
            served = served_map(c, mid, tmp_path / "after.safetensors")
            ref = rebuilt(config, 6)
            assert_same_tsdf(served, ref)
            assert c.send_lidar(mid, *scan(6))["seq"] == 7
    finally:
        faulthandler.cancel_dump_traceback_later()

"""Damaged files under a killed server (issue 29, findings 1-3), black box: ``mapper serve`` in a subprocess
takes acknowledged frames into several maps and is killed (SIGKILL); bytes of its WAL segments and snapshots
are flipped, truncated or deleted here; a restarted server must bring back every acknowledged frame that was
not itself damaged, report the damage (``/readyz``, ``/metrics``, its log) and serve the other maps.

One server run builds every case (one map each), one restart checks them all: a failing map must not keep
the others from serving. Frames are ``scan(i)`` with the sensor at x = 0.1 i, so the recovered trajectory
names exactly which frames came back; the TSDF is compared with a map rebuilt here from those frames."""

from __future__ import annotations

import struct

import httpx
import pytest
from crash_helpers import assert_same_tsdf, rebuilt, served_map, wait_until
from test_service_helpers import Server, scan

from mapper.client import MapperClient

CONFIG = dict(voxel_size_m=0.25, layers=["tsdf"], max_range_m=20.0)
N = 50  # frames of the WAL cases: damage in record 20 of 40 (after snapshot 10) or of 50
N_SNAP = 20  # frames of the snapshot cases: snapshot 5 damaged, frames 1-5 must come back from the WAL
HEADER = struct.Struct("<4sIQI")  # the documented WAL record header: magic, length, seq, crc32


def frame(i: int):
    return scan(i, 300)


def record_offsets(data: bytes) -> list[int]:
    """Byte offsets of the records of an intact segment (walking the documented header, not the library)."""
    out, pos = [], 0
    while pos < len(data):
        out.append(pos)
        pos += HEADER.size + HEADER.unpack_from(data, pos)[1]
    return out


def flip(path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """Build the maps, kill the server, damage the files, restart: ``(client url, ids, data dir, log)``."""
    tmp = tmp_path_factory.mktemp("damage")
    data = tmp / "data"
    server = Server(data, tmp / "a.log", MAPPER_SNAPSHOT_INTERVAL_S="0", MAPPER_WARMUP="false").start()
    ids: dict[str, str] = {}
    try:
        with MapperClient(server.url) as c:

            def build(name: str, n: int, snapshots_at=(10,)) -> str:
                mid = c.create_map(name=name, **CONFIG)["id"]
                for i in range(n):
                    assert c.send_lidar(mid, *frame(i))["seq"] == i + 1
                    if i + 1 in snapshots_at:
                        assert c.snapshot(mid)["seq"] == i + 1
                ids[name] = mid
                return mid

            build("wal-flip", N)  # snapshot 10 + 40 WAL records: a byte of record 20 of 40 flipped
            build("wal-length", N, ())  # 50 WAL records: record 20's length field overwritten
            build("snap-tensor", N_SNAP, (5,))  # snapshot 5 (a tensor byte flipped) + 15 records
            build("snap-gone", N_SNAP, (5,))  # snapshot 5's .safetensors deleted
            build("snap-manifest", N_SNAP, (5,))  # snapshot 5's manifest cut short
            build("blocked", 5, ())  # its post-recovery snapshot cannot be written
            build("gap", 15, (5, 10, 15))  # snapshots 10 and 15 damaged, the WAL before 10 pruned
            build("torn", 5, ())  # a torn tail appended: cut, not reported
            build("healthy", 3)
    finally:
        server.kill()
        server.stop()
    maps = data / "maps"

    def seg(mid: str):
        (path,) = sorted(maps.glob(f"{mid}/wal-*.log"))[-1:]
        return path

    # wal-flip: segment wal-11 holds records 11..50; record 20 of them is seq 30 (frame 29)
    path = maps / ids["wal-flip"] / f"wal-{11:016d}.log"
    offs = record_offsets(path.read_bytes())
    assert len(offs) == 40
    flip(path, offs[19] + HEADER.size + 100)
    # wal-length: record 20 (frame 19) claims 2^31 - 16 bytes
    path = maps / ids["wal-length"] / f"wal-{1:016d}.log"
    offs = record_offsets(path.read_bytes())
    raw = bytearray(path.read_bytes())
    raw[offs[19] + 4 : offs[19] + 8] = struct.pack("<I", (1 << 31) - 16)
    path.write_bytes(bytes(raw))
    snap5 = f"snapshot-{5:016d}"
    flip(maps / ids["snap-tensor"] / f"{snap5}.safetensors", -7)
    (maps / ids["snap-gone"] / f"{snap5}.safetensors").unlink()
    manifest = maps / ids["snap-manifest"] / f"{snap5}.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    torn = maps / ids["torn"] / f"wal-{1:016d}.log"
    torn_size = torn.stat().st_size
    with open(torn, "ab") as f:  # an append cut short by the kill: a header and part of its payload
        f.write(HEADER.pack(b"MWAL", 5000, 6, 0) + bytes(100))
    (maps / ids["blocked"] / f".snapshot-{5:016d}.safetensors.tmp").mkdir()  # the write fails (EISDIR)
    for seq in (10, 15):
        flip(maps / ids["gap"] / f"snapshot-{seq:016d}.safetensors", -3)
    assert not (maps / ids["gap"] / f"wal-{1:016d}.log").exists()  # pruned by snapshot 10: no way back
    gap_files = sorted(p.name for p in (maps / ids["gap"]).iterdir())

    server = Server(data, tmp / "b.log", MAPPER_SNAPSHOT_INTERVAL_S="0", MAPPER_WARMUP="false").start()
    try:
        yield server, ids, data, (gap_files, torn_size)
    finally:
        server.stop()


def positions(c: MapperClient, mid: str) -> list[int]:
    """Indices of the frames in the map's trajectory (the sensor sits at x = 0.1 i)."""
    r = httpx.get(f"{c.url}/v1/maps/{mid}/trajectory", headers={"accept": "application/json"})
    assert r.status_code == 200, r.text
    return [round(p[0] / 0.1) for p in r.json()["positions"]]


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


def metric(url: str, series: str, **labels) -> float | None:
    """The value of the sample ``series{labels}`` in ``/metrics`` (None when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics(url)):
        for sample in fam.samples:
            if sample.name == series and sample.labels == labels:
                return sample.value
    return None


def check_frames(c, mid: str, n: int, want: list[int], tmp_path, tsdf: bool) -> None:
    """Map ``mid`` (``n`` records logged) holds exactly frames ``want`` (and with ``tsdf`` the TSDF of a map
    rebuilt here from them) and keeps ingesting."""
    m = c.get_map(mid)
    assert m["frames_integrated"] == len(want) and m["last_seq"] == n
    assert positions(c, mid) == want
    if tsdf:
        served = served_map(c, mid, tmp_path / f"{mid}.safetensors")
        ref = rebuilt(CONFIG, len(want), lambda k: frame(want[k]))
        assert_same_tsdf(served, ref)
    assert c.send_lidar(mid, *frame(n))["seq"] == n + 1


@pytest.mark.parametrize("case, lost", [("wal-flip", 29), ("wal-length", 19)])
def test_damaged_wal_record_in_the_middle_loses_only_itself(damaged, case, lost, tmp_path):
    server, ids, data, _ = damaged
    mid = ids[case]
    with MapperClient(server.url) as c:
        check_frames(c, mid, N, [i for i in range(N) if i != lost], tmp_path, tsdf=case == "wal-flip")
    ready = httpx.get(server.url + "/readyz").json()
    (note,) = ready["quarantined"][mid]["records"]
    assert note["kind"] == "wal" and note["after_seq"] == lost and note["bytes"] > HEADER.size
    qfile = data / "maps" / mid / "quarantine" / f"{note['segment'][:-4]}-{note['offset']:012d}.bin"
    assert qfile.stat().st_size == note["bytes"]  # the damaged bytes are kept
    assert metric(server.url, "mapper_storage_damage_total", map=mid, name=case, kind="wal") == 1
    assert f"map {mid}: damaged write-ahead log bytes" in server.log_path.read_text()


@pytest.mark.parametrize("case", ["snap-tensor", "snap-gone", "snap-manifest"])
def test_damaged_snapshot_falls_back_to_the_previous_base_and_the_kept_wal(damaged, case, tmp_path):
    server, ids, data, _ = damaged
    mid = ids[case]
    with MapperClient(server.url) as c:
        # nothing lost: frames 1-5 come from the WAL kept since the previous base (the map as created)
        check_frames(c, mid, N_SNAP, list(range(N_SNAP)), tmp_path, tsdf=case == "snap-tensor")
    ready = httpx.get(server.url + "/readyz").json()
    notes = ready["quarantined"][mid]["records"]
    assert [(n["kind"], n["seq"]) for n in notes] == [("snapshot", 5)]
    assert (data / "maps" / mid / "quarantine" / f"snapshot-{5:016d}.note.json").exists()
    assert metric(server.url, "mapper_storage_damage_total", map=mid, name=case, kind="snapshot") == 1


def test_a_map_that_cannot_be_rebuilt_fails_alone_and_stays_on_disk(damaged):
    server, ids, data, (gap_files, _) = damaged
    mid = ids["gap"]
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200  # not "restoring" forever
    assert "records 1..10 are missing" in ready.json()["failed"][mid]
    with MapperClient(server.url) as c:
        assert mid not in [m["id"] for m in c.list_maps()]
        assert c.get_map(ids["healthy"])["frames_integrated"] == 3  # the others serve
    assert httpx.get(f"{server.url}/v1/maps/{mid}").status_code == 404
    assert metric(server.url, "mapper_map_failed", map=mid, name=mid, stage="recovery") == 1
    assert sorted(p.name for p in (data / "maps" / mid).iterdir()) == gap_files  # untouched
    log = server.log_path.read_text()
    assert log.count(f"map {mid}: recovery failed") == 1


def test_a_failing_post_recovery_snapshot_marks_only_its_map_and_is_retried(damaged):
    server, ids, data, _ = damaged
    mid = ids["blocked"]
    ready = httpx.get(server.url + "/readyz").json()
    assert "Is a directory" in ready["degraded"][mid] and list(ready["degraded"]) == [mid]
    assert metric(server.url, "mapper_map_failed", map=mid, name="blocked", stage="snapshot") == 1
    with MapperClient(server.url) as c:
        assert c.get_map(mid)["frames_integrated"] == 5  # served meanwhile (the WAL holds everything)
        blocker = data / "maps" / mid / f".snapshot-{5:016d}.safetensors.tmp"
        assert not (data / "maps" / mid / f"snapshot-{5:016d}.json").exists()
        blocker.rmdir()  # the cause goes away: the next retry (backoff <= 60 s, here 1-8 s) succeeds
        assert wait_until(lambda: mid not in httpx.get(server.url + "/readyz").json()["degraded"], 30)
        assert (data / "maps" / mid / f"snapshot-{5:016d}.json").exists()
        assert metric(server.url, "mapper_map_failed", map=mid, name="blocked", stage="snapshot") == 0
        assert c.send_lidar(mid, *frame(5))["seq"] == 6
    assert f"map {mid}: snapshot failed" in server.log_path.read_text()


def test_a_torn_tail_is_cut_and_not_reported_as_damage(damaged):
    server, ids, data, (_, torn_size) = damaged
    mid = ids["torn"]
    with MapperClient(server.url) as c:
        assert c.get_map(mid)["frames_integrated"] == 5
    assert mid not in httpx.get(server.url + "/readyz").json()["quarantined"]
    assert (data / "maps" / mid / f"wal-{1:016d}.log").stat().st_size == torn_size


def test_damage_survives_a_second_restart_without_new_reports(damaged, tmp_path):
    """After the post-recovery snapshots, a restart finds nothing new: the same frames, no new damage. (The
    module's last test: it stops the shared server.)"""
    server, ids, data, _ = damaged
    blocker = data / "maps" / ids["blocked"] / f".snapshot-{5:016d}.safetensors.tmp"
    if blocker.exists():  # (this test alone)
        blocker.rmdir()
    with MapperClient(server.url) as c:
        before = {k: c.get_map(ids[k])["frames_integrated"] for k in ("wal-flip", "snap-tensor", "healthy")}
        wait_until(lambda: not httpx.get(server.url + "/readyz").json()["degraded"], 30)
    server.stop()
    with Server(data, tmp_path / "c.log", MAPPER_WARMUP="false") as s3, MapperClient(s3.url) as c:
        after = {k: c.get_map(ids[k])["frames_integrated"] for k in before}
        assert after == before
        assert "mapper_storage_damage_total{" not in metrics(s3.url)
        ready = httpx.get(s3.url + "/readyz").json()
        assert ids["gap"] in ready["failed"] and ready["degraded"] == {}

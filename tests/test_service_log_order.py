"""The writer's batch (issue 13, one way in): a LiDAR frame without a pose enters the map once (tracked and
integrated in one ``Map.integrate_lidar`` call, then logged with the pose used, before its ack); the live
map equals a replay of its log with posed and pose-less frames mixed in one batch; a WAL failure inside a
batch drops the batch's records and reloads the map, so the live map never holds what its replay would
not."""

from __future__ import annotations

import re
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
from test_service_helpers import MSGPACK_HEADERS, client, scan

from mapper import Map, wire
from mapper.persistence import DataDir
from mapper.store import decode_record, recover_map

VOXEL = 0.25
N_POINTS = 1200
LIMITS = wire.Limits(1 << 40, 1 << 40, 1 << 40, 1e9)


class Spy:
    """Counts the entries into the map from outside it (``Map.integrate_lidar`` / ``Map.track_lidar`` calls
    not made by another of these calls) per thread name."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str]] = []
        self.depth = threading.local()
        for name in ("integrate_lidar", "track_lidar"):
            orig = getattr(Map, name)

            def wrapped(m, *a, _orig=orig, _name=name, **kw):
                d = getattr(self.depth, "n", 0)
                if d == 0 and not m.read_only:
                    self.calls.append((_name, threading.current_thread().name))
                self.depth.n = d + 1
                try:
                    return _orig(m, *a, **kw)
                finally:
                    self.depth.n = d

            monkeypatch.setattr(Map, name, wrapped)

    def count(self, name: str) -> int:
        return sum(n == name and t.startswith("map-") for n, t in self.calls)


def _message(i: int, posed: bool, seed: int = 0) -> bytes:
    pts, T = scan(i, N_POINTS, seed)
    return wire.packb(wire.lidar_message(pts, T if posed else None, float(i), f"{seed}:{i}"))


def _post_in_one_batch(c, mid, entry, messages: list[bytes]) -> list:
    """POST ``messages`` so that the first (a posed frame) is a batch of its own and the others queue behind
    it, in order, into the next batch (the writer is held at its write gate meanwhile). Returns the
    responses in order."""
    out: list = [None] * len(messages)

    def post(k):
        out[k] = c.post(f"/v1/maps/{mid}/frames", content=messages[k], headers=MSGPACK_HEADERS)

    threads = [threading.Thread(target=post, args=(k,)) for k in range(len(messages))]
    deadline = time.monotonic() + 60
    seq = entry.last_seq
    with entry.write_gate:
        threads[0].start()
        while entry.last_seq == seq:  # its batch is formed and logged (a posed frame: before the gate)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for k, t in enumerate(threads[1:], 1):
            t.start()
            while entry.queue.qsize() < k:  # queued in this order
                assert time.monotonic() < deadline
                time.sleep(0.005)
    for t in threads:
        t.join(60)
    return out


def wal_record_size(message: bytes) -> int:
    """Bytes of the WAL record of a posed frame message (header + payload)."""
    from mapper.persistence import HEADER
    from mapper.store import encode_record

    return HEADER.size + len(encode_record("frame", wire.parse_frame(wire.unpackb(message), LIMITS)))


def _assert_same_map(a: Map, b: Map, tracker: bool = True) -> None:
    """Same layers bit for bit (TSDF, ESDF source) and, with ``tracker``, the same tracking state."""
    assert a.version == b.version and a.frames_integrated == b.frames_integrated
    for name in a.layers:
        if name == "esdf":
            continue
        ga, sa = a.layer(name)
        gb, sb = b.layer(name)
        assert torch.equal(ga.ijk, gb.ijk), name
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (name, k)
    pa, va, _ = a.trajectory()
    pb, vb, _ = b.trajectory()
    assert torch.equal(pa, pb) and torch.equal(va, vb)
    if tracker:
        oa, ob = a._tracker.odometry, b._tracker.odometry
        assert (oa is None) == (ob is None)
        if oa is not None:
            assert torch.equal(oa.pose, ob.pose) and torch.equal(oa.delta, ob.delta)
            assert oa.frames == ob.frames
            torch.testing.assert_close(oa.map.point_cloud(), ob.map.point_cloud(), rtol=0, atol=0)


def test_pose_less_frames_enter_the_map_once_and_the_live_map_equals_its_replay(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    posed = [True, False, True, False, False, True, False]  # batch 1: [0]; batch 2: frames 1-6, mixed
    with client(tmp_path, max_batch=16, esdf_update="lazy") as c:
        mid = c.post("/v1/maps", json={"name": "m", "voxel_size_m": VOXEL, "layers": ["tsdf"]}).json()["id"]
        entry = c.app.state.service.maps[mid]
        resp = _post_in_one_batch(c, mid, entry, [_message(i, p) for i, p in enumerate(posed)])
        assert [r.status_code for r in resp] == [200] * len(posed), [r.text for r in resp]
        acks = [msgpack.unpackb(r.content) for r in resp]
        # one call into the map per frame, by the writer; no separate tracking pass
        assert spy.count("integrate_lidar") == len(posed) and spy.count("track_lidar") == 0
        live = entry.map
        mdir = DataDir(tmp_path / "data").map_dir(mid)
        logged = [(seq, decode_record(p, LIMITS)) for seq, p in mdir.replay(0)]
        replayed, *_ = recover_map(mdir, "cpu")  # the log replayed as a restart does
        _assert_same_map(live, replayed)
        assert entry.view.version == live.version == len(posed)
        metrics = c.get("/metrics").text
    assert [a["seq"] for a in acks] == list(range(1, len(posed) + 1))  # in arrival order
    assert [a["map_version"] for a in acks] == list(range(1, len(posed) + 1))
    assert re.search(r"mapper_group_commit_records_count 2\.0", metrics)  # two batches, two fsyncs
    assert re.search(rf"mapper_group_commit_records_sum {len(posed)}\.0", metrics)
    assert [s for s, _ in logged] == [a["seq"] for a in acks]
    oracle = Map(VOXEL, layers=("tsdf",), device="cpu")  # the library called directly, in order
    for (_, (kind, f)), a, p, i in zip(logged, acks, posed, range(len(posed)), strict=True):
        assert kind == "frame" and f.frame_id == f"0:{i}" and f.pose_estimated == (not p)
        used = np.asarray(a["T_world_sensor"]).reshape(4, 4)
        np.testing.assert_array_equal(f.T_world_sensor, used)  # the record holds the pose the ack gives
        pts, T = scan(i, N_POINTS)
        res = oracle.integrate_lidar(pts, T if p else None)
        np.testing.assert_array_equal(res["T_world_sensor"].numpy(), used)
        assert ("registration" in a) == (not p)
    _assert_same_map(live, oracle)


def test_a_failed_wal_sync_reloads_the_map_and_drops_the_batch(tmp_path):
    """The fsync of a batch (posed and pose-less frames, already integrated into the live map) fails: every
    frame of it gets 503, none is in the log, the map is reloaded (= its replay, = the acked frames), versions
    do not go back, and the map keeps ingesting."""
    posed = [True, True, False, True, False]
    with client(tmp_path, max_batch=16, esdf_update="eager") as c:
        r = c.post("/v1/maps", json={"name": "w", "voxel_size_m": VOXEL, "layers": ["tsdf", "esdf"]})
        mid = r.json()["id"]
        entry = c.app.state.service.maps[mid]
        first = _post_in_one_batch(c, mid, entry, [_message(i, p) for i, p in enumerate(posed[:2])])
        assert [r.status_code for r in first] == [200, 200]
        wal, real_sync, calls = entry.wal, entry.wal.sync, []

        def failing_sync():  # the second batch's group commit fails, after its frames entered the map
            calls.append(len(calls))
            if len(calls) == 2:
                raise OSError(5, "Input/output error (injected)")
            real_sync()

        wal.sync = failing_sync
        # batch 3: frame 0 (posed) alone; batch 4 (fails): posed and pose-less frames 1-4
        msgs = [_message(i, p, seed=1) for i, p in enumerate(posed)]
        size = None

        def note_size():
            nonlocal size
            size = wal.size

        entry.executor.submit(note_size).result()
        failed = _post_in_one_batch(c, mid, entry, msgs)
        codes = [r.status_code for r in failed]
        assert codes == [200] + [503] * (len(posed) - 1), [r.text for r in failed]
        assert "write-ahead log failed" in failed[-1].json()["detail"]
        batch3 = msgpack.unpackb(failed[0].content)
        assert entry.wal is not wal and entry.last_seq == batch3["seq"] == 3
        assert entry.wal.size == size + wal_record_size(msgs[0])
        assert entry.view.version >= batch3["map_version"] and entry.broken is None
        metrics = c.get("/metrics").text
        assert f'mapper_map_reloads_total{{map="{mid}",name="w"}} 1.0' in metrics
        # the map goes on: two more frames, one without a pose
        more = [
            c.post(f"/v1/maps/{mid}/frames", content=_message(i, i == 3, 2), headers=MSGPACK_HEADERS)
            for i in (3, 4)
        ]
        assert [r.status_code for r in more] == [200, 200], [r.text for r in more]
        acks = [msgpack.unpackb(r.content) for r in first + failed[:1] + more]
        mdir = DataDir(tmp_path / "data").map_dir(mid)
        logged = [decode_record(p, LIMITS)[1].frame_id for _, p in mdir.replay(0)]
        live = entry.map
        replayed, *_ = recover_map(mdir, "cpu")
        _assert_same_map(live, replayed)
        view = entry.view
    assert logged == ["0:0", "0:1", "1:0", "2:3", "2:4"]  # nothing of the failed batch
    assert [a["seq"] for a in acks] == [1, 2, 3, 4, 5] == [a["map_version"] for a in acks]
    oracle = Map(VOXEL, layers=("tsdf", "esdf"), device="cpu")
    for i, seed, p in ((0, 0, True), (1, 0, True), (0, 1, True), (3, 2, True), (4, 2, False)):
        pts, T = scan(i, N_POINTS, seed)
        oracle.integrate_lidar(pts, T if p else None)
    oracle.update_esdf()
    _assert_same_map(live, oracle)
    q = np.random.default_rng(5).uniform([-5, -5, -0.8], [5, 5, 1.5], (300, 3))
    np.testing.assert_allclose(
        view.query_distance(q)[0].numpy(), oracle.query_distance(q)[0].numpy(), rtol=0, atol=1e-5
    )


def test_a_map_that_cannot_be_reloaded_refuses_writes_and_serves_reads(tmp_path, monkeypatch):
    """The WAL fails and so does the reload: the map answers 503 to writes, reads its last version."""
    import mapper.api.service as service

    with client(tmp_path, max_batch=4) as c:
        mid = c.post("/v1/maps", json={"name": "b", "voxel_size_m": VOXEL, "layers": ["tsdf"]}).json()["id"]
        entry = c.app.state.service.maps[mid]
        ok = c.post(f"/v1/maps/{mid}/frames", content=_message(0, True), headers=MSGPACK_HEADERS)
        assert ok.status_code == 200

        def fail(*a, **kw):
            raise OSError(28, "No space left on device (injected)")

        entry.wal.sync = fail
        monkeypatch.setattr(service, "recover_map", fail)
        r = c.post(f"/v1/maps/{mid}/frames", content=_message(1, False), headers=MSGPACK_HEADERS)
        assert r.status_code == 503 and "write-ahead log failed" in r.json()["detail"]
        assert entry.broken is not None and "could not be reloaded" in entry.broken
        r = c.post(f"/v1/maps/{mid}/frames", content=_message(2, True), headers=MSGPACK_HEADERS)
        assert r.status_code == 503 and "until the service restarts" in r.json()["detail"]
        got = c.get(f"/v1/maps/{mid}")
        assert got.status_code == 200 and got.json()["version"] == 1


def _tracker_state(m: Map):
    """A copy of a map's tracking state: (odometry pose, motion, frames, local map points, threshold) or
    the last posed scan kept while tracking is off."""
    odo = m._tracker.odometry
    if odo is None:
        last = m._tracker.last_posed
        return ("off", None if last is None else (last[0].clone(), last[1].clone()))
    th = (odo.threshold._sse, odo.threshold._n)
    return ("on", odo.pose.clone(), odo.delta.clone(), odo.frames, odo.map.point_cloud().clone(), th)


def _same_state(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("refuse", ["budget", "range"])
def test_a_pose_less_frame_refused_after_tracking_leaves_the_map_and_the_log_alone(tmp_path, refuse):
    """A pose-less scan whose estimated pose fails the map's checks (its memory budget; its coordinate range)
    is refused after the estimate and before anything changes: 4xx, not logged, the layers *and the tracking
    state* as they were (a refused scan that would have started tracking leaves it off), so the live map
    still equals its replay; the next pose-less scan goes through."""
    with client(tmp_path, max_batch=4) as c:
        mid = c.post("/v1/maps", json={"name": "r", "voxel_size_m": VOXEL, "layers": ["tsdf"]}).json()["id"]
        entry = c.app.state.service.maps[mid]
        ok = c.post(f"/v1/maps/{mid}/frames", content=_message(0, True), headers=MSGPACK_HEADERS)
        assert ok.status_code == 200
        budget = entry.budget
        if refuse == "budget":  # tracking is still off: this scan would start it
            entry.budget = entry.bytes + (1 << 16)  # no room for another scan's bricks
        else:  # tracking on, predicting a pose outside the map's coordinate range (2^20 x 0.25 m)
            ok = c.post(f"/v1/maps/{mid}/frames", content=_message(1, False), headers=MSGPACK_HEADERS)
            assert ok.status_code == 200
            entry.map._tracker.odometry.delta[0, 3] = 3e5
        layers = entry.map.layer("tsdf")[1]["tsdf"].clone()
        tracker, seq, version = _tracker_state(entry.map), entry.last_seq, entry.map.version
        r = c.post(f"/v1/maps/{mid}/frames", content=_message(2, False), headers=MSGPACK_HEADERS)
        if refuse == "budget":
            assert r.status_code == 507 and "memory budget" in r.json()["detail"], r.text
            assert tracker[0] == "off"
        else:
            assert r.status_code == 422 and "coordinate range" in r.json()["detail"], r.text
        assert entry.last_seq == seq and entry.map.version == version
        assert torch.equal(entry.map.layer("tsdf")[1]["tsdf"], layers)
        assert _same_state(_tracker_state(entry.map), tracker)
        if refuse == "range":
            entry.map._tracker.odometry.delta[0, 3] = 0.1  # the motion the replay saw
        entry.budget = budget
        r = c.post(f"/v1/maps/{mid}/frames", content=_message(3, False), headers=MSGPACK_HEADERS)
        assert r.status_code == 200, r.text
        mdir = DataDir(tmp_path / "data").map_dir(mid)
        logged = [s for s, _ in mdir.replay(0)]
        live = entry.map
        if refuse == "budget":  # (the range case edited the live tracker's motion: no replay to compare)
            replayed, *_ = recover_map(mdir, "cpu")
            _assert_same_map(live, replayed)
    assert logged == list(range(1, seq + 2))


@pytest.mark.parametrize("posed", [False, True])
def test_integrate_lidar_admit_refuses_with_the_map_unchanged(posed):
    """The library contract the writer relies on: ``Map.integrate_lidar(admit=...)`` calls ``admit`` with the
    pose to be used (the estimate for a scan without a pose) before anything changes; raising there leaves
    the layers, the version and the tracking state as they were; accepting integrates as without it."""

    class Refused(Exception):
        pass

    m = Map(VOXEL, layers=("tsdf",), device="cpu")
    ref = Map(VOXEL, layers=("tsdf",), device="cpu")
    for i in range(2):
        pts, T = scan(i, N_POINTS)
        m.integrate_lidar(pts, T if i == 0 else None)
        ref.integrate_lidar(pts, T if i == 0 else None)
    pts, T = scan(2, N_POINTS)
    seen = []

    def refuse(T_used):
        seen.append(T_used.clone())
        raise Refused

    state, layers = _tracker_state(m), m.layer("tsdf")[1]["tsdf"].clone()
    with pytest.raises(Refused):
        m.integrate_lidar(pts, T if posed else None, admit=refuse)
    assert len(seen) == 1 and seen[0].dtype == torch.float64 and seen[0].shape == (4, 4)
    assert m.version == 2 and torch.equal(m.layer("tsdf")[1]["tsdf"], layers)
    assert _same_state(_tracker_state(m), state)
    res = m.integrate_lidar(pts, T if posed else None, admit=seen.append)  # accepted: as without admit
    want = ref.integrate_lidar(pts, T if posed else None)
    assert torch.equal(seen[-1], res["T_world_sensor"]) and torch.equal(
        res["T_world_sensor"], want["T_world_sensor"]
    )
    if posed:
        np.testing.assert_array_equal(seen[0].numpy(), T)
    else:
        assert torch.equal(seen[0], seen[-1])  # the same estimate, refused then accepted
    _assert_same_map(m, ref)

"""Many maps share the writer fairly (issue 13): the writers' turns (``FairTurns``) are handed out first
come, first served, so a map flooded with frames delays another map's batch by at most one of its own
batches per writer slot; and the one way in (``MapEntry.prepare`` -> ``submit`` -> WAL -> ``store.apply``)
validates, logs and integrates a frame once."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
from test_service_helpers import MSGPACK_HEADERS, client, scan

from mapper import Map, store, wire
from mapper.api.service import FairTurns
from mapper.client import decode_arrays
from mapper.persistence import DataDir
from mapper.store import decode_record

VOXEL = 0.25


# ------------------------------------------------------------------------------------------ FairTurns
def test_fair_turns_hand_over_in_arrival_order():
    """With one slot: the holder's next request queues behind everyone already waiting (round-robin), and
    a waiter cancelled in the queue neither gets nor loses a turn."""

    async def main():
        turns = FairTurns(1)
        order: list[str] = []

        async def worker(name: str, rounds: int):
            for _ in range(rounds):
                await turns.acquire()
                order.append(name)
                await asyncio.sleep(0.001)
                turns.release()

        await turns.acquire()  # hold the slot while a, b and c queue up
        tasks = [asyncio.create_task(worker(n, 3)) for n in "abc"]
        await asyncio.sleep(0.01)
        turns.release()
        await asyncio.gather(*tasks)
        assert order == list("abcabcabc")  # a flooder cannot take two turns while another waits
        assert turns.free == 1 and not turns.waiters

        await turns.acquire()
        doomed = asyncio.create_task(turns.acquire())
        late = asyncio.create_task(turns.acquire())
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        turns.release()
        await asyncio.wait_for(late, 5)  # the turn went to the next live waiter
        turns.release()
        assert turns.free == 1 and not turns.waiters

    asyncio.run(main())


def test_fair_turns_bound_concurrency():
    async def main():
        turns = FairTurns(2)
        running, peak = 0, 0

        async def work():
            nonlocal running, peak
            await turns.acquire()
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.005)
            running -= 1
            turns.release()

        await asyncio.gather(*(work() for _ in range(10)))
        assert peak == 2 and turns.free == 2

    asyncio.run(main())


# ------------------------------------------------------------------------------------- the service
def test_a_flooded_map_does_not_starve_another(tmp_path):
    """Map A is flooded by 3 clients (its queue stays full); map B sends a frame now and then. With one
    writer slot, between B's frame being queued and B's batch starting, A starts at most one batch; B's
    ack latency is bounded by about one A batch plus its own. Bounded in time (~6 s of flooding)."""
    n_points = 1500
    with client(tmp_path, writer_slots=1, max_batch=2, queue_depth=8, esdf_update="lazy") as c:
        ids = {}
        for name in ("a", "b"):
            r = c.post("/v1/maps", json={"name": name, "voxel_size_m": VOXEL, "layers": ["tsdf"]})
            ids[name] = r.json()["id"]
        service = c.app.state.service
        batches: list[tuple[str, float, float, list[float]]] = []  # (map, start, end, the ops' t0)
        for name, mid in ids.items():
            entry = service.maps[mid]
            process = entry._process

            def traced(batch, _name=name, _process=process):
                t = time.perf_counter()
                out = _process(batch)
                batches.append((_name, t, time.perf_counter(), [op.t0 for op in batch]))
                return out

            entry._process = traced
        stop = threading.Event()
        flood_acks = [0]

        def flood(k: int):
            i = 0
            while not stop.is_set():
                pts, T = scan(i % 20, n_points, seed=k)
                body = wire.packb(wire.lidar_message(pts, T))
                r = c.post(f"/v1/maps/{ids['a']}/frames", content=body, headers=MSGPACK_HEADERS)
                assert r.status_code in (200, 429), r.text
                flood_acks[0] += r.status_code == 200
                i += 1

        threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(3)]
        for t in threads:
            t.start()
        lat = []
        try:
            time.sleep(1.0)  # A's queue fills
            for i in range(5):
                pts, T = scan(i, n_points, seed=9)
                t0 = time.perf_counter()
                r = c.post(
                    f"/v1/maps/{ids['b']}/frames",
                    content=wire.packb(wire.lidar_message(pts, T)),
                    headers=MSGPACK_HEADERS,
                )
                lat.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                assert msgpack.unpackb(r.content)["map_version"] == i + 1
                time.sleep(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        a_batches = [b for b in batches if b[0] == "a"]
        b_batches = [b for b in batches if b[0] == "b"]
        assert len(b_batches) == 5 and flood_acks[0] >= 3
        for _, start, _, t0s in b_batches:
            queued = t0s[0]
            # A's batches that started after B's frame was queued and before B's batch started
            ahead = sum(queued < a_start < start for _, a_start, _, _ in a_batches)
            assert ahead <= 1, f"B waited behind {ahead} batches of the flooded map"
        # one writer slot: no batch of A ran at the same time as one of B
        for _, bs, be, _ in b_batches:
            assert not any(a_s < be and bs < a_e for _, a_s, a_e, _ in a_batches)
        a_max = max(e - s for _, s, e, _ in a_batches)
        b_max = max(e - s for _, s, e, _ in b_batches)
        print(
            f"B ack latency max {max(lat) * 1e3:.0f} ms (A batch max {a_max * 1e3:.0f} ms, B batch max "
            f"{b_max * 1e3:.0f} ms), {len(a_batches)} A batches"
        )
        # one A batch ahead at most, plus B's own, plus the loop's and the HTTP client's overhead
        assert max(lat) <= a_max + b_max + 2.0


def test_one_way_in_logs_once_and_replays_the_same_map(tmp_path):
    """Posed and pose-less LiDAR frames through the one way in: every acked frame is logged exactly once,
    in seq order, a pose-less frame with the pose the map estimated, and a replay of the log (through
    ``store.apply``) equals a map built here by calling ``Map.integrate_lidar`` on the same frames."""
    frames = [scan(i, 1500) for i in range(6)]
    posed = [True, True, False, False, True, False]
    with client(tmp_path, max_batch=4, esdf_update="lazy") as c:
        mid = c.post("/v1/maps", json={"name": "m", "voxel_size_m": VOXEL, "layers": ["tsdf"]}).json()["id"]
        acks = []
        for (pts, T), p in zip(frames, posed, strict=True):
            msg = wire.lidar_message(pts, T if p else None)
            r = c.post(f"/v1/maps/{mid}/frames", content=wire.packb(msg), headers=MSGPACK_HEADERS)
            assert r.status_code == 200, r.text
            acks.append(msgpack.unpackb(r.content))
        bad = wire.lidar_message(frames[0][0], np.full((4, 4), np.nan))
        r = c.post(f"/v1/maps/{mid}/frames", content=wire.packb(bad), headers=MSGPACK_HEADERS)
        assert r.status_code == 422 and "T_world_sensor" in r.json()["detail"]  # refused, not logged
        far = np.eye(4)
        far[0, 3] = 1e6  # outside the map's coordinate range (2^20 voxels of 0.25 m)
        r = c.post(
            f"/v1/maps/{mid}/frames",
            content=wire.packb(wire.lidar_message(frames[0][0], far)),
            headers=MSGPACK_HEADERS,
        )
        assert r.status_code == 422 and "coordinate range" in r.json()["detail"]
        limits = wire.Limits(1 << 40, 1 << 40, 1 << 40, 1e9)
        logged = [
            (seq, decode_record(p, limits)) for seq, p in DataDir(tmp_path / "data").map_dir(mid).replay(0)
        ]
    assert [a["seq"] for a in acks] == list(range(1, 7))
    assert [s for s, _ in logged] == list(range(1, 7))  # each acked frame logged once, nothing refused
    oracle = Map(VOXEL, layers=("tsdf",), device="cpu")
    replayed = Map(VOXEL, layers=("tsdf",), device="cpu")
    for (_, (kind, f)), (pts, T), p, ack in zip(logged, frames, posed, acks, strict=True):
        assert kind == "frame" and f.pose_estimated == (not p)
        np.testing.assert_array_equal(f.points, pts)
        used = np.asarray(ack["T_world_sensor"]).reshape(4, 4)
        np.testing.assert_array_equal(f.T_world_sensor, used)  # the pose used is the pose logged
        if p:
            np.testing.assert_array_equal(used, T)
        res = oracle.integrate_lidar(pts, T if p else None)  # the library, called directly
        np.testing.assert_allclose(res["T_world_sensor"].numpy(), used, rtol=0, atol=1e-9)
        store.apply(replayed, kind, f)  # the log, replayed the way recovery does
    assert replayed.version == oracle.version == 6
    q = np.random.default_rng(3).uniform([-5, -5, -0.8], [5, 5, 1.5], (500, 3))
    for m in (replayed,):
        d, w = m.query_tsdf(q)
        d0, w0 = oracle.query_tsdf(q)
        np.testing.assert_array_equal(w.numpy(), w0.numpy())
        np.testing.assert_array_equal(d.numpy(), d0.numpy())


def test_maps_integrate_on_their_own_streams(tmp_path, device):
    """Two maps ingesting at once: on CUDA each writer thread runs on its map's own stream (not the default
    one, not the other map's); on any device each map equals a map built here from its frames in order
    (the publish event orders the reads after the stream's work)."""
    frames = {k: [scan(i, 1500, seed=k) for i in range(4)] for k in range(2)}
    with client(tmp_path, device=device.type, max_batch=2) as c:
        ids = [
            c.post(
                "/v1/maps", json={"name": f"m{k}", "voxel_size_m": VOXEL, "layers": ["tsdf", "esdf"]}
            ).json()["id"]
            for k in range(2)
        ]
        service = c.app.state.service
        entries = [service.maps[mid] for mid in ids]
        if device.type == "cuda":
            streams = [e.executor.submit(torch.cuda.current_stream).result() for e in entries]
            assert streams[0] == entries[0].stream and streams[1] == entries[1].stream
            assert streams[0] != streams[1]
            assert all(s != torch.cuda.default_stream(device) for s in streams)
        else:
            assert all(e.stream is None for e in entries)

        def post_all(k):
            for pts, T in frames[k]:
                r = c.post(
                    f"/v1/maps/{ids[k]}/frames",
                    content=wire.packb(wire.lidar_message(pts, T)),
                    headers=MSGPACK_HEADERS,
                )
                assert r.status_code == 200, r.text

        threads = [threading.Thread(target=post_all, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        q = np.random.default_rng(5).uniform([-5, -5, -0.8], [5, 5, 1.5], (400, 3))
        body = wire.packb({"points": wire.encode_array(q)})
        got = []
        for mid in ids:
            r = c.post(f"/v1/maps/{mid}/query/distance", content=body, headers=MSGPACK_HEADERS)
            assert r.status_code == 200 and r.headers["x-map-version"] == "4"
            got.append(np.asarray(decode_arrays(msgpack.unpackb(r.content))["distance"]))
    for k in range(2):
        oracle = Map(VOXEL, layers=("tsdf", "esdf"), device=device)
        for pts, T in frames[k]:
            oracle.integrate_lidar(pts, T)
        oracle.update_esdf()
        want = oracle.query_distance(q)[0].cpu().numpy()
        np.testing.assert_allclose(got[k], want, rtol=0, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("env, want", [({}, False), ({"MAPPER_WS_COMPRESSION": "true"}, True)])
def test_serve_declines_permessage_deflate_unless_asked(tmp_path, monkeypatch, env, want):
    """``mapper serve`` runs uvicorn without permessage-deflate by default (a zlib inflate of every frame
    on the event loop for ~8 % fewer bytes of float32 points); ``MAPPER_WS_COMPRESSION=true`` restores it.
    The client never offers it."""
    import uvicorn

    from mapper import cli
    from mapper.client import FrameStream

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    for k, v in {"MAPPER_DATA_DIR": str(tmp_path), "MAPPER_DEVICE": "cpu", **env}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--port", "0"])
    assert done.value.code == 0
    assert seen["ws_per_message_deflate"] is want

    offered = {}

    class Refused(Exception):
        pass

    def fake_connect(url, **kw):
        offered.update(kw)
        raise Refused

    import websockets.sync.client

    monkeypatch.setattr(websockets.sync.client, "connect", fake_connect)
    with pytest.raises(Refused):
        FrameStream("ws://127.0.0.1:1/v1/maps/x/stream", None)
    assert offered["compression"] is None


def test_stage_times_do_not_sync_every_cuda_frame(tmp_path, device, monkeypatch):
    """Reading a frame's per-stage times synchronises the whole device on CUDA (every map's stream): the
    writer samples them there (one frame per ``STAGE_SAMPLE_S``) and reads every frame's on the CPU."""
    from mapper.api import service as service_mod

    monkeypatch.setattr(service_mod, "STAGE_SAMPLE_S", 1e9)
    with client(tmp_path, device=device.type) as c:
        mid = c.post("/v1/maps", json={"name": "s", "voxel_size_m": VOXEL, "layers": ["tsdf"]}).json()["id"]
        for i in range(3):
            pts, T = scan(i, 1500)
            r = c.post(
                f"/v1/maps/{mid}/frames",
                content=wire.packb(wire.lidar_message(pts, T)),
                headers=MSGPACK_HEADERS,
            )
            assert r.status_code == 200, r.text
        text = c.get("/metrics").text
    import re

    counts = dict(re.findall(r'mapper_stage_seconds_count\{stage="(\w+)"\} (\S+)', text))
    assert "grow" in counts and "update" in counts, counts  # the TSDF integrator's stages
    want = 1.0 if device.type == "cuda" else 3.0
    assert all(float(n) == want for n in counts.values()), counts

"""``mapper serve --ray`` on a local Ray cluster (3 CPU map workers), through the real HTTP/WebSocket API:
maps land on different workers and answer as a map built here from the same frames; a worker killed with
SIGKILL mid-stream is restarted by Ray, loses no acknowledged frame and answers again within 60 s; a map
moved between workers mid-stream loses nothing. Bounded: the whole module dies after WATCHDOG_S."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import tarfile
import threading
import time

import crash_helpers
import httpx
import numpy as np
import pytest
import torch
from crash_helpers import StreamThread, answer_within, check_recovered, rebuilt, served_map
from test_service_helpers import scan

from mapper import Map
from mapper.client import ApiError, MapperClient
from mapper.cluster import shards
from mapper.cluster.local import serve_in_thread, wait_ready
from mapper.persistence import DataDir, MapDir, load_snapshot_file
from mapper.settings import Settings
from mapper.store import save_new_map

pytest.importorskip("ray", reason="ray is not installed (pip install 'mapper[ray]'): cluster tests skip")

pytestmark = pytest.mark.ray  # on the session's local Ray (conftest.py: local_ray)

WATCHDOG_S = 600  # the module took 403 s at load ~15 on 2 cores (session 3)
TOKEN, READ = "cluster-token", "cluster-read"
CONFIG = dict(voxel_size_m=0.25, layers=["tsdf", "esdf"], esdf_max_distance_m=1.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, local_ray):
    from mapper.cluster.ingress import create_cluster_app

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # never hang CI
    root = tmp_path_factory.mktemp("cluster")
    # a map of a plain `mapper serve` on the same data directory: the cluster adopts it
    legacy = Map(**CONFIG, device="cpu")
    for i in range(3):
        legacy.integrate_lidar(*scan(i + 50))
    save_new_map(DataDir(root), legacy, name="legacy")
    settings = Settings(
        data_dir=root,
        device="cpu",
        snapshot_interval_s=0,
        api_tokens=[TOKEN],
        read_tokens=[READ],
        memory_budget_bytes=1 << 30,
        query_threads=1,
        malloc_trim_s=0,
    )
    try:
        with serve_in_thread(create_cluster_app(settings, workers=3), timeout_s=240) as url:
            yield url, root
    finally:
        faulthandler.cancel_dump_traceback_later()


def cluster_info(url: str, token: str = READ) -> dict:
    r = httpx.get(f"{url}/v1/cluster", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def owner(url: str, map_id: str) -> dict:
    return next(w for w in cluster_info(url)["workers"] if map_id in w.get("maps", []))


def reference(n: int, offset: int = 0) -> Map:
    return rebuilt(CONFIG, n, lambda i: scan(i + offset))


def assert_same_tsdf(a: Map, b: Map) -> None:
    crash_helpers.assert_same_tsdf(a, b, atol=1e-4)


def test_cluster_auth_and_workers(cluster, tmp_path):
    url, root = cluster
    assert httpx.get(f"{url}/v1/cluster", timeout=30).status_code == 401
    assert (
        httpx.get(f"{url}/v1/cluster", headers={"Authorization": "Bearer nope"}, timeout=30).status_code
        == 401
    )
    info = cluster_info(url)
    assert len(info["workers"]) == 3
    pids = {w["pid"] for w in info["workers"]}
    assert len(pids) == 3 and os.getpid() not in pids
    for w in info["workers"]:
        assert w["device"] == "cpu" and w["memory"]["budget_bytes"] > 0 and w["frames_per_s"] >= 0
    # a read token cannot write through the ingress; bad input gets the single-process app's errors
    with MapperClient(url, token=READ) as c, pytest.raises(ApiError) as e:
        c.create_map(name="ro", **CONFIG)
    assert e.value.status == 403
    with MapperClient(url, token=TOKEN) as c:
        with pytest.raises(ApiError) as e:
            c.create_map(name="bad", voxel_size_m=-1)
        assert e.value.status == 422
        for k, msg in (
            (0, "shards"),
            (4, "4 shards need 4 map workers; this cluster has 3"),
            (True, "shards"),
        ):
            with pytest.raises(ApiError) as e:  # a bad K: refused, nothing created
                c.create_map(name="sharded", shards=k, **CONFIG)
            assert e.value.status == 422 and msg in e.value.detail, e.value.detail
        assert c.find_map("sharded") is None
        with pytest.raises(ApiError) as e:
            c.get_map("no-such-map")
        assert e.value.status == 404
        legacy = c.find_map("legacy")  # adopted from <root>/maps into a worker's directory
        assert legacy is not None and legacy["frames_integrated"] == 3
        assert not (root / "maps" / legacy["id"]).exists()
        assert_same_tsdf(served_map(c, legacy["id"], tmp_path / "l.st"), reference(3, offset=50))
        # import, as mapper serve: a taken stored name falls back to the id, a taken ?name= is a conflict
        copy = c.import_map(tmp_path / "l.st")
        assert copy["id"] != legacy["id"] and copy["name"] == copy["id"] and copy["frames_integrated"] == 3
        with pytest.raises(ApiError) as e:
            c.import_map(tmp_path / "l.st", name="legacy")
        assert e.value.status == 409
        assert c.import_map(tmp_path / "l.st", name="legacy2")["name"] == "legacy2"
        with pytest.raises(ApiError) as e:
            c.import_map(b"not a snapshot")
        assert e.value.status in (400, 422)


def test_maps_land_on_different_workers_and_answer_as_one_process(cluster, tmp_path):
    url, _ = cluster
    with MapperClient(url, token=TOKEN) as c:
        # placement by load: the worker with fewest maps, then fewest bytes in maps
        def least_loaded():
            ws = cluster_info(url)["workers"]
            return min((len(w["maps"]), w["memory"]["maps_bytes"], w["worker"]) for w in ws)[2]

        expect = least_loaded()
        a = c.create_map(name="alpha", **CONFIG)["id"]
        assert owner(url, a)["worker"] == expect
        expect = least_loaded()
        b = c.create_map(name="beta", **CONFIG)["id"]
        assert owner(url, b)["worker"] == expect
        with pytest.raises(ApiError) as e:
            c.create_map(name="alpha", **CONFIG)  # names are unique over the cluster
        assert e.value.status == 409
        for i in range(2):  # maps land on both workers
            assert cluster_info(url)["workers"][i]["maps"]
        for i in range(6):
            c.send_lidar(a, *scan(i), frame_id=f"a{i}")
        with c.stream(b, window=4) as s:
            for i in range(6):
                s.send_lidar(*scan(i + 10), frame_id=f"b{i}")
            s.flush()
        assert {m["id"] for m in c.list_maps()} >= {a, b}
        time.sleep(1.2)  # one more sample of the workers' frames/s after the last frame
        wb = owner(url, b)
        assert wb["frames_per_s"] > 0 and wb["memory"]["maps_bytes"] > 0 and wb["memory"]["rss_bytes"] > 0
        assert isinstance(wb["node"], str) and wb["node"]
        ref_a, ref_b = reference(6), reference(6, offset=10)
        assert_same_tsdf(served_map(c, a, tmp_path / "a.st"), ref_a)
        assert_same_tsdf(served_map(c, b, tmp_path / "b.st"), ref_b)
        rng = np.random.default_rng(0)
        pts = rng.uniform([-5, -5, -0.9], [5, 5, 1.5], (500, 3)).astype(np.float32)
        t, w = c.query_tsdf(a, pts)
        t_ref, w_ref = ref_a.query_tsdf(pts)
        np.testing.assert_allclose(w, w_ref.numpy(), atol=1e-4)
        np.testing.assert_allclose(np.nan_to_num(t, nan=9), np.nan_to_num(t_ref.numpy(), nan=9), atol=1e-4)
        ref_b.update_esdf()
        d, _, obs = c.query_distance(b, pts)
        d_ref, _, obs_ref = ref_b.query_distance(pts)
        np.testing.assert_array_equal(obs.astype(bool), obs_ref.numpy().astype(bool))
        np.testing.assert_allclose(np.nan_to_num(d, nan=9), np.nan_to_num(d_ref.numpy(), nan=9), atol=1e-4)
        assert len(c.mesh(a)["faces"]) > 0
        assert c.esdf_slice_png(b, z=0.0)[:8] == b"\x89PNG\r\n\x1a\n"
        c.delete_map(a)
        with pytest.raises(ApiError) as e:
            c.get_map(a)
        assert e.value.status == 404
    assert a not in owner(url, b)["maps"]
    auth = {"Authorization": f"Bearer {READ}"}  # the spec needs a read token once tokens are set
    spec = httpx.get(f"{url}/openapi.json", headers=auth, timeout=30).json()  # mapper serve's + the cluster's
    for path in ("/v1/maps/{map_id}/frames", "/v1/maps/{map_id}/query/distance", "/v1/cluster"):
        assert path in spec["paths"], path
    assert "post" in spec["paths"]["/v1/maps/{map_id}/move"] and "post" in spec["paths"]["/v1/maps"]
    assert httpx.get(f"{url}/docs", headers=auth, timeout=30).status_code == 200
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {READ}"}, timeout=30)
    assert r.status_code == 200 and 'worker="w0"' in r.text and 'worker="w1"' in r.text


def test_sigkill_of_a_worker_mid_stream_loses_no_acked_frame(cluster, tmp_path):
    url, _ = cluster
    n_frames = 40
    with MapperClient(url, token=TOKEN) as c:
        mid = c.create_map(name="crash", **CONFIG)["id"]
        hid = c.create_map(name="crash-http", **CONFIG)["id"]
    victim = owner(url, mid)
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{url}/v1/maps/{hid}/move", json={"worker": victim["worker"]}, headers=h, timeout=120)
    assert r.status_code == 200 and owner(url, hid)["worker"] == victim["worker"]
    # HTTP frames into a second map of the same worker: (frame index, "acked" | "lost" (502)) in order
    posted: list[tuple[int, str]] = []
    stop = threading.Event()

    post_errors: list[BaseException] = []

    def post():
        with MapperClient(url, token=TOKEN) as c2:
            i = 0
            while not stop.is_set() and i < 60:
                try:
                    c2.send_lidar(hid, *scan(i + 200))
                    posted.append((i, "acked"))
                except ApiError as e:
                    if not (e.status == 502 and e.type == "worker_lost"):
                        post_errors.append(e)
                        return
                    posted.append((i, "lost"))
                except BaseException as e:
                    post_errors.append(e)
                    return
                i += 1

    poster = threading.Thread(target=post)
    poster.start()

    stream = StreamThread(url, mid, n_frames, token=TOKEN).start()
    killed = stream.kill_after(10, lambda: os.kill(victim["pid"], signal.SIGKILL), join_s=90)
    n_acked = len(stream.acks)
    assert 10 <= n_acked < n_frames
    assert stream.frame_ids() == [f"f{i}" for i in range(n_acked)]
    with MapperClient(url, token=TOKEN) as c:
        # the map answers again (Ray restarted the worker; it recovered the map)
        answer_within(lambda: c.get_map(mid), killed, errors=(ApiError, httpx.HTTPError))
        now = owner(url, mid)
        assert now["worker"] == victim["worker"] and now["pid"] != victim["pid"]
        recovered, served = check_recovered(c, mid, n_acked, 4, tmp_path / "after.st")
        assert_same_tsdf(served, reference(recovered))
        # the HTTP map: requests that found the worker down waited for its restart; every acked frame is in
        time.sleep(1.0)
        stop.set()
        poster.join(120)
        assert not poster.is_alive() and not post_errors, post_errors
        n_ok = sum(1 for _, st in posted if st == "acked")
        lost = [i for i, st in posted if st == "lost"]
        assert n_ok >= 2 and len(lost) <= 1, posted
        m = c.get_map(hid)
        assert n_ok <= m["last_seq"] == m["frames_integrated"] <= n_ok + len(lost)
        kept = [i for i, st in posted if st == "acked" or m["last_seq"] > n_ok]
        ref = Map(**CONFIG, device="cpu")
        for i in kept:
            ref.integrate_lidar(*scan(i + 200))
        assert_same_tsdf(served_map(c, hid, tmp_path / "http.st"), ref)


def test_move_mid_stream_loses_nothing(cluster, tmp_path):
    url, _ = cluster
    n_frames = 24
    with MapperClient(url, token=TOKEN) as c:
        mid = c.create_map(name="mover", **CONFIG)["id"]
        hid = c.create_map(name="mover-http", **CONFIG)["id"]
        src, hsrc = owner(url, mid)["worker"], owner(url, hid)["worker"]
        acks: list[dict] = []
        http_acks: list[dict] = []
        moved: dict[str, tuple] = {}

        def move(map_id, target, progress, after):
            while len(progress) < after:
                time.sleep(0.01)
            r = httpx.post(
                f"{url}/v1/maps/{map_id}/move",
                json={"worker": target},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=120,
            )
            moved[map_id] = (r, len(progress))  # how many frames were acked when the move was done

        def post():  # HTTP frames into the second map while it moves: each must be acked, in order
            with MapperClient(url, token=TOKEN) as c2:
                for i in range(12):
                    http_acks.append(c2.send_lidar(hid, *scan(i + 300)))

        threads = [
            threading.Thread(target=move, args=(mid, (src + 1) % 3, acks, 8)),
            threading.Thread(target=move, args=(hid, (hsrc + 1) % 3, http_acks, 4)),
            threading.Thread(target=post),
        ]
        for t in threads:
            t.start()
        with c.stream(mid, window=4) as s:
            for i in range(n_frames):
                acks.extend(s.send_lidar(*scan(i), frame_id=f"f{i}"))
                if i > 8:
                    time.sleep(0.05)
            acks.extend(s.flush())
        for t in threads:
            t.join(120)
        for map_id, target in ((mid, (src + 1) % 3), (hid, (hsrc + 1) % 3)):
            r, done_at = moved[map_id]
            assert r.status_code == 200, r.text
            assert r.json()["worker"] == target and owner(url, map_id)["worker"] == target
        assert moved[mid][1] < n_frames and moved[hid][1] < 12  # the moves finished mid-stream
        assert [a["seq"] for a in http_acks] == list(range(1, 13))
        assert_same_tsdf(served_map(c, hid, tmp_path / "moved-http.st"), reference(12, offset=300))
        assert [a["frame_id"] for a in acks] == [f"f{i}" for i in range(n_frames)]
        assert [a["seq"] for a in acks] == list(range(1, n_frames + 1))
        m = c.get_map(mid)
        assert m["last_seq"] == m["frames_integrated"] == n_frames
        assert_same_tsdf(served_map(c, mid, tmp_path / "moved.st"), reference(n_frames))
        # bad moves: unknown worker, unknown map, read token
        h = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.post(f"{url}/v1/maps/{mid}/move", json={"worker": 7}, headers=h).status_code == 422
        assert httpx.post(f"{url}/v1/maps/nosuch/move", json={"worker": 0}, headers=h).status_code == 404
        ro = {"Authorization": f"Bearer {READ}"}
        assert httpx.post(f"{url}/v1/maps/{mid}/move", json={"worker": src}, headers=ro).status_code == 403


def test_mapper_serve_ray_command(tmp_path):
    """The real command: `mapper serve --ray` starts its own local Ray and one worker, serves the API, and
    on SIGTERM stops with every map snapshotted in its worker's directory."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mapper", "serve", "--ray", "--ray-workers", "1", "--port", str(port)]
    cmd += ["--data-dir", str(tmp_path / "data"), "--device", "cpu", "--log-level", "warning"]
    env = {**os.environ, "MAPPER_MALLOC_TRIM_S": "0", "MAPPER_QUERY_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            assert wait_ready(url, 180, workers=1, alive=lambda: proc.poll() is None)["status"] == "ready"
        except RuntimeError as e:
            raise AssertionError(f"{e}: {(tmp_path / 'serve.log').read_text()[-2000:]}") from None
        with MapperClient(url) as c:
            info = c._request("GET", "/v1/cluster").json()
            assert [w["worker"] for w in info["workers"]] == [0] and info["workers"][0]["pid"] != proc.pid
            mid = c.create_map(name="cli", **CONFIG)["id"]
            assert c.send_lidar(mid, *scan(0))["seq"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
    snap = MapDir(tmp_path / "data" / "workers" / "w0" / "maps" / mid, True).latest_snapshot()
    assert snap is not None and snap.seq == 1, "the map was not snapshotted at shutdown"
    assert_same_tsdf(Map.from_state_dict(*load_snapshot_file(snap.path), device="cpu"), reference(1))


def test_errors_and_answers_match_mapper_serve(cluster, tmp_path):
    """The same requests to the cluster and to a single-process app give the same status and error type
    (auth, bad ids, bad bodies, bad parameters) and the same answers on an empty map."""
    from fastapi.testclient import TestClient

    from mapper.api import create_app

    url, _ = cluster
    single = create_app(
        Settings(
            data_dir=tmp_path / "single",
            device="cpu",
            snapshot_interval_s=0,
            api_tokens=[TOKEN],
            read_tokens=[READ],
            malloc_trim_s=0,
        )
    )
    full, ro = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"Bearer {READ}"}
    with TestClient(single) as local, httpx.Client(base_url=url, timeout=60) as remote:
        ids = {}
        for name, cl in (("local", local), ("remote", remote)):
            r = cl.post("/v1/maps", json={"name": "conform", **CONFIG}, headers=full)
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]

        def requests(mid):
            j = {**full, "content-type": "application/json"}
            return [
                ("GET", "/v1/maps/bad!id", {}, full),
                ("GET", "/v1/maps/nosuch", {}, full),
                ("DELETE", "/v1/maps/nosuch", {}, full),
                ("GET", f"/v1/maps/{mid}", {}, {}),
                ("POST", f"/v1/maps/{mid}/frames", {"content": b"{}"}, ro),
                ("POST", f"/v1/maps/{mid}/frames", {"content": b"not json"}, j),
                ("POST", f"/v1/maps/{mid}/frames", {"content": b"x"}, {**full, "content-type": "text/plain"}),
                ("POST", f"/v1/maps/{mid}/frames", {"json": {"kind": "lidar"}}, full),
                ("POST", f"/v1/maps/{mid}/query/distance", {"json": {"points": [[0, 0]]}}, ro),
                ("POST", f"/v1/maps/{mid}/query/tsdf", {"json": {"points": [[0, 0, 0], [1, 2, 3]]}}, ro),
                ("POST", f"/v1/maps/{mid}/query/occupancy", {"json": {"points": [[0, 0, 0]]}}, ro),
                ("GET", f"/v1/maps/{mid}/esdf/slice?z=abc", {}, ro),
                ("GET", f"/v1/maps/{mid}/esdf/slice?z=0&x_min=1", {}, ro),
                ("GET", f"/v1/maps/{mid}/mesh?format=bad", {}, ro),
                ("POST", f"/v1/maps/{mid}/clear", {"json": {"aabb_min": [0, 0]}}, full),
                ("POST", f"/v1/maps/{mid}/decay", {"json": {"factor": 2}}, full),
                ("POST", "/v1/maps", {"json": {"name": "x", "bogus": 1}}, full),
                ("POST", "/v1/maps", {"json": {"name": "conform"}}, full),
                ("GET", "/v1/maps", {}, {"Authorization": "Bearer wrong"}),
            ]

        for (m, path, kw, h), (_, path2, kw2, _) in zip(
            requests(ids["local"]), requests(ids["remote"]), strict=True
        ):
            a = local.request(m, path, headers=h, **kw)
            b = remote.request(m, path2, headers=h, **kw2)
            assert a.status_code == b.status_code, (m, path, a.text, b.text)
            if a.status_code >= 400:
                assert a.json()["type"] == b.json()["type"], (m, path, a.text, b.text)
            elif "query" in path:
                assert a.json() == b.json(), (path, a.text, b.text)


def drive(i: int):
    """A frame of a drive 4 m / frame along x (1 m along -y): the map spans several 8 m blocks."""
    pts, T = scan(i, n=700, seed=3)
    T = T.copy()
    T[0, 3], T[1, 3] = 4.0 * i, -1.0 * i
    return pts, T


def test_sharded_maps_answer_as_one_map(cluster, tmp_path):
    """K = 2 and K = 3 shards (8 m blocks) fed the same frames as an unsharded map (HTTP and a stream) give
    the same TSDF at every voxel of the unsharded map, the same query answers, ESDF box and slice (given
    bounds and the default ones), mesh (whole, incremental, viewer blocks), status, occupied voxels and
    trajectory; a shard moved to another worker while frames arrive loses none; each shard sits on its own
    worker and holds less than the whole map."""
    from mapper import io
    from mapper.mesh import apply_delta

    url, _ = cluster
    n, more = 4, 2
    with MapperClient(url, token=TOKEN) as c:
        flat = c.create_map(name="flat", **CONFIG)["id"]
        sh = {k: c.create_map(name=f"sharded{k}", shards=k, shard_block_m=8.0, **CONFIG) for k in (2, 3)}
        for k, m in sh.items():
            assert m["config"]["shards"] == k and len({p["worker"] for p in m["shards"]}) == k
        with pytest.raises(ApiError) as e:  # frames of a sharded map need a pose
            c.send_lidar(sh[2]["id"], drive(0)[0])
        assert e.value.status == 422 and "T_world_sensor" in e.value.detail
        for i in range(n):
            c.send_lidar(flat, *drive(i))
            ack = c.send_lidar(sh[2]["id"], *drive(i), frame_id=f"f{i}")
            assert ack["frame_id"] == f"f{i}" and ack["shards"]
        acks = []
        with c.stream(sh[3]["id"], window=4) as s:
            for i in range(n):
                acks += s.send_lidar(*drive(i), frame_id=f"s{i}")
            acks += s.flush()
        assert [a["frame_id"] for a in acks] == [f"s{i}" for i in range(n)]

        def raw_mesh(mid, since=None):
            params = {"format": "msgpack"} | ({} if since is None else {"since_version": since})
            return io.mesh_from_msgpack(c._request("GET", f"/v1/maps/{mid}/mesh", params=params).content)

        shown = {k: raw_mesh(m["id"]) for k, m in sh.items()}  # the meshes a viewer holds now
        # shard 1 of the 2-shard map moves to another worker while more frames arrive
        mover, src = sh[2]["id"], sh[2]["shards"][1]["worker"]
        target = next(w for w in range(3) if w not in {p["worker"] for p in sh[2]["shards"]})
        moved = []

        def move():
            h = {"Authorization": f"Bearer {TOKEN}"}
            moved.append(
                httpx.post(
                    f"{url}/v1/maps/{mover}/move", json={"worker": target, "shard": 1}, headers=h, timeout=120
                )
            )

        mover_thread = threading.Thread(target=move)
        mover_thread.start()
        for i in range(n, n + more):
            c.send_lidar(flat, *drive(i))
            for m in sh.values():
                assert c.send_lidar(m["id"], *drive(i), frame_id=f"m{i}")["frame_id"] == f"m{i}"
        mover_thread.join(120)
        assert moved and moved[0].status_code == 200, moved and moved[0].text
        assert [p["worker"] for p in moved[0].json()["shards"]][1] == target != src
        assert owner(url, c.get_map(mover)["shards"][1]["map_id"])["worker"] == target
        n += more
        assert {m["name"] for m in c.list_maps()} >= {"flat", "sharded2", "sharded3"}
        ref = served_map(c, flat, tmp_path / "flat.st")
        g, d = ref.layer("tsdf")
        centres = ((g.ijk.double() + 0.5) * CONFIG["voxel_size_m"]).float().numpy()
        rng = np.random.default_rng(7)
        lo, hi = centres.min(0), centres.max(0)
        pts = rng.uniform(lo, hi, (3000, 3)).astype(np.float32)
        c_ref = c.query_tsdf(flat, centres)  # at every voxel centre of the unsharded map
        assert (c_ref[1] > 0).sum() > 1000
        d_ref = c.query_distance(flat, pts)
        t_ref = c.query_tsdf(flat, pts)
        box_lo, box_hi = [lo[0] + 4, lo[1] + 4, lo[2]], [lo[0] + 14, lo[1] + 14, hi[2]]
        box_ref = c.esdf_box(flat, box_lo, box_hi)
        bounds = ((float(lo[0]), float(lo[1])), (float(hi[0]), float(hi[1])))
        slice_ref = c.esdf_slice(flat, z=0.5, bounds=bounds)
        default_ref = c.esdf_slice(flat, z=0.5)
        mesh_ref = raw_mesh(flat)
        blocks_ref = c._request("GET", f"/v1/maps/{flat}/mesh/blocks").content
        status_ref = c._request("GET", f"/v1/maps/{flat}/status").json()
        traj_ref = c._request("GET", f"/v1/maps/{flat}/trajectory", params={"start": 1}).json()
        occ_ref = c._request("GET", f"/v1/maps/{flat}/occupied", params={"max_voxels": 200}).json()

        def faces(m):
            v = np.round(m.vertices.double().numpy(), 5)[m.faces.long().numpy()]
            return sorted(tuple(sorted(map(tuple, f))) for f in v.tolist())

        for k, m in sh.items():
            mid = m["id"]
            for a, b in zip(c.query_tsdf(mid, centres), c_ref, strict=True):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(c.query_tsdf(mid, pts), t_ref, strict=True):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(c.query_distance(mid, pts), d_ref, strict=True):
                np.testing.assert_array_equal(a, b)
            box = c.esdf_box(mid, box_lo, box_hi)
            for key in ("distance", "gradient", "observed"):
                np.testing.assert_array_equal(box[key], box_ref[key])
            for sl, want in (
                (c.esdf_slice(mid, z=0.5, bounds=bounds), slice_ref),
                (c.esdf_slice(mid, z=0.5), default_ref),
            ):
                assert sl.origin_xy == want.origin_xy
                np.testing.assert_array_equal(sl.distance, want.distance)
            assert c.esdf_slice_png(mid, z=0.5, bounds=bounds)[:8] == b"\x89PNG\r\n\x1a\n"
            mesh = raw_mesh(mid)
            assert mesh.num_faces == mesh_ref.num_faces > 100 and faces(mesh) == faces(mesh_ref)
            delta = raw_mesh(mid, since=shown[k].version)  # incremental: since the mesh held before
            # a delta; the moved map's shard was reloaded, its change log starts again: the whole mesh
            assert delta.full == (mid == mover) and 0 < delta.num_faces <= mesh.num_faces
            merged = apply_delta(shown[k], delta)
            assert merged.num_faces == mesh.num_faces and faces(merged) == faces(mesh)
            assert raw_mesh(mid, since=10**12).full  # a cursor never handed out: the whole mesh
            blocks = c._request("GET", f"/v1/maps/{mid}/mesh/blocks").content
            assert blocks[:8] == blocks_ref[:8] and blocks[24:] == blocks_ref[24:]  # past the versions
            st = c._request("GET", f"/v1/maps/{mid}/status").json()
            for key in ("frames_integrated", "trajectory_length", "bounds", "layer_names", "voxel_size_m"):
                assert st[key] == status_ref[key], key
            assert st["id"] == mid and st["mesh_version"] == mesh.version
            traj = c._request("GET", f"/v1/maps/{mid}/trajectory", params={"start": 1}).json()
            assert traj["positions"] == traj_ref["positions"] and traj["count"] == traj_ref["count"] == n
            occ = c._request("GET", f"/v1/maps/{mid}/occupied", params={"max_voxels": 200}).json()
            assert occ["total"] == occ_ref["total"] > 200 and occ["centers"] == occ_ref["centers"]
            detail = c.get_map(mid)
            assert detail["frames_integrated"] == n and detail["stats"]["layers"]["tsdf"]["voxels"] > 0
            per = [p["memory_bytes"] for p in detail["shards"]]
            assert len(per) == k and all(p > 0 for p in per)
            # export: a tar of the shards' snapshots; imported, a sharded map again with the same answers
            path = c.export(mid, tmp_path / f"sharded{k}.tar")
            with tarfile.open(path) as tar:
                assert tar.getnames() == ["manifest.json", *(f"shard{i}.safetensors" for i in range(k))]
            with pytest.raises(ApiError) as e:
                c.import_map(path, name="flat")
            assert e.value.status == 409
            if k == 2:  # shard 0's file twice: refused naming it, and shard 0 imported first is removed
                man, files = shards.read_export(path.read_bytes())
                m_ = json.dumps(man).encode()
                bad = shards.tar_header("manifest.json", len(m_)) + m_ + shards.tar_padding(len(m_))
                for i in range(2):
                    bad += shards.tar_header(f"shard{i}.safetensors", len(files[0])) + files[0]
                    bad += shards.tar_padding(len(files[0]))

                def held():
                    return {x["id"] for x in c.list_maps()}, sorted(
                        mm for w in cluster_info(url)["workers"] for mm in w["maps"]
                    )

                before = held()
                with pytest.raises(ApiError) as e:
                    c.import_map(bad + shards.TAR_END)
                assert e.value.status == 422 and "is not shard 1 of 2" in e.value.detail
                assert held() == before
            copy = c.import_map(path)  # the stored name is taken: the id, as mapper serve does
            assert copy["id"] != mid and copy["name"] == copy["id"] and copy["config"]["shards"] == k
            assert copy["frames_integrated"] == n and len(copy["shards"]) == k
            for a, b in zip(c.query_tsdf(copy["id"], centres), c_ref, strict=True):
                np.testing.assert_array_equal(a, b)
            c.delete_map(copy["id"])
        h = {"Authorization": f"Bearer {TOKEN}"}
        for body, msg in (({"worker": 0}, "say which"), ({"worker": 0, "shard": 3}, "not a shard")):
            r = httpx.post(f"{url}/v1/maps/{sh[3]['id']}/move", json=body, headers=h, timeout=60)
            assert r.status_code == 422 and msg in r.json()["detail"], r.text
        r = httpx.post(f"{url}/v1/maps/{flat}/move", json={"worker": 0, "shard": 0}, headers=h, timeout=60)
        assert r.status_code == 422 and "not sharded" in r.json()["detail"]
        c.delete_map(sh[2]["id"])
        with pytest.raises(ApiError) as e:
            c.get_map(sh[2]["id"])
        assert e.value.status == 404


def test_sigkill_of_a_shard_worker_mid_stream_loses_nothing(cluster):
    """A stream into a 2-shard map; the worker hosting shard 1 is killed (SIGKILL) mid-stream. The frame it
    held is sent again or taken from its WAL once Ray restarted it, so every frame is acked once, in order,
    the map answers again within 60 s, and it equals a map fed every frame."""
    url, _ = cluster
    n_frames = 14
    with MapperClient(url, token=TOKEN) as c:
        m = c.create_map(name="shard-crash", shards=2, shard_block_m=8.0, **CONFIG)
    mid = m["id"]
    victim = owner(url, m["shards"][1]["map_id"])
    stream = StreamThread(url, mid, n_frames, frame=drive, window=2, token=TOKEN, prefix="k").start()
    stream.wait_acks(4)
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    with MapperClient(url, token=TOKEN) as c:
        # the map answers again (Ray restarted the worker; it recovered the shard)
        answer_within(lambda: c.get_map(mid), killed, errors=(ApiError, httpx.HTTPError))
        stream.join(180)
        assert not stream.errors, stream.errors
        assert stream.frame_ids() == [f"k{i}" for i in range(n_frames)]
        assert owner(url, m["shards"][1]["map_id"])["pid"] != victim["pid"]
        assert c.get_map(mid)["frames_integrated"] == n_frames
        ref = rebuilt(CONFIG, n_frames, drive)
        g, _ = ref.layer("tsdf")
        centres = ((g.ijk.double() + 0.5) * CONFIG["voxel_size_m"]).float().numpy()
        got, want = c.query_tsdf(mid, centres), ref.query_tsdf(torch.from_numpy(centres))
        assert (want[1] > 0).sum() > 1000
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(
                np.nan_to_num(a, nan=9), np.nan_to_num(b.numpy(), nan=9), rtol=0, atol=1e-5
            )
        traj = c._request("GET", f"/v1/maps/{mid}/trajectory").json()
        assert traj["count"] == n_frames
        want = np.stack([drive(i)[1][:3, 3] for i in range(n_frames)])
        np.testing.assert_allclose(np.asarray(traj["positions"]), want, rtol=0, atol=1e-9)

"""Issue 10 (part A): no request may take down the service. Every allocation a request can cause is bounded
before it happens: reads too large get 413 naming the numbers, frames over a map's or the process's memory
budget get 507 before they reach the write-ahead log, device OOM becomes 503 with the map intact, and the
radius policy keeps a map near its sensor. Black box over HTTP where the findings were."""

from __future__ import annotations

import math
import shutil
import threading
import time

import numpy as np
import torch
from test_api_errors import check_error
from test_service_helpers import READ_TOKEN, TOKEN, client, frame_bytes, scan

from mapper import Map, wire
from mapper import map_reads as map_module
from mapper.budget import (
    READ_WORKING_BYTES,
    esdf_site_domain,
    lidar_growth,
    rss_bytes,
)

CT = {"content-type": wire.MSGPACK}
MiB = 1 << 20


def auth(tok=TOKEN):
    return {"authorization": f"Bearer {tok}"}


class PeakRss:
    """Peak resident memory of this process while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def grew(self) -> int:
        return self.peak - self.start


def metric(text: str, series: str, **labels) -> float:
    """The value of one sample in a Prometheus text page (labels in any order)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        if line.startswith(series + "{") or line.startswith(series + " "):
            got = set(line[line.find("{") + 1 : line.find("}")].split(",")) if "{" in line else set()
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} {labels} not in the metrics")


def scattered(n: int, r_max: float, seed: int = 0) -> np.ndarray:
    """``n`` returns scattered in a ball (the adversarial frame: every return in its own brick)."""
    rng = np.random.default_rng(seed)
    d = rng.normal(size=(n, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return (d * rng.uniform(0.3 * r_max, r_max, (n, 1))).astype(np.float32)


def lidar(points, T=None) -> bytes:
    return wire.packb(wire.lidar_message(points, np.eye(4) if T is None else T, 0.0))


def new_map(c, **kw) -> str:
    r = c.post("/v1/maps", json={"voxel_size_m": 0.25, **kw}, headers=auth())
    assert r.status_code == 201, r.text
    return r.json()["id"]


# ------------------------------------------------------------------------------------- finding 1: reads
def test_huge_slice_is_413_in_milliseconds_and_allocates_nothing(tmp_path):
    """The finding's request (800 m x 800 m at 0.2 m = 16 M cells, read-only token): refused before
    anything is allocated, naming the numbers; the process's memory does not move."""
    with client(tmp_path, api_tokens=[TOKEN], read_tokens=[READ_TOKEN]) as c:
        mid = new_map(c)
        assert (
            c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={**CT, **auth()}).status_code
            == 200
        )
        url = f"/v1/maps/{mid}/esdf/slice?z=0&x_min=-400&y_min=-400&x_max=400&y_max=400&resolution_m=0.2"
        c.get(url.replace("400", "1"), headers=auth(READ_TOKEN))  # warm the route
        with PeakRss() as mem:
            t = time.perf_counter()
            r = c.get(url, headers=auth(READ_TOKEN))
            dt = time.perf_counter() - t
        body = check_error(r, 413, "request_too_large")
        assert "16000000 cells" in body["detail"] and "MAPPER_MAX_SLICE_CELLS=4000000" in body["detail"]
        assert dt < 0.5, dt
        assert mem.grew < 16 * MiB, mem.grew  # the old path took ~1.2 KB per cell: 19 GB
        metrics = c.get("/metrics", headers=auth(READ_TOKEN)).text
        assert metric(metrics, "mapper_budget_refusals_total", budget="request", map=mid, name=mid) == 1


def test_read_bounds_by_bytes_name_the_numbers(tmp_path):
    """MAPPER_MAX_REQUEST_BYTES bounds slices (per format), boxes, point queries and meshes before they
    run; requests under it are served."""
    limit = READ_WORKING_BYTES + 200_000
    with client(tmp_path, max_request_bytes=limit) as c:
        mid = new_map(c, layers=["tsdf", "esdf"])
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers=CT).status_code == 200
        base = f"/v1/maps/{mid}/esdf/slice?z=0.5&x_min=-5&y_min=-5&x_max=5&y_max=5"
        assert c.get(base + "&resolution_m=0.1&format=png").status_code == 200  # 10 000 cells x 16 B
        body = check_error(c.get(base + "&resolution_m=0.05&format=png"), 413, "request_too_large")
        # 200 x 200 cells at 16 B + the working set, against the limit, and the most that fits
        need = 40_000 * 16 + READ_WORKING_BYTES
        for s in ("40000 cells", f"MAPPER_MAX_REQUEST_BYTES={limit}", "at most 12500 cells", "16 B per cell"):
            assert s in body["detail"], body
        assert f"{need / MiB:.2f} MiB" in body["detail"], (need, body)
        check_error(c.get(base + "&resolution_m=0.1&format=json"), 413)  # JSON costs 100 B per cell
        # box: 20^3 voxels x 400 B (JSON) > 200 kB; 5^3 fits
        check_error(
            c.post(f"/v1/maps/{mid}/esdf/box", json={"aabb_min": [0, 0, 0], "aabb_max": [5, 5, 5]}),
            413,
            match="8000 voxels",
        )
        assert (
            c.post(
                f"/v1/maps/{mid}/esdf/box", json={"aabb_min": [0, 0, 0], "aabb_max": [1.25] * 3}
            ).status_code
            == 200
        )
        pts = np.zeros((1000, 3)).tolist()
        check_error(c.post(f"/v1/maps/{mid}/query/distance", json={"points": pts}), 413, match="1000 points")
        assert c.post(f"/v1/maps/{mid}/query/distance", json={"points": pts[:100]}).status_code == 200
        bricks = c.get(f"/v1/maps/{mid}").json()["stats"]["layers"]["tsdf"]["bricks"]
        assert bricks * 64 * 16 > 200_000
        check_error(c.get(f"/v1/maps/{mid}/mesh"), 413, match=f"{bricks * 64} voxels")
        assert c.get("/healthz").status_code == 200


def test_chunked_queries_equal_one_piece(monkeypatch):
    """Chunking (QUERY_CHUNK) changes no value: slices, boxes and point queries in chunks of 7 points
    equal the single-chunk results (bit for bit; within an ulp for the sigmoid of occupancy, whose
    vectorised tail differs with the length)."""
    m = Map(voxel_size_m=0.25, layers=("tsdf", "occupancy", "esdf"), device="cpu")
    pts, T = scan(0, 2000)
    m.integrate_lidar(pts, T)
    q = np.random.default_rng(1).uniform(-7, 7, (500, 3))

    def everything():
        sl = m.esdf_slice(0.3, (-6, -6), (6, 6), resolution_m=0.37)
        box = m.esdf_box([-2, -2, -1], [2, 1, 1])
        return [sl.distance, box.distance, box.gradient, box.observed, *m.query_distance(q)] + [
            *m.query_tsdf(q),
            *m.query_occupancy(q),
        ]

    one = everything()
    monkeypatch.setattr(map_module, "QUERY_CHUNK", {"cpu": 7})
    chunked = everything()
    for a, b in zip(one, chunked, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-6, atol=0, equal_nan=True)
            assert torch.equal(torch.isnan(a), torch.isnan(b))
        else:
            assert torch.equal(a, b)
    for a, b in zip(one[:7], chunked[:7], strict=True):  # the distances: exactly
        assert torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0))
    assert bool(torch.isfinite(one[0]).any())  # the slice meets the map


def test_slice_memory_per_cell_is_small():
    """A slice costs its float32 output plus one chunk, not ~1.2 KB per cell (the finding: 1 M cells ->
    +1.0 GB)."""
    m = Map(voxel_size_m=0.25, layers=("tsdf", "esdf"), device="cpu")
    pts, T = scan(0, 2000)
    m.integrate_lidar(pts, T)
    m.update_esdf()
    m.esdf_slice(0.0, (-1, -1), (1, 1), resolution_m=0.1)  # warm-up
    n = 400  # 160 000 cells: ~190 MB on the old path
    with PeakRss() as mem:
        sl = m.esdf_slice(0.0, (-50, -50), (50, 50), resolution_m=100 / n)
    assert tuple(sl.distance.shape) == (n, n)
    assert mem.grew < 64 * MiB, mem.grew / MiB  # one chunk's working set (~40 MB) + 0.6 MB of output


# ------------------------------------------------------------------------------------ finding 4: budgets
def _seq_and_bytes(c, mid):
    s = c.get(f"/v1/maps/{mid}").json()
    return s["last_seq"], s["memory_bytes"], s["frames_integrated"]


def test_frame_over_map_budget_is_507_before_the_wal(tmp_path):
    """A frame whose projected growth exceeds the map's budget is refused (507) before logging: the map's
    bytes, WAL position and frames are unchanged, it still answers, and the budget survives a restart."""
    budget = 64 * MiB
    with client(tmp_path) as c:
        mid = new_map(c, memory_budget_bytes=budget, max_range_m=1000)
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0, 500), headers=CT).status_code == 200
        before = _seq_and_bytes(c, mid)
        big = scattered(250_000, 900.0)  # the finding: 250 k scattered returns, max_range 1000 m
        with PeakRss() as mem:
            t = time.perf_counter()
            r = c.post(f"/v1/maps/{mid}/frames", content=lidar(big), headers=CT)
            dt = time.perf_counter() - t
        body = check_error(r, 507, "insufficient_storage")
        assert f"budget of {budget} bytes" in body["detail"] and "unchanged" in body["detail"], body
        assert _seq_and_bytes(c, mid) == before  # nothing logged, nothing allocated
        assert mem.grew < 200 * MiB, mem.grew / MiB  # the decoded frame itself is 3 MB; +500 MB before
        assert dt < 10, dt
        q = c.post(f"/v1/maps/{mid}/query/tsdf", json={"points": [[5.9, 0.0, 0.0]]})
        assert q.status_code == 200
        ok = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(1, 500), headers=CT)
        assert ok.status_code == 200 and ok.json()["seq"] == before[0] + 1
        m = c.get("/metrics", headers=auth(READ_TOKEN)).text
        assert metric(m, "mapper_budget_refusals_total", budget="map", map=mid, name=mid) == 1
        assert metric(m, "mapper_map_memory_budget_bytes", map=mid, name=mid) == budget
        assert metric(m, "mapper_map_memory_bytes", map=mid, name=mid) == _seq_and_bytes(c, mid)[1]
    with client(tmp_path) as c:
        s = c.get(f"/v1/maps/{mid}").json()
        assert s["memory_budget_bytes"] == budget and s["last_seq"] == before[0] + 1
        assert s["frames_integrated"] == 2
        check_error(c.post(f"/v1/maps/{mid}/frames", content=lidar(big), headers=CT), 507)


def test_process_budget_covers_all_maps(tmp_path):
    """MAPPER_MEMORY_BUDGET_BYTES bounds all maps together: a frame that fits its map's budget but not
    the process's is refused with 507 naming that setting."""
    with client(tmp_path, memory_budget_bytes=48 * MiB, map_memory_budget_bytes=1 << 40) as c:
        a, b = new_map(c, name="a"), new_map(c, name="b")
        assert c.post(f"/v1/maps/{a}/frames", content=frame_bytes(0, 500), headers=CT).status_code == 200
        before = _seq_and_bytes(c, b)
        body = check_error(
            c.post(f"/v1/maps/{b}/frames", content=lidar(scattered(20_000, 90.0)), headers=CT), 507
        )
        assert "MAPPER_MEMORY_BUDGET_BYTES" in body["detail"] and str(48 * MiB) in body["detail"]
        assert _seq_and_bytes(c, b) == before


def test_growth_bound_holds_on_real_scans():
    """The projected growth is an upper bound on what a frame really adds (real norlab scans, 3 layers)."""
    from mapper.datasets import NorlabLidar

    ds = NorlabLidar("../shared/data/norlab_lidar")
    m = Map(voxel_size_m=0.4, layers=("tsdf", "occupancy", "esdf"), device="cpu", max_range_m=40)
    for i in range(2):
        f = ds[i]
        pts = f["points"][i::16]  # 2.6 k of the 41 k returns: the bound is per ray, the CPU is slow
        g = lidar_growth(m, pts, f["T_world_sensor"])
        cheap = lidar_growth(m, pts, f["T_world_sensor"], room=1e18)  # the bounding-box bound
        assert all(cheap.bricks[k] >= n for k, n in g.bricks.items()) and cheap.bytes >= g.bytes
        b0, n0 = m.bricks, m.nbytes
        m.integrate_lidar(pts, f["T_world_sensor"])
        m.update_esdf()
        for layer, n in m.bricks.items():
            assert n - b0[layer] <= g.bricks[layer], (layer, n - b0[layer], g.bricks)
        assert m.nbytes - n0 <= g.bytes
    assert g.bricks["tsdf"] > 0


def test_growth_bound_holds_on_real_depth_frames():
    """The same for depth frames (3DMatch, real Kinect noise; image and K subsampled 4x for speed)."""
    from mapper.budget import depth_growth
    from mapper.datasets import SevenScenesSequence

    ds = SevenScenesSequence("../shared/data/3dmatch_seq01")
    m = Map(voxel_size_m=0.1, layers=("tsdf", "occupancy", "esdf"), device="cpu")
    for i in range(2):
        f = ds[i]
        depth = np.ascontiguousarray(np.asarray(f["depth_m"])[::4, ::4])
        K = np.asarray(f["K"], float).copy()
        K[:2] /= 4
        g = depth_growth(m, depth, K, f["T_world_sensor"])
        b0, n0 = m.bricks, m.nbytes
        m.integrate_depth(depth, K, f["T_world_sensor"])
        m.update_esdf()
        for layer, n in m.bricks.items():
            assert 0 <= n - b0[layer] <= g.bricks[layer], (layer, n - b0[layer], g.bricks)
        assert m.nbytes - n0 <= g.bytes
    assert m.bricks["tsdf"] > 0


def test_depth_frame_over_budget_is_507(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, voxel_size_m=0.02, memory_budget_bytes=4 * MiB, esdf_max_distance_m=0.1)
        depth = np.full((120, 160), 3.0, np.float32)
        msg = wire.depth_message(depth, [100.0, 100.0, 80.0, 60.0], np.eye(4))
        before = _seq_and_bytes(c, mid)
        check_error(
            c.post(f"/v1/maps/{mid}/frames", content=wire.packb(msg), headers=CT), 507, "insufficient_storage"
        )
        assert _seq_and_bytes(c, mid) == before


def test_import_over_budget_is_507(tmp_path):
    with client(tmp_path / "a") as c:
        mid = new_map(c)
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers=CT).status_code == 200
        data = c.get(f"/v1/maps/{mid}/export").content
    with client(tmp_path / "b") as c:  # the map as imported (no ESDF yet: it is recomputed)
        r = c.post("/v1/maps/import", content=data)
        assert r.status_code == 201
        size = r.json()["memory_bytes"]
    with client(tmp_path / "c", memory_budget_bytes=size - 1) as c:
        body = check_error(c.post("/v1/maps/import", content=data), 507, "insufficient_storage")
        assert f"holds {size} bytes" in body["detail"] and str(size - 1) in body["detail"], body
        assert c.get("/v1/maps").json()["maps"] == []
    with client(tmp_path / "d", memory_budget_bytes=size) as c:
        assert c.post("/v1/maps/import", content=data).status_code == 201


def test_esdf_reach_refused_at_create_or_bounded_per_frame(tmp_path):
    """esdf_max_distance_m=50: at 0.1 m one surface brick's ESDF alone is over the budget -> 413 at
    create, naming the numbers; at 0.25 m the map is created, but the finding's 24 KB frame of 2 k
    points is refused (507) before the ESDF grows."""
    budget = 8 << 30
    bricks, need = esdf_site_domain(0.1, 50.0)
    assert bricks == (2 * math.ceil(501 / 4) + 1) ** 3
    with client(tmp_path, memory_budget_bytes=budget) as c:
        body = check_error(
            c.post("/v1/maps", json={"voxel_size_m": 0.1, "esdf_max_distance_m": 50}),
            413,
            "request_too_large",
        )
        assert f"{bricks} bricks" in body["detail"] and str(budget) in body["detail"], body
        mid = new_map(c, esdf_max_distance_m=50, max_range_m=1000)
        before = _seq_and_bytes(c, mid)
        frame = lidar(scattered(2000, 500.0))
        assert len(frame) < 32_000
        with PeakRss() as mem:
            r = c.post(f"/v1/maps/{mid}/frames", content=frame, headers=CT)
            q = c.post(f"/v1/maps/{mid}/query/distance", json={"points": [[1.0, 2.0, 3.0]]})
        check_error(r, 507, "insufficient_storage", match="esdf")
        assert q.status_code == 200
        assert _seq_and_bytes(c, mid) == before
        assert mem.grew < 64 * MiB, mem.grew / MiB  # was +2.6 GB within 1.4 s


# ---------------------------------------------------------------------------------------------- GPU OOM
def test_device_oom_is_503_and_the_map_survives(tmp_path, monkeypatch):
    """torch.OutOfMemoryError while integrating or reading -> 503 ``out_of_device_memory``; the map keeps
    its earlier frames and answers."""
    from mapper.integrators import tsdf

    with client(tmp_path) as c:
        mid = new_map(c)
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers=CT).status_code == 200
        probe = {"points": [[5.9, 0.0, 0.0], [0.0, 5.9, 0.5]]}
        d0 = c.post(f"/v1/maps/{mid}/query/distance", json=probe).json()["distance"]
        real = tsdf.integrate_lidar

        def oom(*a, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        monkeypatch.setattr(tsdf, "integrate_lidar", oom)
        body = check_error(c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(1), headers=CT), 503)
        assert body["type"] == "out_of_device_memory"
        monkeypatch.setattr(Map, "query_distance", lambda *a, **kw: oom())
        check_error(c.post(f"/v1/maps/{mid}/query/distance", json=probe), 503, "out_of_device_memory")
        monkeypatch.undo()
        assert tsdf.integrate_lidar is real
        assert c.post(f"/v1/maps/{mid}/query/distance", json=probe).json()["distance"] == d0
        assert c.get(f"/v1/maps/{mid}").json()["frames_integrated"] == 1
        assert c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(2), headers=CT).status_code == 200
        assert c.get("/healthz").status_code == 200


# -------------------------------------------------------------------------------------- radius policy
def _brick_far(bricks: torch.Tensor, origin, bm: float) -> torch.Tensor:
    """Brute force: distance from ``origin`` to the nearest point of each brick (numpy per axis)."""
    lo = bricks.double().numpy() * bm
    near = np.clip(np.asarray(origin, float), lo, lo + bm)
    return torch.from_numpy(np.linalg.norm(near - np.asarray(origin, float), axis=1))


def test_keep_radius_frees_bricks_outside_the_latest_pose():
    r = 4.0
    keep = Map(voxel_size_m=0.25, layers=("tsdf", "occupancy", "esdf"), device="cpu", keep_radius_m=r)
    full = Map(voxel_size_m=0.25, layers=("tsdf", "occupancy", "esdf"), device="cpu")
    cleared = 0
    for i in range(0, 40, 10):  # the sensor moves 1 m per frame along x
        pts, T = scan(i, 1500)
        cleared += keep.integrate_lidar(pts, T)["bricks_cleared"]
        assert "bricks_cleared" not in full.integrate_lidar(pts, T)
    keep.update_esdf()
    full.update_esdf()
    origin = T[:3, 3]
    assert cleared > 0
    for name in ("tsdf", "occupancy"):
        kb = keep._require(name) if name != "tsdf" else keep._tsdf
        fb = full._occ if name == "occupancy" else full._tsdf
        kept = kb.brick_table()[0]
        assert bool((_brick_far(kept, origin, 1.0) <= r).all())  # nothing left outside the radius
        allb = fb.brick_table()[0]
        inside = allb[_brick_far(allb, origin, 1.0) <= r]
        assert bool((_brick_far(allb, origin, 1.0) > r).any())  # the policy had work to do
        # the last frame's bricks inside the radius are all there (it was integrated after the clearing)
        kset = {tuple(b) for b in kept.tolist()}
        last_frame = full._last_updated[name]  # what the last frame's integrator returned
        last = {tuple(b) for b in last_frame.tolist()} & {tuple(b) for b in inside.tolist()}
        assert last <= kset
    assert keep.config()["keep_radius_m"] == r
    assert keep.nbytes < full.nbytes


def test_keep_radius_over_http_survives_restart_and_replay(tmp_path):
    with client(tmp_path) as c:
        mid = new_map(c, keep_radius_m=3.0, layers=["tsdf", "esdf"])
        for i in range(0, 30, 10):
            assert (
                c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(i, 1500), headers=CT).status_code == 200
            )
        s = c.get(f"/v1/maps/{mid}").json()
        assert s["config"]["keep_radius_m"] == 3.0
        probe = {"points": np.random.default_rng(0).uniform(-6, 9, (300, 3)).tolist()}
        live = c.post(f"/v1/maps/{mid}/query/tsdf", json=probe, headers={"accept": wire.MSGPACK}).content
        m = c.get("/metrics", headers=auth(READ_TOKEN)).text
        assert f'mapper_keep_radius_m{{map="{mid}",name="{mid}"}} 3.0' in m
        series = f'mapper_radius_cleared_bricks_total{{map="{mid}",name="{mid}"}}'
        line = next(x for x in m.splitlines() if x.startswith(series))
        assert float(line.split()[-1]) > 0
        # a copy of the data directory now holds info.json and the write-ahead log, no snapshot
        shutil.copytree(tmp_path / "data", tmp_path / "copy" / "data")
    assert not list((tmp_path / "copy").rglob("*.safetensors"))
    # the log alone replays the same map: the policy is part of the config
    with client(tmp_path / "copy") as c:
        s2 = c.get(f"/v1/maps/{mid}").json()
        assert s2["frames_integrated"] == 3 and s2["config"]["keep_radius_m"] == 3.0
        again = c.post(f"/v1/maps/{mid}/query/tsdf", json=probe, headers={"accept": wire.MSGPACK}).content
        a, b = wire.unpackb(live), wire.unpackb(again)
        for k in ("tsdf", "weight"):
            x, y = wire.decode_array(a[k], k), wire.decode_array(b[k], k)
            assert np.array_equal(np.nan_to_num(x, nan=-9), np.nan_to_num(y, nan=-9))
        assert s2["stats"]["layers"]["tsdf"]["bricks"] == s["stats"]["layers"]["tsdf"]["bricks"]


def test_clear_in_chunks_equals_one_piece(monkeypatch):
    """Clearing walks the bricks in chunks (it held ~4 KB per brick at once): the same map either way,
    and the same as a brute-force voxel test of the box."""

    def build():
        m = Map(voxel_size_m=0.25, layers=("tsdf", "occupancy"), device="cpu")
        pts, T = scan(0, 1500)
        m.integrate_lidar(pts, T)
        return m

    lo, hi = np.array([-2.0, -3.0, -1.0]), np.array([3.0, 2.5, 0.7])
    one = build()
    one.clear(lo, hi)
    monkeypatch.setattr(map_module, "QUERY_CHUNK", {"cpu": 64 * 3})
    chunked = build()
    chunked.clear(lo, hi)
    for name in ("tsdf", "occupancy"):
        g1, d1 = one.layer(name)
        g2, d2 = chunked.layer(name)
        assert torch.equal(g1.ijk, g2.ijk)
        for k in d1:
            assert torch.equal(torch.nan_to_num(d1[k], nan=-9.0), torch.nan_to_num(d2[k], nan=-9.0))
        c = (g1.ijk.double().numpy() + 0.5) * 0.25
        inside = ((c >= lo) & (c <= hi)).all(axis=1)
        seen = (d1["weight"] > 0) if name == "tsdf" else ~torch.isnan(d1["log_odds"])
        assert inside.any() and not bool(seen[torch.from_numpy(inside)].any())
        assert bool(seen[torch.from_numpy(~inside)].any())

"""Cluster benchmark (``mapper serve --ray``): ingest frames/s and ack latency of C robots streaming into C
maps, then distance-query latency, with 1, 2 and 4 map workers (Ray actors) on this machine. Writes a
markdown report.

    python benchmarks/bench_cluster.py --device cpu --out benchmarks/results/cluster_cpu.md
    python benchmarks/bench_cluster.py --device cuda --out $OUT/cluster_h200.md   # workers share the GPU
    python benchmarks/bench_cluster.py --sharded --out benchmarks/results/cluster_cpu.md   # appends

``--sharded``: one 1 cm map larger than one worker's memory budget (``--budget-mib`` per worker): fed
unsharded it is refused with 507 once it outgrows the budget; split over ``--shards`` workers every frame is
acked, and its answers equal those of a map built here from the same frames without a budget.

A local Ray is started once (small object store, no dashboard); for each worker count the ingress app runs
in this process on a free loopback port (as ``mapper serve --ray`` does) with a fresh data directory (WAL
fsync on). Maps are placed by load, so C maps spread over the workers. Frames are pre-encoded.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_service import hardware, lidar_scan  # noqa: E402

from mapper import wire  # noqa: E402
from mapper.client import MapperClient  # noqa: E402
from mapper.cluster.local import serve_in_thread  # noqa: E402


def run_case(url: str, clients: int, frames: list[bytes], warmup_s: float, measure_s: float, voxel: float):
    with MapperClient(url) as c:
        ids = [
            c.create_map(voxel_size_m=voxel, layers=["tsdf", "esdf"], esdf_max_distance_m=1.0)["id"]
            for _ in range(clients)
        ]
    lat: list[float] = []
    counted = [0]
    t_start = time.monotonic()
    t_meas, t_end = t_start + warmup_s, t_start + warmup_s + measure_s
    lock = threading.Lock()

    errors: list[BaseException] = []

    def robot(map_id: str):
        from websockets.sync.client import connect

        try:
            with connect(url.replace("http", "ws", 1) + f"/v1/maps/{map_id}/stream", max_size=None) as ws:
                sent: list[float] = []
                i = 0
                while time.monotonic() < t_end or sent:
                    if len(sent) < 4 and time.monotonic() < t_end:
                        sent.append(time.monotonic())
                        ws.send(frames[i % len(frames)])
                        i += 1
                        continue
                    ack = wire.unpackb(ws.recv())
                    if "type" in ack:
                        raise RuntimeError(f"error ack: {ack}")
                    done, t0 = time.monotonic(), sent.pop(0)
                    if t0 >= t_meas and t0 < t_end:
                        with lock:
                            lat.append(done - t0)
                            counted[0] += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=robot, args=(m,)) for m in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(measure_s + warmup_s + 300)
    if errors:
        raise errors[0]
    fps = counted[0] / measure_s
    rng = np.random.default_rng(0)
    pts = rng.uniform([-15, -12, -1.5], [15, 12, 2.0], (2000, 3)).astype(np.float32)
    q: list[float] = []
    with MapperClient(url) as c:
        for k in range(60):
            t0 = time.perf_counter()
            c.query_distance(ids[k % len(ids)], pts)
            q.append(time.perf_counter() - t0)
        info = c._request("GET", "/v1/cluster").json()
    per_worker = [len(w.get("maps", [])) for w in info["workers"]]
    return {
        "frames": counted[0],
        "fps": fps,
        "ack_p50": 1e3 * float(np.percentile(lat, 50)) if lat else float("nan"),
        "ack_p99": 1e3 * float(np.percentile(lat, 99)) if lat else float("nan"),
        "q_p50": 1e3 * float(np.percentile(q, 50)),
        "q_p99": 1e3 * float(np.percentile(q, 99)),
        "q_max": 1e3 * max(q),
        "maps_per_worker": per_worker,
    }


def drive_scan(i: int, n: int, step_m: float, radius_m: float = 1.5) -> tuple[np.ndarray, np.ndarray]:
    """A LiDAR-like scan (sensor frame) of a ground disk (``radius_m``, 1 m below) and a wall at 0.8
    ``radius_m`` to the left, from a pose driving ``step_m`` along x per frame: a 1 cm map that grows with
    every frame while each frame stays small."""
    rng = np.random.default_rng(i)
    m = n * 3 // 4
    r = radius_m * np.sqrt(rng.uniform(0.02, 1, m))
    a = rng.uniform(-np.pi, np.pi, m)
    ground = np.stack([r * np.cos(a), r * np.sin(a), np.full(m, -1.0)], 1)
    k = n - m
    wall = np.stack(
        [rng.uniform(-radius_m, radius_m, k), np.full(k, 0.8 * radius_m), rng.uniform(-1, 1.0, k)], 1
    )
    T = np.eye(4)
    T[0, 3] = step_m * i
    return np.concatenate([ground, wall]).astype(np.float32), T


def run_sharded(args) -> str:
    """The sharded-map case (see the module docstring); returns the markdown report."""
    import ray
    import torch

    from mapper import Map, sharding
    from mapper.client import ApiError
    from mapper.cluster.ingress import create_cluster_app
    from mapper.cluster.ray_cluster import start_local_ray
    from mapper.settings import Settings

    budget = args.budget_mib << 20
    scans = [drive_scan(i, args.points, args.step) for i in range(args.frames)]
    cfg = dict(voxel_size_m=args.voxel, layers=["tsdf"])
    start_local_ray(num_cpus=2, namespace="mapper-bench")
    out: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="mapper-shard-bench-") as tmp:
            settings = Settings(
                data_dir=Path(tmp), device="cpu", snapshot_interval_s=0, memory_budget_bytes=budget
            )
            with (
                serve_in_thread(create_cluster_app(settings, workers=args.shards)) as url,
                MapperClient(url) as c,
            ):
                flat = c.create_map(name="unsharded", **cfg)["id"]
                acked, refusal = 0, None
                for pts, T in scans:
                    try:
                        c.send_lidar(flat, pts, T)
                        acked += 1
                    except ApiError as e:
                        refusal = (e.status, e.detail)
                        break
                out["flat"] = {"acked": acked, "refusal": refusal, "bytes": c.get_map(flat)["memory_bytes"]}
                print(out["flat"], flush=True)
                c.delete_map(flat)
                sm = c.create_map(name="sharded", shards=args.shards, shard_block_m=args.block, **cfg)
                lat = []
                for pts, T in scans:
                    t0 = time.perf_counter()
                    c.send_lidar(sm["id"], pts, T)
                    lat.append(time.perf_counter() - t0)
                detail = c.get_map(sm["id"])
                out["sharded"] = {
                    "acked": len(lat),
                    "lat": lat,
                    "shards": [(p["worker"], p["memory_bytes"]) for p in detail["shards"]],
                    "voxels": detail["stats"]["layers"]["tsdf"]["voxels"],
                }
                print(out["sharded"], flush=True)
                ref = Map(**cfg, device="cpu")
                for pts, T in scans:
                    ref.integrate_lidar(pts, T)
                rng = np.random.default_rng(0)
                # points where the trilinear TSDF query is defined (its 8 voxels observed): the common
                # corners of observed voxels of the local map, kept where it answers; plus random points
                g, d = ref.layer("tsdf")
                seen = g.ijk[d["weight"] > 0]
                pick = torch.from_numpy(rng.choice(seen.shape[0], min(400_000, seen.shape[0]), replace=False))
                corners = ((seen[pick].double() + 1) * args.voxel).float()
                corners = corners[ref.query_tsdf(corners)[1] > 0][:20000]
                rand = rng.uniform([-2, -2, -1.1], [args.step * args.frames + 2, 2, 1.1], (5000, 3))
                q = np.concatenate([corners.numpy(), rand.astype(np.float32)])
                t, w = c.query_tsdf(sm["id"], q)
                t_ref, w_ref = (x.numpy() for x in ref.query_tsdf(torch.from_numpy(q)))
                both = (w > 0) & (w_ref > 0)
                out["check"] = {
                    "points": len(q),
                    "shard_owners": [
                        int(x)
                        for x in np.bincount(
                            sharding.owner_of_points(
                                q, args.voxel, args.shards, detail["config"]["shard_block_tiles"]
                            ).numpy(),
                            minlength=args.shards,
                        )
                    ],
                    "observed": int((w_ref > 0).sum()),
                    "weight_mismatch": int(((w > 0) != (w_ref > 0)).sum()),
                    "max_tsdf_diff": float(np.abs(t[both] - t_ref[both]).max()) if both.any() else 0.0,
                    "max_weight_diff": float(np.abs(w - w_ref).max()),
                    "ref_bytes": ref.nbytes,
                    "ref_voxels": ref.stats()["layers"]["tsdf"]["voxels"],
                }
                print(out["check"], flush=True)
    finally:
        ray.shutdown()
    f, sh, ck = out["flat"], out["sharded"], out["check"]
    lat = np.asarray(sh["lat"]) * 1e3
    status = (
        f"refused with {f['refusal'][0]} after {f['acked']} of {args.frames} frames"
        if f["refusal"]
        else (f"NOT refused ({f['acked']} frames acked): raise --frames or lower --budget-mib")
    )
    lines = [
        "# Sharded map larger than one worker's memory budget (mapper serve --ray)",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}; python {platform.python_version()}, ray {ray.__version__}; shared with "
        "other jobs (load varies)",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {args.shards} CPU map workers, each with MAPPER_MEMORY_BUDGET_BYTES = {args.budget_mib} MiB; map "
        f"{args.voxel * 100:g} cm voxels, tsdf only; {args.frames} LiDAR frames of {args.points} points "
        f"(ground disk r = 1.5 m + a wall), driving {args.step:g} m per frame; sharded: K = {args.shards}, "
        f"blocks of {args.block:g} m; frames over HTTP, one after another",
        "",
        "| case | frames acked | map bytes | result |",
        "|---|---|---|---|",
        f"| unsharded | {f['acked']} | {f['bytes'] / 2**20:.1f} MiB at the refusal | {status}: "
        f"`{(f['refusal'] or ('', ''))[1][:160]}` |",
        f"| {args.shards} shards | {sh['acked']} / {args.frames} | "
        + " + ".join(f"{b / 2**20:.1f}" for _, b in sh["shards"])
        + f" = {sum(b for _, b in sh['shards']) / 2**20:.1f} MiB (workers {[w for w, _ in sh['shards']]}) | "
        f"every frame acked; largest shard {max(b for _, b in sh['shards']) / 2**20:.1f} MiB of the "
        f"{args.budget_mib} MiB budget |",
        "",
        f"- sharded ack latency per frame (all its shards): median {np.median(lat):.0f} ms, p99 "
        f"{np.percentile(lat, 99):.0f} ms, max {lat.max():.0f} ms",
        f"- the same frames in one local map without a budget: {ck['ref_bytes'] / 2**20:.1f} MiB for "
        f"{ck['ref_voxels']} TSDF voxels = {ck['ref_bytes'] / max(ck['ref_voxels'], 1):.2f} B per allocated "
        f"voxel (CPU pools); the shards together hold {sh['voxels']} voxels "
        f"({sh['voxels'] / max(ck['ref_voxels'], 1):.2f}x: halos and blocks shared at borders)",
        f"- answers: query_tsdf at {ck['points']} points ({ck['observed']} observed: common corners of "
        f"observed voxels + 5000 random; owned by shards {ck['shard_owners']}) through the ingress vs "
        f"that local map: {ck['weight_mismatch']} observed/unobserved mismatches, max |tsdf diff| "
        f"{ck['max_tsdf_diff']:.3g} m, max |weight diff| {ck['max_weight_diff']:.3g}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--points", type=int, default=4000)
    ap.add_argument("--voxel", type=float, default=0.3)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sharded", action="store_true", help="the sharded-map case instead (module doc)")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--budget-mib", type=int, default=40)
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--block", type=float, default=2.0)
    args = ap.parse_args()
    if args.sharded:
        if args.voxel == 0.3:
            args.voxel = 0.01
        if args.points == 4000:
            args.points = 1500
        text = run_sharded(args)
        print(text)
        if args.out:  # appended: the file keeps the worker-count table
            args.out.parent.mkdir(parents=True, exist_ok=True)
            old = args.out.read_text() if args.out.exists() else ""
            args.out.write_text(old + ("\n" if old else "") + text.replace("# Sharded", "## Sharded", 1))
        return

    import ray

    from mapper.cluster.ingress import create_cluster_app
    from mapper.cluster.ray_cluster import start_local_ray
    from mapper.settings import Settings

    frames = [wire.packb(wire.lidar_message(*lidar_scan(i, args.points), float(i))) for i in range(64)]
    start_local_ray(num_cpus=2, namespace="mapper-bench")
    rows = []
    try:
        for n in [int(x) for x in args.workers.split(",")]:
            with tempfile.TemporaryDirectory(prefix="mapper-cluster-bench-") as tmp:
                settings = Settings(data_dir=Path(tmp), device=args.device, snapshot_interval_s=0)
                t0 = time.perf_counter()
                with serve_in_thread(create_cluster_app(settings, workers=n)) as url:
                    start_s = time.perf_counter() - t0
                    r = run_case(url, args.clients, frames, args.warmup, args.seconds, args.voxel)
                r["workers"], r["start_s"] = n, start_s
                rows.append(r)
                print(r, flush=True)
    finally:
        ray.shutdown()

    cmd = "python " + " ".join(sys.argv)
    lines = [
        "# Cluster benchmark (mapper serve --ray)",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}; python {platform.python_version()}, ray {ray.__version__}",
        f"- command: `{cmd}`",
        f"- {args.clients} robots, one map each (placed by load over the workers), WebSocket window 4, "
        f"{args.points}-point LiDAR frames, voxel {args.voxel} m, tsdf+esdf (ESDF max distance 1 m, eager), "
        "WAL fsync per batch; "
        f"{args.warmup:g} s warm-up, {args.seconds:g} s measured; then 60 distance queries of 2000 points, "
        "one after another, no ingest",
        "",
        "| workers | maps per worker | start (s) | frames | frames/s | ack p50 (ms) | ack p99 (ms) "
        "| query p50 (ms) | query p99 (ms) | query max (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["workers"], r["maps_per_worker"], f"{r['start_s']:.1f}", r["frames"], f"{r['fps']:.2f}"]
        cells += [f"{r[k]:.0f}" for k in ("ack_p50", "ack_p99")]
        cells += [f"{r[k]:.1f}" for k in ("q_p50", "q_p99", "q_max")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()

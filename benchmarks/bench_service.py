"""Service benchmark: sustained ingest (frames/s, ack latency p50/p99) of ~120 k-point LiDAR frames over
WebSocket and HTTP with 1 and N concurrent clients, and distance-query latency (10 k points) under that
ingest load. Writes a markdown report.

    python benchmarks/bench_service.py --device cpu --out benchmarks/results/service_cpu.md
    python benchmarks/bench_service.py --device cuda --out benchmarks/results/service_h200.md   # GPU
    python benchmarks/bench_service.py --cases query --out benchmarks/results/service_query_cpu.md

``--cases query`` runs only the read-latency case (issue 13): distance queries on an idle map, then the
same queries while ``--query-writers`` clients stream into that map; the target is query p99 under load
<= 3 x the idle p50 + 20 ms (reads never wait for a batch: they run on the last published version).

It starts ``mapper serve`` on a free loopback port with a temporary data directory (WAL fsync on, as in
production) unless ``--url`` points at a running server. Each client streams into its own map (a robot
per map; ``--shared-map`` puts all clients on one map). Frames are pre-encoded so the clients measure the
service, not msgpack.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapper import wire  # noqa: E402
from mapper.client import MapperClient  # noqa: E402


def lidar_scan(i: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A spinning-LiDAR-like scan (sensor frame) of a 40 m x 30 m hall with a floor and pillars, and a
    pose that drives along x at 1 m/s at 10 Hz."""
    rng = np.random.default_rng(seed * 100_003 + i)
    az = rng.uniform(-np.pi, np.pi, n)
    el = rng.uniform(-0.3, 0.26, n)  # 32-beam-like vertical field of view
    d = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], 1)
    x0 = 0.1 * i
    with np.errstate(divide="ignore"):
        tx = np.where(d[:, 0] > 0, (20 - x0) / d[:, 0], (-20 - x0) / d[:, 0])
        ty = np.where(d[:, 1] > 0, 15 / d[:, 1], -15 / d[:, 1])
        tz = np.where(d[:, 2] < 0, -1.8 / d[:, 2], np.inf)
    r = np.minimum(np.minimum(tx, ty), tz)
    r *= 1 + rng.normal(0, 0.002, n)
    T = np.eye(4)
    T[0, 3] = x0
    return (d * r[:, None]).astype(np.float32), T


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(device: str, data_dir: str, **env) -> tuple[subprocess.Popen, str]:
    """``mapper serve`` on a free loopback port with ``data_dir`` (``env``: extra ``MAPPER_*`` settings).
    Returns (process, base URL); the caller waits for readiness and terminates it."""
    port = free_port()
    full_env = {
        **os.environ,
        "MAPPER_DEVICE": device,
        "MAPPER_DATA_DIR": data_dir,
        "MAPPER_PORT": str(port),
        "MAPPER_HOST": "127.0.0.1",
        "MAPPER_LOG_LEVEL": "warning",
        **{k: str(v) for k, v in env.items()},
    }
    proc = subprocess.Popen([sys.executable, "-m", "mapper", "serve"], env=full_env)
    return proc, f"http://127.0.0.1:{port}"


def hardware() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    return f"{model}, {os.cpu_count()} cores{gpu}"


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if len(xs) else float("nan")


class Case:
    def __init__(self, name, transport, clients, window=1):
        self.name, self.transport, self.clients, self.window = name, transport, clients, window
        self.lat: list[float] = []
        self.slat: list[float] = []
        self.frames = 0
        self.seconds = 0.0
        self.qlat: list[float] = []
        self.lock = threading.Lock()


def summary(cs: Case) -> str:
    fps = cs.frames / cs.seconds if cs.seconds > 0 else float("nan")
    out = f"  {cs.name}: {fps:.2f} frames/s, ack p50 {pct(cs.lat, 50):.0f} ms, p99 {pct(cs.lat, 99):.0f} ms"
    if cs.qlat:
        out += f"; query p50 {pct(cs.qlat, 50):.1f} ms, p99 {pct(cs.qlat, 99):.1f} ms"
    if cs.slat:
        out += f"; slice p50 {pct(cs.slat, 50):.1f} ms, p99 {pct(cs.slat, 99):.1f} ms"
    return out


def run_client(url, token, map_id, frames, transport, window, stop, warm_until, case: Case):
    lat, count = [], 0
    with MapperClient(url, token=token, timeout=600) as c:
        if transport == "http":
            i = 0
            while not stop.is_set():
                body = frames[i % len(frames)]
                t = time.perf_counter()
                r = c._http.post(
                    f"/v1/maps/{map_id}/frames",
                    content=body,
                    headers={"content-type": wire.MSGPACK, "accept": wire.MSGPACK},
                )
                if r.status_code == 429:
                    time.sleep(0.005)
                    continue
                r.raise_for_status()
                now = time.perf_counter()
                if now >= warm_until:
                    lat.append(now - t)
                    count += 1
                i += 1
        else:
            from websockets.sync.client import connect

            headers = {"Authorization": f"Bearer {token}"} if token else None
            ws_url = "ws" + url[4:] + f"/v1/maps/{map_id}/stream"
            with connect(ws_url, additional_headers=headers, max_size=None) as ws:
                sent: deque = deque()
                i = 0
                while not stop.is_set() or sent:
                    while not stop.is_set() and len(sent) < window:
                        ws.send(frames[i % len(frames)])
                        sent.append(time.perf_counter())
                        i += 1
                    ws.recv()
                    t = sent.popleft()
                    now = time.perf_counter()
                    if now >= warm_until and not stop.is_set():
                        lat.append(now - t)
                        count += 1
    with case.lock:
        case.lat.extend(lat)
        case.frames += count


def run_queries(url, token, map_id, points, stop, warm_until, case: Case):
    with MapperClient(url, token=token, timeout=600) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.query_distance(map_id, points)
            now = time.perf_counter()
            if now >= warm_until:
                case.qlat.append(now - t)


def run_slices(url, token, map_id, cells, stop, warm_until, case: Case):
    """ESDF slices of ``cells`` x ``cells`` (msgpack) at z = 0.5 m over 40 m x 40 m, back to back."""
    params = {"z": 0.5, "format": "msgpack", "x_min": -20.0, "y_min": -20.0, "x_max": 20.0, "y_max": 20.0}
    params["resolution_m"] = 40.0 / cells
    with MapperClient(url, token=token, timeout=600) as c:
        while not stop.is_set():
            t = time.perf_counter()
            r = c._http.get(f"/v1/maps/{map_id}/esdf/slice", params=params)
            r.raise_for_status()
            now = time.perf_counter()
            if now >= warm_until:
                case.slat.append(now - t)


def run_query_case(url, token, args, frames_per_client) -> dict:
    """Idle distance-query latency on a map, then the same queries while ``args.query_writers`` clients
    stream into that map; returns the latencies (s) and the map versions the loaded queries read."""
    layers = args.layers.split(",")
    window = int(str(args.window).split(",")[-1])
    with MapperClient(url, token=token, timeout=600) as c:
        mid = c.create_map(voxel_size_m=args.voxel, layers=layers, max_range_m=100.0)["id"]
        for body in frames_per_client[0][:2]:  # a map with content
            c._http.post(f"/v1/maps/{mid}/frames", content=body, headers={"content-type": wire.MSGPACK})
        qpts = np.random.default_rng(7).uniform([-15, -12, -1.5], [15, 12, 3], (args.query_points, 3))
        body = wire.packb({"points": wire.encode_array(qpts)})
        hdr = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}

        def query():
            t = time.perf_counter()
            r = c._http.post(f"/v1/maps/{mid}/query/distance", content=body, headers=hdr)
            r.raise_for_status()
            return time.perf_counter() - t, int(r.headers.get("x-map-version", -1))

        for _ in range(3):
            query()  # warm-up
        idle = []
        t_end = time.perf_counter() + args.idle_duration
        while time.perf_counter() < t_end:
            idle.append(query()[0])
        case = Case(f"{args.query_writers} writers (ws) on one map", "ws", args.query_writers)
        stop = threading.Event()
        warm_until = time.perf_counter() + args.warmup
        writers = [
            threading.Thread(
                target=run_client,
                args=(url, token, mid, frames_per_client[k], "ws", window, stop, warm_until, case),
            )
            for k in range(args.query_writers)
        ]
        for t in writers:
            t.start()
        loaded, versions = [], []
        t_end = warm_until + args.duration
        while time.perf_counter() < t_end:
            dt, v = query()
            if time.perf_counter() >= warm_until:
                loaded.append(dt)
                versions.append(v)
        stop.set()
        case.seconds = time.perf_counter() - warm_until
        print(  # kept in the log if the caller's time runs out before the report
            f"  idle p50 {pct(idle, 50):.1f} ms; under ingest p50 {pct(loaded, 50):.1f} ms, p99 "
            f"{pct(loaded, 99):.1f} ms ({len(loaded)} queries)",
            file=sys.stderr,
            flush=True,
        )
        for t in writers:
            t.join(600)
        print(summary(case), file=sys.stderr, flush=True)
        c.delete_map(mid)
    return {"idle": idle, "loaded": loaded, "versions": versions, "ingest": case}


def query_report(q: dict, args) -> list[str]:
    idle, loaded, ing = q["idle"], q["loaded"], q["ingest"]
    target = 3 * pct(idle, 50) + 20
    p99 = pct(loaded, 99)
    fps = ing.frames / ing.seconds if ing.seconds > 0 else float("nan")
    v = q["versions"]
    monotonic = all(a <= b for a, b in zip(v, v[1:], strict=False))
    return [
        "",
        f"## Reads under ingest ({args.query_writers} WebSocket writers on the queried map)",
        "",
        "| | queries | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
        f"| idle map | {len(idle)} | {pct(idle, 50):.1f} | {pct(idle, 99):.1f} | {pct(idle, 100):.1f} |",
        f"| under ingest | {len(loaded)} | {pct(loaded, 50):.1f} | {p99:.1f} | {pct(loaded, 100):.1f} |",
        "",
        f"- ingest meanwhile: {ing.frames} frames acked, {fps:.2f} frames/s, "
        f"ack p50 {pct(ing.lat, 50):.0f} ms, p99 {pct(ing.lat, 99):.0f} ms",
        f"- versions read under ingest: {len(set(v))} distinct, "
        f"from {min(v, default=-1)} to {max(v, default=-1)} (never decreasing: {monotonic})",
        f"- target: p99 under load <= 3 x idle p50 + 20 ms = {target:.1f} ms: "
        f"**{'PASS' if p99 <= target else 'FAIL'}** ({p99:.1f} ms)",
    ]


def run_case(url, token, case: Case, args, frames_per_client, queries: bool) -> Case:
    with MapperClient(url, token=token) as c:
        if args.shared_map:
            ids = [
                c.create_map(voxel_size_m=args.voxel, layers=args.layers.split(","), max_range_m=100.0)["id"]
            ]
            ids = ids * case.clients
        else:
            ids = [
                c.create_map(voxel_size_m=args.voxel, layers=args.layers.split(","), max_range_m=100.0)["id"]
                for _ in range(case.clients)
            ]
    stop = threading.Event()
    t0 = time.perf_counter()
    warm_until = t0 + args.warmup
    threads = [
        threading.Thread(
            target=run_client,
            args=(
                url,
                token,
                ids[k],
                frames_per_client[k],
                case.transport,
                case.window,
                stop,
                warm_until,
                case,
            ),
        )
        for k in range(case.clients)
    ]
    if queries:
        qpts = np.random.default_rng(7).uniform([-15, -12, -1.5], [15, 12, 3], (args.query_points, 3))
        threads.append(
            threading.Thread(target=run_queries, args=(url, token, ids[0], qpts, stop, warm_until, case))
        )
        if args.slice_cells:
            threads.append(
                threading.Thread(
                    target=run_slices, args=(url, token, ids[0], args.slice_cells, stop, warm_until, case)
                )
            )
    for t in threads:
        t.start()
    time.sleep(args.warmup + args.duration)
    stop.set()
    case.seconds = time.perf_counter() - warm_until
    for t in threads:
        t.join(600)
    with MapperClient(url, token=token) as c:
        for mid in set(ids):
            c.delete_map(mid)
    return case


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--token", default=os.environ.get("MAPPER_TOKEN"))
    ap.add_argument("--device", default="cpu", help="server device when it is started here (cpu | cuda)")
    ap.add_argument("--voxel", type=float, default=0.2)
    ap.add_argument("--layers", default="tsdf,esdf")
    ap.add_argument(
        "--esdf-update", choices=("eager", "lazy"), default="eager", help="MAPPER_ESDF_UPDATE of the server"
    )
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--clients", default="1,4", help="client counts to run")
    ap.add_argument("--transports", default="ws,http")
    ap.add_argument(
        "--window", default="4", help="frames in flight per WebSocket client (a list: one case per window)"
    )
    ap.add_argument(
        "--slice-cells",
        type=int,
        default=0,
        help="with the query case of the ingest matrix: also ESDF "
        "slices of N x N cells, back to back (0: none)",
    )
    ap.add_argument(
        "--no-query-case",
        dest="query_case",
        action="store_false",
        help="ingest matrix only (no ingest + queries case)",
    )
    ap.add_argument(
        "--no-ingest-matrix",
        dest="ingest_matrix",
        action="store_false",
        help="only the ingest + queries case (no plain ingest cases)",
    )
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server started here")
    ap.add_argument("--query-clients", help="ingest clients of the query case (default: the largest count)")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per case")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--query-points", type=int, default=10_000)
    ap.add_argument("--shared-map", action="store_true")
    ap.add_argument("--distinct-frames", type=int, default=6, help="pre-encoded frames per client (cycled)")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--cases", default="ingest,query", help="ingest (the transport x clients matrix), query")
    ap.add_argument("--query-writers", type=int, default=2, help="writers on the queried map (query case)")
    ap.add_argument("--idle-duration", type=float, default=10.0, help="seconds of idle queries (query case)")
    args = ap.parse_args(argv)

    server = None
    tmp = None
    url = args.url
    if url is None:
        tmp = tempfile.mkdtemp(prefix="bench-service-")
        server, url = start_server(
            args.device,
            tmp,
            MAPPER_SNAPSHOT_INTERVAL_S="0",
            MAPPER_ESDF_UPDATE=args.esdf_update,
            **dict(kv.split("=", 1) for kv in args.env),
        )

        def stopped(signum, frame):  # `timeout`: kill the server too (an orphan would hold the GPU)
            server.kill()
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, stopped)
    try:
        with MapperClient(url, token=args.token) as c:
            c.wait_ready(120)
        counts = [int(x) for x in args.clients.split(",")]
        windows = [int(x) for x in str(args.window).split(",")]
        nmax = max(*counts, args.query_writers, int(args.query_clients or 0))
        todo = args.cases.split(",")
        print(f"encoding {args.distinct_frames} x {nmax} frames of {args.points} points ...", file=sys.stderr)
        frames = [
            [
                wire.packb(wire.lidar_message(*lidar_scan(i, args.points, seed=k), float(i)))
                for i in range(args.distinct_frames)
            ]
            for k in range(nmax)
        ]
        cases = []
        if "ingest" in todo and args.ingest_matrix:
            # HTTP: one frame in flight per client (a POST waits for its ack); WebSocket: `window` in flight
            # (window 1 is the same closed loop as HTTP: the per-message cost of each transport)
            for n in counts:
                for transport in args.transports.split(","):
                    for w in windows if transport == "ws" else [1]:
                        name = f"{transport} x{n}" + (f" (window {w})" if transport == "ws" else "")
                        case = Case(name, transport, n, w)
                        print(f"running {case.name} ...", file=sys.stderr, flush=True)
                        cases.append(run_case(url, args.token, case, args, frames, queries=False))
                        print(summary(case), file=sys.stderr, flush=True)  # kept if a later case times out
        if "ingest" in todo and args.query_case and "esdf" in args.layers.split(","):  # needs the ESDF
            nq = int(args.query_clients or max(counts))
            what = "distance queries" + (f" + {args.slice_cells}^2 slices" if args.slice_cells else "")
            qcase = Case(f"ws x{nq} (window {windows[-1]}) + {what}", "ws", nq, windows[-1])
            print(f"running {qcase.name} ...", file=sys.stderr, flush=True)
            cases.append(run_case(url, args.token, qcase, args, frames, queries=True))
            print(summary(qcase), file=sys.stderr, flush=True)
        qres = None
        if "query" in todo:
            print("running the query case (idle, then under ingest) ...", file=sys.stderr, flush=True)
            qres = run_query_case(url, args.token, args, frames)
        with MapperClient(url, token=args.token) as c:
            ready = c._http.get("/readyz").json()
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "# Service benchmark",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}; server device {ready.get('device')}",
        f"- server settings: {', '.join(args.env) or 'defaults'}",
        f"- command: `python benchmarks/bench_service.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- frames: {args.points} points (float32, {args.points * 12 / 1e6:.2f} MB msgpack), voxel "
        f"{args.voxel} m, layers {args.layers}, one map per client"
        f"{' (shared map)' if args.shared_map else ''}, WAL fsync before each ack, ESDF updated "
        f"{'before each ack (eager)' if args.esdf_update == 'eager' else 'on the next query (lazy)'}; "
        f"WebSocket window {args.window}; {args.warmup:.0f} s warm-up then "
        f"{args.duration:.0f} s measured per case; clients on the same machine as the server",
        "",
    ]
    if cases:
        lines += [
            "| case | frames | frames/s | per client | ack p50 (ms) | ack p99 (ms) | query p50 (ms) "
            "| query p99 (ms) | queries | slice p50 (ms) | slice p99 (ms) | slices |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for cs in cases:
        fps = cs.frames / cs.seconds if cs.seconds > 0 else float("nan")
        q50 = f"{pct(cs.qlat, 50):.1f}" if cs.qlat else "-"
        q99 = f"{pct(cs.qlat, 99):.1f}" if cs.qlat else "-"
        lat = f"{pct(cs.lat, 50):.0f} | {pct(cs.lat, 99):.0f}"
        s50 = f"{pct(cs.slat, 50):.1f}" if cs.slat else "-"
        s99 = f"{pct(cs.slat, 99):.1f}" if cs.slat else "-"
        lines.append(
            f"| {cs.name} | {cs.frames} | {fps:.2f} | {fps / cs.clients:.2f} | {lat} | {q50} | {q99} "
            f"| {len(cs.qlat)} | {s50} | {s99} | {len(cs.slat)} |"
        )
    if cases:
        lines += [
            "",
            f"Query case: {args.query_points} random points per distance query, one query client issuing "
            "back to back while the ingest clients stream. Targets (issue, H200): >= 100 frames/s at 20 cm "
            "from 4 clients, query p99 <= 10 ms under that load.",
        ]
    if qres is not None:
        lines += query_report(qres, args)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()

"""Soak test of the service: a long run with static maps, watching errors, latencies and server memory.

    python benchmarks/soak_service.py --duration 1800 --out benchmarks/results/soak_cpu.md

It starts ``mapper serve`` (CPU by default) on a free loopback port with a temporary data directory
(WAL fsync on, periodic snapshots). ``--writers`` clients replay the same few frames at the same poses
over and over (real norlab LiDAR scans from ``--data``, or simulated ones when absent), half over the
WebSocket stream and half by HTTP POST, so the maps stop growing after the first cycle; ``--readers``
clients query distances, ESDF slices and meshes of those maps back to back. Every few seconds the server's
resident memory (VmRSS) is sampled. The report gives errors by kind, request counts, latencies
(p50/p99/max), RSS at start / 10 min / end (2-minute means) and the growth over the last 20 minutes (the
last two thirds of shorter runs; a Theil-Sen line through the samples). Exit status 1 when there
were errors or the growth exceeds ``--max-growth``.

A 429 (queue full) is backpressure, not an error: the writer retries it and it is counted apart.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_service import hardware, lidar_scan, pct, start_server  # noqa: E402

from mapper import wire  # noqa: E402
from mapper.client import MapperClient  # noqa: E402

TIMEOUT_S = 300.0  # per request: the 2-core CPU is shared, a request waiting longer is an error
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "norlab_lidar"


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def load_frames(data: Path, count: int, points: int) -> tuple[list[bytes], str]:
    """``count`` pre-encoded LiDAR frames (msgpack): norlab scans when ``data`` exists, else simulated."""
    if (data / "icp_odom.csv").exists():
        from mapper.datasets import NorlabLidar

        ds = NorlabLidar(data)
        rng = np.random.default_rng(0)
        out = []
        for i in range(min(count, len(ds))):
            s = ds[i]
            pts = s["points"]
            if points and len(pts) > points:
                pts = pts[rng.choice(len(pts), points, replace=False)]
            msg = wire.lidar_message(pts.astype(np.float32), s["T_world_sensor"], s["timestamp"])
            out.append(wire.packb(msg))
        return out, f"norlab scans ({data}), {len(out)} distinct, {points or 'all'} points each"
    frames = [
        wire.packb(wire.lidar_message(*lidar_scan(i, points or 30_000), float(i))) for i in range(count)
    ]
    return frames, f"simulated scans (bench_service.lidar_scan), {count} distinct, {points} points each"


class Stats:
    """Thread-safe counters: latencies by operation, errors by kind, retries."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.busy = 0
        self.error_examples: list[str] = []

    def ok(self, op: str, seconds: float) -> None:
        with self.lock:
            self.lat[op].append(seconds)

    def error(self, op: str, kind: str, detail: str = "") -> None:
        with self.lock:
            self.errors[f"{op}: {kind}"] += 1
            if len(self.error_examples) < 10:
                self.error_examples.append(f"{op}: {kind} {detail[:200]}")


def http_writer(url, token, map_id, frames, stop: threading.Event, period: float, st: Stats):
    with MapperClient(url, token=token, timeout=TIMEOUT_S) as c:
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            try:
                r = c._http.post(
                    f"/v1/maps/{map_id}/frames",
                    content=frames[i % len(frames)],
                    headers={"content-type": wire.MSGPACK, "accept": wire.MSGPACK},
                )
            except httpx.HTTPError as e:
                st.error("frame/http", type(e).__name__, str(e))
                stop.wait(1.0)
                continue
            if r.status_code == 429:
                with st.lock:
                    st.busy += 1
                stop.wait(0.05)
                continue
            if r.status_code != 200:
                st.error("frame/http", str(r.status_code), r.text)
            else:
                st.ok("frame/http", time.perf_counter() - t)
            i += 1
            stop.wait(max(0.0, period - (time.perf_counter() - t)))


def ws_writer(url, token, map_id, frames, stop: threading.Event, period: float, window: int, st: Stats):
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {token}"} if token else None
    ws_url = "ws" + url[4:] + f"/v1/maps/{map_id}/stream"
    while not stop.is_set():  # one stream per ~minute: connection set-up and teardown are soaked too
        try:
            with connect(ws_url, additional_headers=headers, max_size=None, open_timeout=60) as ws:
                sent: list[float] = []
                until = time.monotonic() + 60
                i = 0
                while (not stop.is_set() and time.monotonic() < until) or sent:
                    if not stop.is_set() and time.monotonic() < until and len(sent) < window:
                        ws.send(frames[i % len(frames)])
                        sent.append(time.perf_counter())
                        i += 1
                        if len(sent) < window:
                            stop.wait(period)
                            continue
                    ack = msgpack.unpackb(ws.recv(timeout=TIMEOUT_S), raw=False)
                    t = sent.pop(0)
                    if "type" in ack:
                        st.error("frame/ws", ack["type"], ack.get("detail", ""))
                    else:
                        st.ok("frame/ws", time.perf_counter() - t)
                        stop.wait(max(0.0, period - (time.perf_counter() - t)))
        except Exception as e:  # a cut stream, a timeout
            st.error("frame/ws", type(e).__name__, str(e))
            stop.wait(1.0)


def reader(url, token, map_id, stop: threading.Event, pause: float, st: Stats, seed: int):
    rng = np.random.default_rng(seed)
    ops = ("distance", "slice", "mesh", "distance", "slice_png", "mesh_since")
    k = seed
    last_version = 0
    with MapperClient(url, token=token, timeout=TIMEOUT_S) as c:
        while not stop.is_set():
            op = ops[k % len(ops)]
            k += 1
            t = time.perf_counter()
            try:
                if op == "distance":
                    c.query_distance(map_id, rng.uniform([-20, -20, -2], [20, 20, 4], (5000, 3)))
                elif op == "slice":
                    c.esdf_slice(map_id, z=float(rng.uniform(-1, 2)), bounds=((-15, -15), (15, 15)))
                elif op == "slice_png":
                    c.esdf_slice_png(map_id, z=0.5, bounds=((-10, -10), (10, 10)))
                elif op == "mesh":
                    last_version = int(c.mesh(map_id)["version"])
                else:
                    c.mesh(map_id, since_version=last_version)
                st.ok(op, time.perf_counter() - t)
            except Exception as e:
                st.error(op, type(e).__name__, str(e))
                stop.wait(1.0)
            stop.wait(pause)


def map_size(c: MapperClient) -> tuple[int, int]:
    """(active voxels, layer bytes): sums of the ``mapper_active_voxels`` and ``mapper_layer_bytes`` gauges
    over every map and layer."""
    total = {"mapper_active_voxels{": 0.0, "mapper_layer_bytes{": 0.0}
    for line in c.metrics().splitlines():
        for k in total:
            if line.startswith(k):
                total[k] += float(line.rsplit(" ", 1)[1])
    return int(total["mapper_active_voxels{"]), int(total["mapper_layer_bytes{"])


PROBES = {  # /metrics series logged next to RSS every sample (mapper.api.memory.MemoryCollector)
    'mapper_malloc_bytes{kind="in_use"}': "in_use",
    'mapper_malloc_bytes{kind="free"}': "free",
    'mapper_malloc_bytes{kind="mmap"}': "mmap",
    "mapper_python_allocated_blocks": "py_blocks",
    "mapper_threads": "threads",
    "mapper_work_running": "running",
    "mapper_work_waiting": "waiting",
    "mapper_work_reserved_bytes": "reserved",
    "mapper_work_memory_budget_bytes": "work_budget",
    "mapper_ws_connections": "ws",
}


def probe(c: MapperClient) -> dict[str, float]:
    """The server's memory probes (PROBES) and its number of metric series (a label explosion shows)."""
    out: dict[str, float] = {"series": 0}
    for line in c.metrics().splitlines():
        if not line or line[0] == "#":
            continue
        out["series"] += 1
        key, _, value = line.rpartition(" ")
        if key in PROBES:
            out[PROBES[key]] = float(value)
        elif key.startswith("mapper_malloc_arena_bytes{"):  # summed over the arenas
            kind = "arena_free" if 'kind="free"' in key else "arena_system"
            out[kind] = out.get(kind, 0.0) + float(value)
            out["arenas"] = out.get("arenas", 0.0) + (kind == "arena_system")
    return out


def growth_window(duration: float) -> tuple[float, float]:
    """(start, end) seconds of the window whose RSS growth is judged: the last 20 minutes of a run of
    30 minutes or more, else its last two thirds."""
    return (duration - 1200.0 if duration >= 1800 else duration / 3), duration


def rss_at(samples: list[tuple[float, int]], t: float, span: float = 120.0) -> float:
    """Mean RSS over the ``span`` seconds starting at ``t`` (ending at the last sample when ``t`` is
    within ``span`` of it): a request in flight moves RSS by ~10 %, a window mean smooths that."""
    t = min(t, samples[-1][0] - span)
    xs = [r for ts, r in samples if t <= ts <= t + span] or [min(samples, key=lambda s: abs(s[0] - t))[1]]
    return float(np.mean(xs))


def run(args) -> dict:
    frames, frames_desc = load_frames(args.data, args.distinct_frames, args.points)
    tmp = tempfile.mkdtemp(prefix="soak-service-")
    env = {"MAPPER_SNAPSHOT_INTERVAL_S": str(args.snapshot_interval_s), **dict(args.env or [])}
    if args.token:
        env["MAPPER_API_TOKENS"] = args.token
    server, url = start_server(args.device, tmp, **env)
    st = Stats()
    samples: list[tuple[float, int]] = []
    probes: list[tuple[float, dict]] = []  # (t, PROBES + requests done so far)
    voxels: list[tuple[float, tuple[int, int]]] = []
    stop = threading.Event()
    try:
        with MapperClient(url, token=args.token) as c:
            c.wait_ready(120)
            n_maps = max(1, (args.writers + 1) // 2)
            ids = [
                c.create_map(voxel_size_m=args.voxel, layers=["tsdf", "esdf"], max_range_m=args.max_range)[
                    "id"
                ]
                for _ in range(n_maps)
            ]
            ready = c._http.get("/readyz").json()
        period = 1.0 / args.writer_hz if args.writer_hz > 0 else 0.0
        threads = []
        for w in range(args.writers):
            mid = ids[w // 2 % n_maps]
            if w % 2 == 0:
                a = (url, args.token, mid, frames, stop, period, args.window, st)
                threads.append(threading.Thread(target=ws_writer, args=a, daemon=True))
            else:
                a = (url, args.token, mid, frames, stop, period, st)
                threads.append(threading.Thread(target=http_writer, args=a, daemon=True))
        for r in range(args.readers):
            a = (url, args.token, ids[r % n_maps], stop, args.reader_pause_s, st, r)
            threads.append(threading.Thread(target=reader, args=a, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        next_voxels = 0.0
        with MapperClient(url, token=args.token) as c:
            while (now := time.monotonic() - t0) < args.duration:
                if server.poll() is not None:
                    st.error("server", f"exited with {server.returncode}")
                    break
                samples.append((now, rss_bytes(server.pid)))
                try:
                    p = probe(c)
                except Exception as e:
                    st.error("metrics", type(e).__name__, str(e))
                    p = {}
                with st.lock:
                    p["requests"] = sum(len(v) for v in st.lat.values())
                p["load"] = os.getloadavg()[0]
                probes.append((now, p))
                if args.log:
                    print(
                        f"{now:.0f} rss={samples[-1][1]} " + " ".join(f"{k}={v:.4g}" for k, v in p.items()),
                        file=args.log,
                        flush=True,
                    )
                if now >= next_voxels:
                    try:
                        voxels.append((now, map_size(c)))
                    except Exception as e:
                        st.error("metrics", type(e).__name__, str(e))
                    next_voxels = now + 60
                if args.progress and len(samples) % max(1, int(60 / args.sample_s)) == 0:
                    n = sum(len(v) for v in st.lat.values())
                    print(
                        f"[{now / 60:5.1f} min] rss {samples[-1][1] / 2**20:7.1f} MiB, {n} requests, "
                        f"{sum(st.errors.values())} errors, map (voxels, bytes) "
                        f"{voxels[-1][1] if voxels else '-'}",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(args.sample_s)
            samples.append((time.monotonic() - t0, rss_bytes(server.pid)))
        elapsed = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(180)
            if t.is_alive():
                st.error("client", "did not finish within 180 s of the stop")
    finally:
        stop.set()
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(120)
            except Exception:
                server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "frames_desc": frames_desc,
        "ready": ready,
        "stats": st,
        "samples": samples,
        "probes": probes,
        "voxels": voxels,
        "elapsed": elapsed,
        "n_maps": n_maps,
    }


def rss_growth(samples: list[tuple[float, int]], w0: float, w1: float) -> tuple[float, float]:
    """(growth over [w0, w1] as a fraction, slope in MiB/min) of a Theil-Sen line (the median of the
    pairwise slopes) through the RSS samples of the window: robust to the ~10 % swings and spikes of the
    requests in flight, which the difference of two samples (or of two short means) is not."""
    tail = [(t, r) for t, r in samples if w0 <= t <= w1]
    if len(tail) < 3:
        return 0.0, 0.0
    t = np.array([x for x, _ in tail]) / 60
    r = np.array([y for _, y in tail]) / 2**20
    i, j = np.triu_indices(len(t), 1)
    slope = float(np.median((r[j] - r[i]) / (t[j] - t[i])))
    start = float(np.median(r - slope * t)) + slope * t[0]
    return slope * (t[-1] - t[0]) / start, slope


def series(probes: list[tuple[float, dict]], *keys: str) -> list[tuple[float, float]]:
    """(t, sum of ``keys``) of the probes that have them all."""
    return [(t, sum(p[k] for k in keys)) for t, p in probes if all(k in p for k in keys)]


def retained(samples, probes) -> list[tuple[float, float]]:
    """(t, RSS - live native heap): what the process holds beyond the live blocks (code, Python's own
    arenas, thread stacks and the free pages malloc keeps). A creep of freed memory shows here; the
    temporaries of the work in flight do not."""
    live = dict(series(probes, "in_use", "mmap"))
    return [(t, r - live[t]) for t, r in samples if t in live]


def mean_growth(xs: list[tuple[float, float]], w0: float, w1: float, span: float = 120.0) -> float:
    """Growth (fraction) between the means over the first and the last ``span`` seconds of [w0, w1]."""
    a, b = rss_at(xs, w0, span), rss_at(xs, w1, span)
    return (b - a) / a if a else 0.0


def report(args, res: dict, argv: list[str]) -> tuple[str, bool]:
    st: Stats = res["stats"]
    samples = res["samples"]
    probes = res.get("probes", [])
    elapsed = res["elapsed"]
    w0, w1 = growth_window(elapsed)
    r0, r1 = rss_at(samples, w0), rss_at(samples, w1)
    growth, slope = rss_growth(samples, w0, w1)
    growth_means = mean_growth(samples, w0, w1)
    n_err = sum(st.errors.values())
    ok = n_err == 0 and growth <= args.max_growth
    mib = 2**20
    live = series(probes, "in_use", "mmap")
    kept = retained(samples, probes)
    loads = [p["load"] for _, p in probes if "load" in p]
    lines = [
        "# Service soak",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}; server device {res['ready'].get('device')}",
        f"- command: `python benchmarks/soak_service.py {' '.join(argv)}`",
        f"- load: {args.writers} writers (half WebSocket with window {args.window}, half HTTP POST; at most "
        f"{args.writer_hz:g} frames/s each) replaying {res['frames_desc']} at the same poses into "
        f"{res['n_maps']} maps (voxel {args.voxel} m, tsdf+esdf, WAL fsync, snapshot every "
        f"{args.snapshot_interval_s:g} s); {args.readers} readers cycling distance queries (5 000 points), "
        f"ESDF slices (msgpack, PNG) and meshes (full, since a version), {args.reader_pause_s:g} s apart",
        f"- duration: {elapsed / 60:.1f} min; RSS and the server's memory probes (/metrics) sampled every "
        f"{args.sample_s:g} s",
        *(
            [
                f"- machine load average (1 min; the 2 cores are shared with other jobs): min "
                f"{min(loads):.1f}, median {np.median(loads):.1f}, max {max(loads):.1f}"
            ]
            if loads
            else []
        ),
        *([f"- note: {args.note}"] if args.note else []),
        "",
        f"**Result: {'PASS' if ok else 'FAIL'}** — {n_err} errors; RSS growth {growth * 100:+.2f} % over "
        f"{w0 / 60:.1f}–{w1 / 60:.1f} min (limit {args.max_growth * 100:.0f} %; Theil-Sen line through "
        f"the samples: {slope:+.2f} MiB/min); from 2-minute means {r0 / mib:.0f} → {r1 / mib:.0f} MiB: "
        f"{growth_means * 100:+.2f} %.",
    ]
    if live:
        g_live, s_live = rss_growth(live, w0, w1)
        g_kept, s_kept = rss_growth(kept, w0, w1)
        lines += [
            "",
            "Where the RSS is (same window, Theil-Sen): live native heap (glibc `mallinfo2` in use + "
            f"mmapped: the maps and the temporaries of the work in flight) {s_live:+.2f} MiB/min "
            f"({g_live * 100:+.2f} %); RSS minus the live heap (code, Python, stacks, free pages kept) "
            f"{s_kept:+.2f} MiB/min ({g_kept * 100:+.2f} %).",
        ]
    lines += [
        "",
        "| server RSS (mean over 2 min from) | MiB |",
        "|---|---|",
        f"| start | {rss_at(samples, 0) / mib:.1f} |",
        f"| 10 min | {rss_at(samples, 600) / mib:.1f} |",
        f"| growth window start ({w0 / 60:.1f} min) | {r0 / mib:.1f} |",
        f"| end (last 2 min) | {r1 / mib:.1f} |",
        f"| max (one sample) | {max(r for _, r in samples) / mib:.1f} |",
        "",
        "| operation | requests | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
    ]
    for op in sorted(st.lat):
        xs = st.lat[op]
        lines.append(f"| {op} | {len(xs)} | {pct(xs, 50):.1f} | {pct(xs, 99):.1f} | {max(xs) * 1e3:.1f} |")
    total = sum(len(v) for v in st.lat.values())
    lines += [
        f"| **all** | {total} | | | |",
        "",
        f"429 (queue full, retried): {st.busy}. Errors by kind: "
        + (", ".join(f"{k} × {v}" for k, v in sorted(st.errors.items())) or "none"),
    ]
    if st.error_examples:
        lines += ["", "Examples:", *[f"- `{e}`" for e in st.error_examples]]
    lines += [
        "",
        "Active voxels / layer MiB (all maps and layers, by minute): "
        + ", ".join(f"{t / 60:.0f}: {v} / {b / mib:.1f}" for t, (v, b) in res["voxels"]),
    ]
    if probes:
        lines += ["", *minute_table(samples, probes, args.sample_s)]
    else:
        lines += [
            "",
            "RSS by half minute (MiB): "
            + ", ".join(f"{t / 60:.1f}: {r / mib:.0f}" for t, r in samples if int(t) % 30 < args.sample_s),
        ]
    return "\n".join(lines) + "\n", ok


def minute_table(samples, probes, sample_s: float) -> list[str]:
    """Per minute: means of RSS, the live native heap, RSS minus it, the work budget's operations running
    and its bytes reserved; the requests completed, the metric series and the load average."""
    mib = 2**20
    rows = [
        "Per minute (means of the samples; live = glibc heap in use + mmapped; arenas = bytes glibc's "
        "malloc arenas hold from the OS and, of those, free (malloc_info); work = heavy operations "
        "running under the work budget; series = metric series on /metrics):",
        "",
        "| min | RSS MiB | live heap MiB | RSS - live MiB | arenas MiB | arenas free MiB | work running "
        "| reserved MiB | requests/min | series | Python blocks (k) | threads | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rss = dict(samples)
    end = max(t for t, _ in probes)
    prev_req = 0.0
    for m in range(int(end // 60) + 1):
        ps = [(t, p) for t, p in probes if m * 60 <= t < (m + 1) * 60]
        if not ps:
            continue

        def avg(key, ps=ps):
            xs = [p[key] for _, p in ps if key in p]
            return float(np.mean(xs)) if xs else float("nan")

        r = np.mean([rss[t] for t, _ in ps if t in rss]) / mib
        lv = np.mean([p["in_use"] + p["mmap"] for _, p in ps if "in_use" in p and "mmap" in p] or [np.nan])
        req = ps[-1][1].get("requests", prev_req)
        rows.append(
            f"| {m} | {r:.0f} | {lv / mib:.0f} | {r - lv / mib:.0f} | {avg('arena_system') / mib:.0f} | "
            f"{avg('arena_free') / mib:.0f} | {avg('running'):.1f} | "
            f"{avg('reserved') / mib:.0f} | {req - prev_req:.0f} | {avg('series'):.0f} | "
            f"{avg('py_blocks') / 1e3:.0f} | {avg('threads'):.0f} | {avg('load'):.1f} |"
        )
        prev_req = req
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--writer-hz", type=float, default=2.0, help="frames/s per writer at most (0: no limit)")
    ap.add_argument("--window", type=int, default=2, help="frames in flight per WebSocket writer")
    ap.add_argument("--reader-pause-s", type=float, default=0.05)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="norlab_lidar folder (else simulated)")
    ap.add_argument("--distinct-frames", type=int, default=4, help="frames replayed in a cycle")
    ap.add_argument("--points", type=int, default=20_000, help="points per frame (subsampled; 0 = all)")
    ap.add_argument("--voxel", type=float, default=0.2)
    ap.add_argument("--max-range", type=float, default=40.0)
    ap.add_argument("--snapshot-interval-s", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    ap.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth (fraction)")
    ap.add_argument("--token", default="soak-token")
    ap.add_argument("--env", nargs=2, action="append", metavar=("NAME", "VALUE"), help="server env var")
    ap.add_argument("--progress", action="store_true", help="a line per minute on stderr")
    ap.add_argument("--note", help="a line for the report (e.g. what else ran on the machine)")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--log", type=argparse.FileType("w"), help="a line per sample: RSS and the probes")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    res = run(args)
    text, ok = report(args, res, argv)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

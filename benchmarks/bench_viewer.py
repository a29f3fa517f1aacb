"""The browser viewer on this machine: headless Chromium with software WebGL (SwiftShader) against a local
``mapper serve`` (normal priority; the load average is reported).

* open: a map whose mesh has about 1 M triangles (the TSDF of a sphere shell written directly, as in
  bench_outputs.py) is served. *Cold*: ``/viewer?map=ID`` on a map the service has not meshed yet (one copy
  of the map per repetition): navigation -> the first frame drawn with the whole mesh
  (``state.meshShownMs``, after ``gl.finish()``), which includes the server's full extraction and encoding.
  *Cached*: the same on a map whose mesh the service holds. ``GET /mesh/blocks`` is also timed with httpx.
* live: a spinning LiDAR (mapper.sim, VLP-16-like by default: 16 beams x 1800 azimuths, +-15 deg, a drive
  through the outdoor scene) streams scans over the WebSocket into a map as fast as the service takes them
  (window 4) while the page shows it (it polls mesh deltas every 100 ms). Counted in a fixed window: frames
  integrated, page updates that carried changes, the delta latency (a frame's ack at the client -> the page
  has applied a delta whose ``X-Map-Version`` includes it, and -> the frame that draws it was submitted), the
  page's apply time (parse + store + upload) and the request round trip of each update.

    python benchmarks/bench_viewer.py --out benchmarks/results/viewer_cpu.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_outputs import shell_map  # noqa: E402

from mapper import sim  # noqa: E402
from mapper.client import MapperClient  # noqa: E402
from mapper.persistence import DataDir  # noqa: E402
from mapper.store import save_new_map  # noqa: E402

ARGS = ["--use-gl=angle", "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--no-sandbox"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(data_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "MAPPER_HOST": "127.0.0.1",
        "MAPPER_PORT": str(port),
        "MAPPER_DATA_DIR": str(data_dir),
        "MAPPER_DEVICE": "cpu",
        "MAPPER_LOG_LEVEL": "warning",
        "MAPPER_ESDF_UPDATE": "lazy",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mapper", "serve"], env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                SERVER_PID[0] = proc.pid
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready: " + log.read_text()[-2000:])


SERVER_PID = [0]


def server_cpu_s() -> float:
    """CPU seconds (user + system, all threads) the service process has used: its cost apart from the
    other jobs on the machine, which stretch the wall times."""
    with open(f"/proc/{SERVER_PID[0]}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def open_page(browser, url, map_id):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{url}/viewer?map={map_id}")
    page.wait_for_function("window.mapperViewer.state.meshShownMs !== undefined", timeout=300_000, polling=50)
    st = "window.mapperViewer.state"
    shown = page.evaluate(f"{st}.meshShownMs")
    client = page.evaluate(f"{st}.meshShownMs - {st}.meshReceivedMs")
    tris = page.evaluate(f"{st}.triangles")
    page.close()
    return shown, client, tris


def bench_open(browser, url, cold_ids, cached_id, reps, rows):
    cold = [open_page(browser, url, i) for i in cold_ids]
    server_ms, sizes, cpu_ms = [], [], []
    for _ in range(reps + 1):
        t, c0 = time.perf_counter(), server_cpu_s()
        r = httpx.get(f"{url}/v1/maps/{cached_id}/mesh/blocks", timeout=300)
        server_ms.append((time.perf_counter() - t) * 1e3)
        if not cpu_ms:
            cpu_ms.append((server_cpu_s() - c0) * 1e3)
        sizes.append(len(r.content))
    cached = [open_page(browser, url, cached_id) for _ in range(reps)]
    tris = cached[0][2]
    rows.append(
        (
            "open, cold: page navigation -> first frame with the mesh",
            [c[0] for c in cold],
            f"{tris:,} triangles",
        )
    )
    rows.append(("open, cached: page navigation -> first frame with the mesh", [c[0] for c in cached], ""))
    rows.append(
        (
            "open: in the page, reply received -> parsed, uploaded, drawn",
            [c[1] for c in cold + cached],
            "SwiftShader",
        )
    )
    mib = f"{statistics.median(sizes) / 2**20:.1f} MiB"
    rows.append(("open: server GET mesh/blocks, first (extract + encode + transfer)", server_ms[:1], mib))
    rows.append(("open: server GET mesh/blocks, again (cached mesh: transfer)", server_ms[1:], mib))
    rows.append(("open: server CPU time of the first GET (extract + encode)", cpu_ms, "CPU, not wall"))


class TimedStream(threading.Thread):
    """Streams scans as fast as the service takes them; records each ack's wall time and map version."""

    def __init__(self, client, map_id, scans):
        super().__init__(daemon=True)
        self.client, self.map_id, self.scans = client, map_id, scans
        self.stop = threading.Event()
        self.acks: list[tuple[float, int, float]] = []  # (wall s, map version, integrate ms)

    def run(self):
        with self.client.stream(self.map_id, window=4) as s:
            recv = s._recv

            def timed(*a, **k):
                msg = recv(*a, **k)
                if "map_version" in msg:
                    self.acks.append(
                        (time.time(), int(msg["map_version"]), float(msg.get("integrate_ms", 0)))
                    )
                return msg

            s._recv = timed
            i = 3
            while not self.stop.is_set():
                pts, T = self.scans[i % len(self.scans)]
                s.send_lidar(pts.numpy(), T.numpy())
                i += 1


def bench_live(browser, url, args, layers, rows, notes):
    label = " + ".join(layers)
    with MapperClient(url) as c:
        m = c.create_map(name="live-" + "-".join(layers), voxel_size_m=args.live_voxel, layers=layers)
        lidar = sim.SpinningLidar(
            n_beams=args.beams, n_azimuth=args.azimuth, fov_up_deg=15.0, fov_down_deg=-15.0, max_range_m=100.0
        )
        scans = list(sim.lidar_sequence(args.scans, lidar=lidar, extent_m=120.0))
        n_pts = statistics.median(int(p.shape[0]) for p, _ in scans)
        for pts, T in scans[:3]:  # a first mesh (one sparse scan may observe no whole cell)
            c.send_lidar(m["id"], pts.numpy(), T.numpy())
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{url}/viewer?map={m['id']}")
        page.wait_for_function("Number(document.body.dataset.triangles || 0) > 0", timeout=120_000)
        if "esdf" in layers:  # the slice shown: the page refreshes it every 2 s while the map changes
            page.wait_for_function("window.mapperViewer.state.sliceFetches > 0", timeout=300_000)
        f0 = c.get_map(m["id"])["stats"]["frames_integrated"]
        stream = TimedStream(c, m["id"], scans)
        w0, c0 = time.time(), server_cpu_s()
        stream.start()
        time.sleep(args.live_seconds)
        w1, c1 = time.time(), server_cpu_s()
        stream.stop.set()
        stream.join(600)
        time.sleep(2.0)  # the page applies the last deltas
        ups = page.evaluate("window.mapperViewer.state.updates")
        slices = page.evaluate("window.mapperViewer.state.sliceFetches")
        f1 = c.get_map(m["id"])["stats"]["frames_integrated"]
        page.close()
    acks = [a for a in stream.acks if w0 <= a[0] <= w1]
    frames = len(acks)
    ups_in = [u for u in ups if w0 * 1e3 <= u["wall"] <= w1 * 1e3]
    wall = w1 - w0
    rate = len(ups_in) / wall
    latency, drawn = [], []
    for t_ack, version, _ in acks:
        u = next((u for u in ups if u["mapVersion"] >= version and u["wall"] >= t_ack * 1e3 - 50), None)
        if u is not None:
            latency.append(u["wall"] - t_ack * 1e3)
            if "drawnWall" in u:
                drawn.append(u["drawnWall"] - t_ack * 1e3)
    nan = [float("nan")]
    rows.append(
        (f"live [{label}]: frame ack -> delta applied in the page", latency or nan, f"{len(latency)} frames")
    )
    rows.append((f"live [{label}]: frame ack -> frame drawn submitted", drawn or nan, ""))
    rows.append(
        (f"live [{label}]: page apply (parse + store + upload)", [u["applyMs"] for u in ups_in] or nan, "")
    )
    rows.append(
        (
            f"live [{label}]: delta request round trip",
            [u["fetchMs"] for u in ups_in] or nan,
            "server mesh + encode",
        )
    )
    rows.append(
        (f"live [{label}]: integrate per frame (ack's integrate_ms)", [a[2] for a in acks] or nan, "server")
    )
    blocks = [u["blocks"] for u in ups_in] or [0]
    kib = [u["bytes"] / 1024 for u in ups_in] or [0]
    notes.append(
        f"live [{label}]: {frames} LiDAR frames ({lidar.n_beams} x {lidar.n_azimuth} rays, median {n_pts} "
        f"returns, voxel {args.live_voxel} m) integrated in {wall:.1f} s = {frames / wall:.2f} frames/s "
        f"({f1 - f0} in all); {len(ups_in)} page updates with changes = {rate:.2f} updates/s; "
        f"per update median "
        f"{statistics.median(blocks):.0f} blocks, {statistics.median(kib):.0f} KiB"
        + (f"; {slices} slice fetches" if "esdf" in layers else "")
        + f"; the service used {c1 - c0:.1f} CPU-s in the {wall:.0f} s ({(c1 - c0) / wall:.2f} cores: "
        f"integration, deltas, encoding, serving); load average now {os.getloadavg()[0]:.1f}"
    )


def bench_cost(args, rows, notes):
    """In process, no service or page: the CPU time (``time.process_time``: what this process used, apart
    from the other jobs on the machine) of each step a live frame costs the service: integration, the
    delta since the previous frame (``Map.mesh(since_version)``) and its block encoding."""
    from mapper.map import Map
    from mapper.viewer import mesh_to_blocks_bytes

    lidar = sim.SpinningLidar(
        n_beams=args.beams, n_azimuth=args.azimuth, fov_up_deg=15.0, fov_down_deg=-15.0, max_range_m=100.0
    )
    m = Map(args.live_voxel, layers=("tsdf",), device="cpu")
    cost = {"integrate": [], "delta": [], "encode": []}
    blocks, faces, version = [], [], None
    for i, (pts, T) in enumerate(sim.lidar_sequence(args.cost_frames, lidar=lidar, extent_m=120.0)):
        t = time.process_time()
        m.integrate_lidar(pts, T)
        t1 = time.process_time()
        mesh = m.mesh() if version is None else m.mesh(since_version=version)
        t2 = time.process_time()
        mesh_to_blocks_bytes(mesh)
        t3 = time.process_time()
        version = mesh.version
        if i >= 2:  # the first frames build the map (and compile nothing on the CPU)
            cost["integrate"].append((t1 - t) * 1e3)
            cost["delta"].append((t2 - t1) * 1e3)
            cost["encode"].append((t3 - t2) * 1e3)
            blocks.append(mesh.blocks.shape[0] + mesh.removed_blocks.shape[0])
            faces.append(mesh.num_faces)
    for k, v in cost.items():
        rows.append((f"cost per frame, CPU time, 1 thread: {k}", v, "tsdf, in process"))
    per = statistics.median([a + b + c for a, b, c in zip(*cost.values(), strict=True)])
    notes.append(
        f"cost: {len(blocks)} frames after 2; a delta re-meshes "
        f"median {statistics.median(blocks):.0f} blocks "
        f"({statistics.median(faces):.0f} faces); integrate + delta + encode = {per:.0f} CPU-ms per frame, "
        f"i.e. at most {1e3 / per:.1f} frames/s with meshed deltas on one core"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=float, default=2.4e6, help="TSDF voxels of the sphere shell (~1 M tris)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--live-seconds", type=float, default=30.0)
    ap.add_argument("--live-voxel", type=float, default=0.15, help="voxel size of the live map (m)")
    ap.add_argument("--beams", type=int, default=16)
    ap.add_argument("--azimuth", type=int, default=1800)
    ap.add_argument("--scans", type=int, default=40, help="scans of the simulated drive (then looped)")
    ap.add_argument(
        "--live-layers", default="tsdf", help="';'-separated layer sets of the live runs (tsdf;tsdf,esdf)"
    )
    ap.add_argument("--cost-frames", type=int, default=12, help="in-process cost frames (0: skip)")
    ap.add_argument("--skip-open", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    tmp = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    rows, notes = [], [f"load average at start: {os.getloadavg()[0]:.1f} (2 cores)"]
    if args.cost_frames:
        bench_cost(args, rows, notes)
    m = shell_map(args.voxels, 0.05, torch.device("cpu"))
    data = DataDir(tmp / "data")
    ids = (
        []
        if args.skip_open
        else [save_new_map(data, m, name=f"sphere{i}")["id"] for i in range(args.reps + 1)]
    )
    del m
    proc, url = serve(tmp / "data", tmp / "server.log")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS, headless=True)
            if ids:
                bench_open(browser, url, ids[1:], ids[0], args.reps, rows)
                notes.append(f"load average after open: {os.getloadavg()[0]:.1f}")
            for layers in args.live_layers.split(";"):
                if layers:
                    bench_live(browser, url, args, layers.split(","), rows, notes)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    notes.append(f"load average at end: {os.getloadavg()[0]:.1f}")
    chrome = subprocess.run([chromium, "--version"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# bench_viewer (cpu, headless Chromium, software WebGL)",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- hardware: {platform.machine()}; CPU threads: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}, {chrome}, SwiftShader",
        f"- command: `python benchmarks/bench_viewer.py {' '.join(sys.argv[1:])}`",
        "",
        "| case | median ms | p99 ms | max ms | note |",
        "|---|---|---|---|---|",
    ]
    for name, xs, note in rows:
        xs = [x for x in xs if x == x] or [float("nan")]
        lines.append(f"| {name} | {statistics.median(xs):.0f} | {pct(xs, 99):.0f} | {max(xs):.0f} | {note} |")
    lines += [""] + [f"- {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

"""The browser viewer on this machine: headless Chromium with software WebGL (SwiftShader) against a local
``mapper serve``.

* open: a map whose mesh has about 1 M triangles (the TSDF of a sphere shell written directly, as in
  bench_outputs.py) is served. ``GET /mesh/blocks`` is timed with httpx: the first request extracts and
  encodes, later ones get the service's cached mesh. Then each repetition opens ``/viewer?map=ID`` in a
  fresh page and reads the time from navigation to the first frame drawn with the whole mesh
  (``state.meshShownMs``, after ``gl.finish()``), and the part spent in the page after the reply arrived.
* live: a simulated spinning LiDAR (mapper.sim) streams scans over the WebSocket into a second map while the
  page shows it; the page's mesh updates (delta replies that changed blocks) are counted, with the frames the
  service integrated in the same window.

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
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready: " + log.read_text()[-2000:])


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def bench_open(browser, url, map_id, reps, rows):
    server_ms, sizes = [], []
    for _ in range(reps):
        t = time.perf_counter()
        r = httpx.get(f"{url}/v1/maps/{map_id}/mesh/blocks", timeout=300)
        server_ms.append((time.perf_counter() - t) * 1e3)
        sizes.append(len(r.content))
    page_ms, client_ms, tris = [], [], 0
    for _ in range(reps):
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{url}/viewer?map={map_id}")
        page.wait_for_function(
            "window.mapperViewer.state.meshShownMs !== undefined", timeout=300_000, polling=50
        )
        st = "window.mapperViewer.state"
        page_ms.append(page.evaluate(f"{st}.meshShownMs"))
        client_ms.append(page.evaluate(f"{st}.meshShownMs - {st}.meshReceivedMs"))
        tris = page.evaluate("window.mapperViewer.state.triangles")
        page.close()
    rows.append(
        ("open: page navigation -> first frame with the mesh (cached)", page_ms, f"{tris:,} triangles")
    )
    rows.append(("open: in the page, reply received -> parsed, uploaded, drawn", client_ms, "SwiftShader"))
    mib = f"{statistics.median(sizes) / 2**20:.1f} MiB"
    rows.append(("open: server GET mesh/blocks, first (extract + encode + transfer)", server_ms[:1], mib))
    rows.append(("open: server GET mesh/blocks, again (cached mesh: transfer)", server_ms[1:], mib))


def bench_live(browser, url, seconds, rows, notes):
    with MapperClient(url) as c:
        m = c.create_map(name="live", voxel_size_m=0.2, layers=["tsdf", "occupancy", "esdf"])
        lidar = sim.SpinningLidar(n_beams=16, n_azimuth=512)
        scans = list(sim.lidar_sequence(40, lidar=lidar, extent_m=120.0))
        c.send_lidar(m["id"], scans[0][0].numpy(), scans[0][1].numpy())
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{url}/viewer?map={m['id']}")
        page.wait_for_function("Number(document.body.dataset.triangles || 0) > 0", timeout=120_000)
        stop = threading.Event()
        sent = [0]

        def stream():
            with c.stream(m["id"], window=4) as s:
                i = 1
                while not stop.is_set():
                    pts, T = scans[i % len(scans)]
                    s.send_lidar(pts.numpy(), T.numpy())
                    sent[0] += 1
                    i += 1

        f0 = c.get_map(m["id"])["stats"]["frames_integrated"]
        t0 = page.evaluate("performance.now()")
        th = threading.Thread(target=stream)
        w0 = time.perf_counter()
        th.start()
        time.sleep(seconds)
        t1 = page.evaluate("performance.now()")
        wall = time.perf_counter() - w0
        ups = page.evaluate(f"window.mapperViewer.state.updates.filter(u => u.t >= {t0} && u.t <= {t1})")
        stop.set()
        th.join()
        f1 = c.get_map(m["id"])["stats"]["frames_integrated"]
        page.close()
    times = [u["t"] for u in ups]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    rate = len(ups) / ((t1 - t0) / 1e3)
    frames = f1 - f0
    rows.append(
        (
            "live: interval between mesh updates in the page",
            gaps or [float("nan")],
            f"{rate:.1f} updates/s over {wall:.0f} s",
        )
    )
    blocks = [u["blocks"] for u in ups] or [0]
    kib = [u["bytes"] / 1024 for u in ups] or [0]
    notes.append(
        f"live: {frames} LiDAR frames ({lidar.n_beams} x {lidar.n_azimuth} rays, voxel 0.2 m, "
        f"tsdf + occupancy + esdf, lazy ESDF) integrated in {wall:.1f} s = {frames / wall:.1f} "
        f"frames/s; {len(ups)} mesh updates = {rate:.1f} updates/s; per update median "
        f"{statistics.median(blocks):.0f} blocks, {statistics.median(kib):.0f} KiB"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxels", type=float, default=2.4e6, help="TSDF voxels of the sphere shell (~1 M tris)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--live-seconds", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    tmp = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    m = shell_map(args.voxels, 0.05, torch.device("cpu"))
    info = save_new_map(DataDir(tmp / "data"), m, name="sphere")
    proc, url = serve(tmp / "data", tmp / "server.log")
    rows, notes = [], [f"load average at start: {os.getloadavg()[0]:.1f} (2 cores)"]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS, headless=True)
            bench_open(browser, url, info["id"], args.reps, rows)
            bench_live(browser, url, args.live_seconds, rows, notes)
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
        f"- hardware: {platform.machine()}; CPU threads: {os.cpu_count()}; shared with other jobs",
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

"""Memory of reads and the frame growth bound (issue 10), on the CPU.

1. Peak resident memory of ``Map.esdf_slice`` per cell, in one piece (the old path: ``QUERY_CHUNK`` set
   beyond the cell count) and in chunks (the default), each in a fresh subprocess.
2. ``mapper.budget.lidar_growth`` on real norlab scans: its time and its bound against the bricks and
   bytes a frame really adds.

    python benchmarks/bench_memory_bounds.py [--cells 250000 1000000] [--out results/memory_bounds_cpu.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SLICE_CHILD = r"""
import json, sys, threading, time
import numpy as np, torch
torch.set_num_threads(1)
from mapper import Map
from mapper import map_reads as map_module
from mapper.budget import rss_bytes
cells, chunked = int(sys.argv[1]), sys.argv[2] == "1"
if not chunked:
    map_module.QUERY_CHUNK = {"cpu": 1 << 40}
m = Map(voxel_size_m=0.25, layers=("tsdf", "esdf"), device="cpu")
rng = np.random.default_rng(0)
az = rng.uniform(-np.pi, np.pi, 3000)
pts = np.stack([6 * np.cos(az), 6 * np.sin(az), rng.uniform(-1, 2, 3000)], 1).astype(np.float32)
m.integrate_lidar(pts, np.eye(4)); m.update_esdf()
m.esdf_slice(0.0, (-1, -1), (1, 1), resolution_m=0.1)
n = int(round(cells ** 0.5))
peak = [rss_bytes()]; start = peak[0]; stop = [False]
def watch():
    while not stop[0]:
        peak[0] = max(peak[0], rss_bytes()); time.sleep(0.002)
t = threading.Thread(target=watch); t.start()
t0 = time.perf_counter()
m.esdf_slice(0.0, (-50, -50), (50, 50), resolution_m=100 / n)
dt = time.perf_counter() - t0
stop[0] = True; t.join()
print(json.dumps({"cells": n * n, "chunked": chunked, "peak_mb": (peak[0] - start) / 2**20, "s": dt}))
"""


def slice_rows(cells_list):
    rows = []
    for cells in cells_list:
        for chunked in (False, True):
            out = subprocess.run(
                [sys.executable, "-c", SLICE_CHILD, str(cells), "1" if chunked else "0"],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def growth_rows(frames: int):
    import torch

    torch.set_num_threads(1)
    from mapper import Map
    from mapper.budget import lidar_growth
    from mapper.datasets import NorlabLidar

    ds = NorlabLidar(ROOT.parent / "shared" / "data" / "norlab_lidar")
    rows = []
    for vox, layers in (
        (0.2, ("tsdf", "esdf")),
        (0.2, ("tsdf", "occupancy", "esdf")),
        (0.4, ("tsdf", "esdf")),
    ):
        m = Map(voxel_size_m=vox, layers=layers, device="cpu", max_range_m=80)
        for i in range(frames):
            f = ds[i]
            times = []
            for _ in range(3):
                t = time.perf_counter()
                g = lidar_growth(m, f["points"], f["T_world_sensor"])
                times.append(time.perf_counter() - t)
            b0, n0 = m.bricks, m.nbytes
            m.integrate_lidar(f["points"], f["T_world_sensor"])
            m.update_esdf()
            real = {k: v - b0[k] for k, v in m.bricks.items()}
            rows.append(
                (vox, "+".join(layers), i, sorted(times)[1] * 1e3, g.bricks, real, g.bytes, m.nbytes - n0)
            )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, nargs="+", default=[250_000, 1_000_000])
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = [
        "# Memory bounds (issue 10), CPU",
        "",
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, 1 torch thread; "
        f"`python benchmarks/bench_memory_bounds.py {' '.join(sys.argv[1:])}`",
        "",
        "## ESDF slice: peak resident memory (each run in a fresh process)",
        "| cells | path | peak MB | B/cell | s |",
        "|---|---|---|---|---|",
    ]
    for r in slice_rows(a.cells):
        path = "chunked" if r["chunked"] else "one piece (old)"
        per_cell = r["peak_mb"] * 2**20 / r["cells"]
        lines.append(f"| {r['cells']} | {path} | {r['peak_mb']:.0f} | {per_cell:.0f} | {r['s']:.1f} |")
    lines += [
        "",
        "## Frame growth bound on norlab scans (41 k points; median of 3 timings)",
        "| voxel | layers | frame | bound ms | bound bricks | real bricks | bound bytes | real bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for vox, layers, i, ms, gb, rb, gbytes, rbytes in growth_rows(a.frames):
        lines.append(f"| {vox} | {layers} | {i} | {ms:.0f} | {gb} | {rb} | {gbytes} | {rbytes} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()

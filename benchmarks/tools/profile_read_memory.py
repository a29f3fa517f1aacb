"""Peak working memory (glibc heap bytes in use above the resting heap) of each request kind of the soak
(benchmarks/soak_service.py), in process on the CPU, on the soak's maps (norlab scans, 0.2 m, tsdf+esdf).

    python benchmarks/tools/profile_read_memory.py [--out benchmarks/results/read_memory_cpu.md]

A thread samples ``mallinfo2`` every ~1 ms while one operation runs alone (torch releases the GIL); the
peak minus the heap in use before it is the operation's working set. It is what the service's read
budget (``MAPPER_READ_MEMORY_BYTES``, mapper.api.memory.ReadBudget) reserves per read.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_service import hardware  # noqa: E402
from soak_service import DEFAULT_DATA  # noqa: E402

from mapper import io, render, wire  # noqa: E402
from mapper.api import memory  # noqa: E402
from mapper.datasets import NorlabLidar  # noqa: E402
from mapper.map import Map  # noqa: E402


def _live() -> int:
    """Bytes of live native heap blocks: in the arenas plus mmapped."""
    h = memory.heap_info()
    return h["in_use"] + h["mmap"]


def peak_in_use(fn, period_s: float = 0.001) -> tuple[int, float]:
    """(peak heap bytes in use above the start while ``fn()`` runs, seconds)."""
    memory.trim()
    base = _live()
    peak = base
    done = threading.Event()

    def watch():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _live())
            time.sleep(period_s)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        fn()
    finally:
        dt = time.perf_counter() - t
        done.set()
        th.join()
    return max(0, peak - base), dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--voxel", type=float, default=0.2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if memory.heap_info() is None:
        print("needs glibc >= 2.33 (mallinfo2)")
        return 1
    ds = NorlabLidar(args.data)
    rng = np.random.default_rng(0)
    frames = []
    for i in range(4):
        s = ds[i]
        pts = s["points"]
        if len(pts) > args.points:
            pts = pts[rng.choice(len(pts), args.points, replace=False)]
        frames.append((pts.astype(np.float32), s["T_world_sensor"]))
    m = Map(voxel_size_m=args.voxel, layers=["tsdf", "esdf"], max_range_m=40.0)
    for p, T in frames:
        m.integrate_lidar(p, T)
    m.update_esdf()
    qrng = np.random.default_rng(1)
    box = ([-20, -20, -2], [20, 20, 4])

    def slice_(half):
        return m.esdf_slice(0.5, aabb_min_xy=(-half, -half), aabb_max_xy=(half, half))

    ops = {
        "frame (integrate, replayed pose)": lambda: m.integrate_lidar(*frames[0]),
        "ESDF update after one frame": lambda: (m.integrate_lidar(*frames[1]), m.update_esdf()),
        "distance query (5 000 points)": lambda: m.query_distance(qrng.uniform(*box, (5000, 3))),
        "slice msgpack (30 x 30 m)": lambda: wire.packb({"d": np.asarray(slice_(15).distance)}),
        "slice PNG (20 x 20 m)": lambda: render.slice_to_png(
            slice_(10), max_distance_m=m.esdf_max_distance_m
        ),
        "mesh (whole, msgpack)": lambda: wire.packb(io.mesh_to_msgpack_dict(m.mesh())),
        "mesh since a version": lambda: wire.packb(
            io.mesh_to_msgpack_dict(m.mesh(since_version=m.version - 1))
        ),
    }
    stats = m.stats()
    tsdf_vox = stats["layers"]["tsdf"]["voxels"]
    rows = []
    for name, fn in ops.items():
        res = [peak_in_use(fn) for _ in range(args.repeat)]
        peak = max(r[0] for r in res)
        rows.append((name, peak, float(np.median([r[1] for r in res]))))
        print(f"{name}: peak {peak / 2**20:.1f} MiB, {rows[-1][2] * 1e3:.0f} ms", flush=True)
    lines = [
        "# Working memory per request kind (CPU, in process)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}",
        f"- command: `python benchmarks/tools/profile_read_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}`",  # noqa: E501
        f"- map: 4 norlab scans, {args.points} points each, voxel {args.voxel} m, tsdf+esdf; {tsdf_vox} TSDF "
        f"voxels; heap in use at rest {memory.heap_info()['in_use'] / 2**20:.0f} MiB",
        f"- peak = max over {args.repeat} runs of (glibc heap in use, sampled every ~1 ms) - (in use before)",
        "",
        "| operation | peak working set (MiB) | per TSDF voxel (B) | median time (ms) |",
        "|---|---|---|---|",
    ]
    for name, peak, dt in rows:
        lines.append(f"| {name} | {peak / 2**20:.1f} | {peak / tsdf_vox:.1f} | {dt * 1e3:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

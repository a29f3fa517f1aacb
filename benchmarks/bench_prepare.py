"""The host work of the one way in, per frame, before a frame reaches its map's writer
(``MapEntry.prepare`` on a decode thread): msgpack decode, ``wire.parse_frame`` (the one validation), the
WAL record, the memory-growth bound (``mapper.budget.lidar_growth``). Median and minimum of ``--reps`` (on a
shared, loaded machine the minimum is the cost, the median includes waiting for a core); markdown report.

    python benchmarks/bench_prepare.py --out benchmarks/results/prepare_cpu.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit, frame_args, lidar_frame  # noqa: E402

from mapper import Map, budget, store, wire  # noqa: E402


def main(argv=None) -> None:
    ap = frame_args(__doc__)
    ap.add_argument("--voxel", type=float, default=0.1)
    ap.add_argument("--columns", type=int, default=3, help="point columns: 3 (x, y, z) or 4 (+ intensity)")
    args = ap.parse_args(argv)
    data = lidar_frame(args.points, args.columns)
    m = Map(args.voxel, layers=("tsdf", "esdf"), device="cpu", max_range_m=100.0)
    limits = wire.Limits(1 << 24, 1 << 26, 1 << 24, 1e6)

    def med(fn):
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            out = fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return out, (float(np.median(ts)), min(ts))

    msg, t_unpack = med(lambda: wire.unpackb(data))
    frame, t_parse = med(lambda: wire.parse_frame(wire.unpackb(data), limits))
    _, t_record = med(lambda: store.encode_record("frame", frame))
    _, t_bound = med(lambda: budget.lidar_growth(m, frame.points, frame.T_world_sensor, 1 << 40))
    rows = [
        ("msgpack decode", t_unpack),
        ("decode + wire.parse_frame (validation)", t_parse),
        ("WAL record (store.encode_record)", t_record),
        ("growth bound (budget.lidar_growth)", t_bound),
    ]
    lines = [
        f"- frame: {args.points} points x {args.columns} ({len(data)} bytes msgpack), voxel {args.voxel} m, "
        "tsdf+esdf",
        "",
        "| step | median (ms) | min (ms) |",
        "|---|---|---|",
        *[f"| {name} | {ms[0]:.1f} | {ms[1]:.1f} |" for name, ms in rows],
    ]
    emit("The one way in: host work per frame before the writer", "bench_prepare.py", argv, lines, args.out)


if __name__ == "__main__":
    main()

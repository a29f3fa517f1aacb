"""What permessage-deflate costs a WebSocket LiDAR stream: one ~120 k-point frame (msgpack, as a client sends
it) deflated as a client would (zlib level 6, raw, sync flush) and inflated as the server does, on its event
loop, for every frame. Median and max of ``--reps`` runs; writes a markdown report.

    python benchmarks/bench_ws_deflate.py --out benchmarks/results/ws_deflate_cpu.md
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import emit, frame_args, lidar_frame  # noqa: E402


def main(argv=None) -> None:
    ap = frame_args(__doc__)
    args = ap.parse_args(argv)
    msg = lidar_frame(args.points)
    comp_ms, infl_ms, size = [], [], 0
    for _ in range(args.reps):
        c = zlib.compressobj(6, zlib.DEFLATED, -15)
        t = time.perf_counter()
        comp = c.compress(msg) + c.flush(zlib.Z_SYNC_FLUSH)
        comp_ms.append((time.perf_counter() - t) * 1e3)
        d = zlib.decompressobj(-15)
        t = time.perf_counter()
        out = d.decompress(comp)
        infl_ms.append((time.perf_counter() - t) * 1e3)
        assert out == msg
        size = len(comp)
    lines = [
        f"- frame: {args.points} points, {len(msg)} bytes msgpack -> {size} bytes deflated "
        f"({size / len(msg):.3f})",
        "",
        "| | median (ms) | max (ms) |",
        "|---|---|---|",
        f"| deflate (client, per frame) | {np.median(comp_ms):.1f} | {max(comp_ms):.1f} |",
        f"| inflate (server event loop, per frame) | {np.median(infl_ms):.1f} | {max(infl_ms):.1f} |",
    ]
    emit("permessage-deflate on a LiDAR frame", "bench_ws_deflate.py", argv, lines, args.out)


if __name__ == "__main__":
    main()

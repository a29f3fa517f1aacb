"""Cost of the service's read versions (issue 13): per frame, the time to publish a copy-on-write read view
(``Map.read_view``), the bytes the next frame copies because the view shares them (page copy-on-write), and
the frame time (integration + ESDF update) with a view published after every frame vs without.

    python benchmarks/bench_read_views.py --device cpu --out benchmarks/results/read_views_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_service import hardware, lidar_scan  # noqa: E402

from mapper import Map  # noqa: E402
from mapper.api.service import _layers_of  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(args, views: bool) -> dict:
    dev = torch.device(args.device)
    m = Map(args.voxel, layers=tuple(args.layers.split(",")), device=dev, max_range_m=100.0)
    frames = [lidar_scan(i, args.points) for i in range(args.frames)]
    frame_s, publish_s, cow, cow_s, view = [], [], [], [], None
    for i, (pts, T) in enumerate(frames):
        before = sum(la.pool.cow_bytes for la in _layers_of(m))
        before_s = sum(la.pool.cow_seconds for la in _layers_of(m))
        sync(dev)
        t = time.perf_counter()
        m.integrate_lidar(pts, T)
        if "esdf" in m.layers:
            m.update_esdf()
        sync(dev)
        t1 = time.perf_counter()
        if views:
            view = m.read_view()  # the previous view is dropped here (no reader holds it)
            sync(dev)
        t2 = time.perf_counter()
        if i >= args.warmup:
            frame_s.append(t1 - t)
            publish_s.append(t2 - t1)
            cow.append(sum(la.pool.cow_bytes for la in _layers_of(m)) - before)
            cow_s.append(sum(la.pool.cow_seconds for la in _layers_of(m)) - before_s)
    del view
    return {"frame": frame_s, "publish": publish_s, "cow": cow, "cow_s": cow_s, "map_bytes": m.nbytes}


def stats(xs, scale=1e3) -> str:
    a = np.asarray(xs) * scale
    return f"{np.median(a):.2f} | {np.percentile(a, 99):.2f} | {a.max():.2f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--voxel", type=float, default=0.2)
    ap.add_argument("--layers", default="tsdf,esdf")
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    base = run(args, views=False)
    cow = run(args, views=True)
    mb = cow["map_bytes"] / 2**20
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    cow_mb = np.asarray(cow["cow"]) / 2**20
    lines = [
        "# Read views: the cost of publishing a version per frame",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}; device {args.device}, torch {torch.__version__}",
        f"- command: `python benchmarks/bench_read_views.py {cmd}`",
        f"- {args.frames} frames of {args.points} points (bench_service's hall, driving 0.1 m per frame), "
        f"voxel {args.voxel} m, layers {args.layers}; first {args.warmup} frames not counted; map at the end "
        f"{mb:.1f} MiB",
        "",
        "| | median | p99 | max |",
        "|---|---|---|---|",
        f"| frame (integrate + ESDF), no views (ms) | {stats(base['frame'])} |",
        f"| frame (integrate + ESDF), a view published after each frame (ms) | {stats(cow['frame'])} |",
        f"| publish: `read_view()` (ms) | {stats(cow['publish'])} |",
        f"| pages copied by the next frame (MiB) | {stats(cow_mb, 1)} |",
        f"| time copying them, inside the frame (ms{'; CUDA: launch only' if args.device != 'cpu' else ''}) "
        f"| {stats(cow['cow_s'])} |",
        "",
        f"Copy-on-write copied {cow_mb.mean():.1f} MiB per frame on average "
        f"({100 * cow_mb.mean() / max(mb, 1e-9):.0f} % of the map): the pages a frame writes while the "
        "published view still shares them; that memory is held until no reader holds the previous view. "
        "The frame-time difference (views vs none) is the copy time plus noise (the machine is shared).",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()

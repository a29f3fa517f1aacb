"""CPU cost of the occupancy frame path, this tree against the previous path (``bench_occ_ab``'s patches),
interleaved in one process on the same frames (issue 12's budget: the CPU path at most +10 %).

Per round and variant a fresh CPU map integrates the same LiDAR frames; the time is the process CPU time
(``time.process_time``: the shared machine's load swings wall times) of each frame, rounds alternate
``new, old, old, new, ...`` so a drift in the load hits both. Reported: per variant the median over rounds of
the per-round total, and the ratio.

  python benchmarks/bench_occ_cpu_ab.py --beams 64 --frames 2 --rounds 3 --voxel 0.1 --out r.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_occ_ab import restore_previous_path  # noqa: E402

from mapper import Map, sim  # noqa: E402


def run(frames, voxel: float) -> list[float]:
    m = Map(voxel, layers=("occupancy",), device=torch.device("cpu"), max_range_m=60.0)
    out = []
    for pts, T in frames:
        t = time.process_time()
        m.integrate_lidar(pts, T, track=False)
        out.append(time.process_time() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--beams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--voxel", type=float, default=0.1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lidar = sim.SpinningLidar(n_beams=args.beams, range_noise_std_m=0.01)
    frames = list(sim.lidar_sequence(args.frames, lidar=lidar))
    totals = {"new": [], "old": []}
    order = []
    for r in range(args.rounds):
        order += ["new", "old"] if r % 2 == 0 else ["old", "new"]
    for v in order:
        undo = restore_previous_path() if v == "old" else (lambda: None)
        try:
            t = run(frames, args.voxel)
        finally:
            undo()
        totals[v].append(sum(t))
        print(f"{v}: {sum(t):.2f} s CPU ({', '.join(f'{x:.2f}' for x in t)})", flush=True)
    med = {v: statistics.median(x) for v, x in totals.items()}
    lines = [
        "# Occupancy frame path on the CPU: this tree vs the previous path (bench_occ_cpu_ab.py)",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC; {platform.machine()}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {args.frames} LiDAR frames ({args.beams} x 1875 rays, {frames[0][0].shape[0]} points in #0), "
        f"occupancy at {args.voxel} m, fresh map per round; process CPU time; order {' '.join(order)}",
        "",
        "| variant | per-round totals (s CPU) | median |",
        "|---|---|---|",
        *(f"| {v} | {', '.join(f'{x:.2f}' for x in totals[v])} | {med[v]:.2f} |" for v in ("new", "old")),
        "",
        f"new / old = {med['new'] / med['old']:.3f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

"""CPU A/B of the LiDAR TSDF path between two trees (issue 12: "CPU timings must not regress by more than
10 %"): the scan's rays and bands (``lidar_rays``: the normal fit and the band rule) and whole frames
(``Map.integrate_lidar``, 10 cm), on a 64 x 1875 = 120 k-return scan of a box room (floor, four walls: the
grazing floor is the case the normal fit is for). Each measurement is **process CPU time** of a child
process (1 thread) with ``PYTHONPATH`` at one tree, trees alternating per round, so the other jobs of a
loaded machine shift both alike; the report gives per tree the median over rounds of each round's median.

  python benchmarks/bench_lidar_cpu_ab.py --base /tmp/base --new . --rounds 3 --out r.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from mapper import Map
from mapper.integrators.tsdf import TsdfConfig, lidar_rays
sys.path.insert(0, sys.argv[1])
from count_frame_ops import _box_scan, _pose
reps, frames = int(sys.argv[2]), int(sys.argv[3])
pts = [_box_scan(64, 1875, k) for k in range(frames)]
cfg = TsdfConfig(voxel_size_m=0.1)
T = _pose(0)
w = pts[0].double() @ T[:3, :3].T + T[:3, 3]
o = T[:3, 3].clone()
lidar_rays(o, w, cfg)
ts = []
for _ in range(reps):
    t = time.process_time(); lidar_rays(o, w, cfg); ts.append((time.process_time() - t) * 1e3)
m = Map(0.1, layers=("tsdf",), max_range_m=60.0)
fs = []
for k in range(frames):
    t = time.process_time(); m.integrate_lidar(pts[k], _pose(k), track=False)
    fs.append((time.process_time() - t) * 1e3)
print(json.dumps({"rays": statistics.median(ts), "frame": statistics.median(fs[1:] or fs)}))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--frames", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools")  # count_frame_ops
    res: dict[str, list[dict]] = {"base": [], "new": []}
    for r in range(a.rounds):
        for tag in ("base", "new") if r % 2 == 0 else ("new", "base"):
            tree = os.path.abspath(a.base if tag == "base" else a.new)
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", MAPPER_KERNELS="torch")
            cmd = [sys.executable, "-c", CHILD, here, str(a.reps), str(a.frames)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            res[tag].append(json.loads(out.strip().splitlines()[-1]))
            print(r, tag, res[tag][-1], flush=True)
    lines = [
        "# LiDAR TSDF on the CPU: this tree vs a base tree (process CPU time)",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC; host: {platform.node()}, "
        f"{os.cpu_count()} CPUs (shared with other jobs: loaded), 1 thread",
        f"- command: `{' '.join(['python', 'benchmarks/bench_lidar_cpu_ab.py', *(argv or sys.argv[1:])])}`",
        f"- {a.rounds} rounds, trees alternating; per round the median of {a.reps} `lidar_rays` calls and of "
        f"frames 2..{a.frames} of a fresh 10 cm map; 120 k returns",
        "",
        "| measure | base median (ms) | new median (ms) | new / base | rounds base | rounds new |",
        "|---|---|---|---|---|---|",
    ]
    for k in ("rays", "frame"):
        b = [x[k] for x in res["base"]]
        n = [x[k] for x in res["new"]]
        mb, mn = statistics.median(b), statistics.median(n)
        fmt = ", ".join
        lines.append(
            f"| {k} | {mb:.1f} | {mn:.1f} | {mn / mb:.3f} | {fmt(f'{x:.0f}' for x in b)} | "
            f"{fmt(f'{x:.0f}' for x in n)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()

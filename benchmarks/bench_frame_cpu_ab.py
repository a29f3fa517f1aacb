"""CPU cost of the frame path, for A/B runs of two trees on a loaded machine (issue 12: "CPU timings must not
regress by more than 10 %").

Per case a fresh map takes ``--frames`` frames (``--warmup`` first ones not counted); each frame's cost is the
**process CPU time** (``time.process_time``: 1 thread, so the other jobs of a shared machine do not inflate
it the way they inflate wall time). Run it once per tree with ``PYTHONPATH`` pointing at that tree, in
alternation, and compare the medians.

Usage: PYTHONPATH=<tree> OMP_NUM_THREADS=1 python benchmarks/bench_frame_cpu_ab.py --label new --json r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mapper
from mapper import Map, sim


def _lidar(n):
    lidar = sim.SpinningLidar(n_beams=16, n_azimuth=1875, range_noise_std_m=0.01)
    return list(sim.lidar_sequence(n, lidar=lidar))


def _depth(n):
    cam = sim.PinholeCamera(320, 240, 260.0, 260.0, 160.0, 120.0)
    return list(sim.depth_sequence(n, cam, max_range_m=8.0))


CASES = {
    "lidar_tsdf_10cm": (lambda: Map(0.1, layers=("tsdf",), max_range_m=60.0), "lidar"),
    "occupancy_10cm": (lambda: Map(0.1, layers=("occupancy",), max_range_m=60.0), "lidar"),
    "depth_tsdf_2cm": (lambda: Map(0.02, layers=("tsdf",), max_range_m=8.0), "depth"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--label", default="run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kinds = {CASES[c][1] for c in args.cases}
    data = {k: (_lidar if k == "lidar" else _depth)(args.frames) for k in kinds}
    out = {"label": args.label, "tree": mapper.__file__, "torch": torch.__version__}
    for case in args.cases:
        make, kind = CASES[case]
        m = make()
        ts = []
        for i, f in enumerate(data[kind]):
            t = time.process_time()
            if kind == "lidar":
                m.integrate_lidar(f[0], f[1], track=False)
            else:
                m.integrate_depth(*f)
            if i >= args.warmup:
                ts.append((time.process_time() - t) * 1e3)
        out[case] = {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "n": len(ts)}
        med = out[case]["median_ms"]
        print(f"{args.label} {case}: median {med:.1f} ms (min {min(ts):.1f}, max {max(ts):.1f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()

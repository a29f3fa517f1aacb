"""Kernel-level profile of the grid operators on the GPU (torch.profiler), for finding where time goes.

python benchmarks/tools/profile_ops.py --sizes 1e8 5e8 --ops dilate prune
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_topology
from bench_topology import HALF_WIDTH, radius_for  # noqa: E402

from mapper.synthetic import narrow_band_shell, voxel_phi  # noqa: E402


def profile_size(n: float, names: list[str], rows: int) -> None:
    r = radius_for(n)
    g = narrow_band_shell("sphere", r, HALF_WIDTH, device="cuda")
    g2 = narrow_band_shell("sphere", r, HALF_WIDTH, device="cuda", center=(5.25, 2.5, 2.125))
    keep = voxel_phi("sphere", g, r).abs() <= 1
    ops = {
        "dilate": lambda: g.dilated_grid(1, 26),
        "prune": lambda: g.pruned_grid(keep),
        "merge": lambda: g.merged_grid(g2),
    }
    for name in names:
        fn = ops[name]
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(
            f"\n=== {name} @ {g.num_voxels / 1e6:.0f}M voxels, {g.num_leaves} leaves: wall {wall:.2f} ms/call"
        )
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e8])
    ap.add_argument("--ops", nargs="+", default=["dilate", "prune", "merge"])
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    for n in args.sizes:
        profile_size(n, args.ops, args.rows)


if __name__ == "__main__":
    main()

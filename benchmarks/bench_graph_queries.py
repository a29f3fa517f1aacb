"""The distance query (10 k points) and the ESDF slice (1000 x 1000): time per call and what one call
launches, to decide whether a CUDA graph (``mapper.graphs``) would pay for them.

A map of an orbit of 640 x 480 depth frames around the simulated room (TSDF + ESDF, ``--voxel``), its ESDF
brought up to date; then ``Map.query_distance`` on ``--points`` random points in the room and
``Map.esdf_slice`` at mid height over the room's box at ``--pixels`` x ``--pixels``, both with
``update_esdf=False`` (reads only), each timed ``--reps`` times (wall clock, device synchronised around
the call: median, p99, max), then one call of each under the torch profiler (kernel launches, host syncs,
GPU busy time).

    python benchmarks/bench_graph_queries.py --device cuda --out benchmarks/results/graph_queries_h200.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import row, timing_head, wall  # noqa: E402

from mapper import Map, sim  # noqa: E402


def profile(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if "LaunchKernel" in e.key)
    syncs = sum(e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    copies = sum(e.count for e in ev if "Memcpy" in e.key)
    busy = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3
    return f"{launches} launches, {syncs} syncs, {copies} memcpys, GPU busy {busy:.3f} ms"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--voxel", type=float, default=0.05)
    ap.add_argument("--frames", type=int, default=10)
    ap.add_argument("--points", type=int, default=10_000)
    ap.add_argument("--pixels", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    lines = timing_head(f"bench_graph_queries ({args.device})", dev, note_column="one call")
    scene = sim.indoor_scene(0, device=dev)
    cam = sim.PinholeCamera(640, 480, 525.0, 525.0, 319.5, 239.5)
    poses = sim.orbit_trajectory(args.frames, scene=scene)
    m = Map(args.voxel, layers=("tsdf", "esdf"), device=dev)
    for i in range(args.frames):
        m.integrate_depth(cam.render_depth(scene, poses[i].to(dev)), cam.K, poses[i])
    m.update_esdf()
    lo, hi = m._esdf_bounds(False)
    lo, hi = lo.to(torch.float64).cpu(), hi.to(torch.float64).cpu()
    gen = torch.Generator().manual_seed(0)
    pts = (lo + (hi - lo) * torch.rand((args.points, 3), generator=gen, dtype=torch.float64)).float().to(dev)
    z = float((lo[2] + hi[2]) / 2)
    res = float((hi[:2] - lo[:2]).max()) / args.pixels
    lo_xy = (float(lo[0]), float(lo[1]))
    hi_xy = (lo_xy[0] + res * args.pixels - res / 2, lo_xy[1] + res * args.pixels - res / 2)
    cases = [
        (f"query_distance, {args.points:,} points", lambda: m.query_distance(pts, update_esdf=False)),
        (
            f"esdf_slice {args.pixels} x {args.pixels}",
            lambda: m.esdf_slice(z, lo_xy, hi_xy, resolution_m=res, update_esdf=False),
        ),
    ]
    for name, fn in cases:
        fn()
        ts = [wall(fn, dev)[0] for _ in range(args.reps)]
        lines.append(row(name, ts, profile(fn) if dev.type == "cuda" else ""))
        print(lines[-1], flush=True)
    shape = m.esdf_slice(z, lo_xy, hi_xy, resolution_m=res, update_esdf=False).distance.shape
    vox = m.stats()["layers"]["tsdf"]["voxels"] / 1e6
    lines += ["", f"slice shape {tuple(shape)}; map {vox:.2f} M voxels"]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Map outputs: mesh extraction (full, and incremental after one LiDAR frame), point queries and ESDF slices.

* mesh: TSDF maps of ~1 M / 10 M / 100 M voxels (the truncated SDF of a sphere shell written directly into
  the layer, all voxels of the band bricks observed); full ``Map.mesh()``; then one simulated LiDAR frame
  (64 beams, 120 k points, street scene placed beside the sphere) is integrated and
  ``Map.mesh(since_version)`` timed;
* queries: a LiDAR TSDF + ESDF map (simulated street, ``--query-frames`` frames); ``query_distance`` /
  ``query_tsdf`` / ``query_occupancy`` on 10^3, 10^5, 10^6 random points in the map's box;
* slice: ``esdf_slice`` of 1000 x 1000 pixels.

Times: CUDA events (GPU) / perf_counter (CPU), median of ``--reps`` after one warm-up call.
Usage: python benchmarks/bench_outputs.py --device cuda --mesh-sizes 1e6 1e7 1e8 --out results.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import statistics
import sys
import time

import torch

from mapper import Map, sim


def timed(fn, dev: torch.device, reps: int):
    fn()
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def shell_map(n_voxels: float, voxel: float, dev: torch.device) -> Map:
    """A TSDF map whose band bricks hold about n voxels: a sphere of the matching radius."""
    m = Map(voxel, layers=("tsdf",), device=dev, max_range_m=80.0)
    tau = m.tsdf_config.tau
    bs = 4 * voxel
    # a band of 2 bricks around the sphere: 4 pi r^2 * 2 bs / voxel^3 voxels
    r = math.sqrt(n_voxels * voxel**3 / (4 * math.pi * 2 * bs))
    rb = int(math.ceil((r + bs) / bs)) + 1
    layer = m._tsdf
    o = torch.arange(64, device=dev)
    local = torch.stack((o >> 4, (o >> 2) & 3, o & 3), 1)
    for i0 in range(-rb, rb + 1, 32):  # slabs bound the temporaries
        ax = torch.arange(-rb, rb + 1, device=dev)
        sl = torch.arange(i0, min(i0 + 32, rb + 1), device=dev)
        b = torch.stack(torch.meshgrid(sl, ax, ax, indexing="ij"), -1).reshape(-1, 3)
        c = (b.double() + 0.5) * bs
        b = b[(torch.linalg.vector_norm(c, dim=1) - r).abs() < bs * 0.9]
        if b.shape[0] == 0:
            continue
        slots = layer.allocate(b)
        centres = ((b[:, None] * 4 + local[None]).double() + 0.5) * voxel
        d = (torch.linalg.vector_norm(centres, dim=2) - r).clamp(-tau, tau)
        layer.pool.scatter("tsdf", slots, d)
        layer.pool.scatter("weight", slots, torch.ones_like(d))
    return m


def bench_mesh(args, dev, rows):
    lidar = sim.SpinningLidar()
    for n in args.mesh_sizes:
        m = shell_map(n, args.mesh_voxel, dev)
        st = m.stats()["layers"]["tsdf"]
        ms_full = timed(lambda m=m: m.mesh(), dev, args.reps)
        mesh = m.mesh()
        # one LiDAR frame of a street placed inside the map's extent
        scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
        T = sim.driving_trajectory(1, scene=scene)[0]
        pts = lidar.scan(scene, T.to(dev))
        v0 = mesh.version
        m.integrate_lidar(pts, T)
        ms_inc = timed(lambda m=m, v0=v0: m.mesh(since_version=v0), dev, args.reps)
        delta = m.mesh(since_version=v0)
        rows.append(
            {
                "case": f"mesh full, {st['voxels'] / 1e6:.1f} M TSDF voxels",
                "ms": ms_full,
                "note": f"{mesh.faces.shape[0]:,} triangles",
            }
        )
        rows.append(
            {
                "case": f"mesh incremental after 1 LiDAR frame ({st['voxels'] / 1e6:.1f} M map)",
                "ms": ms_inc,
                "note": f"{delta.faces.shape[0]:,} triangles in {delta.blocks.shape[0]:,} blocks",
            }
        )
        for r in rows[-2:]:
            print(fmt(r), flush=True)
        del m, mesh, delta
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_queries(args, dev, rows):
    scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
    lidar = sim.SpinningLidar()
    m = Map(args.query_voxel, layers=("tsdf", "occupancy", "esdf"), device=dev, max_range_m=60.0)
    for T in sim.driving_trajectory(args.query_frames, scene=scene):
        m.integrate_lidar(lidar.scan(scene, T.to(dev)), T)
    t0 = time.perf_counter()
    m.update_esdf()
    print(
        f"# query map: {m.stats()['layers']['esdf']['voxels']:,} ESDF voxels "
        f"(built in {time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    bricks, _ = m._tsdf.brick_table()
    lo = bricks.min(0).values.double() * 4 * m.voxel_size_m
    hi = (bricks.max(0).values + 1).double() * 4 * m.voxel_size_m
    for n in args.query_points:
        p = lo + torch.rand((int(n), 3), dtype=torch.float64, device=dev) * (hi - lo)
        for name, fn in (
            ("query_distance", m.query_distance),
            ("query_tsdf", m.query_tsdf),
            ("query_occupancy", m.query_occupancy),
        ):
            ms = timed(lambda fn=fn, p=p: fn(p), dev, args.reps)
            rows.append({"case": f"{name}, {int(n):,} points", "ms": ms, "note": ""})
            print(fmt(rows[-1]), flush=True)
    c = (lo + hi) / 2
    half = 500 * m.voxel_size_m
    ms = timed(
        lambda: m.esdf_slice(
            float(c[2]), [float(c[0]) - half, float(c[1]) - half], [float(c[0]) + half, float(c[1]) + half]
        ),
        dev,
        args.reps,
    )
    rows.append({"case": "esdf_slice 1000 x 1000", "ms": ms, "note": ""})
    print(fmt(rows[-1]), flush=True)


def fmt(r):
    return f"| {r['case']} | {r['ms']:.3f} | {r['note']} |"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", nargs="+", default=["mesh", "queries"])
    ap.add_argument("--mesh-sizes", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--mesh-voxel", type=float, default=0.1)
    ap.add_argument("--query-voxel", type=float, default=0.1)
    ap.add_argument("--query-frames", type=int, default=10)
    ap.add_argument("--query-points", type=float, nargs="+", default=[1e3, 1e5, 1e6])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    head = [
        f"# bench_outputs ({args.device})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "| case | median ms | note |",
        "|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows = []
    if "mesh" in args.parts:
        bench_mesh(args, dev, rows)
    if "queries" in args.parts:
        bench_queries(args, dev, rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(head) + "\n" + "\n".join(fmt(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()

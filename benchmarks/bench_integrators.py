"""Per-frame integration cost of the map layers on simulated sequences (and Open3D's VoxelBlockGrid).

Sections (``--parts``):
* ``lidar``: LiDAR TSDF and occupancy on a KITTI-like drive through ``mapper.sim.outdoor_scene``
  (64 beams x 1875 azimuths = 120 k rays, 60 m range, 10 Hz at 10 m/s), one map per voxel size;
* ``depth``: depth TSDF on 1200x680 frames (the Replica camera) orbiting ``mapper.sim.indoor_scene``;
* ``esdf``: ESDF cold (fresh integrator on the final LiDAR TSDF map), incremental after one more frame,
  and a call with nothing changed;
* ``open3d``: Open3D 0.20 ``t.geometry.VoxelBlockGrid`` (CPU, block resolution 8, float32 tsdf/weight)
  on the same depth frames.

Frames are generated on the device (the GPU machine receives no data). Per-frame times are CUDA-event
(GPU) or perf_counter (CPU) medians over the frames after ``--warmup`` frames; each integrate call is
timed whole (grow + merge + inject + update, host syncs included). Peak memory = the map's bytes at the
end plus the largest transient allocation of a frame (GPU: ``torch.cuda.max_memory_allocated``).

Usage: python benchmarks/bench_integrators.py --device cuda --frames 500 --out results.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time

import torch

from mapper import Map, sim


class FrameTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b), torch.cuda.max_memory_allocated() - base
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, 0


def run_sequence(m: Map, frames, kind: str, timer: FrameTimer, warmup: int):
    times, transient = [], 0
    for i, f in enumerate(frames):
        if kind == "lidar":
            ms, extra = timer(lambda f=f: m.integrate_lidar(f[0], f[1]))
        else:
            ms, extra = timer(lambda f=f: m.integrate_depth(f[0], f[1], f[2]))
        if i >= warmup:
            times.append(ms)
        transient = max(transient, extra)
    return times, transient


def layer_row(m: Map, name: str, times, transient, label: str) -> dict:
    st = m.stats()["layers"][name]
    return {
        "case": label,
        "frames": len(times),
        "median_ms": statistics.median(times) if times else float("nan"),
        "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] if times else float("nan"),
        "voxels": st["voxels"],
        "observed": st.get("observed_voxels"),
        "map_mb": st["bytes"] / 2**20,
        "peak_mb": (st["bytes"] + transient) / 2**20,
        "peak_b_per_voxel": (st["bytes"] + transient) / max(st["voxels"], 1),
    }


def bench_lidar(args, dev, timer, rows, keep_maps):
    scene = sim.outdoor_scene(0, extent_m=args.extent, device=dev)
    lidar = sim.SpinningLidar()
    poses = sim.driving_trajectory(args.frames + args.warmup, scene=scene)
    frames = [(lidar.scan(scene, T.to(dev)), T) for T in poses]
    pts = statistics.mean(f[0].shape[0] for f in frames)
    print(f"# lidar: {len(frames)} frames, {pts:.0f} points/frame", flush=True)
    for vs in args.lidar_voxels:
        for layer in args.lidar_layers:
            if layer == "occupancy" and vs < args.min_occupancy_voxel:
                continue
            m = Map(vs, layers=(layer,), device=dev, max_range_m=60.0)
            n = len(frames) if layer == "tsdf" else min(len(frames), args.occupancy_frames + args.warmup)
            times, transient = run_sequence(m, frames[:n], "lidar", timer, args.warmup)
            rows.append(layer_row(m, layer, times, transient, f"lidar {layer} {vs * 100:.0f} cm"))
            print(fmt(rows[-1]), flush=True)
            if layer == "tsdf" and abs(vs - args.esdf_voxel) < 1e-9:
                keep_maps["lidar"] = (m, frames)
            else:
                del m
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def depth_frames(args, dev):
    scene = sim.indoor_scene(0, device=dev)
    cam = sim.PinholeCamera.replica()
    poses = sim.orbit_trajectory(args.depth_frames + args.warmup, scene=scene)
    return [(cam.render_depth(scene, T.to(dev), max_range_m=10.0), cam.K, T) for T in poses]


def bench_depth(args, dev, timer, rows):
    frames = depth_frames(args, dev)
    print(f"# depth: {len(frames)} frames of 1200x680", flush=True)
    for vs in args.depth_voxels:
        m = Map(vs, layers=("tsdf",), device=dev, max_range_m=10.0)
        times, transient = run_sequence(m, frames, "depth", timer, args.warmup)
        rows.append(layer_row(m, "tsdf", times, transient, f"depth tsdf {vs * 1000:.0f} mm"))
        print(fmt(rows[-1]), flush=True)
        del m
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_esdf(args, dev, timer, rows, keep_maps):
    if "lidar" not in keep_maps:
        return
    m, frames = keep_maps["lidar"]
    from mapper.integrators.esdf import EsdfIntegrator

    # cold: a fresh integrator over the final TSDF (every brick dirty)
    m._esdf = EsdfIntegrator(m.voxel_size_m, m.esdf_max_distance_m, m.device)
    bricks, _ = m._tsdf.brick_table()
    m._surface_queue.parts = [bricks]
    ms, extra = timer(m.update_esdf)
    st = m._esdf.stats()
    rows.append(
        {
            "case": f"esdf cold {m.voxel_size_m * 100:.0f} cm",
            "frames": 1,
            "median_ms": ms,
            "p90_ms": ms,
            "voxels": st["voxels"],
            "observed": None,
            "map_mb": st["bytes"] / 2**20,
            "peak_mb": (st["bytes"] + extra) / 2**20,
            "peak_b_per_voxel": (st["bytes"] + extra) / max(st["voxels"], 1),
        }
    )
    print(fmt(rows[-1]), flush=True)
    inc = []
    for f in frames[-args.esdf_frames :]:
        m.integrate_lidar(f[0], f[1])
        inc.append(timer(m.update_esdf)[0])
    rows.append(
        {
            "case": "esdf incremental (after 1 LiDAR frame)",
            "frames": len(inc),
            "median_ms": statistics.median(inc),
            "p90_ms": max(inc),
            "voxels": m._esdf.stats()["voxels"],
            "observed": None,
            "map_mb": m._esdf.stats()["bytes"] / 2**20,
            "peak_mb": float("nan"),
            "peak_b_per_voxel": float("nan"),
        }
    )
    print(fmt(rows[-1]), flush=True)
    noop = [timer(m.update_esdf)[0] for _ in range(20)]
    rows.append(
        {
            "case": "esdf update, nothing changed",
            "frames": len(noop),
            "median_ms": statistics.median(noop),
            "p90_ms": max(noop),
            "voxels": m._esdf.stats()["voxels"],
            "observed": None,
            "map_mb": float("nan"),
            "peak_mb": float("nan"),
            "peak_b_per_voxel": float("nan"),
        }
    )
    print(fmt(rows[-1]), flush=True)


def bench_open3d(args, rows):
    try:
        import open3d as o3d
        import open3d.core as o3c
    except ImportError:
        print("# open3d not installed: skipped", flush=True)
        return
    frames = depth_frames(args, torch.device("cpu"))
    for vs in args.depth_voxels:
        vbg = o3d.t.geometry.VoxelBlockGrid(
            attr_names=("tsdf", "weight"),
            attr_dtypes=(o3c.float32, o3c.float32),
            attr_channels=((1), (1)),
            voxel_size=vs,
            block_resolution=8,
            block_count=200_000,
            device=o3c.Device("CPU:0"),
        )
        times = []
        for i, (depth, K, T) in enumerate(frames):
            d = o3d.t.geometry.Image(o3c.Tensor(depth.numpy()))
            intr = o3c.Tensor(K.numpy())
            extr = o3c.Tensor(torch.linalg.inv(T).numpy())
            t0 = time.perf_counter()
            blocks = vbg.compute_unique_block_coordinates(d, intr, extr, 1.0, 10.0, 3.0)
            vbg.integrate(blocks, d, intr, extr, 1.0, 10.0, 3.0)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        n = vbg.hashmap().size() * 512
        rows.append(
            {
                "case": f"open3d VoxelBlockGrid {vs * 1000:.0f} mm",
                "frames": len(times),
                "median_ms": statistics.median(times),
                "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
                "voxels": n,
                "observed": None,
                "map_mb": float("nan"),
                "peak_mb": float("nan"),
                "peak_b_per_voxel": float("nan"),
            }
        )
        print(fmt(rows[-1]), flush=True)


HEADER = (
    "| case | frames | median ms/frame | p90 ms | active voxels | observed voxels | map MiB | peak MiB | "
    "peak B/voxel |\n|---|---|---|---|---|---|---|---|---|"
)


def fmt(r: dict) -> str:
    def f(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)

    return (
        f"| {r['case']} | {r['frames']} | {f(r['median_ms'], '.2f')} | {f(r['p90_ms'], '.2f')} | "
        f"{f(r['voxels'], ',')} | {f(r['observed'], ',')} | {f(r['map_mb'], '.1f')} | "
        f"{f(r['peak_mb'], '.1f')} | {f(r['peak_b_per_voxel'], '.2f')} |"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", nargs="+", default=["lidar", "depth", "esdf", "open3d"])
    ap.add_argument("--frames", type=int, default=500, help="LiDAR frames timed")
    ap.add_argument("--depth-frames", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--extent", type=float, default=600.0, help="length of the simulated street (m)")
    ap.add_argument("--lidar-voxels", type=float, nargs="+", default=[0.4, 0.2, 0.1, 0.05])
    ap.add_argument("--lidar-layers", nargs="+", default=["tsdf", "occupancy"])
    ap.add_argument("--min-occupancy-voxel", type=float, default=0.05)
    ap.add_argument("--occupancy-frames", type=int, default=10**9, help="cap on occupancy frames timed")
    ap.add_argument("--depth-voxels", type=float, nargs="+", default=[0.02, 0.01, 0.005])
    ap.add_argument("--esdf-voxel", type=float, default=0.1)
    ap.add_argument("--esdf-frames", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    timer = FrameTimer(dev)
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    head = [
        f"# bench_integrators ({args.device})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        "- per-frame times are whole integrate calls (grow + merge + inject + update); peak = map bytes +"
        " largest per-frame transient allocation; active voxels = voxels of allocated 4^3 bricks",
        "",
        HEADER,
    ]
    print("\n".join(head), flush=True)
    rows, keep = [], {}
    if "lidar" in args.parts:
        bench_lidar(args, dev, timer, rows, keep)
    if "depth" in args.parts:
        bench_depth(args, dev, timer, rows)
    if "esdf" in args.parts:
        bench_esdf(args, dev, timer, rows, keep)
    if "open3d" in args.parts and dev.type == "cpu":
        bench_open3d(args, rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(head) + "\n" + "\n".join(fmt(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()

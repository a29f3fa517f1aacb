"""Where a frame's time goes in the integrators on the GPU: per-stage ms, CUDA kernel launches, host
syncs (device-to-host copies) and the top kernels, from torch.profiler over a few frames.

python benchmarks/tools/profile_integrators.py --cases lidar-tsdf:0.1 lidar-occupancy:0.1 depth-tsdf:0.005
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mapper import Map, sim


def frames_for(kind: str, n: int, dev):
    if kind == "lidar":
        scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
        lidar = sim.SpinningLidar()
        t0 = time.perf_counter()
        poses = sim.driving_trajectory(n, scene=scene)
        out = [(lidar.scan(scene, T.to(dev)), T) for T in poses]
        torch.cuda.synchronize()
        print(f"# {n} lidar frames generated in {time.perf_counter() - t0:.2f} s", flush=True)
        return out
    scene = sim.indoor_scene(0, device=dev)
    cam = sim.PinholeCamera.replica()
    poses = sim.orbit_trajectory(n, scene=scene)
    return [(cam.render_depth(scene, T.to(dev), max_range_m=10.0), cam.K, T) for T in poses]


def run(m: Map, kind: str, f) -> None:
    if kind == "lidar":
        m.integrate_lidar(f[0], f[1])
    else:
        m.integrate_depth(f[0], f[1], f[2])


def report(fn, frames: int, rows: int) -> None:
    """Profile ``fn`` (``frames`` frames): launches and syncs per frame, then the top kernels."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = sum(
        e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")
    )
    print(f"per frame: {launches / frames:.0f} kernel launches, {syncs / frames:.0f} memcpy/sync calls")
    print(ev.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def profile_esdf(vs: float, frames: int, rows: int) -> None:
    """ESDF cold (every brick dirty) on a LiDAR TSDF map: wall time, launches, syncs, top kernels."""
    from mapper.integrators.esdf import EsdfIntegrator

    dev = torch.device("cuda")
    m = Map(vs, layers=("tsdf", "esdf"), device=dev, max_range_m=60.0)
    for f in frames_for("lidar", frames, dev):
        run(m, "lidar", f)
    m.update_esdf()

    def cold():
        m._esdf = EsdfIntegrator(m.voxel_size_m, m.esdf_max_distance_m, m.device)
        m._surface_queue.parts = [m._tsdf.brick_table()[0]]
        m.update_esdf()

    cold()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cold()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    n = m.stats()["layers"]["esdf"]["voxels"]
    print(f"\n=== esdf cold {vs}: {wall:.1f} ms for {n:,} ESDF voxels")
    report(cold, 1, rows)


def profile_case(case: str, frames: int, rows: int) -> None:
    name, vs = case.split(":")
    if name == "esdf":
        return profile_esdf(float(vs), frames, rows)
    kind, layer = name.split("-")
    dev = torch.device("cuda")
    fr = frames_for(kind, frames + 6, dev)
    m = Map(float(vs), layers=(layer,), device=dev, max_range_m=60.0 if kind == "lidar" else 10.0)
    stages: dict[str, list[float]] = {}
    times = []
    for i, f in enumerate(fr[:frames]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(m, kind, f)
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
            for k, v in m.timings_ms().items():
                stages.setdefault(k, []).append(v)
    med = {k: round(statistics.median(v), 3) for k, v in stages.items()}
    wall = statistics.median(times)
    print(f"\n=== {case}: wall median {wall:.2f} ms/frame over {len(times)}; stages {med}")
    report(lambda: [run(m, kind, f) for f in fr[frames : frames + 5]], 5, rows)


def main():
    ap = argparse.ArgumentParser()
    cases = ["lidar-tsdf:0.1", "lidar-occupancy:0.1", "depth-tsdf:0.005"]
    ap.add_argument("--cases", nargs="+", default=cases)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--rows", type=int, default=22)
    args = ap.parse_args()
    for c in args.cases:
        profile_case(c, args.frames, args.rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Farthest point sampling: pruned vs naive, side by side (mapper.kernels.fps).

Clouds:
* ``lidar``: a LiDAR-like scan: ``mapper.sim.SpinningLidar`` (64 beams, azimuths scaled so that the scan has
  at least N returns) in ``outdoor_scene(0)`` from the first pose of ``driving_trajectory``, then N of its
  points drawn at random (seeded): dense near the sensor, sparse far away, as real scans;
* ``uniform``: N points uniform in a 100 m x 100 m x 10 m box.

Methods (every result is checked against the naive torch result: identical indices):
* ``naive torch``: ``farthest_point_sample_naive`` (one vectorised update + argmax per sample, ~8 ops);
* ``pruned torch``: ``farthest_point_sample_torch`` (the CPU path), with the fraction of chunks updated;
* CUDA only: ``naive triton``: the Triton kernel without pruning (one fused launch per sample), ``pruned
  triton``: the GPU path (CUDA graphs of 64 launches), and ``pruned triton, no graph``.

Times are medians of ``--reps`` calls after one warm-up (CUDA events on the GPU, perf_counter on the CPU);
each call includes the chunk set-up (Morton sort).

Usage:
    python benchmarks/bench_fps.py --device cuda --sizes 65536:4096 1048576:16384 --out fps_h200.md
    python benchmarks/bench_fps.py --device cpu --sizes 65536:1024 262144:1024 --threads 2
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

from mapper import sim
from mapper.kernels.fps import (
    _check,
    _fps_torch,
    _fps_triton,
    farthest_point_sample_naive,
)


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                torch.cuda.synchronize()
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def lidar_cloud(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """float32 [n, 3]: n returns of a simulated spinning LiDAR scan (sensor frame)."""
    scene = sim.outdoor_scene(0, device=device)
    pose = sim.driving_trajectory(1, scene=scene)[0]
    n_az = max(64, math.ceil(n / (64 * 0.9)))
    while True:
        pts = sim.SpinningLidar(n_beams=64, n_azimuth=n_az).scan(scene, pose)
        if pts.shape[0] >= n:
            break
        n_az = math.ceil(n_az * 1.3)
    g = torch.Generator().manual_seed(seed)
    keep = torch.randperm(pts.shape[0], generator=g)[:n].to(pts.device)
    return pts[keep].contiguous()


def uniform_cloud(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand((n, 3), generator=g) - 0.5) * torch.tensor([100.0, 100.0, 10.0])).to(device)


def bench(cloud: str, n: int, m: int, args, dev: torch.device, timer: Timer) -> dict:
    t0 = time.perf_counter()
    p = lidar_cloud(n, dev) if cloud == "lidar" else uniform_cloud(n, dev)
    q = _check(p, m, 0)
    row = {"cloud": cloud, "n": n, "m": m, "gen_s": time.perf_counter() - t0}
    reps = args.reps
    naive_ok = dev.type == "cuda" or n * m <= args.naive_max
    ref = farthest_point_sample_naive(q, m) if naive_ok else None
    if naive_ok:
        row["naive_torch"] = timer(lambda: farthest_point_sample_naive(q, m), reps)
    got, updates = _fps_torch(q, m, 0, chunk=args.torch_chunk)
    row["updated"] = updates / ((m - 1) * math.ceil(n / args.torch_chunk))
    row["check_torch"] = None if ref is None else bool(torch.equal(got, ref))
    if dev.type == "cpu" or n * m <= args.torch_max:
        row["pruned_torch"] = timer(lambda: _fps_torch(q, m, 0, chunk=args.torch_chunk), reps)
    if dev.type == "cuda":
        kw = dict(chunk=args.chunk, chunks_per_program=args.per_program)
        variants = {
            "naive_triton": dict(prune=False),
            "pruned_triton": dict(),
            "pruned_triton_nograph": dict(graph_iters=0),
        }
        for name, extra in variants.items():
            row[f"check_{name}"] = bool(torch.equal(_fps_triton(q, m, 0, **kw, **extra), ref))
            row[name] = timer(lambda extra=extra: _fps_triton(q, m, 0, **kw, **extra), reps)
    return row


def _f(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


def _ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.1f}x"


COLUMNS_CPU = (
    "| cloud | N | M | naive torch ms | pruned torch ms | speed-up | chunks updated | same indices |"
)
COLUMNS_GPU = (
    "| cloud | N | M | naive torch ms | naive triton ms | pruned triton ms | pruned triton, no graph ms | "
    "pruned torch ms | pruned triton vs naive torch | vs naive triton | chunks updated | same indices |"
)


def fmt_row(r: dict, cuda: bool) -> str:
    keys = ("check_torch", "check_naive_triton", "check_pruned_triton", "check_pruned_triton_nograph")
    checks = "/".join("-" if r[k] is None else str(r[k]) for k in keys if k in r)
    g = r.get
    cells = [r["cloud"], r["n"], r["m"], _f(g("naive_torch"))]
    if cuda:
        cells += [_f(g("naive_triton")), _f(g("pruned_triton")), _f(g("pruned_triton_nograph"))]
        cells += [_f(g("pruned_torch")), _ratio(g("naive_torch"), g("pruned_triton"))]
        cells += [_ratio(g("naive_triton"), g("pruned_triton"))]
    else:
        cells += [_f(g("pruned_torch")), _ratio(g("naive_torch"), g("pruned_torch"))]
    cells += [f"{r['updated'] * 100:.2f} %", checks]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", nargs="+", default=["65536:4096", "1048576:16384"], help="N:M pairs")
    ap.add_argument("--clouds", nargs="+", default=["lidar", "uniform"], choices=["lidar", "uniform"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--naive-max", type=float, default=3e9, help="CPU: skip naive torch when N*M is larger")
    ap.add_argument("--torch-max", type=float, default=3e9, help="GPU: skip timing pruned torch above N*M")
    ap.add_argument("--torch-chunk", type=int, default=None, help="points per chunk, torch path")
    ap.add_argument("--chunk", type=int, default=None, help="points per chunk, Triton path")
    ap.add_argument("--per-program", type=int, default=None, help="chunks per Triton program")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    from mapper.kernels import fps

    args.torch_chunk = args.torch_chunk or fps.TORCH_CHUNK
    args.chunk = args.chunk or fps.TRITON_CHUNK
    args.per_program = args.per_program or fps.TRITON_CHUNKS_PER_PROGRAM
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    hw = torch.cuda.get_device_name(dev) if cuda else f"{platform.processor() or platform.machine()}"
    head = [
        f"# bench_fps ({args.device})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}"
        + (f", triton {__import__('triton').__version__}" if cuda else ""),
        f"- command: `python {' '.join(sys.argv)}`",
        f"- chunks: {args.torch_chunk} points (torch), {args.chunk} points x {args.per_program} per program"
        " (Triton); medians of "
        f"{args.reps} calls after a warm-up, chunk set-up included; 'chunks updated' = share of chunk updates"
        " over all (chunk, sample) pairs (torch path); 'same indices' = every pruned/Triton result equals"
        " the naive torch indices",
        "",
        COLUMNS_GPU if cuda else COLUMNS_CPU,
        "|" + "---|" * ((COLUMNS_GPU if cuda else COLUMNS_CPU).count("|") - 1),
    ]
    print("\n".join(head), flush=True)
    timer = Timer(dev)
    rows = []
    for size in args.sizes:
        n, m = (int(float(x)) for x in size.split(":"))
        for cloud in args.clouds:
            rows.append(bench(cloud, n, m, args, dev, timer))
            print(fmt_row(rows[-1], cuda), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(head) + "\n" + "\n".join(fmt_row(r, cuda) for r in rows) + "\n")
    return rows


if __name__ == "__main__":
    main()

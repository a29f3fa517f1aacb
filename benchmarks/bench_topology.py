"""Topology operators on narrow-band shells: dilate, prune, merge and a from-coordinates rebuild baseline.

Shells are ``|phi| < 3`` voxels of a sphere level set in index space (OpenVDB's ``createLevelSetSphere``
convention), built leaf by leaf. Per size it reports, for the grid operators of ``mapper.IndexGrid``:

* ``dilated_grid(1, 26)``;
* ``pruned_grid(|phi| <= 1)``;
* ``merged_grid`` with a second shell of the same radius whose centre is offset by (5, 3, 2) voxels;
* the rebuild baseline: ``IndexGrid.from_ijk`` of the 27 shifted copies of the voxels (what a dilation
  costs without leaf masks), run where it fits in memory;

as the median of CUDA-event (GPU) or perf_counter (CPU) timings after warm-up, the peak memory the
operation adds on top of its inputs (GPU: ``torch.cuda.max_memory_allocated``), and the topology bytes per
active voxel (``nbytes / num_voxels``, tile index included). On the GPU every result is also checked
against the pure-torch reference on the same device.

Usage:
    python benchmarks/bench_topology.py --device cuda --sizes 1e6 1e7 1e8 5e8 --out results.md
    python benchmarks/bench_topology.py --device cpu --sizes 1e6 3e6 12.1e6 2e7
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

from mapper import IndexGrid
from mapper.synthetic import narrow_band_shell, voxel_phi

HALF_WIDTH = 3.0


def radius_for(n_voxels: float) -> float:
    """Sphere radius whose |phi| < 3 shell holds about n voxels (4 pi r^2 * 6)."""
    return math.sqrt(n_voxels / (4 * math.pi * 2 * HALF_WIDTH))


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int, warmup: int = 1):
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
        return statistics.median(times), times


def peak_extra(fn, device) -> float | None:
    """Peak bytes allocated during fn() above what was allocated before (GPU only), GiB."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**30


def same(a: IndexGrid, b: IndexGrid) -> bool:
    la, lb = a.leaves, b.leaves
    return (
        la.keys.shape == lb.keys.shape
        and bool(torch.equal(la.keys, lb.keys))
        and bool(torch.equal(la.masks, lb.masks))
        and bool(torch.equal(la.offsets, lb.offsets))
    )


def with_kernels(mode: str, fn):
    old = os.environ.get("MAPPER_KERNELS")
    os.environ["MAPPER_KERNELS"] = mode
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["MAPPER_KERNELS"]
        else:
            os.environ["MAPPER_KERNELS"] = old


def rebuild_dilation(grid: IndexGrid) -> IndexGrid:
    ijk = grid.ijk
    r = torch.arange(-1, 2, device=ijk.device, dtype=torch.int32)
    off = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(27, 1, 3)
    return IndexGrid.from_ijk((ijk[None] + off).reshape(-1, 3))


def bench_size(n_target: float, args, dev: torch.device, timer: Timer) -> dict:
    r = radius_for(n_target)
    t0 = time.perf_counter()
    g = narrow_band_shell("sphere", r, HALF_WIDTH, device=dev)
    g2 = narrow_band_shell("sphere", r, HALF_WIDTH, device=dev, center=(5.25, 2.5, 2.125))
    keep = voxel_phi("sphere", g, r).abs() <= 1.0
    row = {
        "target": n_target,
        "radius": r,
        "voxels": g.num_voxels,
        "leaves": g.num_leaves,
        "bytes_per_voxel": g.nbytes / g.num_voxels,
        "gen_s": time.perf_counter() - t0,
    }
    reps = args.reps if g.num_voxels < 2e8 else max(3, args.reps // 2)

    def dilate():
        return g.dilated_grid(1, 26)

    def prune():
        return g.pruned_grid(keep)

    def merge():
        return g.merged_grid(g2)

    for name, fn in (("dilate", dilate), ("prune", prune), ("merge", merge)):
        row[f"{name}_ms"] = timer(fn, reps)[0]
        row[f"{name}_peak_gib"] = peak_extra(fn, dev)
    d = dilate()
    row["dilated_voxels"] = d.num_voxels
    row["pruned_voxels"] = prune().num_voxels
    if dev.type == "cuda":
        # correctness on the device: the Triton path against the torch reference
        row["check_dilate"] = same(d, with_kernels("torch", dilate))
        row["check_prune"] = same(prune(), with_kernels("torch", prune))
        row["check_merge"] = same(merge(), with_kernels("torch", merge))
        row["torch_dilate_ms"] = with_kernels("torch", lambda: timer(dilate, 3)[0])
        row["torch_prune_ms"] = with_kernels("torch", lambda: timer(prune, 3)[0])
    del d
    if g.num_voxels <= args.rebuild_max:

        def rebuild():
            return rebuild_dilation(g)

        row["rebuild_ms"] = timer(rebuild, max(2, reps // 3))[0]
        row["rebuild_peak_gib"] = peak_extra(rebuild, dev)
        row["check_rebuild"] = same(rebuild(), dilate())
    return row


def run(args) -> list[dict]:
    dev = torch.device(args.device)
    timer = Timer(dev)
    rows = []
    for n_target in args.sizes:
        rows.append(bench_size(n_target, args, dev, timer))
        print(fmt_row(rows[-1]), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _f(x, spec):
    return "n/a" if x is None else format(x, spec)


def fmt_row(r: dict) -> str:
    return (
        f"| {r['voxels'] / 1e6:8.1f} | {r['leaves']:>9} | {r['bytes_per_voxel']:.3f} | "
        f"{r['dilate_ms']:8.2f} | {_f(r['dilate_peak_gib'], '.3f')} | {r['prune_ms']:8.2f} | "
        f"{_f(r['prune_peak_gib'], '.3f')} | {r['merge_ms']:8.2f} | {_f(r.get('rebuild_ms'), '9.1f')} | "
        f"{_f(r.get('torch_dilate_ms'), '.2f')} | {_f(r.get('torch_prune_ms'), '.2f')} | "
        f"{r.get('check_dilate', '-')}/{r.get('check_prune', '-')}/{r.get('check_merge', '-')}"
        f"/{r.get('check_rebuild', '-')} |"
    )


HEADER = (
    "| voxels (M) | leaves | topo B/voxel | dilate ms | dilate peak GiB | prune ms | prune peak GiB | "
    "merge ms | rebuild ms | torch-ref dilate ms | torch-ref prune ms | checks d/p/m/r |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 3e6, 12.1e6, 2e7])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rebuild-max", type=float, default=2e7, help="largest shell for the rebuild baseline")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    hw = (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else f"{platform.processor() or platform.machine()}"
    )
    head = [
        f"# bench_topology ({args.device})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}"
        + (f", triton {__import__('triton').__version__}" if dev.type == "cuda" else ""),
        f"- command: `python {' '.join(sys.argv)}`",
        "- shells: sphere |phi| < 3 voxels (index space); merge partner: same radius,"
        " centre offset (5, 3, 2); prune keeps |phi| <= 1; rebuild = from_ijk of 27 shifted copies;"
        " peak = memory added by the op (GPU); checks = Triton result equals the torch reference (d/p/m)"
        " and rebuild equals dilation (r)",
        "",
        HEADER,
    ]
    print("\n".join(head), flush=True)
    rows = run(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(head) + "\n" + "\n".join(fmt_row(r) for r in rows) + "\n")
    return rows


if __name__ == "__main__":
    main()

"""Real-time frame path (issue 12): per-frame and per-stage latency over long sequences, spikes included,
and a per-frame stage profile (kernel launches, host syncs, GPU busy time).

Cases: LiDAR TSDF 10 cm / 5 cm and occupancy 5 cm on a KITTI-like drive through ``mapper.sim.outdoor_scene``
(64 beams x 1875 azimuths = 120 k rays, 60 m, 10 Hz at 10 m/s); depth TSDF 2 cm / 1 cm / 5 mm on 640x480
frames (``PinholeCamera.kinect``) orbiting ``mapper.sim.indoor_scene``. Frames are generated where the
benchmark runs (the GPU machine receives no data) and kept on the device.

Method. Before a case, ``--warmup`` frames go into a throwaway map of the same configuration (compiles the
kernels the first frames need). Then a fresh map takes the whole sequence and **every frame is kept**
(growth of the map from empty included): per frame, a CUDA event pair around the integrate call (the
harness synchronises after each frame, outside the timed interval, so a frame's time is its latency from
call to GPU completion; CPU: perf_counter), the map's own stage timers (``Map.timings_ms``), the Triton
compilations it triggered (``triton.knobs.runtime.jit_post_compile_hook``), bricks and pool pages added,
and the CUDA caching allocator's reserved-bytes growth (a cudaMalloc inside the frame). Then
``--profile-frames`` further frames of the sequence run under ``torch.profiler`` (kernels, copies, CUDA
runtime launch and synchronise calls, GPU busy time = union of the kernel intervals) and the same number
under ``torch.cuda.set_sync_debug_mode("warn")`` (host syncs counted as warnings). On the CPU the profile
counts aten ops instead of kernels.

Usage:
  python benchmarks/bench_frame.py --device cuda --lidar-frames 500 --depth-frames 1000 --out r.md
  python benchmarks/bench_frame.py --quick --out r.md        # small, CPU
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time
import warnings

import torch

from mapper import Map, gc_policy, sim

CASES = {
    "lidar_tsdf_10cm": ("lidar", 0.10, ("tsdf",)),
    "lidar_tsdf_5cm": ("lidar", 0.05, ("tsdf",)),
    "occupancy_5cm": ("lidar", 0.05, ("occupancy",)),
    "depth_tsdf_2cm": ("depth", 0.02, ("tsdf",)),
    "depth_tsdf_1cm": ("depth", 0.01, ("tsdf",)),
    "depth_tsdf_5mm": ("depth", 0.005, ("tsdf",)),
}
LIDAR_RANGE_M = 60.0
DEPTH_RANGE_M = 10.0


# ------------------------------------------------------------------------------------------------ data
def lidar_frames(n: int, dev: torch.device, beams: int, poses_on_device: bool = False):
    """(points on ``dev``, pose); the pose on the host, as the service has it, unless ``poses_on_device``."""
    lidar = sim.SpinningLidar(n_beams=beams, range_noise_std_m=0.01)
    seq = sim.lidar_sequence(n, device=dev, lidar=lidar)
    return [(p, T if poses_on_device else T.cpu()) for p, T in seq]


def depth_frames(n: int, dev: torch.device, poses_on_device: bool = False):
    """(depth on ``dev``, K, pose): K and the pose on the host, as the service passes them, unless
    ``poses_on_device``."""
    seq = sim.depth_sequence(n, sim.PinholeCamera.kinect(), device=dev, max_range_m=DEPTH_RANGE_M)
    return [(d, K, T) if poses_on_device else (d, K.cpu(), T.cpu()) for d, K, T in seq]


def make_map(case: str, dev: torch.device) -> Map:
    kind, vs, layers = CASES[case]
    rng = LIDAR_RANGE_M if kind == "lidar" else DEPTH_RANGE_M
    return Map(vs, layers=layers, device=dev, max_range_m=rng)


def integrate(m: Map, kind: str, f) -> None:
    if kind == "lidar":
        m.integrate_lidar(f[0], f[1], track=False)
    else:
        m.integrate_depth(f[0], f[1], f[2])


# -------------------------------------------------------------------------------------------- counters
class CompileCounter:
    """Counts Triton compilations (disk-cache loads included) through the post-compile hook."""

    def __init__(self):
        self.n = 0
        self.names: list[str] = []
        self._knobs = None
        try:
            import triton

            self._knobs = triton.knobs.runtime
        except (ImportError, AttributeError):
            return
        self._prev = self._knobs.jit_post_compile_hook
        self._knobs.jit_post_compile_hook = self._hook

    def _hook(self, *args, **kwargs):
        self.n += 1
        fn = kwargs.get("fn")
        self.names.append(str(getattr(fn, "name", fn)))
        return False

    def close(self):
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._prev


class GcTimer:
    """Time in Python's garbage collector (a full collection of a large process is a spike suspect)."""

    def __init__(self):
        self.ms = 0.0
        self.full = 0
        self._t = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t) * 1e3
            self.full += info.get("generation") == 2

    def close(self):
        gc.callbacks.remove(self._cb)


def pool_state(m: Map) -> tuple[int, int]:
    """(allocated bricks, pool pages) summed over the map's brick layers."""
    b = p = 0
    for _, layer in m._brick_layers():
        b += layer.num_bricks
        p += len(layer.pool.page_starts) - 1
    return b, p


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(xs: list[float]) -> dict:
    med = quantile(xs, 0.5)
    return {
        "median": med,
        "p99": quantile(xs, 0.99),
        "max": max(xs) if xs else float("nan"),
        "p99_x": quantile(xs, 0.99) / med if med else float("nan"),
        "max_x": (max(xs) / med) if xs and med else float("nan"),
    }


# ------------------------------------------------------------------------------------------------ run
def run_sequence(m: Map, kind: str, frames, dev: torch.device, compiles: CompileCounter) -> list[dict]:
    cuda = dev.type == "cuda"
    rows = []
    gct = GcTimer()
    for i, f in enumerate(frames):
        b0, p0 = pool_state(m)
        c0, g0, gf0 = compiles.n, gct.ms, gct.full
        if cuda:
            torch.cuda.synchronize()
            r0 = torch.cuda.memory_reserved()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            integrate(m, kind, f)
            b.record()
            host = (time.perf_counter() - t0) * 1e3
            b.synchronize()
            ms = a.elapsed_time(b)
            dres = torch.cuda.memory_reserved() - r0
        else:
            t0 = time.perf_counter()
            integrate(m, kind, f)
            ms = host = (time.perf_counter() - t0) * 1e3
            dres = 0
        b1, p1 = pool_state(m)
        rows.append(
            {
                "frame": i,
                "ms": ms,
                "host_ms": host,
                "stages": m.timings_ms(),
                "compiles": compiles.n - c0,
                "compiled": sorted(set(compiles.names[c0:])),
                "new_bricks": b1 - b0,
                "new_pages": p1 - p0,
                "reserved_growth_mb": dres / 2**20,
                "gc_ms": gct.ms - g0,
                "gc_full": gct.full - gf0,
            }
        )
    gct.close()
    return rows


def _union_us(intervals: list[tuple[float, float]]) -> float:
    tot, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            tot += e - s
            end = e
        elif e > end:
            tot += e - end
            end = e
    return tot


def profile_frames(m: Map, kind: str, frames, dev: torch.device) -> dict:
    """Launches / copies / runtime calls and GPU busy time per frame under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    if not frames:
        return {}
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for f in frames:
            integrate(m, kind, f)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    n = len(frames)
    out = {"frames": n, "wall_ms_per_frame_profiled": wall / n}
    ev = prof.events()
    if cuda:
        gpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
        kern = [e for e in gpu if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        copies = [e for e in gpu if "memcpy" in e.name.lower()]
        dtoh = [e for e in copies if "dtoh" in e.name.lower().replace(" ", "")]
        iv = [(e.time_range.start, e.time_range.end) for e in gpu]
        rt = [e.name for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
        launch = sum(1 for x in rt if "LaunchKernel" in x)
        syncs = sum(
            1 for x in rt if x in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
        )
        top: dict[str, list[float]] = {}
        for e in kern:
            top.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        out.update(
            {
                "kernels": len(kern) / n,
                "memcpy": len(copies) / n,
                "memcpy_dtoh": len(dtoh) / n,
                "launch_calls": launch / n,
                "sync_calls": syncs / n,
                "gpu_busy_ms": _union_us(iv) / 1e3 / n,
                "top_kernels": sorted(
                    ((k, len(v) / n, sum(v) / 1e3 / n) for k, v in top.items()), key=lambda x: -x[2]
                )[:8],
            }
        )
    else:
        ops = [e for e in ev if e.name.startswith("aten::")]
        out["aten_ops"] = len(ops) / n
    return out


def count_syncs(m: Map, kind: str, frames, dev: torch.device) -> dict:
    """Host syncs per frame as counted by ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA only), with
    the source lines that caused them."""
    if dev.type != "cuda" or not frames:
        return {}
    where: dict[str, int] = {}
    total = 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for f in frames:
                integrate(m, kind, f)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in rec:
        if "called a synchronizing" not in str(w.message):
            continue
        total += 1
        key = f"{os.path.relpath(w.filename)}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    n = len(frames)
    return {
        "syncs": total / n,
        "sync_sites": sorted(((k, v / n) for k, v in where.items()), key=lambda x: -x[1])[:12],
    }


def bench_case(case: str, frames, args, dev: torch.device, compiles: CompileCounter) -> dict:
    kind = CASES[case][0]
    n_prof = args.profile_frames
    timed = frames[: len(frames) - 2 * n_prof] if n_prof else frames
    extra = frames[len(timed) :]
    if args.warmup:
        w = make_map(case, dev)
        for f in frames[: args.warmup]:
            integrate(w, kind, f)
        del w
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    m = make_map(case, dev)
    gc_full_before = gc_full_after = None
    gc.unfreeze()  # the map's warm-up (mapper.warmup) settled already: measure without, then per policy
    if args.gc == "settle":  # what the warm-up does (mapper.gc_policy)
        gc_full_before = gc_policy.full_collection_ms()  # one full collection of the whole heap
        gc_policy.settle()
    c_before = compiles.n
    live0 = len(gc.get_objects())  # objects the collector tracks, the frozen ones apart
    rows = run_sequence(m, kind, timed, dev, compiles)
    live1 = len(gc.get_objects())
    if args.gc == "settle":
        gc_full_after = gc_policy.full_collection_ms()  # the frozen heap apart: what a frame would pay now
    prof = profile_frames(m, kind, extra[:n_prof], dev)
    syncs = count_syncs(m, kind, extra[n_prof:], dev)
    ms = [r["ms"] for r in rows]
    stages = sorted({k for r in rows for k in r["stages"]})
    worst = max(rows, key=lambda r: r["ms"])
    res = {
        "case": case,
        "frames": len(rows),
        "frame": summary(ms),
        "host": summary([r["host_ms"] for r in rows]),
        "stages": {s: summary([r["stages"].get(s, 0.0) for r in rows]) for s in stages},
        "compiles_in_sequence": compiles.n - c_before,
        "compile_frames": [r["frame"] for r in rows if r["compiles"]],
        "page_frames": [r["frame"] for r in rows if r["new_pages"]],
        "malloc_frames": [r["frame"] for r in rows if r["reserved_growth_mb"] > 0],
        "gc_frames": [r["frame"] for r in rows if r["gc_full"]],
        "gc_max_ms": max((r["gc_ms"] for r in rows), default=0.0),
        "gc_ms": summary([r["gc_ms"] for r in rows]),
        "gc_total_ms": sum(r["gc_ms"] for r in rows),
        "gc_full_ms_before_settle": gc_full_before,
        "gc_full_ms_after": gc_full_after,
        "gc_tracked": (live0, live1),
        "worst": worst,
        "top5": sorted(rows, key=lambda r: -r["ms"])[:5],
        "bricks": pool_state(m)[0],
        "map_mb": m.nbytes / 2**20,
        "profile": prof,
        "sync_count": syncs,
        "frame_ms": [round(x, 3) for x in ms],
        "per_frame": rows if args.keep_frames else None,
    }
    del m
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------------------------- report
def fmt_report(results: list[dict], args, dev: torch.device, argv: list[str]) -> str:
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    lines = [
        f"# bench_frame ({dev.type})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python benchmarks/bench_frame.py {' '.join(argv)}`",
        f"- frames: LiDAR {args.lidar_frames} ({args.beams} beams x 1875), depth {args.depth_frames} "
        f"(640x480); warm-up {args.warmup} frames on a throwaway map; all frames of the fresh map kept "
        f"(growth included); GC policy {args.gc}; pose and K "
        f"{'on the device' if args.poses_on_device else 'on the host (as the service passes them)'}",
        "",
        "## Per frame (ms; x = ratio to the median; targets p99 <= 1.5x, max <= 3x)",
        "",
        "| case | frames | median | p99 | max | p99/med | max/med | host median | worst frame | compiles "
        "(frames) | page-growth frames | cudaMalloc frames | full GC frames (max ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, w = r["frame"], r["worst"]
        lines.append(
            f"| {r['case']} | {r['frames']} | {f['median']:.2f} | {f['p99']:.2f} | {f['max']:.2f} | "
            f"{f['p99_x']:.2f} | {f['max_x']:.2f} | {r['host']['median']:.2f} | #{w['frame']} "
            f"({w['compiles']} compiles, {w['new_pages']} pages, +{w['reserved_growth_mb']:.0f} MiB) | "
            f"{r['compiles_in_sequence']} ({_short(r['compile_frames'])}) | {_short(r['page_frames'])} | "
            f"{_short(r['malloc_frames'])} | {_short(r['gc_frames'])} ({r['gc_max_ms']:.1f}) |"
        )
    lines += [
        "",
        f"## Python GC per frame (policy `{args.gc}`: settle = full collection + gc.freeze() after the "
        "warm-up, mapper.gc_policy)",
        "",
        "| case | GC ms median | p99 | max | total over the sequence | gen-2 collections "
        "| one full collection before settle (ms) | after the sequence (ms) | tracked objects before / after "
        "the sequence (frozen apart) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g, b, a = r["gc_ms"], r["gc_full_ms_before_settle"], r["gc_full_ms_after"]
        lines.append(
            f"| {r['case']} | {g['median']:.3f} | {g['p99']:.3f} | {g['max']:.3f} | {r['gc_total_ms']:.1f} | "
            f"{len(r['gc_frames'])} | {_ms(b)} | {_ms(a)} | {r['gc_tracked'][0]} / {r['gc_tracked'][1]} |"
        )
    lines += ["", "## Per stage (ms: median / p99 / max)", ""]
    for r in results:
        parts = [f"{s} {v['median']:.2f} / {v['p99']:.2f} / {v['max']:.2f}" for s, v in r["stages"].items()]
        lines.append(f"- {r['case']}: " + "; ".join(parts))
    lines += ["", "## Stage profile per frame (steady state, frames after the timed sequence)", ""]
    if dev.type == "cuda":
        lines += [
            "| case | kernels | memcpy (DtoH) | launch calls | sync calls | host syncs (warn) | GPU busy ms "
            "| wall ms (profiled) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            p, s = r["profile"], r["sync_count"]
            if not p:
                continue
            lines.append(
                f"| {r['case']} | {p['kernels']:.0f} | {p['memcpy']:.0f} ({p['memcpy_dtoh']:.0f}) | "
                f"{p['launch_calls']:.0f} | {p['sync_calls']:.0f} | {s.get('syncs', float('nan')):.0f} | "
                f"{p['gpu_busy_ms']:.2f} | {p['wall_ms_per_frame_profiled']:.2f} |"
            )
        lines += ["", "Sync sites (per frame) and the heaviest kernels (launches, ms per frame):", ""]
        for r in results:
            s = r["sync_count"].get("sync_sites", [])
            lines.append(f"- {r['case']} syncs: " + ", ".join(f"{k} x{v:g}" for k, v in s))
            lines.append(
                f"- {r['case']} kernels: "
                + ", ".join(f"{k} x{c:g} {t:.3f}" for k, c, t in r["profile"].get("top_kernels", []))
            )
    else:
        lines += ["| case | aten ops per frame | wall ms (profiled) |", "|---|---|---|"]
        for r in results:
            p = r["profile"]
            if p:
                lines.append(f"| {r['case']} | {p['aten_ops']:.0f} | {p['wall_ms_per_frame_profiled']:.1f} |")
    lines += ["", "## Five slowest frames per case", ""]
    for r in results:
        lines.append(
            f"- {r['case']}: "
            + "; ".join(
                f"#{x['frame']} {x['ms']:.1f} ms (compiles {x['compiles']} {' '.join(x['compiled'])}, "
                f"pages {x['new_pages']}, gc "
                f"{x['gc_ms']:.1f} ms, "
                f"+{x['reserved_growth_mb']:.0f} MiB, bricks +{x['new_bricks']}, "
                + ", ".join(f"{k} {v:.1f}" for k, v in x["stages"].items())
                + ")"
                for x in r["top5"]
            )
        )
    return "\n".join(lines) + "\n"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _short(xs: list[int], n: int = 8) -> str:
    if not xs:
        return "-"
    s = ", ".join(str(x) for x in xs[:n])
    return s + (f", ... ({len(xs)})" if len(xs) > n else "")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--lidar-frames", type=int, default=500)
    ap.add_argument("--depth-frames", type=int, default=1000)
    ap.add_argument(
        "--frames", type=int, default=None, help="both sequences' length (overrides the two above)"
    )
    ap.add_argument("--beams", type=int, default=64, help="LiDAR beams (x 1875 azimuths)")
    ap.add_argument(
        "--poses-on-device",
        action="store_true",
        help="pass pose and K as device tensors (default: on the host, as the service passes them)",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-frames", type=int, default=2)
    ap.add_argument(
        "--gc",
        choices=("settle", "default"),
        default="settle",
        help="settle: gc_policy.settle() after the warm-up (the library's policy); default: leave it",
    )
    ap.add_argument("--quick", action="store_true", help="small CPU run: 6 frames, 16 beams")
    ap.add_argument("--keep-frames", action="store_true", help="keep every frame's record in the JSON")
    ap.add_argument("--out", default=None, help="markdown report")
    ap.add_argument("--json", default=None, help="raw results")
    args = ap.parse_args(argv)
    if args.quick:
        args.lidar_frames = args.depth_frames = 6
        args.beams = 16
        args.warmup = 1
        args.profile_frames = 1
    if args.frames is not None:
        args.lidar_frames = args.depth_frames = args.frames
    dev = torch.device(args.device)
    compiles = CompileCounter()
    results = []
    need = {CASES[c][0] for c in args.cases}
    extra = 2 * args.profile_frames
    data = {}
    t0 = time.perf_counter()
    if "lidar" in need:
        data["lidar"] = lidar_frames(args.lidar_frames + extra, dev, args.beams, args.poses_on_device)
        pts = sum(f[0].shape[0] for f in data["lidar"]) / len(data["lidar"])
        print(f"# lidar: {len(data['lidar'])} frames, {pts:.0f} points/frame", flush=True)
    if "depth" in need:
        data["depth"] = depth_frames(args.depth_frames + extra, dev, args.poses_on_device)
        print(f"# depth: {len(data['depth'])} frames 640x480", flush=True)
    print(f"# frames generated in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        for case in args.cases:
            t1 = time.perf_counter()
            r = bench_case(case, data[CASES[case][0]], args, dev, compiles)
            f = r["frame"]
            print(
                f"{case}: median {f['median']:.2f} p99 {f['p99']:.2f} max {f['max']:.2f} ms "
                f"(worst #{r['worst']['frame']}, {r['compiles_in_sequence']} compiles; "
                f"{time.perf_counter() - t1:.1f} s)",
                flush=True,
            )
            results.append(r)
            write(results, args, dev, argv)  # after every case: a run cut short keeps what it measured
    finally:
        compiles.close()
    print(fmt_report(results, args, dev, argv))


def write(results: list[dict], args, dev: torch.device, argv: list[str]) -> None:
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(fmt_report(results, args, dev, argv))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()

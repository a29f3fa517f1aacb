"""Depth TSDF frame on CUDA (issue 12): the grow of ``triton_depth`` (one kernel, one read) against the
previous one (``MAPPER_DEPTH_GROW=keyed``), A/B in one process, so the map's kernels compile once (a cold
``bench_frame.py`` process spends 12-18 s compiling in its warm-up: one process per path did not fit a
70 s device slot).

Per voxel size and path: a throwaway map takes 3 frames (the path's kernels compiled), then a fresh map
takes ``--frames`` 640x480 frames of ``sim.depth_sequence`` (pose and K on the host, as the service passes
them; growth included), each timed to GPU completion, with the map's stage timers; then 2 frames under
``torch.profiler`` (kernels, launch calls, GPU busy) and 2 under ``set_sync_debug_mode("warn")`` (host
syncs). ``--long N``: then an N-frame 2 cm sequence on the new path (p99 / max over the whole sequence).
The report is rewritten after every run, so a time limit keeps what finished.

Usage: python benchmarks/bench_depth_ab.py --frames 100 --long 1000 --out r.md --json r.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_frame as bf  # noqa: E402

from mapper import Map  # noqa: E402

RANGE_M = 10.0


def host_frames(n: int, dev: torch.device):
    return [(d, K.cpu(), T.cpu()) for d, K, T in bf.depth_frames(n, dev)]


def one_run(vs: float, mode: str, frames, n: int, dev, compiles) -> dict:
    os.environ["MAPPER_DEPTH_GROW"] = "keyed" if mode == "keyed" else ""
    w = Map(vs, layers=("tsdf",), device=dev, max_range_m=RANGE_M)
    for f in frames[:3]:
        bf.integrate(w, "depth", f)
    del w
    m = Map(vs, layers=("tsdf",), device=dev, max_range_m=RANGE_M)
    rows = bf.run_sequence(m, "depth", frames[:n], dev, compiles)
    prof = bf.profile_frames(m, "depth", frames[n : n + 2], dev) if len(frames) >= n + 2 else {}
    syncs = bf.count_syncs(m, "depth", frames[n + 2 : n + 4], dev) if len(frames) >= n + 4 else {}
    stages = {}
    for st in ("grow", "merge", "update"):
        xs = [r["stages"].get(st, 0.0) for r in rows]
        stages[st] = bf.summary(xs)
    return {
        "voxel_m": vs,
        "mode": mode,
        "frames": len(rows),
        "frame": bf.summary([r["ms"] for r in rows]),
        "host": bf.summary([r["host_ms"] for r in rows]),
        "stages": stages,
        "compiles": sum(r["compiles"] for r in rows),
        "worst": max(rows, key=lambda r: r["ms"])["frame"],
        "profile": prof,
        "syncs": syncs,
    }


def report(runs: list[dict], cmd: str) -> str:
    lines = [
        "# depth TSDF frame: triton_depth grow vs the previous grow (bench_depth_ab.py)",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}",
        f"- software: torch {torch.__version__}",
        f"- command: `{cmd}`",
        "- frames: 640x480 `sim.depth_sequence`, pose and K on the host; fresh map, growth included; ms to"
        " GPU completion; stage timers of the map; profile: 2 frames, syncs: 2 frames (warn mode)",
        "",
        "| voxel | path | frames | median ms | p99 | max | p99/med | max/med | grow med | merge med |"
        " update med | kernels | launch calls | syncs | GPU busy ms | compiles |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        f, s, p = r["frame"], r["stages"], r["profile"]
        lines.append(
            f"| {r['voxel_m']} | {r['mode']} | {r['frames']} | {f['median']:.2f} | {f['p99']:.2f}"
            f" | {f['max']:.2f} | {f['p99_x']:.2f} | {f['max_x']:.2f} | {s['grow']['median']:.2f}"
            f" | {s['merge']['median']:.2f} | {s['update']['median']:.2f}"
            f" | {p.get('kernels', float('nan')):.0f}"
            f" | {p.get('launch_calls', float('nan')):.0f} | {r['syncs'].get('syncs', float('nan')):.1f}"
            f" | {p.get('gpu_busy_ms', float('nan')):.2f} | {r['compiles']} |"
        )
    lines.append("")
    for r in runs:
        sites = ", ".join(f"{k} x{v:g}" for k, v in r["syncs"].get("sync_sites", []))
        top = ", ".join(f"{k} x{c:g} {ms:.3f}" for k, c, ms in r["profile"].get("top_kernels", [])[:6])
        lines.append(f"- {r['voxel_m']} {r['mode']}: syncs {sites or '-'}; kernels {top or '-'}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--voxels", type=float, nargs="+", default=[0.02, 0.01, 0.005])
    ap.add_argument("--long", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cmd = "python benchmarks/bench_depth_ab.py " + " ".join(sys.argv[1:])
    frames = host_frames(args.frames + 4, dev)
    compiles = bf.CompileCounter()
    runs: list[dict] = []

    def save() -> None:
        text = report(runs, cmd)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(runs, fh, default=str)

    for vs in args.voxels:
        for mode in ("new", "keyed"):
            runs.append(one_run(vs, mode, frames, args.frames, dev, compiles))
            save()
    if args.long:
        del frames
        long_frames = host_frames(args.long, dev)
        runs.append(one_run(0.02, "new", long_frames, args.long, dev, compiles))
        save()
    os.environ.pop("MAPPER_DEPTH_GROW", None)


if __name__ == "__main__":
    main()

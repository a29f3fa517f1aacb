"""CPU cost of the fixed malloc mmap threshold (``MAPPER_MALLOC_MMAP_THRESHOLD``): the soak's heavy
operations (LiDAR frame integration + ESDF update, whole mesh) timed in CPU seconds (``process_time``:
less sensitive to a shared machine's load than wall time) with minor page faults, in subprocesses run
side by side: glibc's dynamic threshold vs fixed ones.

    python benchmarks/bench_mmap_threshold.py [--threshold 1048576 ...] \
        [--out benchmarks/results/mmap_threshold_cpu.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "norlab_lidar"


def child(threshold: int, data: Path, points: int, voxel: float, repeat: int, esdf: bool = True) -> dict:
    from mapper.api import memory

    if threshold:
        assert memory.set_mmap_threshold(threshold)
    from mapper.datasets import NorlabLidar
    from mapper.map import Map

    ds = NorlabLidar(data)
    rng = np.random.default_rng(0)
    frames = []
    for i in range(4):
        s = ds[i]
        p = s["points"]
        if len(p) > points:
            p = p[rng.choice(len(p), points, replace=False)]
        frames.append((p.astype(np.float32), s["T_world_sensor"]))
    m = Map(voxel_size_m=voxel, layers=["tsdf", "esdf"] if esdf else ["tsdf"], max_range_m=40.0)
    for p, T in frames:
        m.integrate_lidar(p, T)
    if esdf:
        m.update_esdf()
    out = {}
    ops = {
        "frame + ESDF update": lambda i: (m.integrate_lidar(*frames[i % 4]), m.update_esdf()),
        "whole mesh": lambda i: m.mesh(),
    }
    if not esdf:  # the CPU ESDF update of the merged main takes minutes: TSDF frames only
        ops["frame (TSDF only)"] = lambda i: m.integrate_lidar(*frames[i % 4])
        del ops["frame + ESDF update"]
    for name, fn in ops.items():
        cpu, flt = [], []
        for i in range(repeat):
            f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            fn(i)
            cpu.append(time.process_time() - c0)
            flt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        out[name] = {"cpu_s": cpu, "minflt": flt}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threshold", type=int, nargs="+", default=[1 << 20], help="fixed thresholds (bytes)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--voxel", type=float, default=0.2)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--no-esdf", action="store_true", help="a TSDF-only map: time frames without ESDF")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(
            json.dumps(child(args.child, args.data, args.points, args.voxel, args.repeat, not args.no_esdf))
        )
        return 0
    base = [sys.executable, __file__, "--data", str(args.data), "--points", str(args.points)]
    base += ["--voxel", str(args.voxel), "--repeat", str(args.repeat), *(["--no-esdf"] * args.no_esdf)]
    base += ["--child"]
    variants = [0, *args.threshold]
    procs = {t: subprocess.Popen([*base, str(t)], stdout=subprocess.PIPE, text=True) for t in variants}
    load0 = os.getloadavg()[0]
    res = {t: json.loads(p.communicate()[0]) for t, p in procs.items()}
    load1 = os.getloadavg()[0]
    from bench_service import hardware

    lines = [
        "# Fixed malloc mmap threshold: CPU cost (CPU, in process)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}; load average (1 min) {load0:.1f} at start, {load1:.1f} at end",
        f"- command: `python benchmarks/bench_mmap_threshold.py {' '.join(sys.argv[1:] if argv is None else argv)}`",  # noqa: E501
        f"- map: 4 norlab scans, {args.points} points, voxel {args.voxel} m, "
        f"{'tsdf' if args.no_esdf else 'tsdf+esdf'}; {args.repeat} runs "
        "per operation, both variants at once (same machine load); CPU seconds of the process",
        "",
        "| operation | threshold | CPU s median | CPU s min | minor page faults median |",
        "|---|---|---|---|---|",
    ]
    for op in res[0]:
        for t in variants:
            r = res[t][op]
            name = "dynamic (glibc default)" if t == 0 else f"fixed {t} B"
            lines.append(
                f"| {op} | {name} | {np.median(r['cpu_s']):.2f} | {min(r['cpu_s']):.2f} | "
                f"{np.median(r['minflt']):.0f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU cost of the ESDF update for LiDAR frames (torch path), and the 1-D pass calibration behind the pick.

Parts:

* ``lidar``: a ``("tsdf", "esdf")`` map at ``--voxel`` fed ``--frames`` norlab scans subsampled to
  ``--points`` points (max range 40 m, the soak's setting), the ESDF updated after each frame. Per update:
  CPU seconds of this process (``time.process_time``: robust to other jobs on a shared machine), stored /
  computed ESDF voxels, sites; then one more update under cProfile split into its stages (line passes,
  1-D distance passes, line layouts, the rest).
* ``passes``: :func:`window_min_torch` (block min-plus) against :func:`lower_envelope_torch` on random
  lines (70 % empty slots) per line length and window: CPU seconds and min-plus pairs per slot, the
  numbers behind ``MINPLUS_PAIRS_PER_SLOT``; results asserted equal below ``(window + 1)^2``.

Run (niced, one thread)::

    nice -n 19 env OMP_NUM_THREADS=1 python benchmarks/bench_esdf_cpu.py --out /tmp/esdf_cpu_part.md
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import math
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "norlab_lidar"

STAGES = {  # cProfile function name -> stage (cumulative time)
    "distance_pass": "1-D distance passes (min-plus / envelope)",
    "line_min": "line passes (nearest crossing)",
    "_line_layout": "line layouts",
    "squared_distances": "transform (all of it)",
    "_recompute": "update (all of it)",
}


def lidar_frames(data: Path, n: int, points: int):
    from mapper.datasets import NorlabLidar

    ds = NorlabLidar(data)
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        s = ds[i]
        p = s["points"]
        if len(p) > points:
            p = p[rng.choice(len(p), points, replace=False)]
        out.append((p.astype(np.float32), s["T_world_sensor"]))
    return out


def lidar_case(data: Path, n: int, points: int, voxel: float) -> tuple[list[str], list[str]]:
    from mapper.map import Map

    frames = lidar_frames(data, n + 1, points)
    m = Map(voxel_size_m=voxel, layers=["tsdf", "esdf"], max_range_m=40.0)
    rows = []
    for k, (p, T) in enumerate(frames[:n]):
        m.integrate_lidar(p, T)
        c0 = time.process_time()
        m.update_esdf()
        cpu = time.process_time() - c0
        st = m.stats()["layers"]["esdf"]
        lu = st["last_update"]
        rows.append(
            f"| {voxel} | {k} | {cpu:.2f} | {lu['recomputed_voxels']:,} | {lu['computed_voxels']:,} | "
            f"{lu['sites']:,} | {st['margin_vox']} |"
        )
        print(rows[-1], flush=True)
    m.integrate_lidar(*frames[n])
    pr = cProfile.Profile(time.process_time)  # CPU time, as the rows
    c0 = time.process_time()
    pr.enable()
    m.update_esdf()
    pr.disable()
    total = time.process_time() - c0
    stats = pstats.Stats(pr).stats
    agg: dict[str, float] = {}
    for (_file, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.items():
        if name in STAGES and STAGES[name] and "mapper" in _file:
            agg[STAGES[name]] = agg.get(STAGES[name], 0.0) + ct
    prof = [f"- profiled update (voxel {voxel} m, frame {n}, cProfile on): {total:.2f} CPU s"]
    for stage in STAGES.values():
        if stage and stage in agg:
            prof.append(f"  - {stage}: {agg[stage]:.2f} s")
    print("\n".join(prof), flush=True)
    return rows, prof


def passes_case() -> list[str]:
    from mapper.kernels.envelope import lower_envelope_torch, window_min_torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for slots, n, w in [(1 << 20, 16, 11), (1 << 20, 64, 41), (1 << 20, 256, 81), (1 << 20, 256, 255),
                        (1 << 20, 1024, 400)]:  # fmt: skip
        nl = slots // n
        f = torch.rand(nl * n, generator=g) * 50
        f[torch.rand(nl * n, generator=g) < 0.7] = math.inf
        start, length = torch.arange(nl) * n, torch.full((nl,), n)
        c0 = time.process_time()
        a = window_min_torch(f, start, length, w)
        c1 = time.process_time()
        b = lower_envelope_torch(f, start, length)
        c2 = time.process_time()
        assert bool(((a == b) | (b >= (w + 1) ** 2)).all())
        r = min(w, n - 1)
        pairs = (r * n - r * (r + 1) // 2) / n
        rows.append(
            f"| {n} | {w} | {nl * n:,} | {pairs:.1f} | {c1 - c0:.3f} | {c2 - c1:.3f} | "
            f"{(c1 - c0) / (nl * n * pairs) * 1e9:.2f} | {(c2 - c1) / (nl * n) * 1e9:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["lidar", "passes"])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--frames", type=int, default=3)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--voxels", type=float, nargs="+", default=[0.2])
    ap.add_argument("--label", default="", help="what code ran (e.g. a commit)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    lines = [
        "### ESDF update on the CPU, LiDAR",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}; torch {torch.__version__}; "
        "threads 1; CPU (the shared 2-core development machine), niced",
        f"- command: `python benchmarks/bench_esdf_cpu.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
        + (f" (code: {args.label})" if args.label else ""),
    ]
    body = []
    if "lidar" in args.parts:
        body += [
            "",
            f"norlab scans, {args.points} points each, max range 40 m, tsdf+esdf, ESDF max distance 2 m:",
            "",
            "| voxel m | frame | ESDF update CPU s | stored voxels | computed voxels | sites | M (voxels) |",
            "|---|---|---|---|---|---|---|",
        ]
        profs = []
        for v in args.voxels:
            rows, prof = lidar_case(args.data, args.frames, args.points, v)
            body += rows
            profs += prof
        body += ["", *profs]
    if "passes" in args.parts:
        body += [
            "",
            "1-D passes on random lines (70 % empty), CPU s (results equal below (window + 1)^2):",
            "",
            "| line length | window | slots | min-plus pairs per slot | min-plus s | envelope s "
            "| ns per pair | envelope ns per slot |",
            "|---|---|---|---|---|---|---|---|",
            *passes_case(),
        ]
    load1 = os.getloadavg()
    lines.append(f"- load average (1/5/15 min): {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f} at start, "
                 f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} at end")  # fmt: skip
    text = "\n".join(lines + body) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

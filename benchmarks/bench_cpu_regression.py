"""Issue 12's CPU budget: the CPU LiDAR TSDF frame of this tree against a base tree (the commit before the
normal-fit TSDF), interleaved, in process CPU time, 1 thread, under glibc's dynamic mmap threshold and the
service's fixed one (``MAPPER_MALLOC_MMAP_THRESHOLD``, 128 KiB).

Each (tree, threshold) runs in its own child process (``mallopt`` is per process); the children alternate
round by round, so the shared machine's load hits every variant alike. Frames: simulated 115 k-point
outdoor scans (``mapper.sim``, made once by this tree and handed to every child), integrated into a fresh
TSDF layer per round (the first frame allocates the pools and is not timed).

    git archive 89c1c20 mapper | tar -x -C /tmp/base   # the tree before the normals (s2-grazing merge)
    python benchmarks/bench_cpu_regression.py --base /tmp/base [--rounds 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(frames_path: str, voxel: float, threshold: int, ncv: float | None) -> dict:
    import torch

    torch.set_num_threads(1)
    if threshold > 0:
        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        try:  # this tree: the CPU path sizes its chunks below the threshold (as the service does)
            from mapper.kernels import chunks

            if hasattr(chunks, "set_cpu_block_bytes"):
                chunks.set_cpu_block_bytes(threshold)
        except ImportError:
            pass
    from mapper.integrators import tsdf
    from mapper.layers import BrickLayer

    frames = torch.load(frames_path)
    cfg = tsdf.TsdfConfig(voxel) if ncv is None else tsdf.TsdfConfig(voxel, normal_cell_vox=ncv)
    layer = BrickLayer(tsdf.tsdf_fields(cfg), torch.device("cpu"))
    times = []
    for i, (o, w) in enumerate(frames):
        t = time.process_time()
        tsdf.integrate_lidar(layer, o, w, cfg, lambda _: nullcontext())
        if i:
            times.append(time.process_time() - t)
    return {"cpu_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="a tree holding the base commit's mapper package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--voxel", type=float, nargs="+", default=[0.2, 0.1])
    ap.add_argument("--threshold", type=int, nargs="+", default=[0, 131072], help="0: glibc's dynamic one")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        frames_path, voxel, threshold, ncv = a.child
        ncv_v = None if ncv == "base" else float(ncv)
        print(json.dumps(child(frames_path, float(voxel), int(threshold), ncv_v)))
        return

    sys.path.insert(0, str(ROOT))
    import torch

    from mapper import sim

    scene = sim.outdoor_scene(0, extent_m=200.0)
    lidar = sim.SpinningLidar()
    frames = []
    for T in sim.driving_trajectory(a.frames, scene=scene):
        p = lidar.scan(scene, T).double()
        frames.append((T[:3, 3].clone(), (p @ T[:3, :3].T + T[:3, 3]).clone()))
    tmp = tempfile.NamedTemporaryFile(suffix=".pt", delete=False)
    torch.save(frames, tmp.name)
    # (label, tree, normal_cell_vox argument): the base's default (along the ray), this tree's default
    # (projected on the normals) and this tree along the ray
    variants = [("now, projected (default)", ROOT, "4.0"), ("now, along the ray", ROOT, "0.0")]
    if a.base:
        variants.insert(0, ("base (before normals)", a.base.resolve(), "base"))
    res: dict[tuple, list[float]] = {}
    for r in range(a.rounds):
        for s in a.voxel:
            for th in a.threshold:
                for label, tree, ncv in variants:
                    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
                    cmd = [sys.executable, __file__, "--child", tmp.name, str(s), str(th), ncv]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                    res.setdefault((s, th, label), []).extend(
                        json.loads(out.strip().splitlines()[-1])["cpu_s"]
                    )
                    print(
                        f"round {r} voxel {s} threshold {th} {label}: {res[(s, th, label)][-3:]}", flush=True
                    )
    os.unlink(tmp.name)
    lines = [
        "# CPU LiDAR TSDF frame: this tree vs the base before the normal fit (bench_cpu_regression.py)",
        "",
        f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), load average "
        f"{os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}",
        f"- command: `python benchmarks/bench_cpu_regression.py {'--base BASE ' if a.base else ''}--rounds "
        f"{a.rounds} --frames {a.frames} --voxel {' '.join(map(str, a.voxel))} --threshold "
        f"{' '.join(map(str, a.threshold))}`",
        f"- {frames[0][1].shape[0]} points per scan; process CPU time of `integrate_lidar`, 1 thread, "
        f"{a.rounds} rounds x {a.frames - 1} frames per variant, children alternating",
        "",
        "| voxel (m) | malloc mmap threshold | variant | median (ms) | p90 (ms) | max (ms) | vs base |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in a.voxel:
        for th in a.threshold:
            base = res.get((s, th, variants[0][0])) if a.base else None
            for label, _, _ in variants:
                v = sorted(res[(s, th, label)])
                med = statistics.median(v)
                p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
                rel = f"{100 * (med / statistics.median(base) - 1):+.1f} %" if base else ""
                thl = "dynamic (glibc)" if th == 0 else f"{th} B"
                ms = f"{med * 1e3:.1f} | {p90 * 1e3:.1f} | {v[-1] * 1e3:.1f}"
                lines.append(f"| {s} | {thl} | {label} | {ms} | {rel} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()

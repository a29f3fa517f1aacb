"""Cost of the LiDAR TSDF's grazing-incidence correction: ``integrate_lidar`` with the distances projected on
the scan's normals (``normal_cell_vox=4``, the default) against the along-ray distance (``normal_cell_vox=0``,
the previous path), interleaved, on simulated 115 k-point outdoor scans; and ``scan_normals`` alone.

Run: ``python benchmarks/bench_lidar_normals.py --device cpu|cuda [--frames 6] [--out FILE.md] [--cpu-time]``
(``--cpu-time``: process CPU time instead of wall time, for a CPU run on a machine other jobs load).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import torch

from mapper import sim
from mapper.integrators import tsdf
from mapper.kernels.normals import scan_normals
from mapper.layers import BrickLayer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--frames", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU time, not wall time (a CPU run on a machine shared with other jobs)",
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    clock = time.process_time if a.cpu_time else time.perf_counter
    scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
    lidar = sim.SpinningLidar()
    frames = []
    for T in sim.driving_trajectory(a.frames, scene=scene):
        T = T.to(dev)
        p = lidar.scan(scene, T).double()
        frames.append((T[:3, 3], p @ T[:3, :3].T + T[:3, 3]))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rows = []
    for s in (0.2, 0.1):
        res: dict[float, list[float]] = {0.0: [], 4.0: []}
        for ncv in (0.0, 4.0, 0.0, 4.0):  # interleaved: the machine's load hits both alike
            cfg = tsdf.TsdfConfig(s, normal_cell_vox=ncv)
            layer = BrickLayer(tsdf.tsdf_fields(cfg), dev)
            for i, (o, w) in enumerate(frames):
                sync()
                t = clock()
                tsdf.integrate_lidar(layer, o, w, cfg, lambda _: nullcontext())
                sync()
                if i:  # the first frame allocates the pools
                    res[ncv].append((clock() - t) * 1e3)
        tn = []
        for o, w in frames:
            sync()
            t = clock()
            scan_normals(o, w, 4 * s)
            sync()
            tn.append((clock() - t) * 1e3)
        row = (s, statistics.median(res[0.0]), statistics.median(res[4.0]), statistics.median(tn))
        rows.append(row)
        print(
            f"voxel {s} m: along-ray {row[1]:.1f} ms, projected {row[2]:.1f} ms, "
            f"normals alone {row[3]:.1f} ms"
        )
    if a.out:
        hw = (
            torch.cuda.get_device_name(0)
            if dev.type == "cuda"
            else (platform.processor() or platform.machine())
        )
        lines = [
            "# LiDAR TSDF: projected on scan normals vs along the ray (bench_lidar_normals.py)",
            "",
            f"{datetime.now(UTC).isoformat(timespec='seconds')}, {hw}, torch {torch.__version__}, "
            f"{a.threads} thread(s)",
            f"command: python benchmarks/bench_lidar_normals.py --device {a.device} --frames {a.frames} "
            f"--threads {a.threads}{' --cpu-time' if a.cpu_time else ''}",
            f"clock: {'process CPU time (the machine is shared)' if a.cpu_time else 'wall time'}",
            f"{frames[0][1].shape[0]} points per scan; integrate_lidar medians over "
            f"{2 * (a.frames - 1)} frames",
            "",
            "| voxel (m) | along-ray (ms) | projected (ms) | scan_normals alone (ms) |",
            "|---|---|---|---|",
        ]
        lines += [f"| {s} | {x:.1f} | {y:.1f} | {z:.1f} |" for s, x, y, z in rows]
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

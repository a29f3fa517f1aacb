"""LiDAR TSDF at grazing incidence: zero-crossing error on a flat ground, along-ray vs projected distance.

Runs the scenes of ``tests/test_tsdf_grazing.py`` (same code, so the numbers are those the tests bound) and
writes a table: per elevation band and plane offset, the vertical zero-crossing error (mean / p95 / p99, in
voxels) and the share of observed columns with a crossing, for ``normal_cell_vox=0`` (the previous
along-ray distance) and the default projected distance; then the objects-on-ground scene.

    python benchmarks/bench_grazing.py [--device cpu|cuda] [--out benchmarks/results/grazing_cpu.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_tsdf_grazing as G  # noqa: E402

from mapper import sim  # noqa: E402
from mapper.integrators import tsdf  # noqa: E402
from mapper.surface import zero_crossings  # noqa: E402


def _objects(device, s, ncv):
    objects = (
        sim.Sphere((3.0, 0.5, 1.2), 1.0),
        sim.Box.from_yaw((-2.5, 2.0, 1.0), (0.8, 1.2, 1.0), 0.4),
        sim.Sphere((0.5, -3.5, 0.8), 0.6),
        sim.Box.from_bounds((-1.0, -6.0, 0.0), (1.5, -5.0, 2.0)),
    )
    ground = sim.Plane((0.0, 0.0, 0.0), (0.0, 0.0, 1.0))
    scene = sim.Scene.from_primitives((ground, *objects))
    lidar = sim.SpinningLidar(n_beams=32, n_azimuth=720, fov_up_deg=15, fov_down_deg=-30, max_range_m=20)
    poses = []
    for f in range(3):
        T = torch.eye(4, dtype=torch.float64)
        T[:3, 3] = torch.tensor([0.3 * f, -0.2 * f, 1.0], dtype=torch.float64)
        poses.append(T)
    g, d = G._integrate(scene, lidar, poses, tsdf.TsdfConfig(s, normal_cell_vox=ncv), device)
    p, _ = zero_crossings(g, d["tsdf"], d["weight"], s)
    p = p.cpu()
    err = scene.sdf(p).abs().numpy() / s
    d_obj = sim.Scene.from_primitives(objects).sdf(p).abs()
    on_obj = (d_obj < sim.Scene.from_primitives((ground,)).sdf(p).abs()).numpy()
    return err[on_obj], err[~on_obj]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    s = 0.1
    lines = [
        "# LiDAR TSDF at grazing incidence: zero-crossing error (issue 11)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- hardware: {platform.machine()}, {os.cpu_count()} CPU threads; device {a.device}"
        + (f" ({torch.cuda.get_device_name()})" if a.device.startswith("cuda") else ""),
        f"- software: python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python benchmarks/bench_grazing.py --device {a.device}"
        + (f" --out {a.out}`" if a.out else "`"),
        "- scenes: those of tests/test_tsdf_grazing.py (24-beam spinning LiDAR 1.73 m over a plane, 3 frames,"
        " 10 cm voxels; errors in voxels; 'before' = normal_cell_vox=0, the along-ray distance)",
        "",
        "| elevations | plane offset (voxel) | before mean / p95 / p99 | before columns | "
        "after mean / p95 / p99 | after columns |",
        "|---|---|---|---|---|---|",
    ]
    for el in ((5, 10), (10, 20), (20, 30)):
        for off in (0.0, 0.3, 0.5):
            row = [f"{el[0]}-{el[1]} deg", f"{off:.1f}"]
            for ncv in (0.0, 4.0):
                err, cov = G._ground_case(dev, el, off * s, s, ncv)
                st = (
                    f"{err.mean():.3f} / {np.percentile(err, 95):.3f} / {np.percentile(err, 99):.3f}"
                    if err.size
                    else "no crossing"
                )
                row += [st, f"{100 * cov:.0f} %"]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    lines += ["", "| objects on a ground (32 beams) | objects mean / p95 | ground mean |", "|---|---|---|"]
    for name, ncv in (("before (along the ray)", 0.0), ("after (projected)", 4.0)):
        obj, gnd = _objects(dev, s, ncv)
        lines.append(f"| {name} | {obj.mean():.4f} / {np.percentile(obj, 95):.3f} | {gnd.mean():.3f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()

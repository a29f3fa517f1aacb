"""Voxelization: the hash-table Triton path vs the sort-based torch path (mapper.kernels.voxelize).

Clouds (4 channels: x, y, z, intensity-like):
* ``sim``: a simulated spinning LiDAR scan (``bench_fps.lidar_cloud``: 64 beams, azimuths scaled to reach
  N returns, N drawn at random, sensor frame) plus the range in metres as the 4th channel;
* ``norlab``: the first real 32-beam scan of ``../shared/data/norlab_lidar`` (41 k points, its size only).

Configurations (nuScenes-style, 360 degrees): ``pillars`` = CenterPoint-PointPillars (0.2 x 0.2 x 8 m,
range [-51.2, -51.2, -5] .. [51.2, 51.2, 3], K = 20, 30 000 voxels); ``voxels`` = CenterPoint-VoxelNet
(0.1 x 0.1 x 0.2 m, range [-54, -54, -5] .. [54, 54, 3], K = 10, 60 000 voxels).

On CUDA both paths run and their outputs are compared (identical tensors); on the CPU only the torch path
(the Triton interpreter is not a speed). Times: medians of ``--reps`` calls after warm-up (CUDA events),
the host sync for the output size included.

Usage:
    python benchmarks/bench_voxelize.py --device cuda --sizes 25e3 50e3 130e3 250e3 500e3 1e6 --out vox.md
    python benchmarks/bench_voxelize.py --device cpu --sizes 25e3 130e3 250e3 --threads 1
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fps import Timer, lidar_cloud  # noqa: E402

from mapper.kernels.voxelize import voxelize_torch, voxelize_triton  # noqa: E402

CONFIGS = {
    "pillars": dict(
        voxel_size_m=(0.2, 0.2, 8.0),
        range_min=(-51.2, -51.2, -5.0),
        range_max=(51.2, 51.2, 3.0),
        max_points_per_voxel=20,
        max_voxels=30000,
    ),
    "voxels": dict(
        voxel_size_m=(0.1, 0.1, 0.2),
        range_min=(-54.0, -54.0, -5.0),
        range_max=(54.0, 54.0, 3.0),
        max_points_per_voxel=10,
        max_voxels=60000,
    ),
}


def with_range(p: torch.Tensor) -> torch.Tensor:
    return torch.cat((p, p.norm(dim=1, keepdim=True)), 1).contiguous()


def norlab_cloud(device: torch.device) -> torch.Tensor | None:
    root = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "norlab_lidar" / "scans"
    files = sorted(root.glob("cloud_*.vtk"))
    if not files:
        return None
    from mapper.datasets import read_vtk_points

    return with_range(torch.from_numpy(read_vtk_points(files[0])["points"]).to(device))


def bench(name: str, p: torch.Tensor, cfg_name: str, args, dev: torch.device, timer: Timer) -> dict:
    cfg = CONFIGS[cfg_name]
    row = {"cloud": name, "n": p.shape[0], "config": cfg_name}
    ref = voxelize_torch(p, **cfg)
    row["voxels"] = ref[0].shape[0]
    row["points_kept"] = int(ref[2].sum())
    row["sort_ms"] = timer(lambda: voxelize_torch(p, **cfg), args.reps)
    if dev.type == "cuda":
        got = voxelize_triton(p, **cfg)
        row["same"] = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        row["hash_ms"] = timer(lambda: voxelize_triton(p, **cfg), args.reps, warmup=3)
    return row


HEAD_CPU = "| cloud | N | config | V | points kept | sort (torch) ms |"
HEAD_GPU = (
    "| cloud | N | config | V | points kept | hash (Triton) ms | sort (torch) ms | sort / hash | same |"
)


def fmt_row(r: dict, cuda: bool) -> str:
    base = f"| {r['cloud']} | {r['n']} | {r['config']} | {r['voxels']} | {r['points_kept']} |"
    if not cuda:
        return base + f" {r['sort_ms']:.2f} |"
    return base + (
        f" {r['hash_ms']:.3f} | {r['sort_ms']:.3f} | {r['sort_ms'] / r['hash_ms']:.1f}x | {r['same']} |"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=float, nargs="+", default=[25e3, 50e3, 130e3, 250e3, 500e3, 1e6])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    hw = torch.cuda.get_device_name(dev) if cuda else f"{platform.processor() or platform.machine()}"
    head = [
        f"# bench_voxelize ({args.device})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}"
        + (f", triton {__import__('triton').__version__}" if cuda else ""),
        f"- command: `python {' '.join(sys.argv)}`",
        "- configs: pillars = 0.2 x 0.2 x 8 m, K = 20, max 30 000 voxels; voxels = 0.1 x 0.1 x 0.2 m,"
        " K = 10, max 60 000 voxels (nuScenes CenterPoint ranges); clouds: sim = simulated 64-beam scan,"
        " norlab = real 32-beam scan; medians of "
        f"{args.reps} calls; same = Triton outputs identical to the torch reference",
        "",
        HEAD_GPU if cuda else HEAD_CPU,
        "|" + "---|" * ((HEAD_GPU if cuda else HEAD_CPU).count("|") - 1),
    ]
    print("\n".join(head), flush=True)
    timer = Timer(dev)
    rows = []

    def clouds():
        real = norlab_cloud(dev)
        if real is not None:
            yield "norlab", real
        for n in args.sizes:
            yield "sim", with_range(lidar_cloud(int(n), dev))

    for name, p in clouds():
        for cfg_name in args.configs:
            rows.append(bench(name, p, cfg_name, args, dev, timer))
            print(fmt_row(rows[-1], cuda), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(head) + "\n" + "\n".join(fmt_row(r, cuda) for r in rows) + "\n")
    return rows


if __name__ == "__main__":
    main()

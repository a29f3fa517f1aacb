"""Demo: build index grids from the real LiDAR scans in ``../shared/data`` and run the topology operators.

``python -m mapper.demo [--data PATH] [--voxel 0.1] [--device auto]``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from . import IndexGrid
from .datasets import NorlabLidar, default_data_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--voxel", type=float, default=0.10, help="voxel size in metres")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    ds = NorlabLidar(args.data / "norlab_lidar")
    print(f"{len(ds)} LiDAR scans from {args.data / 'norlab_lidar'}; voxel {args.voxel} m; device {dev}")
    grid = IndexGrid.empty(dev)
    t0 = time.perf_counter()
    for i in range(len(ds)):
        f = ds[i]
        T = f["T_world_sensor"]
        pts = f["points"][np.isfinite(f["points"]).all(1)]
        world = pts @ T[:3, :3].T + T[:3, 3]
        ijk = torch.from_numpy(np.floor(world / args.voxel).astype(np.int64)).to(dev)
        grid = grid.merged_grid(IndexGrid.from_ijk(ijk))
    t1 = time.perf_counter()
    print(
        f"occupied voxels: {grid.num_voxels} in {grid.num_leaves} leaves "
        f"({grid.nbytes / max(grid.num_voxels, 1):.2f} topology bytes/voxel), built in {t1 - t0:.2f} s"
    )
    for name, fn in [
        ("dilated_grid(2, 26)", lambda: grid.dilated_grid(2, 26)),
        ("eroded_grid(1, 6) of that", lambda: grid.dilated_grid(2, 26).eroded_grid(1, 6)),
        ("coarsened_grid()", grid.coarsened_grid),
        ("refined_grid()", grid.refined_grid),
    ]:
        t = time.perf_counter()
        g = fn()
        print(f"  {name:28s} -> {g.num_voxels:9d} voxels  ({(time.perf_counter() - t) * 1e3:7.1f} ms)")


if __name__ == "__main__":
    main()

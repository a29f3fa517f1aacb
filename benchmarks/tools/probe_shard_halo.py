"""Design probe for sharded maps (issue 17, not built): is "every shard integrates the whole frame, then
drops the voxels outside its root tiles widened by a halo" exact? For K shards (root-tile stripes along x,
tile t owned by shard t mod K) it compares, at every voxel of each shard's own tiles, the TSDF (value,
weight), and at random points of its tiles the ESDF distance and observed flag, with one unsharded map fed
the same frames. Writes a markdown table.

    python benchmarks/tools/probe_shard_halo.py --out benchmarks/results/shard_halo_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_service_helpers import scan  # noqa: E402

from mapper import Map  # noqa: E402

TILE_VOXELS = 32  # a root tile of the index grid is 32 voxels on a side


def run(k: int, halo_m: float, voxel: float, frames: int, esdf_max: float) -> list[dict]:
    cfg = dict(voxel_size_m=voxel, layers=["tsdf", "esdf"], esdf_max_distance_m=esdf_max)
    tile = TILE_VOXELS * voxel

    def owner(x: torch.Tensor) -> torch.Tensor:
        return torch.floor(x / tile).long() % k

    full = Map(**cfg, device="cpu")
    shards = [Map(**cfg, device="cpu") for _ in range(k)]
    for i in range(frames):
        pts, T = scan(i)
        pts = pts.copy()
        T = T.copy()
        T[0, 3] = 0.5 * i  # drive 0.5 m per frame: the map spans several tiles
        full.integrate_lidar(pts, T)
        for s, m in enumerate(shards):
            m.integrate_lidar(pts, T)

            def outside(c, s=s):
                keep = (owner(c[:, 0]) == s) | (owner(c[:, 0] - halo_m) == s) | (owner(c[:, 0] + halo_m) == s)
                return ~keep

            m._clear_where(outside)  # the probe's stand-in for a shard's region
        full.update_esdf()
        for m in shards:
            m.update_esdf()
    g, _ = full.layer("tsdf")
    centres = ((g.ijk.to(torch.float64) + 0.5) * voxel).float()
    own = owner(centres[:, 0].double())
    lo, hi = centres.min(0).values.numpy() - 1, centres.max(0).values.numpy() + 1
    rows = []
    for s, m in enumerate(shards):
        c = centres[own == s]
        t, w = m.query_tsdf(c)
        tf, wf = full.query_tsdf(c)
        rng = np.random.default_rng(s)
        p = torch.tensor(rng.uniform(lo, hi, (30000, 3)), dtype=torch.float32)
        p = p[owner(p[:, 0].double()) == s]
        d, _, ob = m.query_distance(p)
        df, _, obf = full.query_distance(p)
        rows.append(
            {
                "k": k,
                "halo": halo_m,
                "shard": s,
                "voxels": int(c.shape[0]),
                "tsdf": float((torch.nan_to_num(t, 9) - torch.nan_to_num(tf, 9)).abs().max())
                if len(c)
                else 0.0,
                "weight": float((w - wf).abs().max()) if len(c) else 0.0,
                "points": int(p.shape[0]),
                "esdf": float((torch.nan_to_num(d, 99) - torch.nan_to_num(df, 99)).abs().max()),
                "observed": int((ob != obf).sum()),
                "bricks": m.bricks.get("tsdf", 0),
                "full_bricks": full.bricks.get("tsdf", 0),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--voxel", type=float, default=0.1)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--esdf-max", type=float, default=1.0)
    ap.add_argument("--halos", default="0,1.5")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for k in (2, 3):
        for h in [float(x) for x in args.halos.split(",")]:
            rows += run(k, h, args.voxel, args.frames, args.esdf_max)
    lines = [
        "# Sharding probe: whole-frame integration + prune to own root tiles and a halo (issue 17)",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; CPU (2 shared cores)",
        f"- command: `python {' '.join(sys.argv)}` ({time.perf_counter() - t0:.0f} s)",
        f"- voxel {args.voxel} m, tsdf+esdf (ESDF max distance {args.esdf_max} m, truncation 3 voxels), "
        f"{args.frames} LiDAR frames (tests/test_service_helpers.scan, driving 0.5 m per frame); root tiles "
        f"{TILE_VOXELS * args.voxel:g} m wide, striped along x over K shards",
        "- max |difference| vs the unsharded map over each shard's own voxels (TSDF at voxel centres) and "
        "random points in its own tiles (ESDF); 0 = exact",
        "",
        "| K | halo (m) | shard | own voxels | TSDF diff | weight diff | ESDF points | ESDF diff | observed "
        "mismatches | shard TSDF bricks / unsharded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["k"], f"{r['halo']:g}", r["shard"], r["voxels"], f"{r['tsdf']:.3g}", f"{r['weight']:.3g}"]
        cells += [r["points"], f"{r['esdf']:.3g}", r["observed"], f"{r['bricks']} / {r['full_bricks']}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

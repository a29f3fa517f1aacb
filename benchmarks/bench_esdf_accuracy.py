"""How far a (coarse) ESDF reads from the fine surface it covers: ``ESDF - d_true`` in ESDF voxels.

The scenes and the oracle are those of ``tests/test_esdf_overestimate.py`` (partly observed LiDAR scans of
ground, thin poles and walls at a 5 cm TSDF / occupancy voxel; ``d_true`` = exact distance from each observed
ESDF voxel's centre to the fine surface, NumPy / SciPy). Over the observed ESDF voxels with ``d_true <
max distance - S`` (beyond it the clamp hides the error), per source and ESDF voxel ratio: p5 / p50 / p90 /
p99 / max of ``|esdf| - d_true`` and the guaranteed bound ``S / 2 + sqrt(3) / 2 s`` (both in ESDF voxels).

Run (CPU)::

    python benchmarks/bench_esdf_accuracy.py --out benchmarks/results/esdf_accuracy_cpu.md

``PYTHONPATH`` picks the ``mapper`` measured (e.g. another checkout, for a before / after table); the label
goes in the table (``--label``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_esdf_overestimate as scenes  # noqa: E402


def measure(ratios, sources) -> list[str]:
    rows = []
    for source in sources:
        for ratio in ratios:
            S = scenes.FINE * ratio
            m = scenes.build_map(ratio, source)
            over, true, _ = scenes.overestimate(m, source)
            near = true < scenes.MAX_DISTANCE - S
            q = np.percentile(over[near] / S, [5, 50, 90, 99, 100])
            bound = (S / 2 + math.sqrt(3) / 2 * scenes.FINE) / S
            rows.append(
                f"| {source} | {scenes.FINE * 100:.0f} cm / {S * 100:g} cm ({ratio:g}x) | {near.sum()} | "
                + " / ".join(f"{v:+.2f}" for v in q)
                + f" | {bound:.2f} |"
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[1, 2, 2.5, 4])
    ap.add_argument("--sources", nargs="+", default=["tsdf", "occupancy"])
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    head = [
        f"### {args.label} ({_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC, CPU: "
        f"{platform.processor() or platform.machine()})",
        "",
        "| source | TSDF / ESDF voxel | voxels | ESDF - d_true (ESDF voxels): p5 / p50 / p90 / p99 / max "
        "| bound |",
        "|---|---|---|---|---|",
    ]
    text = "\n".join(head + measure([r if r != int(r) else int(r) for r in args.ratios], args.sources)) + "\n"
    sys.stdout.write(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

"""Occupancy frame path A/B on one machine (issue 12): ``bench_frame.py`` with this tree's frame path
(``--variant new``) or with the previous one restored by patches (``--variant old``):

* the log-odds update as the previous code did it on the GPU: per chunk of 2^16 bricks a paged gather,
  ~8 element-wise ops and a paged scatter (``logodds.flags_update_torch`` is that code, kept as the
  reference), instead of the one ``_flags_update_kernel`` launch;
* the frame's ray chunking read its row estimate (``segments._ray_chunks``: a host sync) before the coarse
  pass read its own size; now the coarse pass's size read decides (``brick_segments(max_rows=...)``).

The variants run one after the other in one process on the same frames (generated once; the kernels the
two share compiled once), each a full ``bench_frame.py`` run: everything after ``--`` goes to it, with
``{variant}`` in the paths replaced:
  python benchmarks/bench_occ_ab.py --variants new old -- --cases occupancy_5cm --lidar-frames 100 \
      --out r_{variant}.md --json r_{variant}.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_frame  # noqa: E402

from mapper.integrators import free, occupancy  # noqa: E402
from mapper.kernels import logodds  # noqa: E402
from mapper.kernels import segments as S  # noqa: E402


def restore_previous_path():
    """Patch the previous path in; returns a function that undoes the patches."""
    saved = (occupancy.flags_update, free.flags_update, S.brick_segments)
    occupancy.flags_update = logodds.flags_update_torch  # same signature: the chunked gather/scatter
    free.flags_update = logodds.flags_update_torch
    real = S.brick_segments

    def brick_segments_estimate_first(origins, dirs, t0, t1, cell, max_rows=None):
        if max_rows is not None and len(S._ray_chunks(origins, dirs, t0, t1, cell, max_rows)) > 1:
            return None  # the row estimate (its own host sync), then the coarse pass as before
        return real(origins, dirs, t0, t1, cell)

    S.brick_segments = brick_segments_estimate_first

    def undo():
        occupancy.flags_update, free.flags_update, S.brick_segments = saved

    return undo


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=("old", "new"), default=["new", "old"])
    args = ap.parse_args(argv[:cut])
    if "old" in args.variants and args.variants[-1] != "old":
        ap.error("old must come last (its patches stay for the rest of the process)")
    frames = {}
    gen = bench_frame.lidar_frames

    def lidar_frames_once(n, dev, beams):
        if (n, str(dev), beams) not in frames:
            frames[(n, str(dev), beams)] = gen(n, dev, beams)
        return frames[(n, str(dev), beams)]

    bench_frame.lidar_frames = lidar_frames_once
    for v in args.variants:
        if v == "old":
            restore_previous_path()
        print(f"# variant {v}", flush=True)
        bench_frame.main([a.replace("{variant}", v) for a in argv[cut + 1 :]])


if __name__ == "__main__":
    main()

"""Torch ops, Triton launches and host syncs of one occupancy LiDAR frame, counted on the CPU (issue 12).

The GPU frame is bound by the host: each torch op is a launch (~15-30 us of Python and dispatch on the H200
host), each host sync drains the queue. Both can be counted without a GPU: the frame runs on CPU tensors
with the Triton kernels under the interpreter (``TRITON_INTERPRET=1``, ``MAPPER_KERNELS=triton``: the torch
glue the GPU path issues, op for op), a ``TorchDispatchMode`` counts the aten ops the frame dispatches
(without the interpreter's own, which run inside a kernel launch), the interpreter's ``run`` counts the
launches, and ``tests/sync_count.SyncCounter`` the calls that sync on CUDA. ``--kernels torch`` counts the
CPU path (the torch references) instead.

Run it against two trees for a before/after (the script itself from either):
  PYTHONPATH=<tree> python benchmarks/tools/occ_ops.py --label new --out r.md
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", choices=("triton", "torch"), default="triton")
ap.add_argument("--beams", type=int, default=16)
ap.add_argument("--azimuths", type=int, default=256)
ap.add_argument("--voxel", type=float, default=0.05)
ap.add_argument("--frames", type=int, default=3, help="frames before the counted one (the map grows)")
ap.add_argument("--label", default="")
ap.add_argument("--out", default=None, help="append a markdown row here")
args = ap.parse_args()
os.environ["TRITON_INTERPRET"] = "1"
os.environ["MAPPER_KERNELS"] = args.kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from sync_count import SyncCounter  # noqa: E402

from mapper import Map, sim  # noqa: E402


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Syncs(SyncCounter):
    """The sync-making calls of the frame, without the interpreter's own (inside a launch)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if counter.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


launches: Counter = Counter()
counter = OpCounter()
if args.kernels == "triton":
    from triton.runtime.interpreter import InterpretedFunction

    _run = InterpretedFunction.run

    def run(self, *a, **k):
        launches[self.fn.__name__] += 1
        counter.paused += 1  # the interpreter's own tensor ops are part of the launch
        try:
            return _run(self, *a, **k)
        finally:
            counter.paused -= 1

    InterpretedFunction.run = run

torch.manual_seed(0)
lidar = sim.SpinningLidar(n_beams=args.beams, n_azimuth=args.azimuths, max_range_m=60.0)
frames = list(sim.lidar_sequence(args.frames + 1, lidar=lidar))
m = Map(args.voxel, layers=("occupancy",), max_range_m=60.0)
for pts, T in frames[:-1]:
    m.integrate_lidar(pts, T, track=False)
pts, T = frames[-1]
launches.clear()  # the counted frame's launches only
with Syncs() as syncs, counter:
    m.integrate_lidar(pts, T, track=False)
# ops that only make a view or an empty tensor (no kernel on a GPU)
NO_KERNEL = {
    "aten.slice", "aten.select", "aten.view", "aten.expand", "aten._unsafe_view", "aten.unsqueeze",
    "aten.squeeze", "aten.t", "aten.transpose", "aten.permute", "aten.as_strided", "aten.alias",
    "aten.detach", "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.narrow", "aten.diagonal",
    "aten._reshape_alias", "aten.lift_fresh", "aten.empty", "aten.empty_strided", "aten.empty_like",
    "aten._local_scalar_dense", "aten.reshape",
}  # fmt: skip
n_ops = sum(counter.ops.values())
n_kernels = sum(v for k, v in counter.ops.items() if k not in NO_KERNEL)
n_launch = sum(launches.values())
n_sync = syncs.total
row = (
    f"| {args.label} | {args.kernels} | {pts.shape[0]} | {n_ops} | {n_kernels} | {n_launch} | {n_sync} | "
    + ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(10) if k not in NO_KERNEL)
    + " |"
)
print(row)
print("launches:", dict(launches))
print("syncs:", dict(syncs.sites))
if args.out:
    with open(args.out, "a") as f:
        f.write(row + "\n")

"""Operations one depth TSDF frame issues on the GPU path, counted on the CPU (issue 12: the frame is
host-bound, its wall time ~ the number of ops issued): aten ops that launch work (views and allocations
left out) and Triton launches, per stage, and the host reads, for the grow stage of the previous CUDA path
(``MAPPER_DEPTH_GROW=keyed``) and the current one (``triton_depth``).

Runs on a machine without a GPU: ``MAPPER_KERNELS=triton`` with ``TRITON_INTERPRET=1`` sends the frame down
the Triton path (each launch counted once; the interpreter's own tensor copies are not counted), on a
40x30 frame (one row chunk, as on CUDA; the counts do not depend on the image size).

Usage: TRITON_INTERPRET=1 MAPPER_KERNELS=triton python benchmarks/tools/count_depth_ops.py --out r.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mapper import Map, sim
from mapper.integrators import tsdf
from mapper.integrators.base import DepthFrame

_FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "set_", "resize_"}
_READS = {"_local_scalar_dense", "nonzero", "unique_dim", "_unique2", "masked_select", "item"}


class OpCounter(TorchDispatchMode):
    """aten ops that run a kernel (not views, not allocations), paused inside Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in _FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class LaunchCounter:
    """Triton launches (the interpreter's ``run``), with the op counter paused while one runs."""

    def __init__(self, ops: OpCounter):
        from triton.runtime.interpreter import InterpretedFunction

        self.cls = InterpretedFunction
        self.real = InterpretedFunction.run
        self.n: Counter[str] = Counter()
        counter, real = self, self.real

        def run(fn, *a, **k):
            counter.n[fn.fn.__name__] += 1
            ops.paused += 1
            try:
                return real(fn, *a, **k)
            finally:
                ops.paused -= 1

        InterpretedFunction.run = run

    def close(self):
        self.cls.run = self.real


def count(fn):
    ops = OpCounter()
    launches = LaunchCounter(ops)
    try:
        with ops:
            out = fn()
    finally:
        launches.close()
    return out, ops.ops, launches.n


def summary(ops: Counter, launches: Counter) -> str:
    reads = sum(v for k, v in ops.items() if k in _READS)
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
    tri = ", ".join(f"{k} {v}" for k, v in launches.items()) or "-"
    return f"{sum(ops.values())} | {sum(launches.values())} | {reads} | {top} | {tri}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--voxel", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("MAPPER_KERNELS") != "triton":
        sys.exit("set TRITON_INTERPRET=1 MAPPER_KERNELS=triton (the GPU path on the CPU)")
    cam = sim.PinholeCamera(40, 30, 33.0, 33.0, 20.0, 15.0)
    frames = list(sim.depth_sequence(3, cam, max_range_m=8.0))
    cfg = tsdf.TsdfConfig(args.voxel)
    rows = []
    for label, env in (("previous (keyed + dense bitmap)", "keyed"), ("triton_depth (hash set)", "")):
        os.environ["MAPPER_DEPTH_GROW"] = env
        d, K, T = frames[1]
        K = torch.as_tensor(K, dtype=torch.float64)
        T = torch.as_tensor(T, dtype=torch.float64)
        b, ops, launches = count(lambda d=d, K=K, T=T: tsdf.depth_band_bricks(d, K, T, cfg, 8.0))
        rows.append(f"| grow, {label} | {b.shape[0]} bricks | {summary(ops, launches)} |")
        m = Map(args.voxel, layers=("tsdf",), max_range_m=8.0, warmup=False)
        m.integrate_depth(*frames[0])
        frame = DepthFrame(d, K, T, None, 8.0)
        _, ops, launches = count(lambda m=m, frame=frame: m._integrate(frame))
        rows.append(f"| integrator (grow + merge + update), {label} | | {summary(ops, launches)} |")
        _, ops, launches = count(lambda m=m: m.integrate_depth(*frames[2]))
        rows.append(
            f"| whole Map.integrate_depth (+ host-side pose/K checks), {label} | | {summary(ops, launches)} |"
        )
    os.environ.pop("MAPPER_DEPTH_GROW", None)
    text = "\n".join(
        [
            "# depth TSDF frame: ops issued on the GPU path (counted on the CPU)",
            "",
            f"- date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- hardware: {platform.machine()} CPU (no GPU: Triton interpreter); torch {torch.__version__}",
            "- command: `TRITON_INTERPRET=1 MAPPER_KERNELS=triton python benchmarks/tools/count_depth_ops.py"
            f" --voxel {args.voxel}` (40x30 frame of sim.depth_sequence, frame 1 after frame 0)",
            "- columns: aten ops that launch work (views/allocations excluded) | Triton launches | host reads"
            " among them (`_local_scalar_dense`, `nonzero`, ...) | most frequent ops | Triton kernels",
            "- the whole Map call also counts the pose/K validation (`check_pose`/`check_intrinsics`: torch"
            " ops on 4x4/3x3 host tensors, their scalar reads): CPU work on the GPU path too, no launches",
            "",
            "| what | result | aten ops | Triton | reads | top ops | Triton kernels |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

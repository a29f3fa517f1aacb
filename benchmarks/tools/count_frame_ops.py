"""Count the operations one LiDAR TSDF frame issues, per stage, without a GPU (issue 12: the frame is
host-bound, so its wall time follows the number of torch ops and kernel launches it issues).

Runs the GPU code path on the CPU (``MAPPER_KERNELS=triton`` under ``TRITON_INTERPRET=1``: the same torch
glue and the same Triton launches as on CUDA) and counts, per stage of the map's timer, the aten ops
dispatched (a ``TorchDispatchMode``; what a Triton launch does inside the interpreter is not counted) and
the Triton launches. ``--torch`` counts the CPU reference path instead.

  MAPPER_KERNELS=triton TRITON_INTERPRET=1 python benchmarks/tools/count_frame_ops.py --voxel 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mapper import Map


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.stage = "other"
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[(self.stage, str(func.overloadpacket.__name__))] += 1
        return func(*args, **(kwargs or {}))


def _box_scan(beams: int, azimuth: int, k: int) -> torch.Tensor:
    """float32 ``[beams * azimuth, 3]``: a spinning scan (elevations -25..-1 deg) from 1.7 m above the floor
    of a 24 x 16 m room with 3 m walls, the sensor at ``x = 0.3 k`` (a simple scene: the sim's is slow to
    build on a loaded CPU)."""
    el = torch.deg2rad(torch.linspace(-25.0, -1.0, beams, dtype=torch.float64))
    az = torch.linspace(0, 2 * torch.pi, azimuth + 1, dtype=torch.float64)[:-1] + 0.01 * k
    e, z = torch.meshgrid(el, az, indexing="ij")
    d = torch.stack((torch.cos(e) * torch.cos(z), torch.cos(e) * torch.sin(z), torch.sin(e)), -1).reshape(
        -1, 3
    )
    x0 = 0.3 * k
    t = torch.full((d.shape[0],), 1e9, dtype=torch.float64)
    t = torch.where(d[:, 2] < 0, torch.minimum(t, 1.7 / -d[:, 2]), t)
    for axis, lo, hi, o in ((0, -12.0, 12.0, x0), (1, -8.0, 8.0, 0.0)):
        tw = torch.where(d[:, axis] > 0, (hi - o) / d[:, axis], (lo - o) / d[:, axis])
        t = torch.minimum(t, tw)
    return (d * t[:, None]).to(torch.float32)


def _pose(k: int) -> torch.Tensor:
    T = torch.eye(4, dtype=torch.float64)
    T[0, 3], T[2, 3] = 0.3 * k, 1.7
    return T


def _count_part(a) -> None:
    from mapper.integrators.tsdf import TsdfConfig, lidar_rays
    from mapper.kernels.segments import brick_segments

    cfg = TsdfConfig(voxel_size_m=a.voxel)
    T = _pose(0)
    w = _box_scan(a.beams, a.azimuth, 0).double() @ T[:3, :3].T + T[:3, 3]
    o = T[:3, 3].clone()
    if a.part == "rays":
        run = lambda: lidar_rays(o, w, cfg)  # noqa: E731
    else:
        dirs, _, t0, t1, _, _ = lidar_rays(o, w, cfg)
        oe = o.expand(w.shape[0], 3)
        run = lambda: brick_segments(oe, dirs, t0, t1, 4 * a.voxel)  # noqa: E731
    run()  # warm (compiles nothing on the CPU; imports)
    cnt = _Count()
    launches = Counter()
    import triton.runtime.interpreter as interp

    orig = interp.InterpretedFunction.run

    def hooked(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        cnt.paused += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            cnt.paused -= 1

    interp.InterpretedFunction.run = hooked
    with cnt:
        run()
    interp.InterpretedFunction.run = orig
    mode = "torch reference" if a.torch else "Triton path (interpreted)"
    print(f"# {a.part}: {w.shape[0]} returns, {a.voxel} m, {mode}")
    print(f"aten ops {sum(cnt.ops.values())}, Triton launches {sum(launches.values())} {dict(launches)}")
    if a.verbose:
        for (_, name), v in sorted(cnt.ops.items(), key=lambda kv: -kv[1]):
            print(f"  {name:30s} {v}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxel", type=float, default=0.1)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--azimuth", type=int, default=64)
    ap.add_argument("--torch", action="store_true", help="count the CPU reference path")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--part",
        choices=("frame", "rays", "coarse"),
        default="frame",
        help="frame: a whole frame (slow when interpreted); rays: lidar_rays (normal fit + bands) alone; "
        "coarse: the coarse pass (brick_segments) alone",
    )
    a = ap.parse_args(argv)
    os.environ["MAPPER_KERNELS"] = "torch" if a.torch else "triton"
    if a.part != "frame":
        return _count_part(a)
    frames = [(_box_scan(a.beams, a.azimuth, k), _pose(k)) for k in range(3)]
    m = Map(a.voxel, layers=("tsdf",), max_range_m=60.0)
    for f in frames[:2]:
        m.integrate_lidar(f[0], f[1], track=False)
    cnt = _Count()
    launches = Counter()
    import triton.runtime.interpreter as interp

    orig = interp.InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches[(cnt.stage, self.fn.__name__)] += 1
        cnt.paused += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            cnt.paused -= 1

    interp.InterpretedFunction.run = run
    old_call = type(m._timer).__call__

    @contextlib.contextmanager
    def timer(self, name):
        prev, cnt.stage = cnt.stage, name
        try:
            with old_call(self, name):
                yield
        finally:
            cnt.stage = prev

    type(m._timer).__call__ = timer
    with cnt:
        m.integrate_lidar(frames[2][0], frames[2][1], track=False)
    interp.InterpretedFunction.run = orig
    type(m._timer).__call__ = old_call
    stages = sorted({s for s, _ in cnt.ops} | {s for s, _ in launches})
    mode = "torch reference" if a.torch else "Triton path (interpreted)"
    print(f"# LiDAR TSDF {a.voxel} m, {frames[2][0].shape[0]} points, {mode}")
    print("| stage | aten ops | Triton launches |")
    print("|---|---|---|")
    for s in stages:
        o = sum(v for (st, _), v in cnt.ops.items() if st == s)
        t = sum(v for (st, _), v in launches.items() if st == s)
        print(f"| {s} | {o} | {t} |")
    print(f"| total | {sum(cnt.ops.values())} | {sum(launches.values())} |")
    if a.verbose:
        for (s, name), v in sorted(cnt.ops.items()):
            print(f"  {s:10s} {name:30s} {v}")
        for (s, name), v in sorted(launches.items()):
            print(f"  {s:10s} [triton] {name:26s} {v}")


if __name__ == "__main__":
    sys.exit(main())

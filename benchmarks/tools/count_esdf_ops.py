"""Host cost of one ESDF update, counted on the CPU: aten ops dispatched (each one ~a kernel launch on
CUDA) and sync-making calls (tests/sync_count.py), per source line, for ``Map.update_esdf()`` after one
LiDAR frame (issue 12: the frame path is host-bound, so the op count is what to cut).

``--emulate-cuda`` (default on) runs the CUDA code path's choices on the CPU: dense brick sets, one chunk
per pass, the prefix-count nearest-crossing form, and the 1-D envelope pass counted as one op (a Triton
launch there). Run: ``python benchmarks/tools/count_esdf_ops.py --voxel 0.1 --beams 64``.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from sync_count import SyncCounter  # noqa: E402

from mapper import Map, sim  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts aten ops (views and metadata ops excluded: they launch nothing) per ``mapper`` line."""

    SKIP = (
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "slice",
        "select",
        "detach",
        "alias",
        "unsqueeze",
        "squeeze",
        "permute",
        "t",
        "transpose",
        "as_strided",
        "narrow",
        "split",
        "unbind",
        "_to_copy_noop",
    )

    def __init__(self, sites: bool = True):
        super().__init__()
        self.n = 0
        self.sites: Counter[str] = Counter()
        self.funcs: Counter[str] = Counter()
        self.want_sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name not in self.SKIP:
            self.n += 1
            if self.want_sites:
                for fr in reversed(traceback.extract_stack()[:-1]):
                    if fr.filename.endswith("integrators/esdf.py"):  # the ESDF function that issued it
                        self.sites[f"esdf.{fr.name}:{fr.lineno}"] += 1
                        self.funcs[fr.name] += 1
                        break
        return func(*args, **(kwargs or {}))


_PAUSED = [False]


class _Syncs(SyncCounter):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _PAUSED[0]:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def emulate_cuda():
    """Take the CUDA path's choices on the CPU (``esdf._cuda_path``), the 1-D envelope pass counted as one
    op (one Triton launch on CUDA, no sync)."""
    from mapper.integrators import esdf

    esdf._cuda_path = lambda device: True
    orig_pass = esdf.distance_pass

    def one_op(f, start, length, window):
        _PAUSED[0] = True
        try:
            with torch.utils._python_dispatch._disable_current_modes():
                out = orig_pass(f, start, length, window)
        finally:
            _PAUSED[0] = False
        return out.clone()  # counted: one launch

    esdf.distance_pass = one_op

    from mapper.grid import IndexGrid
    from mapper.layers import PagedPool

    # one Triton launch each on CUDA (the paged gather / scatter / fill where the pool has several pages;
    # the CPU loops over the pages)
    patched = (
        (PagedPool, "gather"),
        (PagedPool, "scatter"),
        (PagedPool, "fill_slots"),
        (IndexGrid, "ijk_to_leaf"),
    )
    for cls, name in patched:
        orig = getattr(cls, name)

        def counted(self, *args, _orig=orig, **kwargs):
            _PAUSED[0] = True
            try:
                with torch.utils._python_dispatch._disable_current_modes():
                    out = _orig(self, *args, **kwargs)
            finally:
                _PAUSED[0] = False
            torch.empty(0)  # counted: one launch
            return out

        setattr(cls, name, counted)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voxel", type=float, default=0.1)
    ap.add_argument("--beams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=2, help="frames integrated; the last update is counted")
    ap.add_argument("--no-emulate", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if not a.no_emulate:
        emulate_cuda()
    dev = torch.device("cpu")
    scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
    lidar = sim.SpinningLidar(n_beams=a.beams)
    poses = sim.driving_trajectory(a.frames, scene=scene)
    m = Map(a.voxel, layers=("tsdf", "esdf"), device=dev)
    for i, T in enumerate(poses):
        pts = lidar.scan(scene, T)
        m.integrate_lidar(pts, T)
        if i < len(poses) - 1:
            m.update_esdf()
    ops, syncs = OpCounter(), _Syncs()
    t = time.perf_counter()
    with syncs, ops:
        r = m.update_esdf()
    el = time.perf_counter() - t
    print(
        f"points {pts.shape[0]} voxel {a.voxel}: update_esdf ops {ops.n} syncs {syncs.total} "
        f"(counted wall {el:.1f} s); {r}"
    )
    print("ops by ESDF function:")
    for s, c in ops.funcs.most_common(a.top):
        print(f"  {c:6d} {s}")
    print("ops by site:")
    for s, c in ops.sites.most_common(a.top):
        print(f"  {c:6d} {s}")
    print("syncs by site:")
    for s, c in syncs.sites.most_common(a.top):
        print(f"  {c:6d} {s}")


if __name__ == "__main__":
    main()

"""The allocation alone (``BrickLayer.allocate``), this branch vs the previous algorithm, interleaved in one
process on the same brick sequence (issue 12: fewer launches per allocation; the merge stage of every frame).

The sequence: a LiDAR-like band of bricks, a ground plane and walls in a window that advances every frame
(``--bricks`` per frame, ~5 % new, new leaves every frame), plus every other frame a revisit of an old window
(nothing new). Per frame both layers allocate the same bricks; each call is timed on the host from its start
to the device finishing it (``torch.cuda.synchronize`` after the call: this is the call's latency),
alternating which one goes first. ``previous`` is ``BrickLayer.allocate_kept`` of commit 04bf0e6 (the
allocation in one size read, ~60 torch ops), copied here as the reference of the comparison; the layers
must be identical at the end. Per call also: aten operators (a ``TorchDispatchMode`` counter, any device),
GPU activities (kernels, copies, fills; ``torch.profiler``, CUDA only) and host syncs
(``torch.cuda.set_sync_debug_mode("warn")``, CUDA only), on a frame with new leaves and on a revisit.

Usage: python benchmarks/bench_allocate.py --device cuda --frames 60 --out r.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mapper.grid import IndexGrid
from mapper.kernels.keys import encode_leaf_keys
from mapper.kernels.setops import insert_sorted_keys
from mapper.kernels.topology import lookup_leaves, make_leaves
from mapper.layers import BrickLayer, FieldSpec, brick_in_leaf, brick_masks

_KEY_SENTINEL = torch.iinfo(torch.int64).max


def previous_allocate_kept(self: BrickLayer, brick_ijk: torch.Tensor, keep: torch.Tensor | None = None):
    """``BrickLayer.allocate_kept`` at commit 04bf0e6 (the comparison's reference; same contract)."""
    dev = self.device
    m = brick_ijk.shape[0]
    z = torch.zeros(0, dtype=torch.int64, device=dev)
    if m == 0:
        return z, z
    old = self.grid.leaves
    la = old.keys.numel()
    lk = encode_leaf_keys(brick_ijk >> 1)
    b = brick_in_leaf(brick_ijk << 2)
    if la:
        in_old = lookup_leaves(old.keys, lk)
        cur = self.slots[in_old.clamp(min=0), b].to(torch.int64)
        cur = torch.where(in_old >= 0, cur, -1)
    else:
        in_old = torch.full_like(lk, -1)
        cur = in_old
    kept = torch.ones(m, dtype=torch.bool, device=dev) if keep is None else keep.to(torch.bool)
    missing = kept & (cur < 0)
    sk, order = torch.sort(torch.where(missing & (in_old < 0), lk, _KEY_SENTINEL))
    first = sk != _KEY_SENTINEL
    first[1:] &= sk[1:] != sk[:-1]
    leaf_rank_sorted = torch.cumsum(first, 0) - 1
    brick_rank = torch.cumsum(missing, 0) - 1
    kept_rank = torch.cumsum(kept, 0) - 1
    sizes = torch.stack((leaf_rank_sorted[-1], brick_rank[-1], kept_rank[-1])) + 1
    n_leaves, n_bricks, n_kept = sizes.tolist()
    if n_kept == 0:
        return z, z
    slots, bver = self.slots, self.brick_versions
    leaf = in_old
    if n_leaves:
        new_keys = torch.empty(n_leaves + 1, dtype=torch.int64, device=dev)
        new_keys[torch.where(first, leaf_rank_sorted, n_leaves)] = sk
        keys, pos_old, pos_new = insert_sorted_keys(old.keys, new_keys[:n_leaves])
        slots = torch.full((keys.numel(), 8), -1, dtype=torch.int32, device=dev)
        slots[pos_old] = self.slots
        bver = torch.full((keys.numel(), 8), -1, dtype=torch.int64, device=dev)
        bver[pos_old] = self.brick_versions
        leaf_rank = torch.empty_like(leaf_rank_sorted)
        leaf_rank[order] = leaf_rank_sorted
        at_new = pos_new[leaf_rank.clamp(0, n_leaves - 1)]
        leaf = torch.where(in_old >= 0, pos_old[in_old.clamp(min=0)], at_new) if la else at_new
    elif self._topology_shared:
        slots, bver = slots.clone(), bver.clone()
    self._topology_shared = False
    slot = cur
    if n_bricks:
        fresh = self.pool.alloc(n_bricks)
        slot = torch.where(missing, fresh[brick_rank.clamp(0, n_bricks - 1)], cur)
    self.version += 1
    flat = leaf.clamp(min=0) * 8 + b
    if keep is not None:
        j = kept.to(torch.uint8).argmax().reshape(1)
        flat = torch.where(kept, flat, flat.index_select(0, j))
        slot = torch.where(kept, slot, slot.index_select(0, j))
    if n_bricks:
        slots.view(-1)[flat] = slot.to(torch.int32)
    bver.view(-1).scatter_(0, flat, self.version)
    if n_bricks:
        keys = keys if n_leaves else old.keys
        tiles = None if n_leaves else self.grid.cached_tiles
        self.grid = IndexGrid(make_leaves(keys, brick_masks(slots >= 0)), tiles)
    self.slots, self.brick_versions = slots, bver
    if keep is None:
        return torch.arange(m, dtype=torch.int64, device=dev), slot
    rows = torch.empty(n_kept + 1, dtype=torch.int64, device=dev)
    rows[torch.where(kept, kept_rank, n_kept)] = torch.arange(m, dtype=torch.int64, device=dev)
    rows = rows[:n_kept]
    return rows, slot[rows]


def previous_allocate(self: BrickLayer, brick_ijk: torch.Tensor) -> torch.Tensor:
    return previous_allocate_kept(self, brick_ijk)[1]


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators a call issues (each a launch or an allocation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _op_count(fn) -> int:
    with _OpCounter() as c:
        fn()
    return c.n


def _gpu_activities(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def frame_bricks(f: int, n: int, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    """Unique bricks of frame ``f``: a window of ground and two walls advancing 4 bricks per frame; odd
    frames revisit the window of frame ``f // 4`` (nothing new)."""
    x0 = (f // 4 if f % 2 else f) * 4
    side = int((n / 3) ** 0.5) + 1
    a = torch.arange(side)
    gx, gy = torch.meshgrid(a, a, indexing="ij")
    ground = torch.stack(
        (gx.reshape(-1) + x0, gy.reshape(-1) - side // 2, torch.zeros(side * side, dtype=torch.int64)), 1
    )
    wall1 = torch.stack((gx.reshape(-1) + x0, torch.full((side * side,), side // 2), gy.reshape(-1) // 4), 1)
    wall2 = torch.stack((gx.reshape(-1) + x0, torch.full((side * side,), -side // 2), gy.reshape(-1) // 4), 1)
    b = torch.unique(torch.cat((ground, wall1, wall2)), dim=0)
    b = b[torch.randperm(b.shape[0], generator=g)[:n]]
    return b.to(dev)


def _sync_count(fn) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing" in str(w.message) for w in rec)


def _stats(ts: list[float]) -> str:
    q = sorted(ts)
    if not q:
        return "- | - | -"
    return f"{statistics.median(q):.3f} | {q[min(len(q) - 1, int(0.99 * len(q)))]:.3f} | {q[-1]:.3f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--bricks", type=int, default=40000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(0)
    frames = [frame_bricks(f, args.bricks, dev, g) for f in range(args.frames)]
    fields = {"tsdf": FieldSpec(torch.float16), "weight": FieldSpec(torch.float16)}
    layers = {"this branch": BrickLayer(fields, dev), "previous": BrickLayer(fields, dev)}
    calls = {"this branch": lambda lay, b: lay.allocate(b), "previous": previous_allocate}
    kinds = ("new leaves", "nothing new")
    # CUDA: wall time to the device finishing; CPU: process CPU time (the machine may be shared)
    clock = time.perf_counter if cuda else time.process_time
    times: dict[str, dict[str, list[float]]] = {k: {c: [] for c in kinds} for k in layers}
    counts: dict[str, dict[str, str]] = {k: {} for k in layers}
    growth: dict[str, list[float]] = {k: [] for k in layers}  # calls that added pool pages (ms)
    counted = {args.frames - 4: "new leaves", args.frames - 3: "nothing new"}  # f even: advancing window
    for f, b in enumerate(frames):
        kind = "new leaves" if f % 2 == 0 else "nothing new"
        order = list(layers) if f % 2 == 0 else list(reversed(layers))
        for name in order:
            lay = layers[name]
            call = lambda lay=lay, name=name, b=b: calls[name](lay, b)  # noqa: E731
            if f in counted:
                ops = _op_count(call)  # the frame's call itself; the next ones repeat it (nothing new)
                parts = [f"{ops} aten ops"]
                if cuda:
                    parts.append(f"{_gpu_activities(call)} GPU activities")
                    parts.append(f"{_sync_count(call)} host syncs")
                counts[name][counted[f]] = ", ".join(parts)
                continue
            if cuda:
                torch.cuda.synchronize()
            pages = len(lay.pool.page_starts)
            t = clock()
            out = call()
            if cuda:
                torch.cuda.synchronize()
            if f >= 3:
                ms = (clock() - t) * 1e3
                times[name][kind].append(ms)
                if len(lay.pool.page_starts) > pages:  # this call added pool pages
                    growth[name].append(ms)
            del out
    a, p = layers["this branch"], layers["previous"]
    cmd = sys.argv[1:] if argv is None else argv
    same = all(
        torch.equal(x, y) for x, y in zip((*a.grid.leaves, a.slots), (*p.grid.leaves, p.slots), strict=True)
    )
    pages = len(a.pool.page_starts) - 1
    lines = [
        f"# bench_allocate ({dev.type})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- hardware: {torch.cuda.get_device_name(dev) if cuda else 'CPU'}; timer:"
        f" {'wall, to the device finishing' if cuda else 'process CPU time'}",
        f"- software: python {sys.version.split()[0]}, torch {torch.__version__}",
        f"- command: `python benchmarks/bench_allocate.py {' '.join(cmd)}`",
        f"- {args.frames} frames of <= {args.bricks} bricks (even frames: an advancing window, new leaves;"
        f" odd: a revisit, nothing new), the first 3 not timed; final map {a.num_bricks} bricks in"
        f" {a.grid.num_leaves} leaves, {pages} pool pages; both layers identical at the end (keys, masks,"
        f" offsets, slots): {same}",
        "",
        f"| allocation | frames | median ms | p99 ms | max ms | per call (frame {args.frames - 4} / "
        f"{args.frames - 3}) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name in layers:
        for kind in kinds:
            lines.append(f"| {name} | {kind} | {_stats(times[name][kind])} | {counts[name].get(kind, '-')} |")
    lines += [
        "",
        "Calls that added pool pages (a page is allocated, nothing is copied; included above):",
        "",
        *(
            f"- {name}: {len(growth[name])} calls, ms: {', '.join(f'{x:.3f}' for x in growth[name])}"
            for name in layers
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    if not same:
        raise SystemExit("the two allocations disagree")


if __name__ == "__main__":
    main()

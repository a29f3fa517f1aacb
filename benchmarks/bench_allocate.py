"""The allocation alone (``BrickLayer.allocate``), this branch vs the previous algorithm, interleaved in one
process on the same brick sequence (issue 12: is the one-read allocation faster per frame, whatever else runs
on the machine?).

The sequence: a LiDAR-like band of bricks, a ground plane and walls in a window that advances every frame
(``--bricks`` per frame, ~5 % new, new leaves every frame), plus every other frame a revisit of an old window
(nothing new). Per frame both layers allocate the same bricks; each call is timed on the host from its start
to the device finishing it (``torch.cuda.synchronize`` after the call, outside nothing: this is the call's
latency), alternating which one goes first. ``previous`` is the allocation of commit b584fd8 (shell grid by
``torch.unique``, sorted merge, counts read one by one), copied here as the reference of the comparison.
Host syncs per call: counted by ``torch.cuda.set_sync_debug_mode("warn")`` on a few calls (CUDA only).

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

from mapper.grid import IndexGrid
from mapper.kernels.keys import encode_leaf_keys
from mapper.kernels.topology import make_leaves
from mapper.layers import BrickLayer, FieldSpec, brick_in_leaf, brick_masks


def _bricks_grid(brick_ijk):
    keys, inv = torch.unique(encode_leaf_keys(brick_ijk >> 1), return_inverse=True)
    b = brick_in_leaf(brick_ijk << 2)
    present = torch.zeros((keys.numel(), 8), dtype=torch.bool, device=brick_ijk.device)
    present[inv, b] = True
    return IndexGrid(make_leaves(keys, brick_masks(present))), inv, b


def previous_allocate(self: BrickLayer, brick_ijk: torch.Tensor) -> torch.Tensor:
    """``BrickLayer.allocate`` at commit b584fd8 (the comparison's reference)."""
    shell, leaf_of, b = _bricks_grid(brick_ijk)
    merged, pos_old, pos_shell = self.grid.merged_grid_with_positions(shell)
    slots, bver = self.slots, self.brick_versions
    if merged.num_leaves != self.grid.num_leaves:
        slots = torch.full((merged.num_leaves, 8), -1, dtype=torch.int32, device=self.device)
        slots[pos_old] = self.slots
        bver = torch.full((merged.num_leaves, 8), -1, dtype=torch.int64, device=self.device)
        bver[pos_old] = self.brick_versions
    leaf = pos_shell[leaf_of]
    cur = slots[leaf, b]
    missing = cur < 0
    rank = torch.cumsum(missing, 0) - 1
    n_new = int(rank[-1]) + 1
    cur = cur.to(torch.int64)
    if n_new:
        fresh = self.pool.alloc(n_new)
        cur = torch.where(missing, fresh[rank.clamp(min=0)], cur)
        slots[leaf, b] = cur.to(torch.int32)
    self.version += 1
    bver[leaf, b] = self.version
    self.grid, self.slots, self.brick_versions = merged, slots, bver
    return cur


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
    times: dict[str, list[float]] = {k: [] for k in layers}
    syncs: dict[str, list[int]] = {k: [] for k in layers}
    for f, b in enumerate(frames):
        order = list(layers) if f % 2 == 0 else list(reversed(layers))
        for name in order:
            lay = layers[name]
            if cuda and f in (args.frames - 3, args.frames - 2):
                syncs[name].append(_sync_count(lambda lay=lay, name=name, b=b: calls[name](lay, b)))
                continue
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = calls[name](lay, b)
            if cuda:
                torch.cuda.synchronize()
            if f >= 3:
                times[name].append((time.perf_counter() - t) * 1e3)
            del out
    a, p = layers["this branch"], layers["previous"]
    cmd = sys.argv[1:] if argv is None else argv
    same = torch.equal(a.grid.leaves.keys, p.grid.leaves.keys) and torch.equal(a.slots, p.slots)
    lines = [
        f"# bench_allocate ({dev.type})",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- hardware: {torch.cuda.get_device_name(dev) if cuda else 'CPU'}",
        f"- software: python {sys.version.split()[0]}, torch {torch.__version__}",
        f"- command: `python benchmarks/bench_allocate.py {' '.join(cmd)}`",
        f"- {args.frames} frames of <= {args.bricks} bricks, the first 3 not timed; final map {a.num_bricks}"
        f" bricks in {a.grid.num_leaves} leaves; both layers identical at the end: {same}",
        "",
        "| allocation | median ms | p90 ms | max ms | host syncs per call |",
        "|---|---|---|---|---|",
    ]
    for name, ts in times.items():
        q = sorted(ts)
        s = "/".join(str(x) for x in syncs[name]) if syncs[name] else "-"
        lines.append(
            f"| {name} | {statistics.median(q):.3f} | {q[int(0.9 * (len(q) - 1))]:.3f} | {q[-1]:.3f} | {s} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()

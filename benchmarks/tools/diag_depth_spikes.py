"""Diagnosis of the slow frames of the 1000-frame depth TSDF sequence (issue 12; frame_h200_s4slim.md: frames
110-111 and 180-195 took 3-4x the median in ``grow`` and ``merge`` with 25-35 new bricks).

Per frame: CUDA-event time, host time, the map's stages, valid pixels, and what ``unique_brick_ranks`` saw
(keys, box cells, dense or sort path, bricks). Then the slow window replayed on a fresh map (data- or
map-dependent?) and a torch.profiler summary of one slow and one normal frame (kernels, GPU busy, top ops).

  python benchmarks/tools/diag_depth_spikes.py --device cuda --frames 1000 --out r.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mapper import Map, gc_policy, sim
from mapper.kernels import segments

SEEN: list[dict] = []
_orig = segments.unique_brick_ranks


def _spy(*keys, bbox=None, max_dense_cells=1 << 26, dense_slack=1 << 20):
    out = _orig(*keys, bbox=bbox, max_dense_cells=max_dense_cells, dense_slack=dense_slack)
    n = sum(k.numel() for k in keys)
    bx = segments._keys_bbox(keys) if bbox is None else bbox
    lo, hi = bx.tolist() if isinstance(bx, torch.Tensor) else bx
    cells = 1
    for a, b in zip(lo, hi, strict=True):
        cells *= max(b - a + 1, 0)
    SEEN.append(
        {
            "keys": n,
            "cells": cells,
            "dense": cells <= max_dense_cells and cells <= 4 * n + dense_slack,
            "bricks": int(out[0].shape[0]),
            "ext": [b - a + 1 for a, b in zip(lo, hi, strict=True)],
        }
    )
    return out


def patch():
    import mapper.integrators.tsdf as tsdf

    for mod in (segments, tsdf):
        if hasattr(mod, "unique_brick_ranks"):
            mod.unique_brick_ranks = _spy


def run(frames, dev, idx, vs):
    m = Map(vs, layers=("tsdf",), device=dev, max_range_m=10.0)
    rows = []
    for i in idx:
        d, K, T = frames[i]
        SEEN.clear()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        m.integrate_depth(d, K.cpu(), T.cpu())
        b.record()
        host = (time.perf_counter() - t0) * 1e3
        b.synchronize()
        rows.append(
            {
                "frame": i,
                "ms": a.elapsed_time(b),
                "host": host,
                "stages": m.timings_ms(),
                "valid": int(((d > 0) & (d <= 10)).sum()),
                "spy": list(SEEN),
            }
        )
    return m, rows


def prof(m, frames, i):
    from torch.profiler import ProfilerActivity, profile

    d, K, T = frames[i]
    Kc, Tc = K.cpu(), T.cpu()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        m.integrate_depth(d, Kc, Tc)
        torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in ev) / 1e3 if ev else 0.0
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    table2 = p.key_averages().table(sort_by="cpu_time_total", row_limit=12)
    return busy, len(ev), table, table2


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--voxel", type=float, default=0.02)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    frames = list(sim.depth_sequence(args.frames, sim.PinholeCamera.kinect(), device=dev, max_range_m=10.0))
    patch()
    run(frames, dev, range(3), args.voxel)  # warm-up
    gc_policy.settle()
    m, rows = run(frames, dev, range(len(frames)), args.voxel)
    ms = [r["ms"] for r in rows]
    med = statistics.median(ms)
    slow = sorted(range(len(ms)), key=lambda i: -ms[i])[:12]
    lines = [
        f"# depth spike diagnosis ({args.device}, voxel {args.voxel}, {len(frames)} frames)",
        "",
        f"median {med:.2f} ms, max {max(ms):.2f}; command: `python {' '.join(sys.argv)}`",
        "",
        "| frame | ms | host | stages | valid px | keys | box ext | cells | dense | bricks |",
        "|" + "---|" * 10,
    ]
    show = sorted(set(slow) | set(range(100, 125)) | set(range(170, 210, 2)))
    for i in show:
        r = rows[i]
        s = r["spy"][0] if r["spy"] else {}
        st = " ".join(f"{k} {v:.1f}" for k, v in r["stages"].items())
        lines.append(
            f"| {i} | {r['ms']:.2f} | {r['host']:.2f} | {st} | {r['valid']} | {s.get('keys')} | "
            f"{s.get('ext')} "
            f"| {s.get('cells')} | {s.get('dense')} | {s.get('bricks')} |"
        )
    # replay the slow window on a fresh map
    w = slow[0]
    win = list(range(max(0, w - 5), min(len(frames), w + 5)))
    _, rr = run(frames, dev, win, args.voxel)
    lines += [
        "",
        f"## frames {win[0]}-{win[-1]} replayed on a fresh map",
        "",
        " ".join(f"{r['frame']}:{r['ms']:.1f}" for r in rr),
    ]
    # profiles: slowest frame and a median frame, on the full map
    normal = sorted(range(len(ms)), key=lambda i: abs(ms[i] - med))[0]
    for tag, i in (("slow", slow[0]), ("normal", normal)):
        busy, nk, t1, t2 = prof(m, frames, i)
        lines += [
            "",
            f"## profile of frame {i} ({tag}) on the full map: {nk} kernels, GPU busy {busy:.2f} ms",
            "",
            "```",
            t1,
            "```",
            "",
            "```",
            t2,
            "```",
        ]
    txt = "\n".join(lines)
    print(txt)
    if args.out:
        open(args.out, "w").write(txt + "\n")
    if args.json:
        json.dump({"ms": ms, "rows": rows}, open(args.json, "w"), default=str)


if __name__ == "__main__":
    main()

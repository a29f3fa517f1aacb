"""Sparse 3-D convolution (mapper.nn): ours vs spconv 2.x and the gather-GEMM-scatter path, same run.

Grids ("map grids"): TSDF-like bands: the voxels of random sphere surfaces (radius 25-60 voxels, placed
in a cube), dilated once (26-connectivity): 3-voxel-thick shells as a TSDF band around surfaces, ~13 active
neighbours per voxel. Sizes ~1e5, 1e6, 1e7 voxels (``--sizes``). Features and weights: seeded normal
float32; TF32 off everywhere.

Per (size, C_in = C_out = C, op):
* ``subm``: 3x3x3 submanifold convolution; ``down``: 2x2x2 stride-2 convolution to ``coarsened_grid``.
* ``ours``: ``mapper.nn.sparse_conv3d`` with its neighbour map cached on the grid (GPU: the Triton
  mask-sorted implicit GEMM; CPU: the torch per-offset path); ``map build`` = the first call minus a
  cached one (neighbour table + sort).
* ``ggs``: the gather-GEMM-scatter method in torch (per offset: gather, cuBLAS/MKL GEMM, index_add), rule
  book precomputed (GPU only; on the CPU it is the same algorithm as ours).
* ``spconv``: spconv 2.x (``SubMConv3d`` / ``SparseConv3d``, ``indice_key`` so the submanifold rule book is
  reused as in a network; its strided conv rebuilds its indices every call, as it does in a network) when
  ``import spconv.pytorch`` works on the device. Its maximum error against ours is reported too.
Calls of the methods are interleaved (one of each per round): ``every round faster`` counts the rounds in
which ours beat the baseline. Times: median / p99 / max over ``--reps`` rounds after ``--warmup`` rounds
(CUDA events on the GPU, perf_counter on the CPU).

U-Net: 4 levels (C 16-32-64-128; per level two 3x3x3 convs, stride-2 2x2x2 down, transposed up, skip
additions, ReLU) forward on a real LiDAR map's TSDF features (norlab scans, ``--unet-voxel`` m voxels;
features [tsdf, weight / max weight]); same network in ours, ggs, spconv.

``--tune`` (GPU): times the Triton kernel with several tile shapes per width at the middle size.

Usage:
    python benchmarks/bench_sparse_conv.py --device cuda --sizes 1e5 1e6 1e7 --out sparse_conv_h200.md
    python benchmarks/bench_sparse_conv.py --device cpu --sizes 1e5 --channels 16 32 64 128 --reps 5
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapper import IndexGrid  # noqa: E402
from mapper.kernels import sparse_conv as sc  # noqa: E402
from mapper.nn import sparse_conv3d  # noqa: E402
from mapper.nn.conv import conv_plan  # noqa: E402

try:  # optional: the benchmark extra
    import spconv.pytorch as spconv
except Exception:  # pragma: no cover - depends on the install
    spconv = None


# --------------------------------------------------------------------------------------------- inputs
def shell_grid(n_target: float, device: torch.device, seed: int = 0) -> IndexGrid:
    """A TSDF-like band of ~``n_target`` voxels: random sphere surfaces, voxelised, dilated once."""
    g = torch.Generator().manual_seed(seed)
    n_sph = max(1, round(n_target / 4.8 / (4 * math.pi * 44.0**2)))  # ~4.8 voxels thick
    side = 3.2 * 42.0 * n_sph ** (1 / 3)
    radii = 25.0 + 35.0 * torch.rand(n_sph, generator=g, dtype=torch.float64)
    centres = torch.rand(n_sph, 3, generator=g, dtype=torch.float64) * side
    per = (4 * math.pi * radii**2 * 3).long()  # ~3 samples per voxel of surface
    which = torch.repeat_interleave(torch.arange(n_sph), per)
    u = torch.randn(int(per.sum()), 3, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True)
    p = centres[which] + radii[which, None] * u
    return IndexGrid.from_ijk(torch.floor(p).long().to(device)).dilated_grid(1)


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def interleaved(fns: dict, clock: Clock, reps: int, warmup: int) -> dict[str, list[float]]:
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            times[k].append(clock(f))
    return times


def stats(t: list[float]) -> tuple[float, float, float]:
    s = sorted(t)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return s[len(s) // 2], p99, s[-1]


# ------------------------------------------------------------------------------------------- spconv
def spconv_input(grid: IndexGrid, x: torch.Tensor):
    ijk = grid.ijk.to(torch.int64)
    lo = (ijk.amin(0) // 2) * 2  # an even shift keeps the 2:1 parity of ours
    r = (ijk - lo).to(torch.int32)
    ind = torch.cat((torch.zeros_like(r[:, :1]), r), 1)
    shape = (r.amax(0) + 2).tolist()
    return spconv.SparseConvTensor(x, ind, shape, 1), lo


def spconv_weight(w: torch.Tensor) -> torch.Tensor:
    return w.permute(4, 0, 1, 2, 3).contiguous()  # ours [k, k, k, in, out] -> spconv [out, k, k, k, in]


# ------------------------------------------------------------------------------------------- one conv
def bench_conv(grid, c: int, op: str, args, dev, clock, ours_config=None) -> dict:
    gen = torch.Generator().manual_seed(1)
    k = 3 if op == "subm" else 2
    stride = 1 if op == "subm" else 2
    x = torch.randn(grid.num_voxels, c, generator=gen).to(dev)
    w = (torch.randn(k, k, k, c, c, generator=gen) / math.sqrt(c * k**3)).to(dev)
    row = {"n": grid.num_voxels, "c": c, "op": op}
    out, y = sparse_conv3d(grid, x, w, stride=stride)  # compiles, builds the map
    fresh = IndexGrid(grid.leaves)  # map build: first call on a fresh copy of the grid minus a cached one
    t_first = clock(lambda: sparse_conv3d(fresh, x, w, stride=stride))
    t_cached = clock(lambda: sparse_conv3d(fresh, x, w, stride=stride))
    row["map_ms"] = max(0.0, t_first - t_cached)
    _, cmap, _ = conv_plan(grid, k, stride)
    row["nbrs"] = float((cmap.nbr >= 0).sum()) / max(1, cmap.num_out)
    wf = w.reshape(k**3, c, c)
    fns = {"ours": lambda: sparse_conv3d(grid, x, w, stride=stride)}
    scale = float(y.abs().max())
    if dev.type == "cuda":
        pairs = sc.gather_gemm_scatter_pairs(cmap)
        yg = sc.conv_gather_gemm_scatter(x, wf, pairs, cmap.num_out)
        row["err_ggs"] = float((yg - y).abs().max()) / scale
        fns["ggs"] = lambda: sc.conv_gather_gemm_scatter(x, wf, pairs, cmap.num_out)
    if spconv is not None and grid.num_voxels <= args.spconv_max:
        t, lo = spconv_input(grid, x)
        if op == "subm":
            m = spconv.SubMConv3d(c, c, 3, bias=False, indice_key="subm").to(dev)
        else:
            m = spconv.SparseConv3d(c, c, 2, stride=2, bias=False, indice_key="down").to(dev)
        with torch.no_grad():
            m.weight.copy_(spconv_weight(w))
            o = m(t)
            if op == "subm":
                row["err_spconv"] = float((o.features - y).abs().max()) / scale
                fns["spconv"] = lambda: m(o)  # ``o`` carries the submanifold rule book
            else:
                cijk = o.indices[:, 1:].to(torch.int64) + lo // 2
                idx = out.ijk_to_index(cijk)
                ok = bool((idx >= 0).all()) and idx.numel() == out.num_voxels
                row["err_spconv"] = float((o.features - y[idx]).abs().max()) / scale if ok else float("nan")
                fns["spconv"] = lambda: m(t)
    with torch.no_grad():
        times = interleaved(fns, clock, args.reps, args.warmup)
    for name, t in times.items():
        row[name] = stats(t)
        if name != "ours":
            row[f"wins_{name}"] = sum(a < b for a, b in zip(times["ours"], t, strict=True)) / len(t)
    return row


def tune(grid, c: int, dev, clock, configs) -> list[tuple]:
    from mapper.kernels import triton_sparse_conv as tsc

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(grid.num_voxels, c, generator=gen).to(dev)
    w = (torch.randn(27, c, c, generator=gen) / math.sqrt(27 * c)).to(dev)
    _, cmap, _ = conv_plan(grid, 3)
    ref = tsc.conv_forward_triton(x, w, cmap)
    res = []
    for cfg in configs:
        try:
            y = tsc.conv_forward_triton(x, w, cmap, config=cfg)
            err = float((y - ref).abs().max())
            t = interleaved(
                {"t": lambda cfg=cfg: tsc.conv_forward_triton(x, w, cmap, config=cfg)}, clock, 7, 2
            )
            res.append((cfg, stats(t["t"])[0], err))
        except Exception as e:  # a shape the compiler rejects (shared memory): report, go on
            res.append((cfg, float("nan"), repr(e)[:80]))
    return res


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, skip): the chosen shapes and runner-ups of the first sweep (NOTES.md)
TUNE = {
    16: [(64, 16, 16, 4, True), (32, 16, 16, 2, True), (128, 16, 16, 8, True), (64, 16, 16, 4, False)],
    32: [(64, 32, 32, 4, True), (128, 32, 32, 8, True), (32, 32, 32, 2, True), (64, 32, 32, 4, False)],
    64: [(64, 64, 32, 4, True), (64, 64, 16, 4, True), (32, 64, 32, 2, True), (64, 64, 32, 4, False)],
    128: [
        (32, 128, 32, 4, True),
        (128, 64, 32, 8, True),
        (32, 128, 16, 4, True),
        (32, 128, 64, 4, True),
        (16, 128, 32, 4, True),
        (32, 128, 32, 8, True),
        (32, 128, 32, 4, False),
        (128, 64, 32, 8, False),
    ],
}


# --------------------------------------------------------------------------------------------- U-Net
def lidar_tsdf(voxel_m: float, scans: int, dev):
    from mapper import Map
    from mapper.datasets import NorlabLidar, default_data_dir

    root = Path(os.environ.get("MAPPER_SHARED_DATA", default_data_dir())) / "norlab_lidar"
    ds = NorlabLidar(root)
    m = Map(voxel_m, layers=("tsdf",), device=dev)
    for i in range(min(scans, len(ds))):
        f = ds[i]
        m.integrate_lidar(f["points"], f["T_world_sensor"])
    g, d = m.layer("tsdf")
    seen = d["weight"] > 0  # the observed voxels (the layer's bricks hold unobserved ones too)
    grid = g.pruned_grid(seen)
    w = d["weight"][seen].float()
    x = torch.stack((d["tsdf"][seen].float(), w / w.max().clamp(min=1e-6)), 1).contiguous()
    return grid, x


WIDTHS = (16, 32, 64, 128)


def unet_weights(c_in: int, dev) -> dict:
    gen = torch.Generator().manual_seed(2)

    def w(k, a, b):
        return (torch.randn(k, k, k, a, b, generator=gen) / math.sqrt(a * k**3)).to(dev)

    p, prev = {}, c_in
    for lvl, c in enumerate(WIDTHS):
        if lvl:
            p[f"down{lvl}"] = w(2, prev, c)
        p[f"enc{lvl}a"], p[f"enc{lvl}b"] = w(3, prev if lvl == 0 else c, c), w(3, c, c)
        prev = c
    for lvl in range(len(WIDTHS) - 1, 0, -1):
        p[f"up{lvl}"] = w(2, WIDTHS[lvl], WIDTHS[lvl - 1])
        p[f"dec{lvl}"] = w(3, WIDTHS[lvl - 1], WIDTHS[lvl - 1])
    return p


def unet_ours(grid, x, p, conv=sparse_conv3d):
    relu = torch.relu
    grids, skips = [], []
    g, h = grid, x
    for lvl in range(len(WIDTHS)):
        if lvl:
            g, h = conv(g, h, p[f"down{lvl}"], stride=2)
        h = relu(conv(g, h, p[f"enc{lvl}a"])[1])
        h = relu(conv(g, h, p[f"enc{lvl}b"])[1])
        grids.append(g)
        skips.append(h)
    for lvl in range(len(WIDTHS) - 1, 0, -1):
        g, h = conv(grids[lvl], h, p[f"up{lvl}"], stride=2, transposed=True)
        h = relu(h + skips[lvl - 1])
        h = relu(conv(g, h, p[f"dec{lvl}"])[1])
    return h


def ggs_conv_factory():
    cache = {}

    def conv(grid, x, w, stride=1, transposed=False):
        k = w.shape[0]
        out, cmap, _ = conv_plan(grid, k, stride, transposed)
        key = (id(grid), k, stride, transposed)
        if key not in cache:
            cache[key] = (grid, sc.gather_gemm_scatter_pairs(cmap))
        pairs = cache[key][1]
        return out, sc.conv_gather_gemm_scatter(
            x, w.reshape(k**3, w.shape[3], w.shape[4]), pairs, cmap.num_out
        )

    return conv


def unet_spconv(t, p):
    import torch.nn.functional as F

    def sub(h, w, key):
        m = spconv.SubMConv3d(w.shape[3], w.shape[4], 3, bias=False, indice_key=key).to(h.features.device)
        m.weight.data = spconv_weight(w)
        return m(h)

    layers = {}
    for lvl, _c in enumerate(WIDTHS):
        if lvl:
            w = p[f"down{lvl}"]
            m = spconv.SparseConv3d(w.shape[3], w.shape[4], 2, stride=2, bias=False, indice_key=f"d{lvl}")
            m.weight.data = spconv_weight(w).to(t.features.device)
            layers[f"down{lvl}"] = m
        for s in "ab":
            w = p[f"enc{lvl}{s}"]
            m = spconv.SubMConv3d(w.shape[3], w.shape[4], 3, bias=False, indice_key=f"s{lvl}")
            m.weight.data = spconv_weight(w).to(t.features.device)
            layers[f"enc{lvl}{s}"] = m
    for lvl in range(len(WIDTHS) - 1, 0, -1):
        w = p[f"up{lvl}"]
        m = spconv.SparseInverseConv3d(w.shape[3], w.shape[4], 2, bias=False, indice_key=f"d{lvl}")
        m.weight.data = spconv_weight(w).to(t.features.device)
        layers[f"up{lvl}"] = m
        w = p[f"dec{lvl}"]
        m = spconv.SubMConv3d(w.shape[3], w.shape[4], 3, bias=False, indice_key=f"s{lvl - 1}")
        m.weight.data = spconv_weight(w).to(t.features.device)
        layers[f"dec{lvl}"] = m

    def forward(t):
        skips, h = [], t
        for lvl in range(len(WIDTHS)):
            if lvl:
                h = layers[f"down{lvl}"](h)
            h = h.replace_feature(F.relu(layers[f"enc{lvl}a"](h).features))
            h = h.replace_feature(F.relu(layers[f"enc{lvl}b"](h).features))
            skips.append(h)
        for lvl in range(len(WIDTHS) - 1, 0, -1):
            h = layers[f"up{lvl}"](h)
            h = h.replace_feature(F.relu(h.features + skips[lvl - 1].features))
            h = h.replace_feature(F.relu(layers[f"dec{lvl}"](h).features))
        return h.features

    return forward


def bench_unet(args, dev, clock) -> dict:
    grid, x = lidar_tsdf(args.unet_voxel, args.unet_scans, dev)
    p = unet_weights(x.shape[1], dev)
    with torch.no_grad():
        y = unet_ours(grid, x, p)
        row = {"n": grid.num_voxels}
        y64 = unet_ours(grid, x.double(), {k: v.double() for k, v in p.items()})  # float64 torch path
        s64 = float(y64.abs().max())
        row["f64"] = {"ours": float((y - y64).abs().max()) / s64}
        fns = {
            "ours": lambda: unet_ours(grid, x, p),
            "fresh": lambda: unet_ours(IndexGrid(grid.leaves), x, p),
        }
        scale = float(y.abs().max())
        if dev.type == "cuda":
            ggs = ggs_conv_factory()
            yg = unet_ours(grid, x, p, conv=ggs)
            row["err_ggs"] = float((yg - y).abs().max()) / scale
            row["f64"]["ggs"] = float((yg - y64).abs().max()) / s64
            fns["ggs"] = lambda: unet_ours(grid, x, p, conv=ggs)
        if spconv is not None:
            t, _ = spconv_input(grid, x)
            fwd = unet_spconv(t, p)
            ys = fwd(t)
            row["err_spconv"] = float((ys - y).abs().max()) / scale
            row["f64"]["spconv"] = float((ys.double() - y64).abs().max()) / s64
            fns["spconv"] = lambda: fwd(t)
        times = interleaved(fns, clock, args.reps, args.warmup)
    for name, t in times.items():
        row[name] = stats(t)
        if name not in ("ours", "fresh"):
            row[f"wins_{name}"] = sum(a < b for a, b in zip(times["ours"], t, strict=True)) / len(t)
            row[f"wins_fresh_{name}"] = sum(a < b for a, b in zip(times["fresh"], t, strict=True)) / len(t)
    return row


# ---------------------------------------------------------------------------------------------- report
def _t(s):
    return "n/a" if s is None else f"{s[0]:.3f} / {s[1]:.3f} / {s[2]:.3f}"


def _x(a, b):
    return "n/a" if a is None or b is None else f"{b[0] / a[0]:.2f}x"


def _e(v):
    return "n/a" if v is None else f"{v:.1e}"


def fmt(r: dict, baselines) -> str:
    g = r.get
    cells = [r.get("op", "unet"), f"{r['n']:,}", r.get("c", "16-128"), f"{g('nbrs', float('nan')):.1f}"]
    cells += [_t(g("ours")), f"{g('map_ms', float('nan')):.1f}"]
    for b in baselines:
        w = g(f"wins_{b}")
        cells += [
            _t(g(b)),
            _x(g("ours"), g(b)),
            "n/a" if w is None else f"{w * 100:.0f} %",
            _e(g(f"err_{b}")),
        ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6, 1e7])
    ap.add_argument("--channels", nargs="+", type=int, default=[16, 32, 64, 128])
    ap.add_argument("--ops", nargs="+", default=["subm", "down"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--spconv-max", type=float, default=2e7)
    ap.add_argument("--unet-voxel", type=float, default=0.1)
    ap.add_argument("--unet-scans", type=int, default=14)
    ap.add_argument("--no-unet", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--use-tuned", action="store_true", help="with --tune: use each width's fastest shape")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = Clock(dev)
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.processor() or 'cpu'}"
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# Sparse convolution ({dev.type}) - {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Hardware: {hw}; {os.cpu_count()} CPU cores, torch {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}; spconv {getattr(sys.modules.get('spconv'), '__version__', 'absent')}.",
        f"Command: `python benchmarks/bench_sparse_conv.py {cmd}`",
        "",
    ]
    print("\n".join(lines), flush=True)
    if args.tune and dev.type == "cuda":
        grid = shell_grid(args.sizes[len(args.sizes) // 2], dev)
        lines += [f"## Tile shapes (subm, {grid.num_voxels:,} voxels; median ms of 7)", ""]
        lines += [
            "| C | (BLOCK_M, BLOCK_N, BLOCK_K, warps, skip) | ms | max diff vs default |",
            "|---|---|---|---|",
        ]
        from mapper.kernels import triton_sparse_conv as tsc

        for c in args.channels:
            res = tune(grid, c, dev, clock, TUNE[c])
            for cfg, ms, err in res:
                lines.append(f"| {c} | {cfg} | {ms:.3f} | {err} |")
                print(lines[-1], flush=True)
            ok = [r for r in res if r[1] == r[1] and isinstance(r[2], float) and r[2] < 1e-3]
            if ok and args.use_tuned:
                tsc.TILES[c] = min(ok, key=lambda r: r[1])[0]
        lines += ["", f"Tile shapes used below: {tsc.TILES}", ""]
        del grid
    baselines = (["ggs"] if dev.type == "cuda" else []) + (["spconv"] if spconv is not None else [])
    head = "| op | voxels | C | nbrs/voxel | ours ms (median / p99 / max) | ours map build ms |"
    sep = "|---|---|---|---|---|---|"
    for b in baselines:
        head += f" {b} ms | ours vs {b} | every round faster | max err vs {b} (rel.) |"
        sep += "---|---|---|---|"
    lines += ["## Single convolutions (C_in = C_out = C)", "", head, sep]
    print(head, flush=True)
    for n in args.sizes:
        grid = shell_grid(n, dev)
        for op in args.ops:
            for c in args.channels:
                r = bench_conv(grid, c, op, args, dev, clock)
                lines.append(fmt(r, baselines))
                print(lines[-1], flush=True)
        del grid
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_unet:
        r = bench_unet(args, dev, clock)
        lines += ["", f"## U-Net forward (4 levels, LiDAR TSDF map at {args.unet_voxel} m)", "", head, sep]
        lines.append(fmt(r, baselines))
        fresh = dict(r, ours=r["fresh"], op="unet, maps built in the call")
        fresh.update({f"wins_{b}": r[f"wins_fresh_{b}"] for b in baselines})
        lines.append(fmt(fresh, baselines))
        note = "(first row: neighbour maps cached on the grids; second: a fresh grid object per call, so "
        lines += ["", note + "every map is built in the call, as spconv does every forward)"]
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r["f64"].items())
        lines += ["", f"Max error vs the same network in float64 (relative to its max |y|): {errs}."]
        print("\n".join(lines[-6:]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Planner-grade ESDF (issue 11): per-frame TSDF integration + ESDF update, ESDF size and memory.

Cases (``--parts``):
* ``depth``: 640x480 depth frames (``PinholeCamera.kinect``) orbiting ``mapper.sim.indoor_scene`` at TSDF
  ``--depth-voxels`` with the ESDF at ``--esdf-voxel`` (default 5 cm), ``("tsdf", "esdf")`` layers (free
  space from the rays' free record), ESDF updated after every frame;
* ``lidar``: 120 k-point scans (64 x 1875 beams, 60 m) of ``mapper.sim.outdoor_scene`` at TSDF
  ``--lidar-voxels`` with the ESDF at 10 cm;
* ``maxd``: the depth case at TSDF 2 cm / ESDF 5 cm for ``esdf_max_distance_m`` in ``--max-distances``;
* ``kernel``: the exact transform alone (``squared_distances``: 3 line passes + 5 lower-envelope passes)
  on a synthetic domain (a slab of ``--kernel-bricks`` bricks with random sub-voxel sites) for
  ``M`` = 10 / 20 / 40 / 80 voxels: the pass costs O(voxels), not O(voxels x M);
* ``cpuab``: the torch 1-D pass three ways (envelope / min-plus forced, the default pick) on the same
  depth / LiDAR frames, process CPU time per update, layers asserted bit-identical;
* ``room``: a long room sequence (``--room-frames``, default 1000) at TSDF ``--room-voxel`` (2 cm) / ESDF
  5 cm, frames rendered one at a time on the device (an orbit in the indoor scene: consecutive frames
  overlap as in a real RGB-D sequence), for the peak-memory check; stops early after ``--room-seconds``
  and says how many frames it ran.

Frames are generated on the device. Per frame: ``integrate_*`` + ``update_esdf`` timed together (CUDA
events or perf_counter, host syncs included), after ``--warmup`` frames; ``esdf`` = the update alone
(host wall time of ``update_esdf``, which synchronises where it needs sizes). Reported: median / p99 /
max ms per frame, ESDF voxels and free-record voxels at the end, peak GPU memory of the whole run.

Usage: python benchmarks/bench_esdf.py --device cuda --out benchmarks/results/esdf_h200.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import sys
import time

import numpy as np
import torch

from mapper import Map, sim


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(m: Map, frames, kind: str, dev, warmup: int, seconds: float = math.inf, every: int = 0) -> dict:
    """Integrate ``frames`` (and update the ESDF after each where the map has one); times and peak memory."""
    has_esdf = "esdf" in m.layers
    tot, esdf, trend = [], [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i, f in enumerate(frames):
        if time.perf_counter() - start > seconds:
            break
        _sync(dev)
        t0 = time.perf_counter()
        if kind == "lidar":
            m.integrate_lidar(f[0], f[1])
        else:
            m.integrate_depth(f[0], f[1], f[2])
        t1 = time.perf_counter()
        if has_esdf:
            m.update_esdf()
        _sync(dev)
        t2 = time.perf_counter()
        if i >= warmup:
            tot.append((t2 - t0) * 1e3)
            esdf.append((t2 - t1) * 1e3)
        if every and (i + 1) % every == 0:  # peak memory so far and the last frames' median
            pk = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
            recent = np.median(tot[-every:]) if tot else float("nan")
            trend.append(
                (
                    i + 1,
                    pk,
                    float(recent),
                    m.stats()["layers"]["esdf"]["voxels"] if has_esdf else 0,
                    time.perf_counter() - start,
                )
            )
            print(
                "trend frames {} peak {:.3f} GiB median {:.2f} ms esdf voxels {} at {:.1f} s".format(
                    *trend[-1]
                ),
                flush=True,
            )
    st = m.stats()["layers"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    t = np.asarray(tot)
    return {
        "frames": len(tot),
        "median": float(np.median(t)),
        "p99": float(np.percentile(t, 99)),
        "max": float(t.max()),
        "esdf_median": float(np.median(esdf)),
        "esdf_p99": float(np.percentile(esdf, 99)),
        "esdf_max": float(np.max(esdf)),
        "esdf_voxels": st["esdf"]["voxels"] if has_esdf else 0,
        "free_voxels": st.get("free", {}).get("voxels", 0),
        "tsdf_voxels": st["tsdf"]["voxels"],
        "peak_gib": peak,
        "trend": trend,
    }


def counts(m: Map, frames, kind: str, dev, n: int = 3) -> dict:
    """Per ESDF update, over ``n`` more frames: ``ops`` = aten operators dispatched under ``update_esdf``
    (torch.profiler; on CUDA nearly each one a launch), ``launches`` = CUDA runtime/driver launch calls
    under it (Triton's included), ``syncs`` = the warnings of ``torch.cuda.set_sync_debug_mode("warn")``
    (every synchronising call torch knows: ``.item()``, ``nonzero``, ``unique``, copies to the host, ...)
    and ``sync_calls`` = the profiler's ``cudaStreamSynchronize`` / blocking ``cudaMemcpy`` calls under
    it. NaN where not measurable (CPU) or when the measurement fails (it is an aid)."""
    import warnings

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as _profile

    nan = float("nan")
    res = {"ops": nan, "launches": nan, "syncs": nan, "sync_calls": nan}
    if n <= 0:
        return res

    def step(f):
        if kind == "lidar":
            m.integrate_lidar(f[0], f[1])
        else:
            m.integrate_depth(f[0], f[1], f[2])

    if dev.type == "cuda":
        try:
            warned = 0
            for f in frames[-n:]:
                step(f)
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        m.update_esdf()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                warned += len(w)
            res["syncs"] = warned / n
        except Exception as e:
            print(f"sync count failed: {e!r}", flush=True)
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with _profile(activities=acts) as prof:
            for f in frames[-n:]:
                step(f)
                with torch.profiler.record_function("update_esdf"):
                    m.update_esdf()
                _sync(dev)
        ops = launches = syncs = 0
        for ev in prof.events():
            p, inside = ev.cpu_parent, False
            while p is not None:
                if p.name == "update_esdf":
                    inside = True
                    break
                p = p.cpu_parent
            if not inside:
                continue
            if (
                ev.name.startswith("aten::")
                and ev.cpu_parent is not None
                and not ev.cpu_parent.name.startswith("aten::")
            ):
                ops += 1  # top-level operators only (not their internal calls)
            if "LaunchKernel" in ev.name or ev.name.startswith("cuLaunch"):
                launches += 1
            elif ev.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize") or (
                ev.name.startswith("cudaMemcpy") and "Async" not in ev.name
            ):
                syncs += 1
        res["ops"] = ops / n
        if dev.type == "cuda":
            res["launches"], res["sync_calls"] = launches / n, syncs / n
    except Exception as e:
        print(f"launch count failed: {e!r}", flush=True)
    return res


def profile(m: Map, frames, n: int, dev) -> str:
    """torch.profiler table (top 25 ops by self CPU time) of ``n`` more frames' ESDF updates."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as _profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with _profile(activities=acts) as prof:
        for f in frames[-n:]:
            m.integrate_depth(f[0], f[1], f[2])
            with torch.profiler.record_function("update_esdf"):
                m.update_esdf()
            _sync(dev)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48)
    print(table, flush=True)
    return f"profile of {n} frames (integrate_depth + update_esdf), by self CPU time:\n{table}"


def cpu_ab(frames, kind: str, voxel: float, esdf_voxel: float, max_range: float, dev) -> dict:
    """The torch 1-D pass three ways on the same frames: three maps fed the same frames, with the torch
    envelope forced, the windowed min-plus forced, and the default pick by the expected work
    (``MINPLUS_PAIRS_PER_SLOT``). Per update: process CPU time (``time.process_time``: robust to other
    jobs on a shared machine, unlike wall time); asserts the three layers equal bit for bit."""
    from mapper.kernels import envelope as env

    default = env.MINPLUS_PAIRS_PER_SLOT
    setting = {"envelope": -1, "minplus": 1 << 40, "pick": default}
    maps = {
        name: Map(voxel, ("tsdf", "esdf"), dev, esdf_voxel_size_m=esdf_voxel, max_range_m=max_range)
        for name in setting
    }
    cpu = {name: [] for name in maps}
    wall = {name: [] for name in maps}
    try:
        for f in frames:
            for name, m in maps.items():
                if kind == "lidar":
                    m.integrate_lidar(f[0], f[1])
                else:
                    m.integrate_depth(f[0], f[1], f[2])
                env.MINPLUS_PAIRS_PER_SLOT = setting[name]
                c0, w0 = time.process_time(), time.perf_counter()
                m.update_esdf()
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
            ga, da = maps["envelope"]._esdf.view()
            for other in ("minplus", "pick"):
                gb, db = maps[other]._esdf.view()
                assert torch.equal(ga.leaves.keys, gb.leaves.keys)
                assert torch.equal(da["esdf"].view(torch.int32), db["esdf"].view(torch.int32))
                assert torch.equal(da["observed"], db["observed"])
    finally:
        env.MINPLUS_PAIRS_PER_SLOT = default
    out = {"frames": len(frames), "voxels": maps["pick"].stats()["layers"]["esdf"]["voxels"]}
    for name in maps:
        out[name] = (float(np.median(cpu[name])), float(np.max(cpu[name])), float(np.median(wall[name])))
    return out


def kernel_case(n_bricks: int, margin: int, dev, reps: int = 5) -> dict:
    """Median ms of ``squared_distances`` over a cube of about ``n_bricks`` bricks, 1 % of voxels sites."""
    from mapper.integrators.esdf import squared_distances

    side = max(round(n_bricks ** (1 / 3)), 1)
    r = torch.arange(side, device=dev)
    bricks = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(-1, 3)
    g = torch.Generator(device="cpu").manual_seed(0)
    vox = torch.randint(0, 4 * side, (max(bricks.shape[0] * 64 // 100, 1), 3), generator=g).to(dev)
    vox = torch.unique(vox, dim=0)
    t = (torch.rand((vox.shape[0], 9), generator=g) - 0.5).to(dev)
    ts = []
    for i in range(reps + 1):
        _sync(dev)
        t0 = time.perf_counter()
        squared_distances(bricks, vox, t, margin)
        _sync(dev)
        if i:
            ts.append((time.perf_counter() - t0) * 1e3)
    return {"voxels": bricks.shape[0] * 64, "sites": vox.shape[0], "median": float(np.median(ts))}


def city_case(n_scans: int, extent_m: float, speed_mps: float, dev, tile_bricks: int | None) -> dict:
    """A street map (``mapper.sim.lidar_sequence``: 64-beam scans, ``speed_mps / 10`` m apart) integrated
    at 10 cm without ESDF updates, then one ``update_esdf()`` of the whole map (cold, tile by tile):
    seconds, the GPU memory it adds at its peak, voxels."""
    from mapper.integrators import esdf as esdf_mod

    m = Map(0.1, ("tsdf", "esdf"), dev, max_range_m=60.0)
    if tile_bricks:
        m._esdf.tile_bricks = tile_bricks
    t0 = time.perf_counter()
    for pts, T in sim.lidar_sequence(n_scans, dev, 0, extent_m=extent_m, speed_mps=speed_mps):
        m.integrate_lidar(pts, T)
    _sync(dev)
    build = time.perf_counter() - t0
    before = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    r = m.update_esdf()
    _sync(dev)
    secs = time.perf_counter() - t0
    extra = (torch.cuda.max_memory_allocated() - before) / 2**30 if dev.type == "cuda" else float("nan")
    st = m.stats()["layers"]
    return {
        "scans": n_scans,
        "build_s": build,
        "seconds": secs,
        "extra_gib": extra,
        "tsdf_voxels": st["tsdf"]["voxels"],
        "esdf_voxels": st["esdf"]["voxels"],
        "tiles": r.get("tiles", 1),
        "tile_bricks": esdf_mod.TILE_BRICKS if not tile_bricks else tile_bricks,
    }


def depth_frames(n, dev, seed=0):
    cam = sim.PinholeCamera.kinect()
    return list(sim.depth_sequence(n, cam, dev, seed, max_range_m=8.0))


def lidar_frames(n, dev, seed=0):
    return list(sim.lidar_sequence(n, dev, seed))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", nargs="+", default=["depth", "lidar", "maxd"])
    ap.add_argument("--depth-frames", type=int, default=60)
    ap.add_argument("--lidar-frames", type=int, default=30)
    ap.add_argument("--maxd-frames", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--depth-voxels", type=float, nargs="+", default=[0.02, 0.01, 0.005])
    ap.add_argument("--lidar-voxels", type=float, nargs="+", default=[0.1, 0.05])
    ap.add_argument("--esdf-voxel", type=float, default=0.05)
    ap.add_argument("--lidar-esdf-voxel", type=float, default=0.1)
    ap.add_argument("--max-distances", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--kernel-bricks", type=int, default=32768)
    ap.add_argument("--room-frames", type=int, default=1000)
    ap.add_argument("--room-voxel", type=float, default=0.02)
    ap.add_argument("--room-seconds", type=float, default=math.inf)
    ap.add_argument("--room-every", type=int, default=100, help="room: peak memory every this many frames")
    ap.add_argument("--count-frames", type=int, default=3, help="frames for launch and sync counts (CUDA)")
    ap.add_argument(
        "--profile", type=int, default=0, help="profile this many ESDF updates (depth, first voxel)"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lidar-occ-voxel", type=float, default=0.05, help="lidar-occ: all voxels")
    ap.add_argument("--city-scans", type=int, default=300, help="city: scans (the issue's street: 1100)")
    ap.add_argument("--city-speed", type=float, default=20.0, help="city: m/s at 10 Hz (2 m a scan)")
    ap.add_argument("--city-extent", type=float, default=1200.0, help="city: outdoor_scene extent (m)")
    ap.add_argument("--tile-bricks", type=int, default=0, help="city: tile_bricks (0: default)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs without the ESDF (peak memory)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--subset-passes",
        action="store_true",
        help="CUDA: envelope passes on the stored bricks' subsets (esdf.SUBSET_PASSES_CUDA), not the domain",
    )
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("mapper.integrators.esdf").setLevel(logging.INFO)  # tiled updates say so
    if args.subset_passes:
        from mapper.integrators import esdf as _esdf

        _esdf.SUBSET_PASSES_CUDA = True
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.processor() or 'cpu'}"
    lines = [
        "# ESDF benchmark (issue 11)",
        "",
        f"- date: {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}",
        f"- hardware: {hw}; torch {torch.__version__}; threads {torch.get_num_threads()}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "| case | frames | ms/frame median | p99 | max | ESDF update median | p99 | max | ESDF voxels | free"
        " voxels | TSDF voxels | peak GiB | peak GiB without ESDF | ops / update | launches / update |"
        " syncs / update (debug mode; sync calls) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(label, r):
        line = (
            f"| {label} | {r['frames']} | {r['median']:.2f} | {r['p99']:.2f} | {r['max']:.2f} | "
            f"{r['esdf_median']:.2f} | {r['esdf_p99']:.2f} | {r['esdf_max']:.2f} | {r['esdf_voxels']:,} | "
            f"{r['free_voxels']:,} | {r['tsdf_voxels']:,} | "
            f"{r['peak_gib']:.3f} | {r.get('peak_base', math.nan):.3f} | {r.get('ops', math.nan):.0f} | "
            f"{r.get('launches', math.nan):.0f} | {r.get('syncs', math.nan):.0f}; "
            f"{r.get('sync_calls', math.nan):.0f} |"
        )
        lines.append(line)
        print(line, flush=True)
        if args.out:  # after every case: a run cut short keeps what it measured
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")

    if "depth" in args.parts or "maxd" in args.parts:
        dframes = depth_frames(max(args.depth_frames, args.maxd_frames) + args.warmup, dev)
    if "depth" in args.parts:
        for v in args.depth_voxels:
            m = Map(v, ("tsdf", "esdf"), dev, esdf_voxel_size_m=args.esdf_voxel, max_range_m=8.0)
            r = run(m, dframes[: args.depth_frames + args.warmup], "depth", dev, args.warmup)
            r.update(counts(m, dframes, "depth", dev, args.count_frames))
            if not args.no_baseline:
                base = Map(v, ("tsdf",), dev, max_range_m=8.0)
                fr = dframes[: args.depth_frames + args.warmup]
                r["peak_base"] = run(base, fr, "depth", dev, 0)["peak_gib"]
                del base
            row(f"depth 640x480, TSDF {v * 100:g} cm, ESDF {args.esdf_voxel * 100:g} cm, max 2 m", r)
            if args.profile and v == args.depth_voxels[0]:
                try:
                    lines.extend(["", "```", profile(m, dframes, args.profile, dev), "```", ""])
                except Exception as e:  # the profile is an aid; never lose the measurements for it
                    print(f"profile failed: {e!r}", flush=True)
            del m
    if "lidar" in args.parts:
        lframes = lidar_frames(args.lidar_frames + args.warmup, dev)
        for v in args.lidar_voxels:
            m = Map(v, ("tsdf", "esdf"), dev, esdf_voxel_size_m=args.lidar_esdf_voxel, max_range_m=60.0)
            r = run(m, lframes, "lidar", dev, args.warmup)
            r.update(counts(m, lframes, "lidar", dev, args.count_frames))
            if not args.no_baseline:
                base = Map(v, ("tsdf",), dev, max_range_m=60.0)
                r["peak_base"] = run(base, lframes, "lidar", dev, 0)["peak_gib"]
                del base
            row(f"LiDAR 120k, TSDF {v * 100:g} cm, ESDF {args.lidar_esdf_voxel * 100:g} cm, max 2 m", r)
            del m
    if "lidar-occ" in args.parts:
        lframes = lidar_frames(args.lidar_frames + args.warmup, dev)
        v = args.lidar_occ_voxel
        m = Map(v, ("tsdf", "occupancy", "esdf"), dev, esdf_voxel_size_m=v, max_range_m=60.0)
        r = run(m, lframes, "lidar", dev, args.warmup)
        r.update(counts(m, lframes, "lidar", dev, args.count_frames))
        if not args.no_baseline:
            base = Map(v, ("tsdf", "occupancy"), dev, max_range_m=60.0)
            r["peak_base"] = run(base, lframes, "lidar", dev, 0)["peak_gib"]
            del base
        row(f"LiDAR 120k, TSDF + occupancy {v * 100:g} cm, ESDF {v * 100:g} cm, max 2 m", r)
        del m
    if "maxd" in args.parts:
        for md in args.max_distances:
            m = Map(
                0.02, ("tsdf", "esdf"), dev, esdf_voxel_size_m=0.05, esdf_max_distance_m=md, max_range_m=8.0
            )
            r = run(m, dframes[: args.maxd_frames + args.warmup], "depth", dev, args.warmup)
            row(f"depth, TSDF 2 cm, ESDF 5 cm, max distance {md:g} m", r)
            del m
    if "cpuab" in args.parts:
        lines += [
            "",
            "| torch 1-D pass, same frames (bits equal) | frames | ESDF voxels | CPU s per update, median /"
            " max (wall median): envelope | min-plus | default pick | envelope / pick |",
            "|---|---|---|---|---|---|---|",
        ]
        cases = [("depth", v, args.esdf_voxel, 8.0) for v in args.depth_voxels]
        cases += [("lidar", v, args.lidar_esdf_voxel, 60.0) for v in args.lidar_voxels]
        for kind, v, ev, rng in cases:
            fr = (
                depth_frames(args.depth_frames, dev)
                if kind == "depth"
                else lidar_frames(args.lidar_frames, dev)
            )
            r = cpu_ab(fr, kind, v, ev, rng, dev)
            e, mp, p = r["envelope"], r["minplus"], r["pick"]
            lines.append(
                f"| {kind}, TSDF {v * 100:g} cm, ESDF {ev * 100:g} cm, max 2 m | {r['frames']} | "
                f"{r['voxels']:,} | {e[0]:.2f} / {e[1]:.2f} ({e[2]:.2f}) | {mp[0]:.2f} / {mp[1]:.2f} "
                f"({mp[2]:.2f}) | {p[0]:.2f} / {p[1]:.2f} ({p[2]:.2f}) | {e[0] / max(p[0], 1e-9):.1f}x |"
            )
            print(lines[-1], flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write("\n".join(lines) + "\n")
        lines.append("")
    if "kernel" in args.parts:
        lines += [
            "",
            "| transform alone: M (voxels) | domain voxels | sites | ms median |",
            "|---|---|---|---|",
        ]
        for mm in (10, 20, 40, 80):
            k = kernel_case(args.kernel_bricks, mm, dev)
            lines.append(f"| {mm} | {k['voxels']:,} | {k['sites']:,} | {k['median']:.2f} |")
            print(lines[-1], flush=True)
        lines.append("")
    if "city" in args.parts:
        c = city_case(args.city_scans, args.city_extent, args.city_speed, dev, args.tile_bricks)
        lines += [
            "",
            "| cold ESDF of a street map (10 cm, max 2 m) | scans | build s | TSDF voxels | ESDF voxels |"
            " tiles | update_esdf s | extra GiB at peak |",
            "|---|---|---|---|---|---|---|---|",
            f"| {c['scans'] * args.city_speed / 10:.0f} m drive | {c['scans']} | {c['build_s']:.1f} | "
            f"{c['tsdf_voxels']:,} | {c['esdf_voxels']:,} | {c['tiles']} (tile_bricks {c['tile_bricks']}) | "
            f"{c['seconds']:.2f} | {c['extra_gib']:.2f} |",
            "",
        ]
        print("\n".join(lines[-4:]), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")
    if "room" in args.parts:
        m = Map(args.room_voxel, ("tsdf", "esdf"), dev, esdf_voxel_size_m=args.esdf_voxel, max_range_m=8.0)
        cam = sim.PinholeCamera.kinect()
        seq = sim.depth_sequence(args.room_frames, cam, dev, 1, max_range_m=8.0)  # lazy: one frame at a time
        r = run(m, seq, "depth", dev, args.warmup, args.room_seconds, every=args.room_every)
        row(
            f"room sequence ({r['frames'] + args.warmup} of {args.room_frames} frames), TSDF "
            f"{args.room_voxel * 100:g} cm, ESDF {args.esdf_voxel * 100:g} cm, max 2 m",
            r,
        )
        lines += [
            "",
            "| room: frames so far | peak GiB so far | median ms (last frames) | ESDF voxels | seconds |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {a} | {b:.3f} | {c:.2f} | {d:,} | {e:.1f} |" for a, b, c, d, e in r["trend"]]
        lines.append("")
        print("\n".join(lines[-len(r["trend"]) - 2 :]), flush=True)
        del m
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()

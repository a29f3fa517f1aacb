"""First frame of a new map: cold (kernels compiled by the frame), after the warm-up, and after a restart
with the Triton cache on disk (issue 12: the first frame of a new map <= 50 ms once warmed up).

Each case runs in a fresh Python process (Triton keeps compiled kernels in memory per process):
* ``cold``: an empty ``TRITON_CACHE_DIR``, ``Map(..., warmup=False)``: the first frame compiles.
* ``warm``: an empty cache, a first ``Map`` (its creation runs the warm-up: timed), then a *new* map (what
  a service does for ``POST /v1/maps`` after start-up): its first frames are timed.
* ``restart``: the cache left by ``warm`` (a restarted service with the cache under its data directory):
  the warm-up again (loads from disk) and the first frames of a new map.
* ``inproc`` (``--cases inproc``, for before/after comparisons inside a short device slot): no warm-up; a
  throwaway map's first two frames compile what a frame uses (its time is the "map creation" column),
  then a new map's first frames are timed. ``MAPPER_BENCH_TRITON_CACHE``: one Triton cache for every case
  (compiled kernels shared between runs of two trees).

A frame = ``integrate_lidar`` of a simulated 120 k-point scan (HDL-64-like, outdoor scene) + ``update_esdf``,
synchronised. Run: ``python benchmarks/bench_warmup.py --device cuda --out DIR`` (writes ``warmup.md`` and
``warmup.json`` there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path


def _case(mode: str, device: str, voxel: float, frames: int, beams: int) -> dict:
    import torch

    from mapper import Map, sim

    dev = torch.device(device)
    scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
    lidar = sim.SpinningLidar(n_beams=beams)
    poses = sim.driving_trajectory(frames, scene=scene)
    scans = [(lidar.scan(scene, T.to(dev)), T) for T in poses]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    sync()
    out = {"mode": mode, "points": int(scans[0][0].shape[0])}
    compiled: list[str] = []  # kernels Triton compiled (or loaded from its cache) during each step
    try:
        import triton

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", str(fn))
            spec = str(kwargs.get("repr", ""))[:800]
            compiled.append(f"{name}: {spec}")

        triton.knobs.runtime.jit_post_compile_hook = hook
    except Exception:  # no triton: nothing compiles
        pass
    t = time.perf_counter()
    first = Map(voxel, layers=("tsdf", "esdf"), device=dev, warmup=mode not in ("cold", "inproc"))
    if mode == "inproc":  # the kernels compiled by a throwaway map's frames instead of the warm-up
        for pts, T in scans[:2]:
            first.integrate_lidar(pts, T)
            first.update_esdf()
        del first
    sync()
    out["map_create_s"] = time.perf_counter() - t
    out["compiles_create"] = len(compiled)
    compiled.clear()
    warm = mode in ("warm", "restart")
    m = Map(voxel, layers=("tsdf", "esdf"), device=dev, warmup=warm) if mode != "cold" else first
    ms, ims, comp = [], [], []
    for pts, T in scans:
        sync()
        t = time.perf_counter()
        m.integrate_lidar(pts, T)
        sync()
        ti = time.perf_counter()
        m.update_esdf()
        sync()
        ms.append((time.perf_counter() - t) * 1e3)
        ims.append((ti - t) * 1e3)
        comp.append(list(compiled))
        compiled.clear()
    out["frame_compiles"] = comp
    out["frame_ms"] = ms
    out["integrate_ms"] = ims
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--voxel", type=float, default=0.1)
    ap.add_argument("--frames", type=int, default=5)
    ap.add_argument("--beams", type=int, default=64, help="64 x 1875 rays: ~120 k returns")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-cold", action="store_true", help="only the warm and restart cases")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=None,
        choices=["cold", "warm", "restart", "inproc"],
        help="instead: these cases; inproc = kernels compiled by a throwaway map's two frames in the same "
        "process (no warm-up: seconds, not the warm-up's minute of cold compiles), then a new map's frames",
    )
    ap.add_argument("--label", default="", help="a label for the report's title (e.g. the tree measured)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:  # child process
        print(json.dumps(_case(a.case, a.device, a.voxel, a.frames, a.beams)))
        return
    results = []
    with tempfile.TemporaryDirectory() as cold_dir, tempfile.TemporaryDirectory() as warm_dir:
        cases = (("cold", cold_dir), ("warm", warm_dir), ("restart", warm_dir), ("inproc", warm_dir))
        if a.cases:
            todo = [c for c in cases if c[0] in a.cases]
        else:
            todo = cases[1:3] if a.skip_cold else cases[:3]
        for mode, cache in todo:
            cache = os.environ.get("MAPPER_BENCH_TRITON_CACHE", cache)  # a shared cache (device scripts)
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            cmd = [sys.executable, __file__, "--case", mode, "--device", a.device, "--voxel", str(a.voxel)]
            cmd += ["--frames", str(a.frames), "--beams", str(a.beams)]
            t = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                print(p.stdout, p.stderr, file=sys.stderr)
                raise SystemExit(f"case {mode} failed")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["process_s"] = time.perf_counter() - t
            results.append(r)
            f = r["frame_ms"]
            if a.out:  # as it goes: a timeout still leaves the finished cases
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / "warmup.json").write_text(json.dumps(results, indent=1))
            print(
                f"{mode:8s} map creation {r['map_create_s'] * 1e3:8.1f} ms  first frame {f[0]:8.1f} ms "
                f"(integrate {r['integrate_ms'][0]:.1f})  next {', '.join(f'{x:.1f}' for x in f[1:])} ms "
                f"(integrate {', '.join(f'{x:.1f}' for x in r['integrate_ms'][1:])})  "
                f"(process {r['process_s']:.1f} s)",
                flush=True,
            )
            for i, c in enumerate(r["frame_compiles"]):
                print(f"  frame {i + 1}: {len(c)} kernels compiled" + "".join(f"\n    {x}" for x in c))
    if a.out:
        import torch

        a.out.mkdir(parents=True, exist_ok=True)
        hw = (
            torch.cuda.get_device_name(0)
            if a.device == "cuda" and torch.cuda.is_available()
            else platform.processor()
        )
        head = [
            "# First frame of a new map: cold / after warm-up / after restart (bench_warmup.py)"
            + (f" - {a.label}" if a.label else ""),
            "",
            f"{datetime.now(UTC).isoformat(timespec='seconds')}, {hw}, torch {torch.__version__}",
            f"command: python benchmarks/bench_warmup.py --device {a.device} --voxel {a.voxel} "
            f"--frames {a.frames}" + (f" --cases {' '.join(a.cases)}" if a.cases else ""),
            f"frame = integrate_lidar ({results[0]['points']} points) + update_esdf, tsdf+esdf at "
            f"{a.voxel} m",
            "",
            "| case | map creation (ms) | first frame (ms) | of which integrate_lidar | frames 2.. (ms) "
            "| of which integrate_lidar | Triton compiles per frame |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results:
            f = r["frame_ms"]
            rest = ", ".join(f"{x:.1f}" for x in f[1:])
            ri = ", ".join(f"{x:.1f}" for x in r["integrate_ms"][1:])
            head.append(
                f"| {r['mode']} | {r['map_create_s'] * 1e3:.1f} | {f[0]:.1f} | {r['integrate_ms'][0]:.1f} | "
                f"{rest} | {ri} | {', '.join(str(len(c)) for c in r['frame_compiles'])} |"
            )
        for r in results:
            for i, c in enumerate(r["frame_compiles"]):
                if c:
                    head.append(f"\n{r['mode']}, frame {i + 1}: " + "; ".join(f"`{x}`" for x in c))
        (a.out / "warmup.md").write_text("\n".join(head) + "\n")
        (a.out / "warmup.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

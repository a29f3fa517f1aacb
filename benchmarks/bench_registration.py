"""Scan-to-map LiDAR odometry (``mapper.registration.Odometry``) side by side with KISS-ICP.

Sequences:
* ``sim``: a KITTI-like drive through ``mapper.sim.outdoor_scene`` (``sim.driving_trajectory``: 10 m/s at
  10 Hz from the first frame on, 0.3 m weave, +-0.5 deg pitch/roll), scanned by a 64-beam
  ``SpinningLidar`` (64 x 1875 rays, 60 m range, 2 cm range noise): ~120 k points per scan. Frames are
  cached (``--cache``) because ray casting them on the CPU takes ~1 s each.
* ``norlab``: the 14 real 32-beam scans of ``../shared/data/norlab_lidar`` (reference: ``icp_odom.csv``,
  libpointmatcher's ICP odometry). The robot moves ~0.1 m in all, so absolute errors are reported.

Metrics (both methods on the same frames, poses expressed relative to the first frame):
* ``rel. transl. %``: KITTI-style: for every start frame and every segment length L in ``--segments``
  (metres of ground-truth path), the translation error of the relative pose over the segment divided by L;
  mean over all (start, L) pairs. Segments shorter than the drive only.
* ``rot. deg/m``: the same for the rotation angle of the relative-pose error, divided by L.
* ``end drift %``: ``|t(inv(T_gt_end) T_est_end)| / path length`` (end-to-end).
* ``ATE m``: RMS of the position errors (no alignment: both start at the identity).
* ``ms/frame``: median (p90) time of one ``register_frame`` call over the frames after the warm-up (5 frames
  of the drive, 1 of norlab): wall time on the CPU; on CUDA, CUDA events around the call (recorded on the
  current stream; the call itself synchronises a few times, e.g. once per ICP iteration for the 6x6 solve).
  KISS-ICP always runs on the CPU with as many threads as torch (``--threads``, default torch's).

On CUDA the drive is simulated on the GPU (seconds; the noise differs from the CPU's, so the two reports
are on statistically equal, not identical, frames). Without kiss-icp installed (the GPU machine has no
network) the KISS-ICP rows are left out and the report says so.

Usage: python benchmarks/bench_registration.py --device cpu --frames 300 \
           --out benchmarks/results/registration_cpu.md
       python benchmarks/bench_registration.py --device cuda --frames 300 \
           --out benchmarks/results/registration_h200.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mapper import sim
from mapper.datasets import NorlabLidar
from mapper.kernels.dispatch import use_triton
from mapper.registration import Odometry, OdometryConfig

ROOT = Path(__file__).resolve().parents[1]
NORLAB = ROOT.parent / "shared" / "data" / "norlab_lidar"


# --------------------------------------------------------------------------------------------- data
def simulated_drive(n_frames: int, seed: int, noise_m: float, cache: Path | None, device=None):
    """``(scans: list of float32 [N, 3] numpy, poses: float64 [n, 4, 4])`` of the KITTI-like drive (ray cast
    on ``device``; the CPU's frames are cached)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    path = None
    if cache is not None:
        tag = "" if device.type == "cpu" else f"_{device.type}"
        path = cache / f"registration_sim_n{n_frames}_s{seed}_noise{noise_m:g}{tag}.npz"
        if path.exists():
            d = np.load(path)
            return [d[f"scan{i}"] for i in range(n_frames)], d["poses"]
    scene = sim.outdoor_scene(seed)
    poses = sim.driving_trajectory(n_frames, scene=scene, seed=seed)
    lidar = sim.SpinningLidar(range_noise_std_m=noise_m)
    scene = scene.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    scans = []
    for i in range(n_frames):
        scans.append(lidar.scan(scene, poses[i].to(device), generator=gen).cpu().numpy())
        print(f"  simulated frame {i + 1}/{n_frames}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    poses = poses.numpy()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, poses=poses, **{f"scan{i}": s for i, s in enumerate(scans)})
    return scans, poses


def norlab_scans():
    ds = NorlabLidar(NORLAB)
    items = [ds[i] for i in range(len(ds))]
    return [it["points"] for it in items], np.stack([it["T_world_sensor"] for it in items])


# ------------------------------------------------------------------------------------------ metrics
def _rel(poses: np.ndarray) -> np.ndarray:
    """Poses relative to the first one."""
    return np.linalg.inv(poses[0]) @ poses


def _angle(R: np.ndarray) -> np.ndarray:
    return np.arccos(np.clip((np.trace(R, axis1=-2, axis2=-1) - 1) / 2, -1.0, 1.0))


def trajectory_errors(gt: np.ndarray, est: np.ndarray, segments_m, first: int = 0) -> dict:
    """KITTI-style relative errors over segments (start frames >= ``first``), end drift and ATE.

    ``gt``/``est``: float64 [n, 4, 4] world-from-sensor poses (any world frames; both are re-anchored at
    their first pose)."""
    gt, est = _rel(gt), _rel(est)
    steps = np.linalg.norm(np.diff(gt[:, :3, 3], axis=0), axis=1)
    dist = np.concatenate([[0.0], np.cumsum(steps)])
    t_err, r_err = [], []
    for i in range(first, len(gt)):
        for L in segments_m:
            j = int(np.searchsorted(dist, dist[i] + L))
            if j >= len(gt):
                continue
            d_gt = np.linalg.inv(gt[i]) @ gt[j]
            d_est = np.linalg.inv(est[i]) @ est[j]
            E = np.linalg.inv(d_gt) @ d_est
            t_err.append(np.linalg.norm(E[:3, 3]) / L)
            r_err.append(np.degrees(_angle(E[:3, :3])) / L)
    E_end = np.linalg.inv(gt[-1]) @ est[-1]
    pos = np.linalg.norm(gt[:, :3, 3] - est[:, :3, 3], axis=1)
    return {
        "rel_t_pct": 100 * float(np.mean(t_err)) if t_err else float("nan"),
        "rel_r_deg_per_m": float(np.mean(r_err)) if r_err else float("nan"),
        "end_drift_pct": 100 * float(np.linalg.norm(E_end[:3, 3]) / max(dist[-1], 1e-9)),
        "end_t_m": float(np.linalg.norm(E_end[:3, 3])),
        "end_r_deg": float(np.degrees(_angle(E_end[:3, :3]))),
        "ate_m": float(np.sqrt(np.mean(pos**2))),
        "path_m": float(dist[-1]),
    }


# ------------------------------------------------------------------------------------------ runners
class Ours:
    def __init__(self, max_range_m: float, device: torch.device):
        self.device = device
        self.name = "mapper (Triton)" if use_triton(device) else "mapper (torch)"
        self.odo = Odometry(OdometryConfig(max_range_m=max_range_m), device=device)

    def __call__(self, points: np.ndarray) -> tuple[np.ndarray, float]:
        pts = torch.from_numpy(points).to(self.device)  # the upload is not timed
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            T = self.odo.register_frame(pts)
            end.record()
            end.synchronize()
            return T.cpu().numpy(), start.elapsed_time(end)
        t0 = time.perf_counter()
        T = self.odo.register_frame(pts)
        return T.numpy(), (time.perf_counter() - t0) * 1e3


def kiss_available() -> bool:
    try:
        import kiss_icp  # noqa: F401
    except ImportError:
        return False
    return True


class Kiss:
    name = "KISS-ICP"

    def __init__(self, max_range_m: float, threads: int):
        from kiss_icp.config import load_config
        from kiss_icp.kiss_icp import KissICP

        cfg = load_config(None)
        cfg.data.max_range = max_range_m
        cfg.mapping.voxel_size = max_range_m / 100.0
        cfg.registration.max_num_threads = threads
        self.kiss = KissICP(cfg)

    def __call__(self, points: np.ndarray) -> tuple[np.ndarray, float]:
        pts = points.astype(np.float64)
        t0 = time.perf_counter()
        self.kiss.register_frame(pts, np.zeros(0))
        ms = (time.perf_counter() - t0) * 1e3
        return self.kiss.last_pose.copy(), ms


def run(scans, runners, warmup: int = 5):
    """Frames interleaved between the runners (same background load for each)."""
    poses = {r.name: [] for r in runners}
    times = {r.name: [] for r in runners}
    for i, pts in enumerate(scans):
        for r in runners:
            T, ms = r(pts)
            poses[r.name].append(T)
            if i >= warmup:
                times[r.name].append(ms)
        print(f"  frame {i + 1}/{len(scans)}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    return {k: np.stack(v) for k, v in poses.items()}, times


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.02, help="range noise std (m) of the simulated LiDAR")
    ap.add_argument("--max-range", type=float, default=100.0, help="max range (m) of both pipelines")
    ap.add_argument("--segments", type=float, nargs="+", default=[25.0, 50.0, 100.0, 200.0])
    ap.add_argument("--steady-from", type=int, default=10, help="first start frame of the steady-state row")
    ap.add_argument("--parts", nargs="+", default=["sim", "norlab"], choices=["sim", "norlab"])
    ap.add_argument("--no-kiss", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=0, help="CPU threads of torch and KISS-ICP (0 = torch's default)"
    )
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "mapper" / "bench"))
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kiss = not args.no_kiss and kiss_available()
    if not args.no_kiss and not kiss:
        print("kiss-icp is not installed: KISS-ICP rows left out", file=sys.stderr)
    rows = []
    for part in args.parts:
        if part == "sim":
            scans, gt = simulated_drive(
                args.frames, args.seed, args.noise, Path(args.cache) if args.cache else None, device
            )
            label = f"sim drive, {len(scans)} frames"
        else:
            if not NORLAB.is_dir():
                print(f"skipping norlab: {NORLAB} not found", file=sys.stderr)
                continue
            scans, gt = norlab_scans()
            label = f"norlab, {len(scans)} real scans"
        npts = int(np.median([len(s) for s in scans]))
        runners = [Ours(args.max_range, device)]
        if kiss:
            runners.append(Kiss(args.max_range, torch.get_num_threads()))
        est, times = run(scans, runners, warmup=5 if len(scans) > 20 else 1)
        for r in runners:
            m = trajectory_errors(gt, est[r.name], args.segments)
            ms = trajectory_errors(gt, est[r.name], args.segments, first=args.steady_from)
            rows.append(
                (
                    label,
                    npts,
                    r.name,
                    m,
                    ms,
                    float(np.median(times[r.name])),
                    float(np.percentile(times[r.name], 90)),
                )
            )
    report = render(rows, args, device, kiss)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


def _f(x: float, spec: str) -> str:
    return "n/a" if not np.isfinite(x) else format(x, spec)


def render(rows, args, device, kiss: bool) -> str:
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    hw = f"{platform.machine()}; CPU threads: {os.cpu_count()}; torch threads: {torch.get_num_threads()}"
    if device.type == "cuda":
        hw += f"; GPU: {torch.cuda.get_device_name(device)}"
    try:
        from importlib.metadata import version

        kiss_v = version("kiss-icp")
    except Exception:  # pragma: no cover
        kiss_v = "not installed"
    timing = (
        "CUDA events around the call (after the warm-up frames; the Triton kernels are compiled by then)"
        if device.type == "cuda"
        else "wall time"
    )
    lines = [
        f"# bench_registration ({device.type})",
        "",
        f"- date: {now}",
        f"- hardware: {hw}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}, kiss-icp {kiss_v}",
        f"- command: `python benchmarks/bench_registration.py {' '.join(sys.argv[1:])}`",
        f"- both pipelines: max range {args.max_range:g} m, voxel {args.max_range / 100:g} m (KISS-ICP's"
        " default rule), no deskew (the scans carry no timestamps); poses re-anchored at the first frame;"
        f" KISS-ICP on the CPU, threads: {torch.get_num_threads()} (as torch)",
        f"- rel. transl./rot.: KITTI-style mean over all start frames and segment lengths {args.segments} m"
        " (segments that fit the path: n/a for the 0.1 m norlab sequence, whose reference is"
        " libpointmatcher's ICP odometry); 'steady' = the same over start frames >= "
        f"{args.steady_from} (excludes the start-up from rest-less constant velocity)",
        f"- ms/frame: median (p90) of one register_frame call after the warm-up frames, {timing};"
        " 'x KISS' = our median / KISS-ICP's",
    ]
    if not kiss:
        lines.append("- KISS-ICP: not run (kiss-icp not installed here, or --no-kiss)")
    lines += [
        "",
        "| sequence | pts/scan | method | rel. transl. % | steady transl. % | rot. deg/m | end drift %"
        " | end err m / deg | ATE m | ms/frame (p90) | x KISS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    kiss_ms = {label: med for label, _, name, _, _, med, _ in rows if name == "KISS-ICP"}
    for label, npts, name, m, ms, med, p90 in rows:
        ratio = f"{med / kiss_ms[label]:.2f}" if label in kiss_ms else "n/a"
        lines.append(
            f"| {label} ({m['path_m']:.1f} m) | {npts:,} | {name} | {_f(m['rel_t_pct'], '.3f')}"
            f" | {_f(ms['rel_t_pct'], '.3f')} | {_f(m['rel_r_deg_per_m'], '.5f')} | {m['end_drift_pct']:.3f}"
            f" | {m['end_t_m']:.3f} / {m['end_r_deg']:.3f} | {m['ate_m']:.3f} | {med:.1f} ({p90:.1f})"
            f" | {ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

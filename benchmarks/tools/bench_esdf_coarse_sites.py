"""CPU cost of the coarse ESDF's sites (issue 25): this checkout's ``esdf.py`` against a reference revision's,
in one process, interleaved rounds, process CPU time, 1 thread; and a bit-for-bit check of the results.

The reference module is ``mapper/integrators/esdf.py`` at ``--ref`` (git), loaded beside this checkout's as
``mapper.integrators._esdf_ref`` (same package, so the rest of ``mapper`` is shared). Per scene (the LiDAR
scene of ``tests/test_esdf_overestimate.py``: 400 azimuth steps / 6 m, and 720 / 9 m) and ESDF / TSDF ratio:
``coarse_tsdf_sites`` on all fine bricks and a cold ``recompute`` of the ESDF (the integrator's class swapped
for the reference's), each round running both in alternating order; the sites (voxels, offsets) and the
ESDF layers (bricks, ``esdf``, ``observed``) of both must be equal bit for bit (NaN == NaN), else it exits 1.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/tools/bench_esdf_coarse_sites.py --ref 8d822de --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import test_esdf_overestimate as scenes  # noqa: E402

import mapper  # noqa: E402
from mapper import sim  # noqa: E402
from mapper.integrators import esdf as cur  # noqa: E402


def load_ref(rev: str):
    cmd = ["git", "show", f"{rev}:mapper/integrators/esdf.py"]
    src = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "_esdf_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("mapper.integrators._esdf_ref", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(ratio: float, n_azimuth: int, max_range: float) -> mapper.Map:
    scene = scenes.lidar_scene()
    lidar = sim.SpinningLidar(
        n_beams=16, n_azimuth=n_azimuth, fov_up_deg=5.0, fov_down_deg=-25.0, max_range_m=max_range
    )
    m = mapper.Map(
        scenes.FINE,
        layers=("tsdf", "esdf"),
        device="cpu",
        esdf_voxel_size_m=scenes.FINE * ratio,
        esdf_max_distance_m=scenes.MAX_DISTANCE,
        warmup=False,
    )
    for x, y in ((0.0, 0.0), (0.6, 0.35)):
        T = torch.eye(4, dtype=torch.float64)
        T[:3, 3] = torch.tensor([x, y, 1.6], dtype=torch.float64)
        m.integrate_lidar(lidar.scan(scene, T), T)
    return m


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN == NaN, -0.0 != +0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(ints), b.view(ints)))


def layer_state(es) -> list[torch.Tensor]:
    la = es.layer
    bricks = cur._unique_bricks(la.brick_table()[0])
    ext, slot = cur._existing_slots(la, bricks)
    return [ext, cur._gather_slots(la, slot, "esdf"), cur._gather_slots(la, slot, "observed")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="8d822de")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ratios", type=float, nargs="+", default=[2, 2.5, 4])
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = load_ref(args.ref)
    cur_cls, ref_cls = cur.EsdfIntegrator, ref.EsdfIntegrator
    ok = True
    print("| scene | ratio | fine bricks | coarse_tsdf_sites ref / this (s, median) | recompute ref / this |")
    print("|---|---|---|---|---|")
    for n_az, rng in ((400, 6.0), (720, 9.0)):
        for ratio in args.ratios:
            m = build(ratio, n_az, rng)
            es, tsdf = m._esdf, m._tsdf
            fine = cur._unique_bricks(tsdf.brick_table()[0])
            fm = cur.FRONT_MAX_VOX * es.source_voxel_size_m
            sites = {"ref": ref.coarse_tsdf_sites, "cur": cur.coarse_tsdf_sites}
            classes = {"ref": ref_cls, "cur": cur_cls}
            t_s = {"ref": [], "cur": []}
            t_r = {"ref": [], "cur": []}
            out_s, out_l = {}, {}
            for rnd in range(args.rounds + 1):  # round 0: warm-up, not timed
                for who in ("ref", "cur") if rnd % 2 else ("cur", "ref"):
                    t0 = time.process_time()
                    out_s[who] = sites[who](tsdf, fine, es.ratio, front_max=fm)
                    t1 = time.process_time()
                    es.__class__ = classes[who]
                    es.recompute(tsdf, None, None)
                    t2 = time.process_time()
                    es.__class__ = cur_cls
                    out_l[who] = layer_state(es)
                    if rnd:
                        t_s[who].append(t1 - t0)
                        t_r[who].append(t2 - t1)
                eq = all(same(a, b) for a, b in zip(out_s["ref"], out_s["cur"], strict=True)) and all(
                    same(a, b) for a, b in zip(out_l["ref"], out_l["cur"], strict=True)
                )
                if not eq:
                    ok = False
                    print(f"MISMATCH: {n_az} az / {rng} m, ratio {ratio}, round {rnd}", file=sys.stderr)
            med = {
                k: statistics.median(v)
                for k, v in (("sr", t_s["ref"]), ("sc", t_s["cur"]), ("rr", t_r["ref"]), ("rc", t_r["cur"]))
            }
            print(
                f"| {n_az} az / {rng:g} m | {ratio:g}x | {fine.shape[0]} | "
                f"{med['sr']:.3f} / {med['sc']:.3f} | "
                f"{med['rr']:.3f} / {med['rc']:.3f} |",
                flush=True,
            )
    print("bit-identical sites and layers: " + ("yes" if ok else "NO"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

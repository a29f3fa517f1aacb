"""Peak host memory and CPU time of ``Map.update_esdf()`` on the CPU, per LiDAR frame (issue 25).

Process RSS high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` before each update) minus
the RSS before it: the update's working memory on the CPU (Linux only). ``--emu`` takes the CUDA path's
choices on the CPU (``esdf._cuda_path``), a proxy for its GPU working memory (the torch line / envelope
passes stand in for the Triton kernels). ``--tile N`` sets ``tile_bricks``; ``--cold N`` then rebuilds the
ESDF cold with ``tile_bricks = N``. Prints an md5 of the layer (equal digests: equal layers).

Run: ``python benchmarks/tools/probe_esdf_memory.py 0.2 32 3 [--emu] [--tile N] [--cold N]``
(voxel m, beams, frames).
"""

import hashlib
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mapper import Map, sim  # noqa: E402

emu = "--emu" in sys.argv
if emu:
    from mapper.integrators import esdf

    esdf._cuda_path = lambda d: True


def hwm():
    for l in open("/proc/self/status"):
        if l.startswith("VmHWM"):
            return int(l.split()[1]) / 1024


def rss():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"):
            return int(l.split()[1]) / 1024


def reset():
    open("/proc/self/clear_refs", "w").write("5")


voxel = float(sys.argv[1])
beams = int(sys.argv[2])
nf = int(sys.argv[3])
torch.set_num_threads(1)
dev = torch.device("cpu")
scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
lidar = sim.SpinningLidar(n_beams=beams)
poses = sim.driving_trajectory(nf, scene=scene)
m = Map(voxel, layers=("tsdf", "esdf"), device=dev)
for i, T in enumerate(poses):
    pts = lidar.scan(scene, T)
    m.integrate_lidar(pts, T)
    if "--tile" in sys.argv:
        m._esdf.tile_bricks = int(sys.argv[sys.argv.index("--tile") + 1])
    reset()
    r0 = rss()
    c0 = time.process_time()
    r = m.update_esdf()
    c1 = time.process_time()
    print(
        f"frame {i} pts {pts.shape[0]} update cpu {c1 - c0:.2f}s peak extra {hwm() - r0:.0f} MiB "
        f"rss {r0:.0f} computed {r.get('computed_voxels')} recomputed {r.get('recomputed_voxels')}",
        flush=True,
    )
g, d = m._esdf.view()
print(
    "digest",
    hashlib.md5(
        g.leaves.keys.numpy().tobytes() + d["esdf"].numpy().tobytes() + d["observed"].numpy().tobytes()
    ).hexdigest(),
)
if "--cold" in sys.argv:
    from mapper.integrators import esdf as E

    tb = int(sys.argv[sys.argv.index("--cold") + 1])
    logging.basicConfig(level=logging.INFO)
    m._esdf.layer = E.BrickLayer(E.esdf_fields(m._esdf.max_distance_m), dev)
    m._esdf.tile_bricks = tb
    reset()
    r0 = rss()
    c0 = time.process_time()
    r = m._esdf.recompute(m._tsdf, m._occ, m._free)
    print(f"cold tile {tb}: cpu {time.process_time() - c0:.2f}s peak extra {hwm() - r0:.0f} MiB {r}")
    g, d = m._esdf.view()
    print(
        "digest",
        hashlib.md5(
            g.leaves.keys.numpy().tobytes() + d["esdf"].numpy().tobytes() + d["observed"].numpy().tobytes()
        ).hexdigest(),
    )

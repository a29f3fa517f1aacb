"""Compile before the first frame: run a map configuration's whole frame path once on tiny synthetic data.

Triton compiles a kernel variant (its dtypes and ``constexpr`` specialisations) on its first launch: on a
new map, the first frame paid 0.3-0.4 s of compilation (and every variant a later frame reached first, a
spike). :func:`warm_up` builds a scratch map of the same configuration and runs, on a small synthetic
scene (a ground plane, a wall and a ball, seen by a LiDAR scan and a depth image):
LiDAR and depth integration, the ESDF update, distance / TSDF / occupancy queries, an ESDF slice and box,
a raycast and the mesh: the kernels of the real frames, at small sizes. ``Map(..., warmup=True)`` (the
default) calls it once per distinct configuration and device per process; the service calls it for
every configuration it restores and for its default one before ``/readyz`` reports ready, with
``TRITON_CACHE_DIR`` under its data directory, so a restart loads the compiled kernels from disk.

Where no Triton kernel runs (CPU without ``TRITON_INTERPRET``, ``MAPPER_KERNELS=torch``), nothing is done.
The coarse ray walk's loop bound is a power-of-two bucket of the longest ray's brick count (a constexpr):
its variants are compiled for every bucket a ray up to the map's ``max_range_m`` can reach, at each cell
size the map walks (:func:`_coarse_buckets`). Kernels whose integer sizes Triton specialises (``== 1``,
``% 16 == 0``) are launched once per class (:func:`_envelope_variants`); the frame-path kernels take their
sizes unspecialised. ``tests/test_warmup_variants.py`` checks that frames after the warm-up launch no
variant it did not (on the CPU, from the launches' specialisation keys; on a GPU, from Triton's compile
hook).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

import torch

from . import gc_policy, graphs
from .kernels.dispatch import compiled
from .kernels.envelope import lower_envelope
from .kernels.segments import brick_segments
from .mesh import warm_graphs

log = logging.getLogger(__name__)

_done: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _key(config: dict, device: torch.device) -> tuple[str, str]:
    return json.dumps(config, sort_keys=True, default=str), str(device)


def warmed(config: dict, device) -> bool:
    """True once :func:`warm_up` completed for ``config`` on ``device`` in this process."""
    return _key(config, torch.device(device)) in _done


def needed(device) -> bool:
    """True when maps on ``device`` run Triton kernels (so a warm-up compiles something)."""
    return compiled(device)


def warm_up(config: dict, device, *, force: bool = False, sizes: tuple[int, ...] = (64, 1027)) -> float:
    """Run the frame path of a map with ``config`` (``Map.config()``) on ``device`` once; returns the
    seconds it took (0.0 when skipped: nothing to compile, or this configuration was warmed already in
    this process and ``force`` is False). Errors are logged, never raised: a warm-up only saves time.
    ``sizes``: columns of the synthetic scans (x 16 beams), one pass of the frame path each (the CPU
    interpreter wants one small one)."""
    dev = torch.device(device)
    if not needed(dev):
        return 0.0
    key = _key(config, dev)
    with _lock:
        if key in _done and not force:
            return 0.0
        t = time.perf_counter()
        try:
            _run(config, dev, sizes)
        except Exception:  # pragma: no cover - a warm-up failure must not stop a map or the service
            log.exception("warm-up of %s on %s failed; kernels compile on first use", config, dev)
            return time.perf_counter() - t
        _done.add(key)
        dt = time.perf_counter() - t
    log.info(
        "warm-up on %s: %.2f s (voxel %s m, layers %s)",
        dev,
        dt,
        config.get("voxel_size_m"),
        config.get("layers"),
    )
    return dt + gc_policy.settle()  # the full collection here, not in a frame (see mapper.gc_policy)


def _scene_points(s: float, dev, n_azimuth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny LiDAR scan (sensor frame, float32 ``[N, 3]``) of a ground 1.5 m below, a wall and a ball, and
    its pose (float64 ``[4, 4]``): ``16 * n_azimuth`` rays, most with a return."""
    az = torch.linspace(0.0, 2.0 * math.pi, n_azimuth + 1, dtype=torch.float64)[:-1]
    el = torch.deg2rad(torch.linspace(-25.0, 10.0, 16, dtype=torch.float64))
    a, e = torch.meshgrid(az, el, indexing="ij")
    d = torch.stack((e.cos() * a.cos(), e.cos() * a.sin(), e.sin()), dim=-1).reshape(-1, 3)
    h, wall = 1.5, 3.0 + 7.0 * s
    t = torch.full((d.shape[0],), math.inf, dtype=torch.float64)
    down = d[:, 2] < -1e-6
    t = torch.where(down, -h / d[:, 2].clamp(max=-1e-6), t)
    fw = d[:, 0] > 1e-6
    t = torch.minimum(t, torch.where(fw, wall / d[:, 0].clamp(min=1e-6), math.inf))
    c, r = torch.tensor([-2.0, 1.0, -0.5], dtype=torch.float64), 0.6  # a ball: its sphere intersection
    b = d @ c
    disc = b * b - (c @ c - r * r)
    tb = torch.where(disc > 0, b - disc.clamp(min=0).sqrt(), math.inf)
    t = torch.minimum(t, torch.where(tb > 0, tb, math.inf))
    ok = torch.isfinite(t) & (t < 12.0)
    pts = (d[ok] * t[ok, None]).to(torch.float32)
    T = torch.eye(4, dtype=torch.float64)
    T[:3, 3] = torch.tensor([0.013, 0.027, h], dtype=torch.float64)
    return pts.to(dev), T


def _coarse_buckets(m, dev: torch.device) -> None:
    """One coarse walk per loop-bound bucket: diagonal rays (the most bricks per metre) of lengths doubling
    from one cell to ``max_range_m``, at the TSDF/occupancy brick and at the free record's brick; 17 and
    32 rays per launch (Triton specialises integer arguments on divisibility by 16 and on 1)."""
    cells = {4.0 * m.voxel_size_m}
    if m.stored_layer("free") is not None:
        cells.add(4.0 * m.esdf_voxel_size_m)
    for n in (17, 32):
        o = torch.full((n, 3), 0.013, dtype=torch.float64, device=dev)
        d = torch.full((n, 3), 1.0 / math.sqrt(3.0), dtype=torch.float64, device=dev)
        t0 = torch.zeros(n, dtype=torch.float64, device=dev)
        for cell in sorted(cells):
            length = cell
            while True:
                brick_segments(o, d, t0, t0 + min(length, m.max_range_m), cell)
                if length >= m.max_range_m:
                    break
                length *= 2.0


ENVELOPE_LINES = (1, 16, 17)  # Triton's integer specialisations: == 1, % 16 == 0, neither


def _envelope_variants(dev: torch.device) -> None:
    """The ESDF's lower-envelope kernel once per specialisation of its line count (``n_lines`` is a
    specialised integer: a tiny warm-up scene gives one residue, real frames meet the others; on the H200
    these compiled in frames 1 and 3 of a new map, 0.9-1.4 s each)."""
    for n in ENVELOPE_LINES:
        f = torch.arange(4 * n, dtype=torch.float32, device=dev) % 5
        start = torch.arange(n, dtype=torch.int64, device=dev) * 4
        lower_envelope(f, start, torch.full((n,), 4, dtype=torch.int64, device=dev))


def _graph_captures(m) -> None:
    """CUDA graphs (``mapper.graphs``): capture every bucket of the map's graphed operations (the meshes)
    first, so neither the frame path below nor a later frame captures one; nothing where graphs do not
    apply (CPU, interpreter, ``MAPPER_CUDA_GRAPHS=0``)."""
    tsdf = m.stored_layer("tsdf")
    if tsdf is not None and graphs.enabled(m.device):
        with graphs.warming():
            warm_graphs(tsdf)


def _run(config: dict, dev: torch.device, sizes) -> None:
    """The frame path at each scan size in ``sizes`` (azimuth columns x 16 beams; two sizes give the
    kernels' integer arguments other residues mod 16), then the coarse walk's buckets."""
    # lazy: map.py imports this module (Map() runs the warm-up)
    from .map import Map

    m = Map(**config, device=dev, warmup=False)
    _graph_captures(m)
    s = m.voxel_size_m
    version = None
    for k, n_az in enumerate(sizes):
        pts, T = _scene_points(s, dev, n_az)
        T[:3, 3] += torch.tensor([0.05 * k, 0.0, 0.0], dtype=torch.float64)
        T2 = T.clone()
        T2[:3, 3] += torch.tensor([0.11, -0.07, 0.0], dtype=torch.float64)
        m.integrate_lidar(pts, T, track=False)
        m.integrate_lidar(pts[: max(1, pts.shape[0] - 5)], T2, track=False)
        # a small depth image looking at the wall (camera z forward = world x)
        w, h = (32, 24) if k == 0 else (67, 45)
        K = torch.tensor([[24.0, 0, (w - 1) / 2], [0, 24.0, (h - 1) / 2], [0, 0, 1]], dtype=torch.float64)
        Tc = torch.eye(4, dtype=torch.float64)
        Tc[:3, :3] = torch.tensor([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]], dtype=torch.float64)
        Tc[:3, 3] = T[:3, 3]
        depth = torch.full((h, w), 3.0 + 7.0 * s, dtype=torch.float32, device=dev)
        color = torch.full((h, w, 3), 128, dtype=torch.uint8, device=dev) if "color" in m.layers else None
        m.integrate_depth(depth, K, Tc, color=color)
        nq = 3 if k == 0 else 35
        q = torch.rand((nq, 3), generator=torch.Generator().manual_seed(k), dtype=torch.float32) * 4 - 2
        q = q.to(dev)
        if m.has_esdf:
            m.update_esdf()
            m.query_distance(q)
            m.esdf_slice(1.0, (-2.0, -2.0), (2.0, 2.0 + 0.3 * k))
            m.esdf_box((-1.0, -1.0, 0.0), (1.0, 1.0 + 0.3 * k, 1.0))
        if "tsdf" in m.layers:
            m.query_tsdf(q)
            K_small = torch.tensor([[3.0, 0, 1.5], [0, 3.0, 1.0], [0, 0, 1]], dtype=torch.float64)
            m.raycast(Tc, K_small, 4, 3, max_range_m=4.0 * s)  # a few pixels and steps: the same kernels
            mesh = m.mesh(since_version=version) if version is not None else m.mesh()
            version = mesh.version
        if "occupancy" in m.layers:
            m.query_occupancy(q)
    _coarse_buckets(m, dev)
    if m.has_esdf:
        _envelope_variants(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)

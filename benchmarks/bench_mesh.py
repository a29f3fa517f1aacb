"""Marching-cubes meshes: full extraction, and the incremental mesh after each frame of a sequence.

* full: a TSDF map whose band bricks hold ``--full-voxels`` voxels (the truncated SDF of a sphere shell
  written directly, as in bench_outputs.py; ~2.5 M voxels at 5 cm make ~1 M triangles); ``Map.mesh()``
  timed ``--reps`` times after a warm-up call, and the marching-cubes operation alone
  (``mapper.kernels.marching.marching_cubes`` over all bricks, neighbour slots precomputed).
* incremental: a simulated sensor sequence at ``--voxel`` (LiDAR: 64 beams, 120 k points per scan, on a
  street; depth: 640 x 480 frames orbiting a room, with colour); after each frame ``Map.mesh(since_version=
  previous)`` is timed (the delta the viewer and Foxglove fetch). The first ``--warmup`` frames are left out
  of the statistics (kernel compilation, first pool pages).

Times: wall clock around the call with the device synchronised before and after (what a caller waits for).
Reports median, p99 and max.

    python benchmarks/bench_mesh.py --device cuda --out benchmarks/results/mesh_h200.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_outputs import shell_map  # noqa: E402
from bench_report import row, timing_head, wall  # noqa: E402

from mapper import Map, graphs, sim  # noqa: E402
from mapper.kernels.marching import changed_neighbourhood_keys, marching_cubes  # noqa: E402
from mapper.mesh import _tables, neighbour_slots  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_full(args, dev, lines):
    m = shell_map(args.full_voxels, args.voxel, dev)
    layer = m._tsdf
    n_vox = m.stats()["layers"]["tsdf"]["voxels"]
    mesh = m.mesh()  # warm-up (compiles the kernels)
    ts = [wall(m.mesh, dev)[0] for _ in range(args.reps)]
    note = f"{mesh.num_faces:,} triangles, {mesh.num_vertices:,} vertices, {n_vox / 1e6:.2f} M voxels"
    lines.append(row(f"full mesh `Map.mesh()`, {args.voxel * 100:g} cm", ts, note))
    print(lines[-1], flush=True)
    bricks = layer.brick_table()[0]
    from mapper.mesh import _sorted_unique_blocks

    bricks = _sorted_unique_blocks(bricks)
    nbr = neighbour_slots(layer, bricks)
    table, count = _tables(dev)

    def op():
        return marching_cubes(bricks, nbr, layer.pool, table, count, args.voxel, False)

    op()
    ts = [wall(op, dev)[0] for _ in range(args.reps)]
    lines.append(row("  of which the marching-cubes op over all bricks", ts, f"{bricks.shape[0]:,} bricks"))
    print(lines[-1], flush=True)
    del m, mesh


def bench_incremental(args, dev, lines, sensor):
    s = args.voxel
    if sensor == "lidar":
        scene = sim.outdoor_scene(0, extent_m=200.0, device=dev)
        lidar = sim.SpinningLidar()
        poses = sim.driving_trajectory(args.frames, scene=scene)
        m = Map(s, layers=("tsdf",), device=dev, max_range_m=40.0)

        def frame(i):
            m.integrate_lidar(lidar.scan(scene, poses[i].to(dev)), poses[i])

    else:
        scene = sim.indoor_scene(0, device=dev)
        cam = sim.PinholeCamera(640, 480, 525.0, 525.0, 319.5, 239.5)
        poses = sim.orbit_trajectory(args.frames, scene=scene)
        m = Map(s, layers=("tsdf", "color"), device=dev)
        rgb = torch.full((480, 640, 3), 128, dtype=torch.uint8, device=dev)

        def frame(i):
            m.integrate_depth(cam.render_depth(scene, poses[i].to(dev)), cam.K, poses[i], color=rgb)

    frame(0)
    version = m.mesh().version
    ts, again, faces, blocks, extra = [], [], [], [], []
    layer = m._tsdf
    for i in range(1, args.frames):
        frame(i)
        changed = int(((layer.slots >= 0) & (layer.brick_versions > version)).sum())  # not timed
        r0 = graphs.stats()["replays"]
        ms, d = wall(lambda v=version: m.mesh(since_version=v), dev)
        ms2 = wall(lambda v=version: m.mesh(since_version=v), dev)[0]  # the same delta again
        version = d.version
        if i > args.warmup:
            ts.append(ms)
            again.append(ms2)
            faces.append(d.num_faces)
            blocks.append(d.blocks.shape[0] + d.removed_blocks.shape[0])
            extra.append(f"frame {i}: {changed} changed, {graphs.stats()['replays'] - r0} replays")
    if args.profile:
        frame(args.frames - 1)
        try:  # the first call after a frame (what the loop above times), then the stages
            profile_once(m, version, lines, "first mesh_since after a frame")
        except Exception as e:  # the numbers above still count
            print(f"profile failed: {e!r}", flush=True)
        profile_stages(m, version, dev, args, lines)
    full = m.mesh()
    note = (
        f"delta: median {int(statistics.median(faces)):,} triangles in {int(statistics.median(blocks)):,} "
        f"blocks; map {full.num_faces:,} triangles, "
        f"{m.stats()['layers']['tsdf']['voxels'] / 1e6:.2f} M voxels"
    )
    lines.append(
        row(f"incremental `Map.mesh(since_version)` after each {sensor} frame, {s * 100:g} cm", ts, note)
    )
    print(lines[-1], flush=True)
    lines.append(row("  the same delta again (no frame in between)", again))
    print(lines[-1], flush=True)
    slow = sorted(zip(ts, blocks, faces, extra, strict=True), reverse=True)[:3]
    lines.append(
        "|   slowest frames (ms, blocks, triangles) | | | | | "
        + "; ".join(f"{t:.3f}, {b:,}, {f:,} ({e})" for t, b, f, e in slow)
        + f"; graphs {graphs.stats()} |"
    )
    print(lines[-1], flush=True)


def bench_graphs(args, dev, lines):
    """What the marching-cubes graphs cost: capture time and GPU memory of every bucket (a fresh map's
    TSDF layer, with and without colour; what a map's warm-up adds)."""
    from mapper import mesh as mm

    if dev.type != "cuda" or not graphs.enabled(dev):
        lines.append("| graphs: not on this device / disabled | | | | | |")
        return
    for layers in (("tsdf",), ("tsdf", "color")):
        m = Map(args.voxel, layers=layers, device=dev, warmup=False)
        mm.MC_GRAPHS.clear()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        a0, r0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        with graphs.warming():
            n = mm.warm_graphs(m._tsdf)
        dt = time.perf_counter() - t0
        a1, r1 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        lines.append(
            f"| capture of the marching-cubes graphs, layers {'+'.join(layers)} | {dt * 1e3:.1f} | | | {n} | "
            f"buckets {mm._graph_buckets()[0]}..{mm.GRAPH_MAX_BRICKS} bricks; GPU memory "
            f"+{(a1 - a0) / 2**20:.0f} MiB allocated, +{(r1 - r0) / 2**20:.0f} MiB reserved |"
        )
        print(lines[-1], flush=True)


def profile_stages(m, version, dev, args, lines):
    """Stages of one incremental mesh (after one more frame), each timed alone, and a torch-profiler count of
    launches and host syncs of the whole call."""
    from mapper import mesh as mm

    layer, s = m._tsdf, m.voxel_size_m
    reps = max(args.reps, 10)
    changed, removed = layer.changed_since(version)
    req = mm.affected_blocks(torch.cat((changed, removed)))
    flags = (layer.slots >= 0) & (layer.brick_versions > version)

    def affected():  # what mesh_since does: 27-neighbourhood keys of the changed bricks, sorted, unique
        return mm.decode_block_keys(torch.unique(changed_neighbourhood_keys(flags, layer.grid.leaves.keys)))

    nbr = mm.neighbour_slots(layer, req)
    table, count = mm._tables(dev)
    stages = [
        ("affected blocks (changed bricks' 27-neighbourhoods, sorted)", affected),
        ("neighbour_slots (27 lookups per brick)", lambda: mm.neighbour_slots(layer, req)),
        (
            "marching_cubes op",
            lambda: marching_cubes(req, nbr, layer.pool, table, count, s, "color" in layer.pool.fields),
        ),
        ("whole mesh_since", lambda: m.mesh(since_version=version)),
    ]
    for name, fn in stages:
        fn()
        ts = [wall(fn, dev)[0] for _ in range(reps)]
        note = (
            f"{changed.shape[0]:,} changed bricks, {req.shape[0]:,} blocks meshed"
            if name.startswith("whole")
            else ""
        )
        lines.append(row(f"  stage: {name}", ts, note))
        print(lines[-1], flush=True)
    try:
        profile_once(m, version, lines, "the same mesh_since again")
    except Exception as e:  # the numbers above still count
        print(f"profile failed: {e!r}", flush=True)


def profile_once(m, version, lines, what="one mesh_since"):
    """Launches (kernels and graph replays), host syncs, memcpys, GPU busy time and the torch ops the host
    issued (top-level ``aten::`` calls, counted on the CPU side of the profile) of one call."""
    from torch.profiler import ProfilerActivity, profile

    dev = m.device
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=acts) as prof:
        m.mesh(since_version=version)
    sync(dev)  # outside the profile: not counted as a sync of the call
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if "LaunchKernel" in e.key or e.key == "cudaGraphLaunch")
    syncs = sum(e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    copies = sum(e.count for e in ev if "Memcpy" in e.key)
    busy = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3
    ops = sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::") and e.device_type.name == "CPU" and not _aten_parent(e)
    )
    lines.append(
        f"| profile of {what} | | | | 1 | {ops} torch ops, {launches} launches, {syncs} syncs, "
        f"{copies} memcpys, GPU busy {busy:.3f} ms |"
    )
    print(lines[-1], flush=True)
    print(ev.table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


def _aten_parent(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", nargs="+", default=["full", "incremental"])
    ap.add_argument("--voxel", type=float, default=0.05)
    ap.add_argument("--full-voxels", type=float, default=2.5e6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sensor", nargs="+", default=["lidar"], choices=["lidar", "depth"])
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--profile", action="store_true", help="stage times and a launch/sync count (incremental)"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    head = timing_head(f"bench_mesh ({args.device})", dev)
    print("\n".join(head), flush=True)
    lines = []
    parts = [bench_full] if "full" in args.parts else []
    if "graphs" in args.parts:
        parts.append(bench_graphs)
    if "incremental" in args.parts:
        parts += [lambda a, d, ls, sensor=x: bench_incremental(a, d, ls, sensor) for x in args.sensor]
    for part in parts:
        try:
            part(args, dev, lines)
        except Exception as e:  # report what ran; a failing part does not hide the others
            lines.append(f"| failed: {e!r} | | | | | |")
            print(lines[-1], flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(head + lines + ["", f"graphs: {graphs.stats()}"]) + "\n")
    print(f"graphs: {graphs.stats()}", flush=True)


if __name__ == "__main__":
    main()

"""The ``mapper`` command line: serve, replay datasets, export meshes and slices, run the demo.

    mapper serve [--host H] [--port P] [--data-dir D] [--store s3://B/P] [--device auto|cpu|cuda] [--token T]
    mapper serve --ray [ADDRESS] [--ray-workers N] ...   (map workers as Ray actors: mapper.cluster)
    mapper replay --format kitti|replica|3dmatch|7scenes|norlab|pcd PATH (--server URL | --out DATA_DIR)
    mapper replay --format rosbag BAG --points-topic T [--world-frame F | --odom-topic T] (--server U|--out D)
    mapper replay --format rosbag BAG --depth-topic T --camera-info-topic T (--world-frame F | --odom-topic T)
    mapper export (--server URL | --data-dir D) --map ID_OR_NAME [--mesh out.ply|.obj|.glb] [--slice out.png]
    mapper demo [--data ../shared/data] [--port 8000] [--exit]

Settings not given as flags come from ``MAPPER_*`` environment variables (see ``mapper.settings``);
``--token`` for the client commands defaults to ``MAPPER_TOKEN``. Exit codes: 0 done, 1 an error (bad
input, refused by the server, map not found), 2 bad usage, 3 the server cannot be reached.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from . import Map, datasets, io, render, wire
from ._validation import resolve_device
from .cluster.ray_cluster import require_ray
from .datasets import default_data_dir
from .errors import InvalidArgument, MapperError
from .formats import nanovdb, vdb
from .foxglove import export_map, export_server_map
from .io import check_mesh_path
from .persistence import DataDir, MapDir
from .recordings import PcdSequence, RosbagSequence
from .store import check_name, find_map_dir, recover_map, save_new_map
from .store_backends import open_store

FORMATS = ("kitti", "replica", "3dmatch", "7scenes", "norlab", "rosbag", "pcd")

# exit codes: 0 done, 1 an error (bad input, refused by the server, map not found), 2 bad usage,
# 3 the server cannot be reached or the connection broke
EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3


class ServerUnreachable(MapperError):
    """Nothing answers at the server URL (or the connection broke)."""


# ------------------------------------------------------------------------------------------- helpers
class Progress:
    """A one-line progress bar on stderr (no dependency): ``done`` counts acknowledged frames; the line
    shows frames/s (acknowledged) and whatever ``extra`` the caller adds (ack latency, frames in flight).
    Not a terminal: one line at most every 2 s, and the last."""

    def __init__(self, total: int, label: str, stream=None, width: int = 28):
        stream = stream or sys.stderr
        self.total, self.label, self.stream, self.width = max(total, 1), label, stream, width
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()
        self._last = 0.0

    def update(self, done: int, extra: str = "") -> None:
        now = time.perf_counter()
        if not self.tty and done < self.total and now - self._last < 2.0:
            return
        self._last = now
        frac = min(done / self.total, 1.0)
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        rate = done / max(now - self.t0, 1e-9)
        line = f"{self.label} [{bar}] {done}/{self.total} acked {rate:5.1f} frames/s {extra}".rstrip()
        self.stream.write(("\r" if self.tty else "") + line + ("" if self.tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _latency_text(lat: list[float]) -> str:
    return f"ack p50 {np.median(lat) * 1e3:.0f} ms" if lat else ""


def open_dataset(fmt: str, path: Path, args=None):
    """(dataset, kind) for a format name; the readers of :mod:`mapper.datasets` and
    :mod:`mapper.recordings` (``rosbag`` takes its topics and pose source from ``args``)."""
    if not path.exists():
        raise MapperError(f"path: {path} does not exist")
    if fmt == "kitti":
        ds = datasets.KittiOdometry(path)
        if ds.poses is None:
            raise MapperError(f"path: {path} has no poses.txt (KITTI replay needs poses)")
        return ds, "lidar"
    if fmt == "norlab":
        return datasets.NorlabLidar(path), "lidar"
    if fmt == "replica":
        return datasets.ReplicaSequence(path), "depth"
    if fmt in ("3dmatch", "7scenes"):
        return datasets.SevenScenesSequence(path), "depth"
    if fmt == "pcd":
        return PcdSequence(path), "lidar"
    if fmt == "rosbag":
        a = args or argparse.Namespace()
        points, depth = getattr(a, "points_topic", None), getattr(a, "depth_topic", None)
        if (points is None) == (depth is None):
            raise MapperError(
                "rosbag: give --points-topic (PointCloud2) or --depth-topic + --camera-info-topic"
            )
        ds = RosbagSequence(
            path,
            points_topic=points,
            depth_topic=depth,
            camera_info_topic=getattr(a, "camera_info_topic", None),
            world_frame=getattr(a, "world_frame", None),
            odom_topic=getattr(a, "odom_topic", None),
            sensor_frame=getattr(a, "sensor_frame", None),
            max_pose_gap_s=getattr(a, "max_pose_gap", None) or 0.1,
        )
        return ds, ds.kind
    raise MapperError(f"format: expected one of {FORMATS}, got {fmt!r}")


def default_map_name(path: Path) -> str:
    """A replayed map's name unless ``--name``: the recording's folder or file name (``3dmatch_seq01``,
    ``lab`` for ``lab.bag``)."""
    p = Path(path).resolve()
    return p.stem if p.is_file() else p.name


def default_layers(kind: str) -> list[str]:
    return ["tsdf", "esdf"] if kind == "lidar" else ["tsdf", "color", "esdf"]


def _frames(ds, kind: str, limit: int | None, stride: int):
    idx = list(range(0, len(ds), max(stride, 1)))
    if limit:
        idx = idx[:limit]
    return idx


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--limit 0`` would replay everything, ``--stride 0`` nothing)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {v}")
    return v


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: the system picks a free one, as uvicorn and the tests use)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {v}")
    return v


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _token(args) -> str | None:
    return getattr(args, "token", None) or os.environ.get("MAPPER_TOKEN") or _first_env_token()


def _first_env_token() -> str | None:
    toks = [t.strip() for t in os.environ.get("MAPPER_API_TOKENS", "").split(",") if t.strip()]
    return toks[0] if toks else None


# --------------------------------------------------------------------------------------------- serve
def cmd_serve(args) -> int:
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    import uvicorn

    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from .api import create_app
    from .settings import Settings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "data_dir": args.data_dir,
            "store": args.store,
            "device": args.device,
            "api_tokens": args.token,
            "log_level": args.log_level,
            "foxglove_port": args.foxglove_port,  # mapper.api.routes.viewer starts the Foxglove bridge
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)
    try:
        settings.check_bind()
        device = resolve_device(settings.device)
        if settings.store:  # an object store: bucket, credentials and endpoint checked before serving
            open_store(settings)
    except MapperError as e:
        print(f"mapper serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(
        f"mapper serve: http://{settings.host}:{settings.port} (device {device}, "
        f"data {settings.store or settings.data_dir}, "
        f"auth {'on' if settings.auth_enabled else 'off'}; docs at /docs)",
        file=sys.stderr,
        flush=True,
    )
    if args.ray is None and args.ray_workers is not None:
        print("mapper serve: --ray-workers needs --ray", file=sys.stderr)
        return 2
    if args.ray is None:
        app = create_app(settings)
    else:  # map workers as Ray actors behind the same API (mapper.cluster)
        try:
            if args.ray_workers is not None and args.ray_workers < 1:
                raise InvalidArgument(f"--ray-workers: {args.ray_workers} is not a positive number")
            if args.foxglove_port is not None:
                raise InvalidArgument(
                    "--foxglove-port: not available with --ray (the maps live in the workers)"
                )
            require_ray()
        except MapperError as e:
            print(f"mapper serve: {e}", file=sys.stderr)
            return 2
        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        from .cluster.ingress import create_cluster_app

        app = create_cluster_app(settings, workers=args.ray_workers, address=args.ray or None)
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from .api.edge import EdgeGuard, http_protocol

    # read timeouts and connection caps (uvicorn has neither): the HTTP protocol of mapper.api.edge
    edge = http_protocol(EdgeGuard(settings, getattr(app.state, "metrics", None)))
    uvicorn.run(
        app,
        http=edge or "auto",
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        ws_max_size=settings.max_body_bytes,
        ws_per_message_deflate=settings.ws_compression,  # off: no inflate of every frame on the loop
        # after the drain (SIGTERM -> acks sent, streams closed: mapper.api.shutdown), the HTTP requests
        # still running get as long again; then the lifespan snapshots every map
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
    )
    return 0


# -------------------------------------------------------------------------------------------- replay
def connect(url: str, token: str | None, wait_s: float = 5.0):
    """A :class:`~mapper.client.MapperClient` for ``url`` once its ``/readyz`` answers 200. Retries for
    ``wait_s`` seconds (a server that is starting or restoring maps), then raises :class:`ServerUnreachable`
    with the reason in one line."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    import httpx

    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from .client import MapperClient

    c = MapperClient(url, token=token)
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        try:
            r = c._http.get("/readyz", timeout=min(max(wait_s, 1.0), 10.0))
            if r.status_code == 200:
                return c
            why = f"/readyz answers HTTP {r.status_code}" + (
                " (restoring maps)" if r.status_code == 503 else ""
            )
        except httpx.HTTPError as e:
            why = _transport_reason(e)
        if time.monotonic() >= deadline:
            c.close()
            raise ServerUnreachable(
                f"cannot reach the mapper service at {url}: {why} (waited {wait_s:g} s; is `mapper serve` "
                "running there? --wait S waits longer)"
            )
        time.sleep(0.2)


def _transport_reason(e: BaseException) -> str:
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    import httpx

    if isinstance(e, httpx.ConnectError):
        cause = e.__context__ or e.__cause__
        return f"connection refused or no route ({cause or e})"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({type(e).__name__})"
    return f"{type(e).__name__}: {e}"


def replay_to_server(args, ds, kind: str, idx: list[int]) -> dict:
    c = connect(args.server, _token(args), getattr(args, "wait", 5.0))
    with c:
        m = None
        name = args.name
        if args.map:
            m = c.get_map(args.map)
        else:
            if not name and getattr(args, "path", None):
                name = default_map_name(args.path)
            m = c.find_map(name) if name else None
        created = m is None
        if m is None:
            m = c.create_map(
                name=name,
                voxel_size_m=args.voxel,
                layers=args.layers.split(",") if args.layers else default_layers(kind),
                max_range_m=args.max_range,
            )
        map_id = m["id"]
        try:
            return _replay_frames(c, args, ds, kind, idx, m, created)
        except MapperError as e:
            # a map this replay created and that took no frame (e.g. its first frame refused with 507) is
            # removed, not left behind empty. The client decides: the server cannot tell an empty map a
            # user created on purpose from one a failed replay left.
            if created and c.get_map(map_id).get("frames_integrated", 0) == 0:
                c.delete_map(map_id)
                e.args = (f"{e}; the empty map {m['name']!r} this replay created was removed",)
            raise


def _replay_frames(c, args, ds, kind: str, idx: list[int], m: dict, created: bool) -> dict:
    """Stream (or POST) the frames ``idx`` of ``ds`` into map ``m`` (``created`` by this replay); the
    replay's summary."""
    map_id = m["id"]
    with_color = "color" in m["config"]["layers"]
    bar = Progress(len(idx), f"replay -> {m['name']}")
    used = dropped = 0
    lat: list[float] = []
    sent_at: deque[float] = deque()
    t0 = time.perf_counter()

    def count(acks, now=None):
        nonlocal used, dropped
        now = time.perf_counter() if now is None else now
        for a in acks:
            used += a.get("points_used", 0)
            dropped += a.get("points_dropped", 0)
            if sent_at:
                lat.append(now - sent_at.popleft())

    if args.http:
        for i in idx:
            msg = _message(ds[i], kind, i, with_color)
            sent_at.append(time.perf_counter())
            count([c.send_frame(map_id, msg)])
            bar.update(len(lat), _latency_text(lat))
    else:
        with c.stream(map_id, window=args.window) as s:
            for i in idx:
                count(s.send(_message(ds[i], kind, i, with_color)))
                sent_at.append(time.perf_counter())
                bar.update(len(lat), f"{_latency_text(lat)} ({s.in_flight} in flight)")
            while s.in_flight:
                count([s.receive()])
                bar.update(len(lat), f"{_latency_text(lat)} ({s.in_flight} in flight)")
    bar.close()
    elapsed = time.perf_counter() - t0
    info = c.get_map(map_id)
    return {
        "map": map_id,
        "name": info["name"],
        "created": created,
        "frames": len(lat),
        "points_used": used,
        "points_dropped": dropped,
        "seconds": elapsed,
        "layers": {k: v.get("voxels") for k, v in info["stats"]["layers"].items()},
        "ack_p50_ms": float(np.median(lat) * 1e3) if lat else None,
        "ack_p99_ms": float(np.percentile(lat, 99) * 1e3) if lat else None,
    }


def _message(f: dict, kind: str, i: int, with_color: bool) -> dict:
    if kind == "lidar":
        return wire.lidar_message(
            f["points"], f["T_world_sensor"], f.get("timestamp", float(i)), f"frame-{i}"
        )
    color = f.get("color") if with_color else None
    return wire.depth_message(f["depth_m"], f["K"], f["T_world_sensor"], color, None, float(i), f"frame-{i}")


def _send_http(c, map_id, f, kind, i, with_color) -> dict:
    return c.send_frame(map_id, _message(f, kind, i, with_color))


def _send_ws(s, f, kind, i, with_color) -> list[dict]:
    return s.send(_message(f, kind, i, with_color))


def replay_offline(args, ds, kind: str, idx: list[int]) -> dict:
    data = DataDir(Path(args.out))
    name = args.name or default_map_name(args.path)
    check_name(name, "--name")  # before the replay, not after it
    try:
        old = find_map_dir(data, name)
    except MapperError:
        old = None
    if old is not None:
        raise MapperError(
            f"name: a map named {name!r} already exists in {args.out} ({old.root.name}); "
            "give another --name or --out"
        )
    layers = args.layers.split(",") if args.layers else default_layers(kind)
    m = Map(
        args.voxel or 0.1,
        layers=layers,
        device=None if args.device == "auto" else args.device,
        max_range_m=args.max_range or 100.0,
    )
    bar = Progress(len(idx), f"replay -> {name}")
    used = dropped = 0
    lat: list[float] = []
    t0 = time.perf_counter()
    for i in idx:
        f = ds[i]
        t = time.perf_counter()
        if kind == "lidar":
            r = m.integrate_lidar(f["points"], f["T_world_sensor"])
        else:
            color = f.get("color") if "color" in layers else None
            r = m.integrate_depth(f["depth_m"], f["K"], f["T_world_sensor"], color=color)
        lat.append(time.perf_counter() - t)
        used += r["points_used"]
        dropped += r["points_dropped"]
        bar.update(len(lat), f"integrate p50 {np.median(lat) * 1e3:.0f} ms")
    if "esdf" in layers:
        m.update_esdf()
    bar.close()
    elapsed = time.perf_counter() - t0
    info = save_new_map(data, m, name)
    stats = m.stats()
    return {
        "map": info["id"],
        "name": info["name"],
        "created": True,
        "frames": len(idx),
        "points_used": used,
        "points_dropped": dropped,
        "seconds": elapsed,
        "layers": {k: v.get("voxels") for k, v in stats["layers"].items()},
        "data_dir": str(args.out),
    }


def cmd_replay(args) -> int:
    if args.format != "rosbag" and (
        args.points_topic or args.depth_topic or args.odom_topic or args.world_frame
    ):
        print("mapper replay: --*-topic and --world-frame apply to --format rosbag only", file=sys.stderr)
        return EXIT_USAGE
    try:
        ds, kind = open_dataset(args.format, Path(args.path), args)
        idx = _frames(ds, kind, args.limit, args.stride)
        if not idx:
            raise MapperError(f"path: no frames to replay in {args.path}")
        summary = (
            replay_to_server(args, ds, kind, idx) if args.server else replay_offline(args, ds, kind, idx)
        )
    except ServerUnreachable:
        raise
    except MapperError as e:
        print(f"mapper replay: {e}", file=sys.stderr)
        return EXIT_ERROR
    fps = summary["frames"] / max(summary["seconds"], 1e-9)
    skipped = getattr(ds, "skipped", 0)
    lat = (
        f"; ack latency p50 {summary['ack_p50_ms']:.0f} ms, p99 {summary['ack_p99_ms']:.0f} ms"
        if summary.get("ack_p50_ms") is not None
        else ""
    )
    print(
        f"replayed {summary['frames']} {kind} frames into {'new' if summary['created'] else 'existing'} map "
        f"{summary['name']!r} ({summary['map']}) in {summary['seconds']:.2f} s ({fps:.1f} frames/s "
        f"acknowledged){lat}; points used {summary['points_used']}, dropped {summary['points_dropped']}"
        + (f"; {skipped} frames without a pose skipped" if skipped else "")
        + f"; voxels per layer {summary['layers']}"
        + (f"; stored in {summary['data_dir']}" if "data_dir" in summary else "")
    )
    return 0


# -------------------------------------------------------------------------------------------- export
def cmd_export(args) -> int:
    if not (args.mesh or args.slice or args.snapshot or args.mcap or args.format):
        print("mapper export: give --mesh, --slice, --snapshot, --mcap and/or --format", file=sys.stderr)
        return EXIT_USAGE
    if bool(args.format) != bool(args.out):
        print("mapper export: --format vdb|nvdb and --out PATH go together", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.mesh:
            check_mesh_path(args.mesh)
    except MapperError as e:
        print(f"mapper export: --mesh: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.server:
            _export_server(args)
        else:
            _export_local(args)
    except ServerUnreachable:
        raise
    except MapperError as e:
        print(f"mapper export: {e}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def _write_mesh(path: Path, mesh=None, ply: bytes | None = None) -> None:
    """``path`` by its extension (.ply, .obj, .glb) from a Mesh or PLY bytes."""
    if path.suffix.lower() == ".ply" and ply is not None:
        path.write_bytes(ply)
    else:
        io.write_mesh(path, mesh if mesh is not None else io.read_ply(ply))
    print(f"mesh -> {path}")


def _export_server(args) -> None:
    c = connect(args.server, _token(args), getattr(args, "wait", 5.0))
    with c:
        m = c.find_map(args.map)
        map_id = m["id"] if m else args.map
        if args.mesh:
            _write_mesh(Path(args.mesh), ply=c.mesh_ply(map_id))
        if args.slice:
            Path(args.slice).write_bytes(c.esdf_slice_png(map_id, args.z, resolution_m=args.resolution))
            print(f"ESDF slice z={args.z} -> {args.slice}")
        if args.snapshot:
            c.export(map_id, args.snapshot)
            print(f"snapshot -> {args.snapshot}")
        if args.mcap:
            export_server_map(c, map_id, m["name"] if m else args.map, args.mcap, args.mcap_z)
            print(f"Foxglove messages -> {args.mcap}")
        if args.format:
            c.export_grid(map_id, args.out, args.format, args.layer)
            print(f"{args.layer} as {args.format} -> {args.out}")


def _export_local(args) -> None:
    if args.store:  # snapshots + WAL in an object store; the snapshot is downloaded to a temporary cache
        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        from .settings import Settings

        with tempfile.TemporaryDirectory(prefix="mapper-export-") as cache:
            return _export_from(args, open_store(Settings(store=args.store, data_dir=Path(cache))))
    return _export_from(args, DataDir(Path(args.data_dir), fsync=False))


def _export_from(args, data) -> None:
    mdir = find_map_dir(data, args.map)
    m, info, snap, last, replayed = recover_map(mdir, None if args.device == "auto" else args.device)
    if args.mesh:
        _write_mesh(Path(args.mesh), mesh=m.mesh())
    if args.slice:
        s = m.esdf_slice(args.z, resolution_m=args.resolution)
        Path(args.slice).write_bytes(render.slice_to_png(s, max_distance_m=m.esdf_max_distance_m))
        print(f"ESDF slice z={args.z} -> {args.slice}")
    if args.snapshot:
        if snap is not None and replayed == 0:
            shutil.copyfile(snap.path, args.snapshot)
        else:
            tmp = MapDir(Path(args.snapshot).parent / f".export-{info['id']}", fsync=False)
            tmp.root.mkdir(parents=True, exist_ok=True)
            tensors, meta = m.state_dict()
            s = tmp.write_snapshot(last, tensors, {**meta, "info": info})
            os.replace(s.path, args.snapshot)
            shutil.rmtree(tmp.root, ignore_errors=True)
        print(f"snapshot -> {args.snapshot}")
    if args.mcap:
        export_map(m, info["name"], args.mcap, args.mcap_z)
        print(f"Foxglove messages -> {args.mcap}")
    if args.format:
        grid = vdb.map_layer_grid(m, args.layer)
        data = vdb.vdb_bytes([grid]) if args.format == "vdb" else nanovdb.nvdb_bytes([grid])
        Path(args.out).write_bytes(data)
        print(f"{args.layer} as {args.format} -> {args.out}")


# ---------------------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    """Serve on loopback, replay ../shared/data through the client, show /metrics; keep serving."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from .client import MapperClient

    port = args.port
    with socket.socket() as s:
        if s.connect_ex((args.host, port)) == 0:
            port = free_port(args.host)
            print(f"port {args.port} is busy; using {port}", file=sys.stderr)
    url = f"http://{args.host}:{port}"
    env = dict(os.environ)
    cmd = [
        sys.executable,
        "-m",
        "mapper",
        "serve",
        "--host",
        args.host,
        "--port",
        str(port),
        "--data-dir",
        str(args.data_dir),
        "--device",
        args.device,
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(cmd, env=env)
    try:
        with MapperClient(url, token=_token(args)) as c:
            c.wait_ready(120)
            print(f"server up at {url} (OpenAPI docs: {url}/docs)")
            data = Path(args.data)
            runs = [
                ("norlab", data / "norlab_lidar", "demo-lidar", 0.2, "ws"),
                ("replica", data / "replica_office0", "demo-replica", 0.05, "http"),
                ("3dmatch", data / "3dmatch_seq01", "demo-3dmatch", 0.05, "http"),
            ]
            for fmt, path, name, voxel, transport in runs:
                if not path.is_dir():
                    print(f"skipping {fmt}: {path} not found")
                    continue
                old = c.find_map(name)
                if old:
                    c.delete_map(old["id"])
                ns = argparse.Namespace(
                    server=url,
                    token=_token(args),
                    map=None,
                    name=name,
                    voxel=voxel,
                    layers=None,
                    max_range=60.0,
                    http=transport == "http",
                    window=8,
                )
                ds, kind = open_dataset(fmt, path)
                summary = replay_to_server(ns, ds, kind, list(range(len(ds))))
                print(
                    f"  {fmt}: {summary['frames']} frames over {transport} -> map {summary['map']} ({name}), "
                    f"{summary['seconds']:.1f} s, voxels {summary['layers']}"
                )
            lid = c.find_map("demo-lidar")
            if lid:
                pts = np.array([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [5.0, 5.0, 0.5]])
                d, _, obs = c.query_distance(lid["id"], pts)
                print(
                    f"  distance query at {pts.tolist()}: {np.round(d, 3).tolist()} (observed {obs.tolist()})"
                )
                png = Path(args.data_dir) / "demo-lidar-slice.png"
                png.write_bytes(c.esdf_slice_png(lid["id"], z=0.5))
                print(f"  ESDF slice z=0.5 m -> {png}")
            print("\n/metrics (frames):")
            for line in c.metrics().splitlines():
                if line.startswith(
                    ("mapper_frames_total", "mapper_active_voxels", "mapper_integrate_seconds_count")
                ):
                    print("  " + line)
        if args.exit:
            return 0
        print(f"\nserving at {url} - try: curl {url}/metrics | grep mapper_frames ; Ctrl-C to stop")
        server.wait()
    except KeyboardInterrupt:
        pass
    except MapperError as e:
        print(f"mapper demo: {e}", file=sys.stderr)
        return 1
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mapper", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the HTTP/WebSocket service")
    s.add_argument("--host", help="bind address (MAPPER_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=port_number, help="MAPPER_PORT (default 8000)")
    s.add_argument("--data-dir", type=Path, help="MAPPER_DATA_DIR (default ./mapper-data)")
    s.add_argument(
        "--store",
        metavar="URL",
        help="keep snapshots + WAL in an object store: s3://bucket/prefix (MAPPER_STORE; MinIO: "
        "MAPPER_S3_ENDPOINT_URL; credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY); default: --data-dir",
    )
    s.add_argument("--device", help="auto | cpu | cuda[:N] (MAPPER_DEVICE)")
    s.add_argument("--token", action="append", help="bearer token (repeatable; MAPPER_API_TOKENS)")
    s.add_argument("--log-level", help="MAPPER_LOG_LEVEL (default info)")
    s.add_argument(
        "--foxglove-port", type=port_number, help="also serve the maps to Foxglove (WebSocket, 127.0.0.1)"
    )
    s.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="map workers as Ray actors: join the Ray cluster at ADDRESS (e.g. auto, ray://head:10001), or "
        "start a local one without ADDRESS; --data-dir must be reachable by every node (unless --store)",
    )
    s.add_argument(
        "--ray-workers",
        type=positive_int,
        metavar="N",
        help="map workers (default: one per GPU, 2 without GPUs)",
    )
    s.set_defaults(fn=cmd_serve)

    r = sub.add_parser(
        "replay",
        help="replay a dataset or a recording (ROS bag, PCD files) into a server or a data directory",
        description="Replay recorded frames into a running service (--server) or into a new map in a "
        "data directory (--out). Exit codes: 0 done, 1 error, 2 bad usage, 3 server unreachable.",
    )
    r.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="kitti (velodyne/*.bin + poses.txt), replica, 3dmatch / 7scenes, norlab (VTK scans + "
        "icp_odom.csv), rosbag (ROS 1 .bag or ROS 2 bag folder, sqlite3 or MCAP), pcd (.pcd files)",
    )
    r.add_argument(
        "path", type=Path, help="the dataset folder, .bag file, ROS 2 bag folder or PCD folder/file"
    )
    dest = r.add_mutually_exclusive_group(required=True)
    dest.add_argument("--server", help="service URL, e.g. http://127.0.0.1:8000")
    dest.add_argument("--out", type=Path, help="data directory to write the map into (offline, no server)")
    r.add_argument("--token", help="bearer token (default MAPPER_TOKEN)")
    r.add_argument("--map", help="append to this existing map id (server)")
    r.add_argument(
        "--name",
        help="map name (default: the recording's folder or file name); on a server frames go to the "
        "map of that name, created if absent",
    )
    r.add_argument("--voxel", type=float, help="voxel size in metres (new maps; default 0.1)")
    r.add_argument("--layers", help="comma-separated layers (default tsdf,esdf; depth adds color)")
    r.add_argument(
        "--max-range",
        type=float,
        default=None,
        help="drop returns farther than this many metres from the sensor (new maps; default 100 offline, "
        "the server's MAPPER_DEFAULT_MAX_RANGE_M otherwise)",
    )
    r.add_argument("--limit", type=positive_int, help="at most this many frames")
    r.add_argument("--stride", type=positive_int, default=1, help="every k-th frame (default 1)")
    r.add_argument("--http", action="store_true", help="one POST per frame instead of a WebSocket stream")
    r.add_argument(
        "--window", type=positive_int, default=8, help="frames in flight on the WebSocket (default 8)"
    )
    r.add_argument(
        "--wait", type=float, default=5.0, help="seconds to wait for the server to be ready (default 5)"
    )
    r.add_argument(
        "--device",
        default="auto",
        help="offline (--out) only: where the map is built, auto | cpu | cuda[:N] (default auto)",
    )
    bag = r.add_argument_group("rosbag", "topics and pose source for --format rosbag")
    bag.add_argument("--points-topic", help="sensor_msgs/PointCloud2 topic (LiDAR frames)")
    bag.add_argument(
        "--depth-topic", help="sensor_msgs/Image depth topic (16UC1 millimetres or 32FC1 metres)"
    )
    bag.add_argument("--camera-info-topic", help="sensor_msgs/CameraInfo topic of the depth camera")
    bag.add_argument(
        "--world-frame",
        help="poses from /tf + /tf_static: the transform from this frame to each message's frame",
    )
    bag.add_argument(
        "--odom-topic", help="poses from this nav_msgs/Odometry topic (chained with /tf_static to the sensor)"
    )
    bag.add_argument("--sensor-frame", help="use this tf frame instead of the messages' header.frame_id")
    bag.add_argument(
        "--max-pose-gap",
        type=float,
        default=0.1,
        help="seconds a frame may lie before the first / after the last pose sample (default 0.1); "
        "frames farther out are skipped and counted",
    )
    r.set_defaults(fn=cmd_replay)

    e = sub.add_parser(
        "export",
        help="export a mesh (PLY, OBJ, GLB), an ESDF slice (PNG) or a snapshot",
        description="Exit codes: 0 done, 1 error, 2 bad usage, 3 server unreachable.",
    )
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", help="service URL, e.g. http://127.0.0.1:8000")
    src.add_argument("--data-dir", type=Path, help="a data directory (offline, no server)")
    src.add_argument(
        "--store",
        metavar="URL",
        help="an object store s3://bucket/prefix (offline; MAPPER_S3_ENDPOINT_URL, AWS credentials)",
    )
    e.add_argument("--map", required=True, help="map id or name")
    e.add_argument("--token", help="bearer token (default MAPPER_TOKEN)")
    e.add_argument(
        "--mesh", type=Path, help="write the mesh; the format follows the extension: .ply, .obj or .glb"
    )
    e.add_argument("--slice", type=Path, help="write an ESDF slice as PNG (colour bar, scale bar, axes)")
    e.add_argument("--z", type=float, default=0.5, help="slice height in metres (default 0.5)")
    e.add_argument(
        "--resolution", type=float, default=None, help="slice resolution in metres (default: voxel)"
    )
    e.add_argument("--snapshot", type=Path, help="write the snapshot (safetensors)")
    e.add_argument(
        "--wait", type=float, default=5.0, help="seconds to wait for the server to be ready (default 5)"
    )
    e.add_argument(
        "--device",
        default="auto",
        help="offline (--data-dir, --store) only: auto | cpu | cuda[:N] (default auto)",
    )
    e.add_argument("--mcap", type=Path, help="write the Foxglove messages (mesh, poses, slice) as MCAP")
    e.add_argument("--mcap-z", type=float, default=None, help="MCAP slice height (default: last sensor z)")
    e.add_argument(
        "--format",
        choices=["vdb", "nvdb"],
        help="write one layer as an OpenVDB (.vdb) or NanoVDB (.nvdb) float grid to --out",
    )
    e.add_argument(
        "--layer", choices=["tsdf", "esdf"], default="tsdf", help="the --format layer (default tsdf)"
    )
    e.add_argument("--out", type=Path, help="the --format output file")
    e.set_defaults(fn=cmd_export)

    d = sub.add_parser("demo", help="serve + replay ../shared/data through the client + show /metrics")
    d.add_argument("--data", type=Path, default=default_data_dir(), help="the sample data (../shared/data)")
    d.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    d.add_argument("--port", type=port_number, default=8000, help="port (default 8000; a free one if busy)")
    d.add_argument(
        "--data-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "mapper-demo",
        help="the server's data directory (default: mapper-demo in the temp folder)",
    )
    d.add_argument("--device", default="cpu", help="auto | cpu | cuda[:N] (default cpu)")
    d.add_argument("--token", help="bearer token (default MAPPER_TOKEN)")
    d.add_argument("--exit", action="store_true", help="stop the server after the demo instead of serving on")
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> None:
    """Run a command; failures end in one line on stderr and a non-zero exit (see ``EXIT_*``)."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    import httpx
    from websockets.exceptions import WebSocketException

    args = build_parser().parse_args(argv)
    cmd = f"mapper {args.command}"
    try:
        code = args.fn(args)
    except KeyboardInterrupt:
        print(f"{cmd}: interrupted", file=sys.stderr)
        code = 130
    except ServerUnreachable as e:
        print(f"{cmd}: {e}", file=sys.stderr)
        code = EXIT_UNREACHABLE
    except (httpx.HTTPError, WebSocketException, ConnectionError, TimeoutError) as e:
        url = getattr(args, "server", None) or ""
        print(f"{cmd}: lost the connection to {url}: {_transport_reason(e)}", file=sys.stderr)
        code = EXIT_UNREACHABLE
    except MapperError as e:
        print(f"{cmd}: {e}", file=sys.stderr)
        code = EXIT_ERROR
    except OSError as e:  # files: unreadable input, unwritable output
        print(f"{cmd}: {e}", file=sys.stderr)
        code = EXIT_ERROR
    sys.exit(code)


if __name__ == "__main__":
    main()

"""The ``mapper`` command line: serve, replay datasets, export meshes and slices, run the demo.

    mapper serve [--host H] [--port P] [--data-dir D] [--device auto|cpu|cuda] [--token T ...]
    mapper replay --format kitti|replica|3dmatch|7scenes|norlab PATH (--server URL | --out DATA_DIR)
    mapper export (--server URL | --data-dir D) --map ID_OR_NAME [--mesh out.ply] [--slice out.png --z 0.5]
    mapper demo [--data ../shared/data] [--port 8000] [--exit]

Settings not given as flags come from ``MAPPER_*`` environment variables (see ``mapper.settings``);
``--token`` for the client commands defaults to ``MAPPER_TOKEN``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .datasets import default_data_dir
from .errors import MapperError

FORMATS = ("kitti", "replica", "3dmatch", "7scenes", "norlab")


# ------------------------------------------------------------------------------------------- helpers
class Progress:
    """A one-line progress bar on stderr (no dependency)."""

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
        frac = done / self.total
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        rate = done / max(now - self.t0, 1e-9)
        line = f"{self.label} [{bar}] {done}/{self.total} {rate:5.1f} frames/s {extra}"
        self.stream.write(("\r" if self.tty else "") + line + ("" if self.tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def open_dataset(fmt: str, path: Path):
    """(dataset, kind) for a format name; datasets are the readers of :mod:`mapper.datasets`."""
    from . import datasets

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
    raise MapperError(f"format: expected one of {FORMATS}, got {fmt!r}")


def default_layers(kind: str) -> list[str]:
    return ["tsdf", "esdf"] if kind == "lidar" else ["tsdf", "color", "esdf"]


def _frames(ds, kind: str, limit: int | None, stride: int):
    idx = list(range(0, len(ds), max(stride, 1)))
    if limit:
        idx = idx[:limit]
    return idx


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
    import uvicorn

    from .api import create_app
    from .settings import Settings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "data_dir": args.data_dir,
            "device": args.device,
            "api_tokens": args.token,
            "log_level": args.log_level,
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)
    try:
        settings.check_bind()
        from ._validation import resolve_device

        device = resolve_device(settings.device)
    except MapperError as e:
        print(f"mapper serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(
        f"mapper serve: http://{settings.host}:{settings.port} (device {device}, data {settings.data_dir}, "
        f"auth {'on' if settings.auth_enabled else 'off'}; docs at /docs)",
        file=sys.stderr,
        flush=True,
    )
    if args.foxglove_port is not None:  # mapper.api.routes.viewer starts the Foxglove bridge
        os.environ["MAPPER_FOXGLOVE_PORT"] = str(args.foxglove_port)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        ws_max_size=settings.max_body_bytes,
        timeout_graceful_shutdown=30,
    )
    return 0


# -------------------------------------------------------------------------------------------- replay
def replay_to_server(args, ds, kind: str, idx: list[int]) -> dict:
    from .client import MapperClient

    with MapperClient(args.server, token=_token(args)) as c:
        c.wait_ready(60)
        m = None
        if args.map:
            m = c.get_map(args.map)
        elif args.name:
            m = c.find_map(args.name)
        if m is None:
            m = c.create_map(
                name=args.name,
                voxel_size_m=args.voxel,
                layers=args.layers.split(",") if args.layers else default_layers(kind),
                max_range_m=args.max_range,
            )
        map_id = m["id"]
        with_color = "color" in m["config"]["layers"]
        bar = Progress(len(idx), f"replay -> {map_id}")
        used = dropped = 0
        lat = []
        t0 = time.perf_counter()

        def count(acks):
            nonlocal used, dropped
            for a in acks:
                used += a.get("points_used", 0)
                dropped += a.get("points_dropped", 0)

        if args.http:
            for n, i in enumerate(idx, 1):
                f = ds[i]
                t = time.perf_counter()
                count([_send_http(c, map_id, f, kind, i, with_color)])
                lat.append(time.perf_counter() - t)
                bar.update(n)
        else:
            with c.stream(map_id, window=args.window) as s:
                for n, i in enumerate(idx, 1):
                    count(_send_ws(s, ds[i], kind, i, with_color))
                    bar.update(n, f"({s.in_flight} in flight)")
                count(s.flush())
        bar.close()
        elapsed = time.perf_counter() - t0
        info = c.get_map(map_id)
    return {
        "map": map_id,
        "name": info["name"],
        "frames": len(idx),
        "points_used": used,
        "points_dropped": dropped,
        "seconds": elapsed,
        "layers": {k: v.get("voxels") for k, v in info["stats"]["layers"].items()},
        "ack_p50_ms": float(np.median(lat) * 1e3) if lat else None,
    }


def _message(f: dict, kind: str, i: int, with_color: bool) -> dict:
    from . import wire

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
    from . import Map
    from .api.service import save_new_map
    from .persistence import DataDir

    layers = args.layers.split(",") if args.layers else default_layers(kind)
    m = Map(
        args.voxel or 0.1,
        layers=layers,
        device=None if args.device == "auto" else args.device,
        max_range_m=args.max_range or 100.0,
    )
    bar = Progress(len(idx), "replay -> " + str(args.out))
    used = dropped = 0
    t0 = time.perf_counter()
    for n, i in enumerate(idx, 1):
        f = ds[i]
        if kind == "lidar":
            r = m.integrate_lidar(f["points"], f["T_world_sensor"])
        else:
            color = f.get("color") if "color" in layers else None
            r = m.integrate_depth(f["depth_m"], f["K"], f["T_world_sensor"], color=color)
        used += r["points_used"]
        dropped += r["points_dropped"]
        bar.update(n)
    if "esdf" in layers:
        m.update_esdf()
    bar.close()
    elapsed = time.perf_counter() - t0
    info = save_new_map(DataDir(Path(args.out)), m, args.name)
    stats = m.stats()
    return {
        "map": info["id"],
        "name": info["name"],
        "frames": len(idx),
        "points_used": used,
        "points_dropped": dropped,
        "seconds": elapsed,
        "layers": {k: v.get("voxels") for k, v in stats["layers"].items()},
        "data_dir": str(args.out),
    }


def cmd_replay(args) -> int:
    try:
        ds, kind = open_dataset(args.format, Path(args.path))
        idx = _frames(ds, kind, args.limit, args.stride)
        summary = (
            replay_to_server(args, ds, kind, idx) if args.server else replay_offline(args, ds, kind, idx)
        )
    except MapperError as e:
        print(f"mapper replay: {e}", file=sys.stderr)
        return 1
    fps = summary["frames"] / max(summary["seconds"], 1e-9)
    print(
        f"replayed {summary['frames']} {kind} frames into map {summary['map']} ({summary['name']}) in "
        f"{summary['seconds']:.2f} s ({fps:.1f} frames/s); points used {summary['points_used']}, dropped "
        f"{summary['points_dropped']}; voxels per layer {summary['layers']}"
        + (f"; stored in {summary['data_dir']}" if "data_dir" in summary else "")
    )
    return 0


# -------------------------------------------------------------------------------------------- export
def cmd_export(args) -> int:
    if not (args.mesh or args.slice or args.snapshot or args.mcap):
        print("mapper export: give --mesh, --slice, --snapshot and/or --mcap", file=sys.stderr)
        return 2
    try:
        if args.server:
            _export_server(args)
        else:
            _export_local(args)
    except MapperError as e:
        print(f"mapper export: {e}", file=sys.stderr)
        return 1
    return 0


def _export_server(args) -> None:
    from .client import MapperClient

    with MapperClient(args.server, token=_token(args)) as c:
        m = c.find_map(args.map)
        map_id = m["id"] if m else args.map
        if args.mesh:
            Path(args.mesh).write_bytes(c.mesh_ply(map_id))
            print(f"mesh -> {args.mesh}")
        if args.slice:
            Path(args.slice).write_bytes(c.esdf_slice_png(map_id, args.z, resolution_m=args.resolution))
            print(f"ESDF slice z={args.z} -> {args.slice}")
        if args.snapshot:
            c.export(map_id, args.snapshot)
            print(f"snapshot -> {args.snapshot}")
        if args.mcap:
            from .foxglove import export_server_map

            export_server_map(c, map_id, m["name"] if m else args.map, args.mcap, args.mcap_z)
            print(f"Foxglove messages -> {args.mcap}")


def _export_local(args) -> None:
    import shutil

    from .api.service import find_map_dir, recover_map
    from .persistence import DataDir

    data = DataDir(Path(args.data_dir), fsync=False)
    mdir = find_map_dir(data, args.map)
    m, info, snap, last, replayed = recover_map(mdir, None if args.device == "auto" else args.device)
    if args.mesh:
        from . import io

        Path(args.mesh).write_bytes(io.mesh_to_ply_bytes(m.mesh()))
        print(f"mesh -> {args.mesh}")
    if args.slice:
        from . import render

        s = m.esdf_slice(args.z, resolution_m=args.resolution)
        Path(args.slice).write_bytes(render.slice_to_png(s, max_distance_m=m.esdf_max_distance_m))
        print(f"ESDF slice z={args.z} -> {args.slice}")
    if args.snapshot:
        if snap is not None and replayed == 0:
            shutil.copyfile(snap.path, args.snapshot)
        else:
            from .persistence import MapDir

            tmp = MapDir(Path(args.snapshot).parent / f".export-{info['id']}", fsync=False)
            tmp.root.mkdir(parents=True, exist_ok=True)
            tensors, meta = m.state_dict()
            s = tmp.write_snapshot(last, tensors, {**meta, "info": info})
            os.replace(s.path, args.snapshot)
            shutil.rmtree(tmp.root, ignore_errors=True)
        print(f"snapshot -> {args.snapshot}")
    if args.mcap:
        from .foxglove import export_map

        export_map(m, info["name"], args.mcap, args.mcap_z)
        print(f"Foxglove messages -> {args.mcap}")


# ---------------------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    """Serve on loopback, replay ../shared/data through the client, show /metrics; keep serving."""
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
    s.add_argument("--port", type=int, help="MAPPER_PORT (default 8000)")
    s.add_argument("--data-dir", type=Path, help="MAPPER_DATA_DIR (default ./mapper-data)")
    s.add_argument("--device", help="auto | cpu | cuda[:N] (MAPPER_DEVICE)")
    s.add_argument("--token", action="append", help="bearer token (repeatable; MAPPER_API_TOKENS)")
    s.add_argument("--log-level", help="MAPPER_LOG_LEVEL (default info)")
    s.add_argument("--foxglove-port", type=int, help="also serve the maps to Foxglove (WebSocket, 127.0.0.1)")
    s.set_defaults(fn=cmd_serve)

    r = sub.add_parser("replay", help="replay a dataset into a server or a data directory")
    r.add_argument("--format", required=True, choices=FORMATS)
    r.add_argument("path", type=Path)
    dest = r.add_mutually_exclusive_group(required=True)
    dest.add_argument("--server", help="service URL, e.g. http://127.0.0.1:8000")
    dest.add_argument("--out", type=Path, help="data directory to write the map into (offline)")
    r.add_argument("--token", help="bearer token (default MAPPER_TOKEN)")
    r.add_argument("--map", help="existing map id (server)")
    r.add_argument("--name", help="map name (created if absent)")
    r.add_argument("--voxel", type=float, help="voxel size in metres (new maps; default 0.1)")
    r.add_argument("--layers", help="comma-separated layers (default tsdf,esdf; depth adds color)")
    r.add_argument("--max-range", type=float, default=None)
    r.add_argument("--limit", type=int, help="at most this many frames")
    r.add_argument("--stride", type=int, default=1, help="every k-th frame")
    r.add_argument("--http", action="store_true", help="one POST per frame instead of a WebSocket stream")
    r.add_argument("--window", type=int, default=8, help="frames in flight on the WebSocket")
    r.add_argument("--device", default="auto", help="offline (--out) device")
    r.set_defaults(fn=cmd_replay)

    e = sub.add_parser("export", help="export a mesh (PLY), an ESDF slice (PNG) or a snapshot")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", help="service URL")
    src.add_argument("--data-dir", type=Path, help="a data directory (offline)")
    e.add_argument("--map", required=True, help="map id or name")
    e.add_argument("--token")
    e.add_argument("--mesh", type=Path, help="write the mesh as binary PLY")
    e.add_argument("--slice", type=Path, help="write an ESDF slice as PNG")
    e.add_argument("--z", type=float, default=0.5, help="slice height (m)")
    e.add_argument("--resolution", type=float, default=None, help="slice resolution (m)")
    e.add_argument("--snapshot", type=Path, help="write the snapshot (safetensors)")
    e.add_argument("--mcap", type=Path, help="write the Foxglove messages (mesh, poses, slice) as MCAP")
    e.add_argument("--mcap-z", type=float, default=None, help="MCAP slice height (default: last sensor z)")
    e.add_argument("--device", default="auto")
    e.set_defaults(fn=cmd_export)

    d = sub.add_parser("demo", help="serve + replay ../shared/data through the client + show /metrics")
    d.add_argument("--data", type=Path, default=default_data_dir())
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "mapper-demo")
    d.add_argument("--device", default="cpu")
    d.add_argument("--token")
    d.add_argument("--exit", action="store_true", help="stop the server after the demo instead of serving on")
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()

"""The durable store's costs, filesystem vs S3 API: WAL group-commit sync (fsync vs one PUT), replay of the
WAL after a snapshot (one file vs one object per batch), snapshot write + publish and load (fresh cache).

The S3 side runs against moto's server on 127.0.0.1 (``moto[server]``: a Python server in this process),
so its numbers are the client's and the protocol's costs plus moto's, not those of AWS S3 or MinIO (measure
those with a real endpoint before relying on them). Run:

    python benchmarks/bench_objstore.py --out benchmarks/results/objstore_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapper.objstore import ObjectDataDir  # noqa: E402
from mapper.persistence import DataDir  # noqa: E402


def stats(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return statistics.median(xs), p99, xs[-1]


def bench_sync(mdir, batches: int, per_batch: int, payload: bytes) -> list[float]:
    wal = mdir.open_wal(1)
    seq = 0
    out = []
    for _ in range(batches):
        for _ in range(per_batch):
            seq += 1
            wal.append(seq, payload)
        t = time.perf_counter()
        wal.sync()
        out.append((time.perf_counter() - t) * 1e3)
    wal.close()
    return out


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200, help="group commits timed per backend")
    ap.add_argument("--per-batch", type=int, default=4, help="records per group commit")
    ap.add_argument("--record-kb", type=int, default=36, help="record size (a 3000-point LiDAR frame: 36 KB)")
    ap.add_argument("--snapshot-mb", type=int, default=64, help="snapshot size")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")

    payload = np.random.default_rng(0).bytes(args.record_kb * 1024)
    tensors = {"x": torch.randn(args.snapshot_mb * (1 << 20) // 4)}
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        backends = {
            "filesystem (fsync)": DataDir(Path(tmp) / "fs", fsync=True),
            "S3 API (moto, loopback)": ObjectDataDir(
                "s3://bench/p", Path(tmp) / "cache", endpoint_url=endpoint
            ),
        }
        for name, data in backends.items():
            mdir = data.map_dir("m")
            mdir.root.mkdir(parents=True, exist_ok=True)
            sync = bench_sync(mdir, args.batches, args.per_batch, payload)
            replay = timed(lambda mdir=mdir: sum(1 for _ in mdir.replay(0)), 3)
            snap_w = timed(lambda mdir=mdir: mdir.write_snapshot(1, tensors, {"config": {}}), 3)

            def load(name=name, mdir=mdir):
                if "S3" in name:  # another node: nothing cached
                    for p in mdir.root.glob("snapshot-*"):
                        p.unlink()
                from mapper.persistence import load_snapshot_file

                load_snapshot_file(mdir.latest_snapshot().path)

            snap_r = timed(load, 3)
            rows.append((name, stats(sync), statistics.median(replay), stats(snap_w), stats(snap_r)))
            print(name, rows[-1], flush=True)
    server.stop()

    n_records = args.batches * args.per_batch
    lines = [
        "# Durable store: filesystem vs S3 API",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared VM, other "
        "jobs running), Python " + platform.python_version(),
        "- command: `python benchmarks/bench_objstore.py" + (f" --out {args.out}`" if args.out else "`"),
        f"- WAL: {args.batches} group commits of {args.per_batch} records of {args.record_kb} KB; replay of "
        f"those {n_records} records (the filesystem: one segment file; S3: one object per commit); snapshot "
        f"{args.snapshot_mb} MB written + published (3 times) and loaded (S3: downloaded to an empty cache)",
        "- S3 side: moto's server in this process on 127.0.0.1 (client + protocol + moto costs; not the "
        "latency of AWS S3 or MinIO)",
        "",
        "| backend | WAL sync p50 (ms) | p99 | max | replay all (ms) | snapshot write p50 (ms) | max "
        "| snapshot load p50 (ms) | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (s50, s99, smax), rep, (w50, _, wmax), (r50, _, rmax) in rows:
        lines.append(
            f"| {name} | {s50:.2f} | {s99:.2f} | {smax:.2f} | {rep:.0f} | {w50:.0f} | {wmax:.0f} | {r50:.0f} "
            f"| {rmax:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

"""What the benchmarks' markdown reports share.

* Timing tables (``bench_graph_queries.py``, ``bench_mesh.py``): :func:`timing_head` (title, date, hardware,
  software, CUDA graphs, the exact command, the table header) and :func:`row` (median, p99, max and count of
  wall-clock milliseconds from :func:`wall`: the device synchronised before and after the call, what a
  caller waits for).
* Host-work reports (``bench_prepare.py``, ``bench_ws_deflate.py``): :func:`lidar_frame` (a LiDAR frame as a
  client sends it) and :func:`emit` (date, hardware and command lines above the report's own, printed and
  written to ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sync(dev) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def wall(fn, dev) -> tuple[float, object]:
    """``(milliseconds, result)`` of ``fn()``, the device synchronised before and after."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return (time.perf_counter() - t0) * 1e3, out


def row(case: str, ms: list[float], note: str = "") -> str:
    """A row of the timing table: median, p99, max (ms) and count of ``ms``."""
    a = np.asarray(ms, float)
    return f"| {case} | {np.median(a):.3f} | {np.percentile(a, 99):.3f} | {a.max():.3f} | {a.size} | {note} |"


def timing_head(title: str, dev, note_column: str = "note") -> list[str]:
    """The lines above a timing table of :func:`row` rows, its header included."""
    import torch

    from mapper import graphs
    from mapper.kernels.dispatch import use_triton

    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return [
        f"# {title}",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- hardware: {hw}; CPU threads: {torch.get_num_threads()}; cores: {os.cpu_count()}",
        f"- software: python {platform.python_version()}, torch {torch.__version__}; kernels: "
        f"{'Triton' if use_triton(dev) else 'torch reference'}",
        f"- CUDA graphs (`MAPPER_CUDA_GRAPHS`): {'on' if graphs.enabled(dev) else 'off'}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        f"| case | median ms | p99 ms | max ms | n | {note_column} |",
        "|---|---|---|---|---|---|",
    ]


def frame_args(doc: str) -> argparse.ArgumentParser:
    """The options of a per-frame host-work report: ``--points`` (120 000: a LiDAR frame), ``--reps``
    (5), ``--out`` (the markdown file)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    return ap


def lidar_frame(points: int, columns: int = 3) -> bytes:
    """Frame 0 of ``bench_service.lidar_scan`` (``points`` points; ``columns`` 4 adds an intensity) as a
    client sends it: a msgpack LiDAR message."""
    from bench_service import lidar_scan  # the service's client imports only where a report needs it

    from mapper import wire

    pts, T = lidar_scan(0, points)
    if columns == 4:
        pts = np.concatenate([pts, np.ones((pts.shape[0], 1), np.float32)], axis=1)
    return wire.packb(wire.lidar_message(pts, T, 0.0))


def emit(title: str, script: str, argv: list[str] | None, lines: list[str], out: Path | None) -> str:
    """The report: ``# title``, date, hardware and the command (``python benchmarks/<script> <argv>``; None:
    this process's arguments), then ``lines``; printed, and written to ``out`` when given."""
    from bench_service import hardware

    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    head = [
        f"# {title}",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}",
        f"- command: `python benchmarks/{script} {cmd}`",
    ]
    report = "\n".join(head + lines) + "\n"
    print(report)
    if out:
        out.write_text(report)
    return report

"""A short soak of a real ``mapper serve`` (benchmarks/soak_service.py, bounded to ~20 s of load): writers
on both transports and readers on every query kind at once, zero errors. The 30-minute run with the memory
check is benchmarks/results/soak_cpu.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from soak_service import parser, report, run  # noqa: E402


@pytest.mark.slow
def test_short_soak_has_no_errors(tmp_path):
    argv = ["--duration", "20", "--points", "3000", "--voxel", "0.3", "--max-range", "10"]
    argv += ["--writer-hz", "4", "--sample-s", "1", "--snapshot-interval-s", "5"]
    args = parser().parse_args(argv)
    res = run(args)
    st = res["stats"]
    assert not st.errors, st.error_examples
    ops = {op: len(v) for op, v in st.lat.items()}
    # every kind of request ran (both ingest transports, every reader operation)
    assert set(ops) == {"frame/ws", "frame/http", "distance", "slice", "slice_png", "mesh", "mesh_since"}, ops
    assert min(ops.values()) >= 1 and sum(ops.values()) >= 40, ops
    assert len(res["samples"]) >= 10 and all(r > 0 for _, r in res["samples"])
    text, _ = report(args, res, argv)
    assert "0 errors" in text and "| frame/ws |" in text

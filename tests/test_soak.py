"""A short soak of a real ``mapper serve`` (benchmarks/soak_service.py, bounded to ~20 s of load): writers
on both transports and readers on every query kind at once, zero errors. The 30-minute run with the memory
check is benchmarks/results/soak_cpu.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from soak_service import parser, report, rss_growth, run  # noqa: E402


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


def test_rss_growth_is_a_line_through_the_window():
    mib = 2**20
    # 2 MiB/min from 1000 MiB, sampled every 5 s, judged from 10 to 30 min: 2 * 19.92 / 1020
    line = [(t, int((1000 + 2 * t / 60) * mib)) for t in range(0, 1800, 5)]
    growth, slope = rss_growth(line, 600, 1800)
    assert slope == pytest.approx(2.0, rel=1e-6)
    assert growth == pytest.approx(2 * (1795 - 600) / 60 / 1020, rel=1e-6)
    # +-150 MiB swings of the requests in flight (a spike at the last sample too) do not move it much
    noisy = [(t, r + (150 if (t // 5) % 2 else -150) * mib) for t, r in line]
    noisy[-1] = (noisy[-1][0], noisy[-1][1] + 400 * mib)
    assert rss_growth(noisy, 600, 1800)[0] == pytest.approx(growth, abs=0.01)
    flat = [(t, 800 * mib) for t in range(0, 1800, 5)]
    assert rss_growth(flat, 600, 1800) == (0.0, pytest.approx(0.0, abs=1e-9))

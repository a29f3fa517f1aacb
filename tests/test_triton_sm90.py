"""Every Triton kernel compiles for the H200 (sm_90), checked on a machine without a GPU.

Runs the Triton cases of the kernel tests in a subprocess with ``MAPPER_TRITON_SM90=1`` (see
``tests/triton_sm90.py``): each launch is compiled to a cubin for sm_90, then interpreted, so the tests'
assertions still hold. Then checks that every ``@triton.jit`` kernel in ``mapper/kernels/triton_*.py`` was
compiled at least once (a kernel no test launches fails here).

The subprocess starts when collection ends (``conftest.py``) and runs beside the rest of the suite (one
thread), so on CI's two cores it costs little wall time; the test is moved to the end of the run and waits
for it. ``MAPPER_SM90_BACKGROUND=0`` starts it only when the test runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# the Triton cases of every test file that has them, except the grid oracle's (2 min more, and the grid
# kernels are all launched by test_grid_errors/test_grid_properties too)
SLOW = {"test_grid_oracle.py"}
TEST_FILES = sorted(
    str(p.relative_to(ROOT))
    for p in (ROOT / "tests").glob("test_*.py")
    if p.name != Path(__file__).name and p.name not in SLOW and "backend" in p.read_text()
)


def declared_kernels() -> set[str]:
    names = set()
    for f in (ROOT / "mapper" / "kernels").glob("triton_*.py"):
        src = f.read_text()
        for m in re.finditer(r"@triton\.jit[^\n]*\ndef (\w+)\(", src):
            if m.group(1).endswith("_kernel"):
                names.add(m.group(1))
    return names


def _command(report: Path, cache: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # one thread: in the background it shares CI's two cores with the main test run
    env.update(MAPPER_TRITON_SM90="1", MAPPER_TRITON_SM90_REPORT=str(report), TRITON_CACHE_DIR=str(cache))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", *TEST_FILES]
    return cmd, env


class Background:
    """The compile check's subprocess, started when the session's collection ends (``conftest.py``) so that
    it runs beside the rest of the suite instead of after it; the test below waits for it."""

    proc: subprocess.Popen | None = None
    dir: Path | None = None

    @classmethod
    def start(cls) -> None:
        if cls.proc is not None:
            return
        cls.dir = Path(tempfile.mkdtemp(prefix="mapper-sm90-"))
        cmd, env = _command(cls.dir / "compiled.txt", cls.dir / "cache")
        out = open(cls.dir / "out.txt", "w")  # noqa: SIM115 - closed when the process is collected
        cls.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def should_start_early() -> bool:
    """No GPU, Triton importable, not an xdist worker (each would start its own)."""
    if torch.cuda.is_available() or os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return os.environ.get("MAPPER_SM90_BACKGROUND", "1") != "0"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the Triton tests compile for the real device")
def test_every_triton_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    Background.start()  # no-op when conftest started it at the end of collection
    proc, d = Background.proc, Background.dir
    try:
        rc = proc.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = (d / "out.txt").read_text()
    tail = out[-5000:]
    assert rc == 0, tail
    assert re.search(r"\d+ passed", out), tail
    compiled = set((d / "compiled.txt").read_text().split())
    missing = declared_kernels() - compiled
    assert not missing, f"kernels no Triton test launched (not compiled for sm_90): {sorted(missing)}"
    shutil.rmtree(d, ignore_errors=True)

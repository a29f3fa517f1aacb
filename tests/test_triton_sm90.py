"""Every Triton kernel compiles for the H200 (sm_90), checked on a machine without a GPU.

Runs the Triton cases of the kernel tests in a subprocess with ``MAPPER_TRITON_SM90=1`` (see
``tests/triton_sm90.py``): each launch is compiled to a cubin for sm_90, then interpreted, so the tests'
assertions still hold. Then checks that every ``@triton.jit`` kernel in ``mapper/kernels/triton_*.py`` was
compiled at least once (a kernel no test launches fails here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the Triton tests compile for the real device")
def test_every_triton_kernel_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton")
    report = tmp_path / "compiled.txt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MAPPER_TRITON_SM90="1", MAPPER_TRITON_SM90_REPORT=str(report), TRITON_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", *TEST_FILES]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert re.search(r"\d+ passed", r.stdout), tail
    compiled = set(report.read_text().split())
    missing = declared_kernels() - compiled
    assert not missing, f"kernels no Triton test launched (not compiled for sm_90): {sorted(missing)}"

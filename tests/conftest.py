"""Test configuration.

* Without CUDA, Triton kernels run on CPU tensors through the interpreter: ``TRITON_INTERPRET=1`` must be
  set before ``triton.jit`` decorates anything, hence here, at import time.
* ``backend`` runs a test with the torch reference and with the Triton kernels (``MAPPER_KERNELS``).
* ``device`` runs a test on the CPU and, where CUDA exists, on the GPU (those cases carry the ``gpu`` mark).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(
    os.environ.get("MAPPER_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def _triton_ok() -> bool:
    from mapper.kernels.dispatch import triton_available

    return triton_available()


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton" and not _triton_ok():
        pytest.skip("triton not installed")
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        dev = request.getfixturevalue("device") if "device" in request.fixturenames else torch.device("cpu")
        if dev.type != "cuda":
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set when there is no CUDA)")
    monkeypatch.setenv("MAPPER_KERNELS", request.param)
    return request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return torch.device(request.param)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA

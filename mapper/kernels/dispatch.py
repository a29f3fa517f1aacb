"""The one place that decides whether an operator runs its Triton kernel or its pure-torch reference.

``MAPPER_KERNELS`` (read at call time): ``auto`` (default: Triton for CUDA tensors when Triton imports),
``torch`` (always the reference), ``triton`` (Triton wherever it can run: CUDA tensors, and CPU tensors
under ``TRITON_INTERPRET=1``, which is how CI runs the kernels, or under the tests' sm_90 compile check
``MAPPER_TRITON_SM90=1``; other CPU tensors use the reference).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def kernel_mode() -> str:
    mode = os.environ.get("MAPPER_KERNELS", "auto").strip().lower()
    return mode if mode in ("auto", "torch", "triton") else "auto"


def use_triton(device: torch.device) -> bool:
    """True when operators on tensors of ``device`` should use their Triton kernels."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if not triton_available():
            raise RuntimeError("MAPPER_KERNELS=triton but triton does not import")
        cpu_ok = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("MAPPER_TRITON_SM90") == "1"
        return device.type == "cuda" or cpu_ok
    return device.type == "cuda" and triton_available()

"""The one place that decides whether an operator runs its Triton kernel or its pure-torch reference.

An operator ``op`` (pytorch3d's ``op`` / ``op_naive``) has a pure-torch reference ``op_torch`` and a Triton
kernel ``op_triton`` with the same signature (in ``mapper/kernels/triton_<module>.py``); ``op`` picks one
once per call with :func:`kernel` and calls it. Callers call ``op``.

``MAPPER_KERNELS`` (read at call time): ``auto`` (default: Triton for CUDA tensors when Triton imports),
``torch`` (always the reference), ``triton`` (Triton wherever it can run: CUDA tensors, and CPU tensors
under ``TRITON_INTERPRET=1``, which is how CI runs the kernels, or under the tests' sm_90 compile check
``MAPPER_TRITON_SM90=1``; other CPU tensors use the reference).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

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


def compiled(device: torch.device | str) -> bool:
    """True when operators on ``device`` run compiled kernels rather than their torch references. The one
    question a caller above the kernels may ask about the choice, to pick a *strategy* that only pays off
    with compiled kernels (a warm-up that compiles them, a CUDA-graph replay, a cache that only helps the
    reference); callers never name the kernel language."""
    return use_triton(torch.device(device))


def kernel(device: torch.device, torch_impl: Callable, triton_impl: str | Callable) -> Callable:
    """The implementation of an operator for tensors on ``device``: ``torch_impl`` (the reference), or its
    Triton twin (same signature) where :func:`use_triton` says so. ``triton_impl`` is the twin, or its name
    ``"<module>:<function>"`` in ``mapper.kernels`` (imported only when chosen, so a CPU install never
    imports Triton)."""
    return triton_twin(triton_impl) if use_triton(device) else torch_impl


def triton_twin(triton_impl: str | Callable) -> Callable:
    """The Triton implementation named by :func:`kernel`'s ``triton_impl`` (imported now)."""
    if callable(triton_impl):
        return triton_impl
    module, name = triton_impl.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)

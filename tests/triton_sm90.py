"""Compile every Triton launch for the H200 (sm_90) on a machine without a GPU, then run it in the
interpreter.

The interpreter (``TRITON_INTERPRET=1``) executes a kernel's Python body with NumPy and accepts things the
compiler rejects (a plain ``float`` module global inside a ``@triton.jit`` function, for one), so a kernel
can pass every CPU test and still fail to compile on the GPU. With ``MAPPER_TRITON_SM90=1`` (see
``conftest.py``; ``TRITON_INTERPRET`` must then be unset so ``triton.jit`` builds real ``JITFunction`` s),
each launch is first compiled to a cubin for ``GPUTarget("cuda", 90, 32)`` by Triton's own front and back
ends (PTX through the bundled ``ptxas``), with a stand-in driver that answers the target, and then executed
by the interpreter on the CPU tensors, so the tests still check its results.
"""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.runtime import driver as _driver
from triton.runtime import interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
compiled: list[str] = []


class _TargetOnlyDriver:
    """Just enough of a CUDA driver for ``JITFunction.run(..., warmup=True)``: no device is touched."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_benchmarker(self):  # pragma: no cover - autotuning is not used
        return None


_INTERPRETED: dict[int, InterpretedFunction] = {}


def _interpreted(jf: JITFunction) -> InterpretedFunction:
    f = _INTERPRETED.get(id(jf))
    if f is None:
        f = _INTERPRETED[id(jf)] = InterpretedFunction(jf.fn)
    return f


def _call_device_function(jf: JITFunction, *args, **kwargs):
    """``InterpretedFunction.__call__`` without its leak: the language patches a device call makes are
    undone when it returns (the interpreter alone never needs that; compiling the next kernel does)."""
    f = _interpreted(jf)
    scope = _interp._patch_lang(f.fn)
    try:
        return f.rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def install() -> None:
    """Patch ``JITFunction.run``: compile for sm_90, then interpret the launch."""
    orig_run, orig_call = JITFunction.run, JITFunction.__call__

    def run(self, *args, grid, warmup, **kwargs):
        _driver.set_active(_TargetOnlyDriver())
        try:
            orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            _driver._active = None  # back to lazy default (never created on a machine without CUDA)
        compiled.append(self.fn.__name__)
        if warmup:
            return None
        # nested @triton.jit helpers (ours and triton.language's, e.g. tl.max) are JITFunctions too: inside
        # the interpreted body, call them as the interpreter calls device functions
        JITFunction.__call__ = _call_device_function
        try:
            return _interpreted(self)[grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = orig_call

    JITFunction.run = run

"""Which Triton kernel variants a piece of code launches, without a GPU (a test helper).

Triton compiles one variant of a ``@triton.jit`` kernel per *specialisation key*: the values of its
``constexpr`` arguments, the dtype of each tensor argument and whether its address is 16-byte aligned, and
for each integer argument its type (i32 / i64 / u64 by value range) and, unless the kernel lists it in
``do_not_specialize``, whether it equals 1 and whether it is divisible by 16 (triton 3.x
``specialize_impl``). :class:`VariantRecorder` computes that key for every launch made through the
interpreter (``TRITON_INTERPRET=1``: the kernels are ``InterpretedFunction`` objects, which compile
nothing), so a CPU test can tell which variants a real GPU would compile: the CPU-side twin of
``triton.knobs.runtime.jit_post_compile_hook``.
"""

from __future__ import annotations

import inspect

import torch


def _int_kind(v: int) -> str:
    if -(2**31) <= v < 2**31:
        return "i32"
    if -(2**63) <= v < 2**63:
        return "i64"
    return "u64"


def spec_key(fn, args: tuple, kwargs: dict) -> tuple:
    """The specialisation key of one launch of interpreted kernel ``fn`` with ``args`` / ``kwargs``."""
    sig = inspect.signature(fn.fn)
    params = sig.parameters
    names = list(params)
    dns = fn.kwargs.get("do_not_specialize") or ()
    dns = {names[d] if isinstance(d, int) else d for d in dns}
    values = dict(zip(names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in params})
    key = []
    for name in names:
        if name not in values:
            continue
        v = values[name]
        ann = params[name].annotation
        if ann is not inspect.Parameter.empty and "constexpr" in str(ann):
            key.append((name, "c", repr(v)))
        elif isinstance(v, torch.Tensor):
            key.append((name, str(v.dtype), v.data_ptr() % 16 == 0))
        elif isinstance(v, bool):
            key.append((name, "i1", v if name not in dns else None))
        elif isinstance(v, int):
            spec = None if name in dns else (v == 1, v % 16 == 0)
            key.append((name, _int_kind(v), spec))
        elif isinstance(v, float):
            key.append((name, "fp32"))
        elif v is None:
            key.append((name, "none"))
        else:
            key.append((name, type(v).__name__, repr(v)))
    return (fn.fn.__name__, tuple(key))


class VariantRecorder:
    """Context manager: records the specialisation key of every interpreted Triton launch in ``keys``."""

    def __init__(self):
        self.keys: list[tuple] = []

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._cls = InterpretedFunction
        self._orig = InterpretedFunction.run
        orig, keys = self._orig, self.keys

        def run(fn, *args, grid, warmup, **kwargs):
            keys.append(spec_key(fn, args, kwargs))
            return orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._orig
        return False

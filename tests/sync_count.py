"""Count the operations that make the host wait for a CUDA device, on any device (a test helper).

On CUDA a host sync happens where the host needs a value the device computes: a scalar read (``item``,
``tolist``, ``int``/``bool``/``float`` of a tensor), an output whose size depends on the data (``nonzero``,
``unique``, boolean-mask indexing and assignment, ``masked_select``, ``repeat_interleave`` without
``output_size``, ``bincount``), a copy to the host, indexing by a 0-dim tensor, a Python scalar written
through a tensor index (``x[idx] = 2`` copies the 2 from the host). :class:`SyncCounter` is a
``TorchFunctionMode`` that records each such call with the ``mapper`` source line that made it, so a CPU
test can count what the same code would cost on a GPU (the torch path; GPU tests count the real thing with
``torch.cuda.set_sync_debug_mode``, see :func:`cuda_syncs`).
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}
_SIZED = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.argwhere,
    torch.unique,
    torch.Tensor.unique,
    torch.unique_consecutive,
    torch.Tensor.unique_consecutive,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.bincount,
    torch.Tensor.bincount,
}


def _index_syncs(idx, value=None) -> bool:
    """Indexing that syncs on CUDA: a boolean mask (``nonzero``), a 0-dim integer tensor (read back as an
    int), or a Python scalar written through a tensor index (copied from the host)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    tensors = [i for i in items if isinstance(i, torch.Tensor)]
    if any(i.dtype in (torch.bool, torch.uint8) for i in tensors):
        return True
    if any(i.dim() == 0 and not i.is_floating_point() for i in tensors):
        return True
    return bool(tensors) and isinstance(value, (bool, int, float))


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):  # without _site and __torch_function__
        if "/mapper/" in fr.filename:
            return f"{fr.filename.rsplit('/mapper/', 1)[1]}:{fr.lineno}"
    return "?"


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as c: ...``; ``c.sites`` counts the sync-making calls per ``mapper`` line."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sync = func in _READS or func in _SIZED
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            sync = _index_syncs(args[1], args[2] if func is torch.Tensor.__setitem__ else None)
        elif func in (torch.where, torch.Tensor.where) and len(args) + len(kwargs) == 1:
            sync = True
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            rep = args[1] if len(args) > 1 else kwargs.get("repeats")
            sync = isinstance(rep, torch.Tensor) and rep.numel() > 1 and kwargs.get("output_size") is None
        elif func in (torch.Tensor.to,) and args:
            dst = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
            sync = any(torch.device(d).type == "cpu" for d in dst) and args[0].device.type != "cpu"
        if sync:
            self.sites[_site()] += 1
        return func(*args, **kwargs)


@contextmanager
def cuda_syncs():
    """Count the host syncs CUDA reports (``set_sync_debug_mode("warn")``) inside the block: yields a
    Counter of warning sites, filled when the block exits."""
    sites: Counter[str] = Counter()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    for w in caught:
        # "called a synchronizing CUDA operation"; not the one-time notice that the mode is a prototype
        # ("Synchronization debug mode is a prototype feature ...", at the first set_sync_debug_mode)
        if "called a synchronizing" in str(w.message):
            sites[f"{w.filename.rsplit('/mapper/', 1)[-1]}:{w.lineno}"] += 1

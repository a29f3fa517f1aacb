"""Per-stage wall times of a map's last frame (``Map.timings_ms``)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StageTimer:
    """Per-stage wall times of the last frame. On CUDA, events are recorded without synchronising and
    resolved when :meth:`resolve` asks. ``timer(stage)`` is a context manager (the integrators' ``timer``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: dict[str, list] = {}
        self.last: dict[str, float] = {}

    def reset(self) -> None:
        self.pending = {}

    @contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            try:
                yield
            finally:
                b.record()
                self.pending.setdefault(stage, []).append((a, b))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.last[stage] = self.last.get(stage, 0.0) + (time.perf_counter() - t0) * 1e3

    def begin_frame(self) -> None:
        self.pending = {}
        self.last = {}

    def resolve(self) -> dict[str, float]:
        if self.cuda and self.pending:
            torch.cuda.synchronize()
            self.last = {k: sum(a.elapsed_time(b) for a, b in pairs) for k, pairs in self.pending.items()}
            self.pending = {}
        return dict(self.last)

"""CUDA graphs for fixed-shape GPU work: one captured graph per shape bucket, replayed per call.

A short GPU operation over a small input (the incremental mesh of a few hundred bricks) costs its launches,
not its arithmetic: a few dozen kernels and torch ops at ~5-10 us of host time each. A CUDA graph records
them once and replays them as one launch. A graph replays fixed addresses and sizes, so:

* the caller pads its input to a **bucket** (:func:`bucket`: sizes rounded up to a power of two) and an
  operation is captured once per bucket key, with **static input buffers** the caller fills per call
  (``fill``) and **static outputs** the replay overwrites: the caller copies out what it keeps, inside
  :meth:`GraphedOp.run`'s ``with`` block (a lock keeps another thread's replay out meanwhile);
* the captured function must not read sizes back, branch on data or allocate outside the graph's pool: it
  runs over whole buckets with masked tails, and its sizes come back as a device tensor among its outputs
  that the caller reads once, after the replay;
* a capture costs milliseconds (the function runs eagerly on a side stream first, so Triton compiles and
  the caching allocator settles, as torch's ``make_graphed_callables`` warm-up does; then it is recorded):
  maps capture their buckets at warm-up (:func:`warming`, called from :mod:`mapper.warmup`). A capture
  outside a warm-up still happens (once per bucket) but is counted in :func:`stats` as ``late_captures``;
  the GPU tests fail on one;
* memory is bounded: the graphs of an operation share one memory pool per device (their replays take
  turns under the operation's lock, and a caller reads a replay's outputs before the next replay, so one
  graph's intermediates may reuse another's memory, as torch's docs allow for graphs never replayed
  concurrently; a replay on another stream first waits for the previous call's reads), an operation keeps
  at most ``max_graphs`` graphs and callers only graph buckets up to a size where launches dominate
  (beyond it, eager work is GPU-bound anyway).

Replays run on the caller's current stream. Where graphs do not apply — CPU tensors, the Triton
interpreter (``TRITON_INTERPRET=1``), ``MAPPER_CUDA_GRAPHS=0``, a bucket over the cap, or a capture that
failed — :meth:`GraphedOp.run` runs the same function eagerly on freshly made inputs (same results: the
tests compare both), and callers keep their plain eager path for those cases.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

ENV = "MAPPER_CUDA_GRAPHS"

_state = threading.local()
_counts_lock = threading.Lock()
_counts = {"captures": 0, "late_captures": 0, "replays": 0, "eager": 0, "failed": 0}


def enabled(device: torch.device | str) -> bool:
    """True when work on ``device`` may be replayed from CUDA graphs: a CUDA device, not the Triton
    interpreter, and ``MAPPER_CUDA_GRAPHS`` not set to ``0`` (read per call)."""
    dev = torch.device(device)
    if dev.type != "cuda" or os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()


def _device_key(dev: torch.device) -> str:
    """``cuda`` and ``cuda:<current>`` are one device: one set of graphs."""
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def bucket(n: int, minimum: int = 64) -> int:
    """The bucket of a size ``n``: the next power of two >= max(n, ``minimum``)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """Captures inside this block (on this thread) are warm-up captures, not ``late_captures``."""
    prev = getattr(_state, "warming", False)
    _state.warming = True
    try:
        yield
    finally:
        _state.warming = prev


def stats() -> dict[str, int]:
    """Counters over all operations in this process: ``captures``, ``late_captures`` (captures outside
    :func:`warming`), ``replays``, ``eager`` (calls run eagerly: disabled, over the cap or failed) and
    ``failed`` (captures that raised; that bucket then stays eager)."""
    with _counts_lock:
        return dict(_counts)


def _count(name: str, n: int = 1) -> None:
    with _counts_lock:
        _counts[name] += n


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: the capture failed, this bucket runs eagerly
    inputs: tuple[torch.Tensor, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()


@dataclass
class GraphedOp:
    """``fn(key, *inputs) -> tuple of tensors`` captured per bucket key.

    Args:
        name: for logs.
        fn: the operation, called as ``fn(key, *inputs)``; runs on whatever the static inputs hold (at
            capture: their initial content from ``make_inputs``; it must not fault on it) and must be
            capturable (no host sync, no data-dependent shapes or branches, no CPU tensors per call).
        make_inputs: ``make_inputs(key, device)`` -> the input tensors of a bucket, holding valid values
            (e.g. an empty list's padding).
        max_graphs: at most this many captured buckets; further keys run eagerly.
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, ...]]  # fn(key, *inputs)
    make_inputs: Callable[[Hashable, torch.device], tuple[torch.Tensor, ...]]
    max_graphs: int = 16
    replays: int = 0  # this op's replays (``stats()`` counts all ops')
    _graphs: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pools: dict = field(default_factory=dict, repr=False)  # device -> the memory pool its graphs share
    _done: dict = field(default_factory=dict, repr=False)  # device -> event after the last call's reads

    def captured(self, device: torch.device | str | None = None) -> list:
        """The keys (bucket, device) with a live graph."""
        dev = None if device is None else _device_key(torch.device(device))
        return [k for k, g in self._graphs.items() if g.graph is not None and dev in (None, k[1])]

    def clear(self) -> None:
        """Drop every graph (and its memory pool)."""
        with self._lock:
            self._graphs.clear()
            self._pools.clear()
            self._done.clear()

    def warm(self, key: Hashable, device: torch.device | str) -> bool:
        """Capture ``key`` on ``device`` now (a warm-up capture); True when a graph is ready."""
        dev = torch.device(device)
        if not enabled(dev):
            return False
        with warming(), self._lock:
            g = self._entry(key, dev)
        return g is not None and g.graph is not None

    @contextlib.contextmanager
    def run(
        self, key: Hashable, device: torch.device | str, fill: Callable[[tuple[torch.Tensor, ...]], None]
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yield the outputs of ``fn`` on the inputs of bucket ``key`` after ``fill(inputs)`` wrote this
        call's values into them: a graph replay on the current stream (the outputs are the graph's static
        buffers: copy out what you keep before leaving the block), or an eager call where graphs do not
        apply."""
        dev = torch.device(device)
        with self._lock:  # the static buffers (and inputs an op shares between buckets) take turns
            g = self._entry(key, dev) if enabled(dev) else None
            if g is not None and g.graph is not None:
                dk = _device_key(dev)
                stream = torch.cuda.current_stream(dev)
                if dk in self._done:  # a caller on another stream may still be reading the buffers
                    stream.wait_event(self._done[dk])
                fill(g.inputs)
                g.graph.replay()
                self.replays += 1
                _count("replays")
                try:
                    yield g.outputs
                finally:
                    self._done[dk] = stream.record_event()
                return
            _count("eager")
            inputs = self.make_inputs(key, dev)
            fill(inputs)
            yield tuple(self.fn(key, *inputs))

    def _entry(self, key: Hashable, dev: torch.device) -> _Graph | None:
        """The graph of ``key`` on ``dev``, captured now if new and under the cap (lock held)."""
        k = (key, _device_key(dev))
        g = self._graphs.get(k)
        if g is not None or len(self._graphs) >= self.max_graphs:
            return g
        late = not getattr(_state, "warming", False)
        try:
            g = self._capture(key, dev)
        except Exception:  # a capture that fails leaves this bucket eager: correct, only slower
            log.exception("CUDA graph capture of %s %s failed; it runs eagerly", self.name, key)
            _count("failed")
            g = _Graph(None)
        else:
            _count("captures")
            if late:
                _count("late_captures")
                log.warning("CUDA graph of %s %s captured outside a warm-up", self.name, key)
        self._graphs[k] = g
        return g

    def _capture(self, key: Hashable, dev: torch.device) -> _Graph:
        with torch.cuda.device(dev):
            inputs = self.make_inputs(key, dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # compile, settle the allocator, off the caller's stream
                for _ in range(2):
                    self.fn(key, *inputs)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            pool = self._pools.setdefault(_device_key(dev), torch.cuda.graph_pool_handle())
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outputs = tuple(self.fn(key, *inputs))
            graph.replay()  # the first launch uploads the graph (~1 ms): not in a caller's frame
            torch.cuda.synchronize(dev)
        return _Graph(graph, inputs, outputs)

"""Python's cyclic garbage collector and the frame path: no frame may pay a full collection.

A full (generation-2) collection walks every container object of the process; with torch, Triton and the
service loaded that is over a million objects, and on the H200 host one took 79 ms inside frame 358 of the
LiDAR 10 cm sequence (``benchmarks/results/frame_h200_s3merged.md``: that frame 86 ms, the median 6.6 ms).
CPython starts one when enough objects have survived into the oldest generation since the last
(``long_lived_pending > long_lived_total / 4``), whichever frame that falls in. The policy:

1. **The frame path leaves no reference cycles** (``tests/test_gc_frames.py`` runs frames of every kind
   with the collector off and requires ``gc.collect() == 0``): its garbage is freed by reference counting,
   at once, with its tensors (the ESDF's recursive closure was a cycle per update, holding ~35 tensors).
2. **After the warm-up, :func:`settle`**: one full collection, then ``gc.freeze()`` moves every survivor
   (modules, compiled kernels, caches, the maps built so far) into the permanent generation, which no
   later collection walks. A full collection can still happen, but it walks only what was created since
   (the maps' few Python objects, the trajectory): a fraction of a millisecond instead of tens. And since
   ``long_lived_total`` still counts the frozen objects, the next one is far away (a steady frame path
   promotes a few objects per frame).
   :func:`mapper.warmup.warm_up` calls it when it ran (so a ``Map`` on CUDA, the service before ``/readyz``,
   the benchmarks after their warm-up).
3. Frozen objects are never collected as cycles, only by reference counting: maps hold no reference
   cycles (tested with every kind of map, and a map the service deletes after a ``settle()`` is freed), so
   a map alive at the freeze is still freed when dropped; :func:`settle` thaws before it collects, so a
   cycle frozen by an earlier call is collected by the next.

Thresholds are left at CPython's defaults: raising the gen-2 threshold would only defer the walk of the
whole heap, not shrink it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)
_lock = threading.Lock()


def settle() -> float:
    """Thaw what an earlier call froze, collect every generation, freeze the survivors; returns the seconds
    it took (the one full collection, paid here instead of inside some frame). Thread-safe."""
    with _lock:
        t = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        dt = time.perf_counter() - t
    log.info(
        "gc settled: %d unreachable collected, %d objects frozen, %.0f ms",
        found,
        gc.get_freeze_count(),
        dt * 1e3,
    )
    return dt


def full_collection_ms() -> float:
    """The wall time (ms) of one full collection now (what a frame would pay if one started in it)."""
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3

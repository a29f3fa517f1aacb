"""Keep the server's native heap flat on a long run (glibc malloc; a no-op elsewhere).

Why: a request's CPU tensors (ESDF update, mesh extraction, slices, query batches) are temporaries of
10^5-10^8 bytes. glibc serves them from per-thread arenas (up to 8 per core) once its dynamic mmap
threshold has risen past them, and keeps the freed pages. Each of the ~12 threads that allocate (map
writers, query pool, ``asyncio.to_thread`` workers) grows its own arena to the peak it has seen, so the
resident size creeps up for many minutes after the maps stopped growing, although the live heap is
flat (NOTES.md, "Service: shutdown and memory on long runs": mallinfo2 showed the arenas' free bytes,
not the bytes in use, growing).

Fix: cap the arenas (``MAPPER_MALLOC_ARENA_MAX``, default 2) before the service's threads start,
return the free pages to the OS every ``MAPPER_MALLOC_TRIM_S`` (default 10 s), and serve every block of
``MAPPER_MALLOC_MMAP_THRESHOLD`` bytes or more (default 128 KiB) with its own mmap. At 1 MiB the
temporaries of 128 KiB-1 MiB (frame arrays, query batches, msgpack bodies, small pool pages) still came
from the arenas; interleaved with longer-lived small blocks they left free space that a trim cannot give
back: at ~100 requests/min the arenas held ~290 MiB with ~70 MiB free (128 KiB: ~128 MiB, ~14 MiB free;
``malloc_arenas`` shows it per arena, NOTES.md #10).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import xml.etree.ElementTree as ET

log = logging.getLogger("mapper.api.memory")

M_MMAP_THRESHOLD = -3  # glibc malloc.h
M_ARENA_MAX = -8


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not (hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim")):
        return None  # not glibc (musl, macOS)
    lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.malloc_trim.argtypes = [ctypes.c_size_t]
    return lib


_LIBC = _libc()


def available() -> bool:
    """glibc's ``mallopt`` and ``malloc_trim`` can be called."""
    return _LIBC is not None


def limit_arenas(n: int) -> bool:
    """At most ``n`` malloc arenas for threads started from now on (0: glibc's default). True if set."""
    if _LIBC is None or n <= 0:
        return False
    ok = bool(_LIBC.mallopt(M_ARENA_MAX, n))
    log.debug("malloc arena max %d: %s", n, ok)
    return ok


def set_mmap_threshold(n: int) -> bool:
    """Serve every allocation of ``n`` bytes or more with its own mmap, unmapped when freed (0: glibc's
    dynamic threshold, which rises to the largest block freed, up to 32 MiB, and then serves such blocks
    from the arenas, whose freed pages stay resident until a trim). True if set."""
    if _LIBC is None or n <= 0:
        return False
    ok = bool(_LIBC.mallopt(M_MMAP_THRESHOLD, int(n)))
    log.debug("malloc mmap threshold %d: %s", n, ok)
    if ok:  # the CPU path keeps its chunks' temporaries below it (mapper.kernels.chunks)
        try:
            from ..kernels.chunks import set_cpu_block_bytes
        except ImportError:  # this module loaded on its own (tests): no CPU path to tell
            return ok
        set_cpu_block_bytes(int(n))
    return ok


def trim() -> bool:
    """Give the free pages of every malloc arena back to the OS. True if memory was released."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 (ctypes' own class attribute)
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap_info() -> dict[str, int] | None:
    """glibc's view of the native heap (``mallinfo2``, glibc >= 2.33), or None: ``in_use`` (bytes of live
    heap chunks), ``free`` (bytes free inside the arenas: resident until trimmed or reused), ``mmap``
    (bytes of live chunks served by mmap, returned to the OS on free)."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    _LIBC.mallinfo2.restype = _MallInfo2
    mi = _LIBC.mallinfo2()
    return {"in_use": int(mi.uordblks), "free": int(mi.fordblks), "mmap": int(mi.hblkhd)}


def malloc_arenas() -> list[dict[str, int]] | None:
    """Per glibc arena (``malloc_info``), the main arena first: ``system`` (bytes the arena holds from the
    OS) and ``free`` (bytes in its free chunks, the top chunk included); None off glibc. Walks every
    arena's bins under its lock (about a millisecond): for probes and scrapes, not per request."""
    if _LIBC is None or not hasattr(_LIBC, "malloc_info") or not hasattr(_LIBC, "open_memstream"):
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    _LIBC.open_memstream.restype = ctypes.c_void_p
    _LIBC.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    _LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _LIBC.fclose.argtypes = [ctypes.c_void_p]
    _LIBC.free.argtypes = [ctypes.c_void_p]
    f = _LIBC.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not f:
        return None
    try:
        _LIBC.malloc_info(0, f)
    finally:
        _LIBC.fclose(f)
    try:
        text = ctypes.string_at(buf, size.value).decode()
    finally:
        _LIBC.free(ctypes.cast(buf, ctypes.c_void_p))
    out = []
    for heap in ET.fromstring(text).findall("heap"):
        tot = {t.get("type"): int(t.get("size", 0)) for t in heap.findall("total")}
        sysm = {t.get("type"): int(t.get("size", 0)) for t in heap.findall("system")}
        out.append({"system": sysm.get("current", 0), "free": tot.get("fast", 0) + tot.get("rest", 0)})
    return out


def rss_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class WorkBudget:
    """Bytes of working memory that the heavy operations in flight may hold together
    (``MAPPER_WORK_MEMORY_BYTES``): reads (queries, slices, boxes, meshes) and the writers' batches (frame
    integration and the ESDF update after it).

    An operation reserves its estimated temporaries before it runs and gives them back when it ends; one
    that does not fit waits (first come, first served: a large one is not overtaken forever by small
    ones), it never fails. One larger than the whole budget runs alone. Used from one event loop (no
    locks); reserve before taking a map's lock, never while holding one.
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"work memory budget: expected > 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self.reserved = 0  # bytes held by the operations running now
        self.running = 0  # operations running now
        self.waiting = 0  # operations waiting for room
        self.waits = 0  # operations that had to wait (total)
        self.peak = 0  # the most bytes reserved at once
        self._queue: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.running == 0 or self.reserved + n <= self.capacity

    def _take(self, n: int) -> None:
        self.reserved += n
        self.running += 1
        self.peak = max(self.peak, self.reserved)

    def _wake(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            n, fut = self._queue.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` fit; returns the bytes reserved (to pass to :meth:`release`)."""
        n = min(max(0, int(nbytes)), self.capacity)
        if not self._queue and self._fits(n):
            self._take(n)
            return n
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((n, fut))
        self.waits += 1
        self.waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # room was given just before the cancel: hand it back
                self.release(n)
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it already
                    self._queue.remove((n, fut))
                self._wake()  # a large one at the head may have blocked smaller ones behind it
            raise
        finally:
            self.waiting -= 1
        return n

    def release(self, n: int) -> None:
        self.reserved -= n
        self.running -= 1
        self._wake()

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int):
        n = await self.acquire(nbytes)
        try:
            yield n
        finally:
            self.release(n)


class MemoryCollector:
    """Prometheus collector (read at scrape time) of the process's memory: RSS, glibc heap in use / free /
    mmapped, Python's allocated blocks, threads, and the work budget's state. The soak
    (benchmarks/soak_service.py) logs these next to RSS to tell live temporaries from retained pages."""

    def __init__(self, work: WorkBudget | None = None):
        self.work = work

    def describe(self):
        return []

    def collect(self):
        # lazy: this module also loads on its own, without the metrics stack
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("mapper_process_resident_bytes", "Resident set size", value=rss_bytes())
        heap = heap_info()
        g = GaugeMetricFamily("mapper_malloc_bytes", "glibc heap (mallinfo2) by kind", labels=["kind"])
        for k, v in (heap or {}).items():
            g.add_metric([k], v)
        yield g
        arenas = malloc_arenas()
        if arenas is not None:
            g = GaugeMetricFamily(
                "mapper_malloc_arena_bytes",
                "glibc malloc arenas (malloc_info): held from the OS, free",
                labels=["arena", "kind"],
            )
            for i, a in enumerate(arenas):
                for k, v in a.items():
                    g.add_metric([str(i), k], v)
            yield g
        yield GaugeMetricFamily(
            "mapper_python_allocated_blocks", "Python objects' memory blocks", value=sys.getallocatedblocks()
        )
        yield GaugeMetricFamily("mapper_threads", "Threads of the process", value=threading.active_count())
        w = self.work
        if w is not None:
            for name, doc, v in (
                ("memory_budget_bytes", "Work memory budget (MAPPER_WORK_MEMORY_BYTES)", w.capacity),
                ("reserved_bytes", "Bytes reserved by the heavy operations running", w.reserved),
                ("peak_bytes", "Most bytes reserved at once", w.peak),
                ("running", "Heavy operations running", w.running),
                ("waiting", "Heavy operations waiting for room", w.waiting),
            ):
                yield GaugeMetricFamily(f"mapper_work_{name}", doc, value=v)
            yield CounterMetricFamily("mapper_work_waits", "Operations that waited for room", value=w.waits)

"""Keep the server's native heap flat on a long run (glibc malloc; a no-op elsewhere).

Why: a request's CPU tensors (ESDF update, mesh extraction, slices, query batches) are temporaries of
10^5-10^8 bytes. glibc serves them from per-thread arenas (up to 8 per core) once its dynamic mmap
threshold has risen past them, and keeps the freed pages. Each of the ~12 threads that allocate (map
writers, query pool, ``asyncio.to_thread`` workers) grows its own arena to the peak it has seen, so the
resident size creeps up for many minutes after the maps stopped growing, although the live heap is
flat (NOTES.md, "Service: shutdown and memory on long runs": mallinfo2 showed the arenas' free bytes,
not the bytes in use, growing).

Fix: cap the arenas (``MAPPER_MALLOC_ARENA_MAX``, default 2) before the service's threads start, and
return the free pages to the OS every ``MAPPER_MALLOC_TRIM_S`` (default 10 s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("mapper.api.memory")

M_ARENA_MAX = -8  # glibc malloc.h


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


def trim() -> bool:
    """Give the free pages of every malloc arena back to the OS. True if memory was released."""
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))

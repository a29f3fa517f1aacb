"""The native-heap hygiene of the service (mapper.api.memory): malloc_trim gives freed heap pages back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from mapper.api import memory


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not memory.available(), reason="needs glibc malloc")
def test_trim_returns_freed_heap_pages():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    n, size = 60_000, 4000  # 240 MB of small blocks: from the heap, never mmapped
    blocks = [libc.malloc(size) for _ in range(n)]
    assert all(blocks)
    for b in blocks:
        libc.memset(b, 1, size)
    touched = rss_bytes()
    for b in blocks[:-1]:  # the last block pins the top of the heap: glibc keeps the pages below it
        libc.free(b)
    freed = rss_bytes()
    assert freed > touched - 100e6  # free() alone gave (almost) nothing back
    assert memory.trim()
    trimmed = rss_bytes()
    libc.free(blocks[-1])
    assert trimmed < freed - 150e6, (touched, freed, trimmed)


def test_limit_arenas_zero_keeps_the_default():
    assert memory.limit_arenas(0) is False

"""Row chunking for the CPU path.

On the CPU, torch temporaries larger than glibc's mmap threshold are fresh pages that fault on first touch;
for element-wise work over millions of rows that costs 5-15x (measured, NOTES.md). Processing in chunks of
~10^5 rows keeps temporaries in reused heap memory and in cache. On CUDA the caching allocator makes
chunking unnecessary, so it is one chunk there.

A process that fixes glibc's mmap threshold (the service: ``MAPPER_MALLOC_MMAP_THRESHOLD``, 128 KiB, to keep
its resident size flat) makes every block at or above it a fresh mmap, freed back to the OS at once: chunks
of ~10^5 rows then fault every temporary in again (the CPU LiDAR walk ran ~2x slower). It says so with
:func:`set_cpu_block_bytes`, and the hot loops size their chunks with :func:`cpu_rows` so that their
temporaries stay below it (reused arena memory, hot in cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

CPU_ROWS = 1 << 17
_BLOCK_BYTES = 0  # glibc's mmap threshold when the process fixed one (0: glibc's dynamic threshold)


def set_cpu_block_bytes(n: int) -> None:
    """Record that CPU allocations of ``n`` bytes or more are fresh mmaps (0: glibc's dynamic threshold,
    the default). Called by :func:`mapper.api.memory.set_mmap_threshold`."""
    global _BLOCK_BYTES
    _BLOCK_BYTES = max(int(n), 0)


def cpu_rows(default: int, bytes_per_row: int) -> int:
    """Rows per CPU chunk: ``default``, or under a fixed mmap threshold the most rows whose temporaries
    (``bytes_per_row`` each row, for the largest one) stay 4 KiB below it (at least 1024)."""
    if _BLOCK_BYTES <= 0:
        return default
    return min(default, max((_BLOCK_BYTES - 4096) // max(bytes_per_row, 1), 1024))


def row_slices(n: int, device: torch.device, cpu_rows: int = CPU_ROWS) -> Iterator[slice]:
    step = n if device.type == "cuda" or n <= cpu_rows else cpu_rows
    for s in range(0, n, max(step, 1)):
        yield slice(s, min(s + step, n))


def map_rows(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, cpu_rows: int = CPU_ROWS) -> torch.Tensor:
    """``fn(*xs)`` computed chunk by chunk along dim 0 on the CPU (concatenated), in one call on CUDA."""
    n = xs[0].shape[0]
    parts = [fn(*(x[s] for x in xs)) for s in row_slices(n, xs[0].device, cpu_rows)]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return fn(*xs)
    return torch.cat(parts)

"""Row chunking for the CPU path.

On the CPU, torch temporaries larger than glibc's mmap threshold are fresh pages that fault on first touch;
for element-wise work over millions of rows that costs 5-15x (measured, NOTES.md). Processing in chunks of
~10^5 rows keeps temporaries in reused heap memory and in cache. On CUDA the caching allocator makes
chunking unnecessary, so it is one chunk there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

CPU_ROWS = 1 << 17


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

"""Triton kernel behind :func:`mapper.kernels.logodds.flags_update` (imported lazily: triton is optional).

One lane per voxel of the frame's bricks: a lane with a flag finds its slot's page (binary search in the
page-start table, as ``triton_paged``), loads the fp16 log-odds, adds ``l_hit`` / ``l_miss`` in float32
(NaN counts as 0), clamps and stores it back (round to nearest even, as torch's ``.to(float16)``). The
bricks are unique, so each voxel has one writer: no atomics; the optional "became known" byte per brick is
a plain store of 1 (every writer writes the same value). Lanes without a flag load nothing but their flag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_paged import n_iter_frame, page_base, page_of

_BLOCK = 256


# sizes vary per frame, and the flags / slots / known buffers may be views at any offset (another allocation
# path): none of these may make a new variant mid-stream
@triton.jit(do_not_specialize=["total", "n_pages", "flags_ptr", "slots_ptr", "known_ptr"])
def _flags_update_kernel(
    flags_ptr, slots_ptr, total, starts_ptr, n_pages, field_ptrs, known_ptr,
    l_hit, l_miss, c_min, c_max,
    KNOWN: tl.constexpr, N_ITER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < total
    f = tl.load(flags_ptr + i, mask=m, other=0)
    upd = m & (f != 0)
    b = i // 64
    slot = tl.load(slots_ptr + b, mask=upd, other=0)
    page, start = page_of(starts_ptr, n_pages, slot, upd, N_ITER)
    p = page_base(field_ptrs, page, upd, tl.float16) + (slot - start) * 64 + i % 64
    old = tl.load(p, mask=upd, other=0.0).to(tl.float32)
    unknown = old != old
    new = tl.where(unknown, 0.0, old) + tl.where(f == 2, l_hit, l_miss)
    new = tl.minimum(tl.maximum(new, c_min), c_max)
    tl.store(p, new.to(tl.float16), mask=upd)
    if KNOWN:
        tl.store(known_ptr + b, tl.full((BLOCK,), 1, tl.uint8), mask=upd & unknown)


def flags_update_triton(pool, name, slots, flags, l_hit, l_miss, c_min, c_max, known=None) -> None:
    """Same contract as :func:`mapper.kernels.logodds.flags_update_torch`: one launch, no host sync."""
    u = slots.numel()
    if u == 0:
        return
    pool.prepare_write(name, slots)  # copy-on-write of pages a published read view holds
    n_pages = len(pool.page_starts) - 1
    fl = flags.reshape(-1)
    _flags_update_kernel[(triton.cdiv(u * 64, _BLOCK),)](
        fl if fl.is_contiguous() else fl.contiguous(), slots.to(torch.int64).contiguous(), u * 64,
        pool.page_start_table(), n_pages, pool.page_table(name), fl if known is None else known,
        float(l_hit), float(l_miss), float(c_min), float(c_max),
        KNOWN=known is not None, N_ITER=n_iter_frame(n_pages), BLOCK=_BLOCK,
    )  # fmt: skip

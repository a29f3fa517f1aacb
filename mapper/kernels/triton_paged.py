"""Triton gather/scatter through a paged pool's page table (imported lazily: triton is optional).

The torch path of :class:`mapper.layers.PagedPool` groups the slots by page (``unique(...).tolist()`` and
a ``nonzero`` per page: host syncs and a handful of launches per page), which on a large map (dozens of
pages) costs milliseconds for any access. Here one launch covers every page: each lane finds its slot's
page by binary search in the page-start table, turns the page's data pointer (an int64 from
``PagedPool.page_table``) into a typed pointer and loads or stores one element. No host sync.

Layout: a page of a field with trailing shape ``C`` (flattened) is ``[page_bricks, 64, C]`` contiguous, so
the element (slot, voxel offset, c) sits at ``((slot - page_start) * 64 + offset) * C + c``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def page_of(starts_ptr, n_pages, slot, m, N_ITER: tl.constexpr):
    """(page, first slot of the page) of int64 slots: the largest p with starts[p] <= slot (binary search;
    ``N_ITER >= log2(n_pages) + 1``; a rolled loop: the query kernel calls this 24 times per point)."""
    lo = tl.zeros_like(slot)
    hi = tl.zeros_like(slot) + n_pages
    for _ in range(N_ITER):
        mid = (lo + hi) // 2
        open_ = hi - lo > 1
        go = tl.load(starts_ptr + mid, mask=m & open_, other=0) <= slot
        lo = tl.where(open_ & go, mid, lo)
        hi = tl.where(open_ & ~go, mid, hi)
    return lo, tl.load(starts_ptr + lo, mask=m, other=0)


@triton.jit
def page_base(ptrs_ptr, page, m, ety: tl.constexpr):
    """Typed pointer to the first element of ``page`` of a field (its page table holds int64 addresses)."""
    return tl.load(ptrs_ptr + page, mask=m, other=0).to(tl.pointer_type(ety))


@triton.jit
def _element_address(ptrs_ptr, starts_ptr, n_pages, i, m, slots_ptr, offs_ptr, ety, C, PER, HAS_OFF, N_ITER):
    row = i // (PER * C)
    rem = i % (PER * C)
    slot = tl.load(slots_ptr + row, mask=m, other=0)
    page, start = page_of(starts_ptr, n_pages, slot, m, N_ITER)
    base = page_base(ptrs_ptr, page, m, ety)
    if HAS_OFF:
        voxel = tl.load(offs_ptr + row, mask=m, other=0)
    else:
        voxel = rem // C
    return base + ((slot - start) * 64 + voxel) * C + rem % C


@triton.jit(do_not_specialize=["n_pages", "total"])  # sizes vary per frame: no recompiles
def _paged_kernel(
    ptrs_ptr, starts_ptr, n_pages, slots_ptr, offs_ptr, buf_ptr, total,
    C: tl.constexpr, PER: tl.constexpr, HAS_OFF: tl.constexpr, SCATTER: tl.constexpr,
    N_ITER: tl.constexpr, BLOCK: tl.constexpr, BCAST: tl.constexpr = False,
):  # fmt: skip
    """Gather (pool -> ``buf``) or, with ``SCATTER``, scatter (``buf`` -> pool), one element per lane; with
    ``BCAST`` the scatter writes the ``C`` values of ``buf`` into every (slot, voxel) (a fill)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < total
    ety = buf_ptr.dtype.element_ty
    addr = _element_address(
        ptrs_ptr, starts_ptr, n_pages, i, m, slots_ptr, offs_ptr, ety, C, PER, HAS_OFF, N_ITER
    )
    if SCATTER:
        if BCAST:
            tl.store(addr, tl.load(buf_ptr + i % C, mask=m), mask=m)
        else:
            tl.store(addr, tl.load(buf_ptr + i, mask=m), mask=m)
    else:
        tl.store(buf_ptr + i, tl.load(addr, mask=m), mask=m)


def n_iter(n_pages: int) -> int:
    # a power-of-two bucket of the page count: few compiled variants as the pool grows
    return max(1, (max(1, n_pages) - 1).bit_length() + 1)


def n_iter_frame(n_pages: int) -> int:
    """Search steps of the frame path's kernels: one bucket up to 2^15 pages (masked steps are cheap in the
    rolled loop), so a growing pool compiles no new variant mid-stream."""
    return max(16, n_iter(n_pages))


def _launch(ptrs, starts, slots, offsets, buf: torch.Tensor, scatter: bool) -> None:
    n = slots.numel()
    total = buf.numel()
    if n == 0 or total == 0:
        return
    per = 1 if offsets is not None else 64
    block = 256
    sl = slots.to(torch.int64).contiguous()
    of = sl if offsets is None else offsets.to(torch.int64).contiguous()
    _paged_kernel[(triton.cdiv(total, block),)](
        ptrs, starts, ptrs.numel(), sl, of, buf, total, C=total // (n * per), PER=per,
        HAS_OFF=offsets is not None, SCATTER=scatter, N_ITER=n_iter_frame(ptrs.numel()), BLOCK=block,
    )  # fmt: skip


def paged_gather(ptrs, starts, slots, offsets, dtype, trailing: tuple[int, ...]) -> torch.Tensor:
    """Values at (slot, offset) pairs (``[M, *C]``) or whole bricks (``[M, 64, *C]``) when ``offsets`` is
    None. ``ptrs``/``starts``: the pool's page table and page-start table (``[P]``, ``[P + 1]``)."""
    shape = (slots.numel(), *(() if offsets is not None else (64,)), *trailing)
    out = torch.empty(shape, dtype=dtype, device=slots.device)
    _launch(ptrs, starts, slots, offsets, out, scatter=False)
    return out


def paged_fill(ptrs, starts, slots, value: torch.Tensor) -> None:
    """Set every voxel of the bricks ``slots`` to ``value`` (the field's dtype, ``[C]``, on the device): one
    launch, no ``[M, 64, C]`` buffer."""
    n = slots.numel()
    c = value.numel()
    if n == 0:
        return
    total = n * 64 * c
    block = 256
    sl = slots.to(torch.int64).contiguous()
    _paged_kernel[(triton.cdiv(total, block),)](
        ptrs, starts, ptrs.numel(), sl, sl, value.contiguous(), total, C=c, PER=64, HAS_OFF=False,
        SCATTER=True, N_ITER=n_iter_frame(ptrs.numel()), BLOCK=block, BCAST=True,
    )  # fmt: skip


def paged_scatter(ptrs, starts, slots, offsets, values: torch.Tensor) -> None:
    """Write ``values`` (already in the field's dtype, ``[M, *C]`` or ``[M, 64, *C]``) at the pairs."""
    _launch(ptrs, starts, slots, offsets, values.contiguous(), scatter=True)

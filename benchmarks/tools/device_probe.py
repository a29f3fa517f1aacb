"""Probe Triton features on the GPU machine that later kernels rely on (int -> pointer casts)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged(table_ptr, idx_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    slot = tl.load(idx_ptr + offs, mask=m, other=0)
    base = tl.load(table_ptr + (slot >> 4), mask=m, other=0).to(tl.pointer_type(tl.float32))
    tl.store(out_ptr + offs, tl.load(base + (slot & 15), mask=m, other=0.0), mask=m)


def main():
    pages = [torch.arange(16, dtype=torch.float32, device="cuda") + 100 * p for p in range(3)]
    table = torch.tensor([p.data_ptr() for p in pages], dtype=torch.int64, device="cuda")
    idx = torch.tensor([0, 5, 17, 33, 47], dtype=torch.int64, device="cuda")
    out = torch.empty(5, device="cuda")
    _paged[(1,)](table, idx, out, 5, BLOCK=8)
    print("paged pointer cast:", out.tolist() == [0.0, 5.0, 101.0, 201.0, 215.0], out.tolist())


if __name__ == "__main__":
    main()

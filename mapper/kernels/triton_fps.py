"""Triton kernel behind :func:`mapper.kernels.fps.farthest_point_sample_triton` (imported lazily).

One launch per sample. Program ``p`` owns chunks ``p*G .. p*G+G-1`` (``[G, B]`` points): it reads the
previous sample from ``best[it - 1]`` (a key: the index is its low 32 bits), skips the chunks whose box
lower bound is at least their max distance (masked loads: skipped chunks cost no point traffic), updates the
others, stores their new keys and folds the max over its chunks into ``best[it]`` with one ``atomic_max``.
The next launch reads ``best[it]``: no host sync. The iteration number is ``base[0] + k`` so that a block
of launches can be captured once as a CUDA graph and replayed (``base`` advances by the block length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW32 = tl.constexpr(0xFFFFFFFF)


@triton.jit(do_not_specialize=["k"])
def _fps_step_kernel(
    p_ptr,  # float32 [N, 3] points (original order)
    s_ptr,  # float32 [NC * B, 3] points in chunk order
    low_ptr,  # int64 [NC * B] 2^32 - 1 - original index (-1: padding)
    dist_ptr,  # float32 [NC * B] current min squared distance
    lo_ptr,  # float32 [NC, 3] chunk boxes
    hi_ptr,
    ckey_ptr,  # int64 [NC] chunk keys
    best_ptr,  # int64 [M] sample keys
    base_ptr,  # int64 [1] iteration base
    k,
    n_chunks,
    B: tl.constexpr,
    G: tl.constexpr,
    PRUNE: tl.constexpr,
):
    it = tl.load(base_ptr) + k
    low = tl.full([], _LOW32, tl.int64)
    q = low - (tl.load(best_ptr + it - 1) & low)
    qx = tl.load(p_ptr + q * 3 + 0)
    qy = tl.load(p_ptr + q * 3 + 1)
    qz = tl.load(p_ptr + q * 3 + 2)
    c = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    cm = c < n_chunks
    kold = tl.load(ckey_ptr + c, mask=cm, other=-1)
    if PRUNE:
        dmax = (kold >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        lox = tl.load(lo_ptr + c * 3 + 0, mask=cm, other=0.0)
        loy = tl.load(lo_ptr + c * 3 + 1, mask=cm, other=0.0)
        loz = tl.load(lo_ptr + c * 3 + 2, mask=cm, other=0.0)
        hix = tl.load(hi_ptr + c * 3 + 0, mask=cm, other=0.0)
        hiy = tl.load(hi_ptr + c * 3 + 1, mask=cm, other=0.0)
        hiz = tl.load(hi_ptr + c * 3 + 2, mask=cm, other=0.0)
        gx = tl.maximum(tl.maximum(lox - qx, qx - hix), 0.0)
        gy = tl.maximum(tl.maximum(loy - qy, qy - hiy), 0.0)
        gz = tl.maximum(tl.maximum(loz - qz, qz - hiz), 0.0)
        lb = gx * gx + gy * gy + gz * gz
        act = cm & (lb < dmax)
    else:
        act = cm
    j = c[:, None] * B + tl.arange(0, B)[None, :]
    am = act[:, None] & (j >= 0)
    x = tl.load(s_ptr + j * 3 + 0, mask=am, other=0.0)
    y = tl.load(s_ptr + j * 3 + 1, mask=am, other=0.0)
    z = tl.load(s_ptr + j * 3 + 2, mask=am, other=0.0)
    dx = x - qx
    dy = y - qy
    dz = z - qz
    dd = dx * dx + dy * dy + dz * dz
    dn = tl.minimum(tl.load(dist_ptr + j, mask=am, other=0.0), dd)
    tl.store(dist_ptr + j, dn, mask=am)
    lowidx = tl.load(low_ptr + j, mask=am, other=-1)
    key = (dn.to(tl.int32, bitcast=True).to(tl.int64) << 32) | lowidx  # -1 for padding
    knew = tl.where(act, tl.max(key, axis=1), kold)
    tl.store(ckey_ptr + c, knew, mask=act)
    tl.atomic_max(best_ptr + it, tl.max(knew, axis=0))


def fps_loop(p: torch.Tensor, ch, best: torch.Tensor, chunks_per_program: int, prune: bool, graph_iters: int):
    """Fill ``best[1:]`` (``best[0]`` holds the start) with the sample keys: ``m - 1`` launches."""
    m = best.numel()
    g = int(chunks_per_program)
    grid = (triton.cdiv(ch.n, g),)
    base = torch.zeros(1, dtype=torch.int64, device=p.device)

    def step(k: int) -> None:
        _fps_step_kernel[grid](
            p,
            ch.xyz,
            ch.low,
            ch.dist,
            ch.lo,
            ch.hi,
            ch.key,
            best,
            base,
            k,
            ch.n,
            B=ch.size,
            G=g,
            PRUNE=prune,
            enable_fp_fusion=False,
        )

    done = 0
    if graph_iters and p.device.type == "cuda" and m - 1 >= 2 * graph_iters:
        step(1)  # compile outside the capture (iteration 1)
        base += 1
        done = 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # captured on a side stream, not run
            for k in range(1, graph_iters + 1):
                step(k)
            base.add_(graph_iters)
        reps = (m - 1 - done) // graph_iters
        for _ in range(reps):
            graph.replay()
        done += reps * graph_iters  # base == done now
    for k in range(1, m - done):
        step(k)

"""Exact 1-D squared-distance transform of lines: the lower envelope of parabolas (Felzenszwalb-Huttenlocher).

For every line ``l`` (slots ``start[l] .. start[l] + length[l] - 1`` of a flat float32 array ``f``) and
every slot ``p`` of it::

    g[p] = min over slots q of the line of  fl(f[q] + fl32((p - q)^2))

(``f[q] = inf``: no parabola). Slots outside every line read ``inf``. Work: ``O(length)`` per line, whatever
the distances (the min-plus window it replaces cost ``O(length * window)``).

**Bits.** The result equals the brute-force minimum of the float32 candidates, bit for bit: the envelope
is built with exact decisions in the normal case (below), the winner ``q*`` at ``p`` has the smallest
exact value ``f[q*] + (p - q*)^2``, and rounding is monotone, so ``fl(f[q*] + d*^2)`` is the smallest
rounded candidate. ``(p - q)^2`` is exact in float32 up to ``|p - q| = 4096``.

**Building the envelope.** Parabolas are pushed in slot order; the top ``v`` (with ``u`` below it) is
popped when the new ``q`` makes it useless: ``s(q, v) <= s(v, u)`` (``s``: where two parabolas cross).
Division-free and translation-invariant, with ``a = q - v``, ``b = v - u``::

    T = ((b * f[q] + a * f[u]) - (a + b) * f[v]) + a * b * (a + b) <= 0

in float64: every product is exact (a float32 times an integer below 2^29), so a fused multiply-add
gives the same bits and the Triton kernel decides exactly as the reference; only the three additions
round (a wrong decision needs ``|T|`` below 1e-16 of its terms: an exact tie, where either choice gives
the same values, or a near tie of ~1e-16 relative, below float32's resolution of the values).

**Reading it.** Entry ``k`` of the envelope takes over from entry ``k - 1`` at the first integer ``p``
where its rounded value is ``<=`` (:func:`takeover`); the entry at ``p`` is the last one whose takeover
points up to it are all ``<= p`` (in exact arithmetic the takeovers increase; rounding cannot make the
two implementations differ: the kernel walks a pointer, the reference searches the running maximum).

* :func:`lower_envelope_torch` - reference, vectorised over the lines (lines grouped by length, one
  host step per slot of the longest line of a group to build the envelopes, then one search); the CPU
  path.
* :func:`mapper.kernels.triton_envelope.lower_envelope_triton` - one Triton program per 32 lines.
* :func:`lower_envelope` - dispatch (``mapper.kernels.dispatch.kernel``).
* :func:`window_min_torch` - the same minimum over the slots within ``window`` of ``p`` only (min-plus
  rounds, ``O(length * window)``, a few large vectorised ops per round: on the CPU cheaper than the
  envelope's host loop while the window is short).
* :func:`distance_pass` - what the ESDF calls: exact below ``(window + 1)^2`` (both forms agree there
  bit for bit, and both are ``>= (window + 1)^2`` elsewhere, ``f >= 0``); the Triton envelope where
  Triton runs, else the cheaper torch form by the expected work.
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from .dispatch import kernel, triton_twin, use_triton

BATCH_SLOTS = 1 << 18  # slots per batch of lines in the torch reference (its temporaries: ~100 B a slot)
# The torch envelope costs about as much per slot as this many min-plus pairs (p, p + d) per slot, or more
# (measured on the CPU with the block min-plus, benchmarks/bench_esdf_cpu.py: the envelope ~0.3-1.3 us a
# slot, a min-plus pair ~1-2.5 ns; the min-plus still 2.7x cheaper at 322 pairs a slot): :func:`distance_pass`
# takes the rounds while they need fewer.
MINPLUS_PAIRS_PER_SLOT = 256


def _check(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor):
    if f.dtype != torch.float32 or f.dim() != 1:
        raise InvalidArgumentType(f"f: expected a float32 [P] tensor, got {f.dtype} {list(f.shape)}")
    for name, t in (("start", start), ("length", length)):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise InvalidArgumentType(
                f"{name}: expected an int32/int64 [L] tensor, got {t.dtype} {list(t.shape)}"
            )
    if start.shape != length.shape:
        raise InvalidArgument(f"start {list(start.shape)} and length {list(length.shape)} differ")


def lower_envelope(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The exact 1-D squared-distance transform of each line (see the module docstring).

    Args:
        f: float32 ``[P]`` values (``inf``: none), any device.
        start: int32/int64 ``[L]`` first slot of each line; ``length``: same, slots per line (``>= 0``);
            the lines must not overlap and must lie inside ``f``.
    Returns:
        float32 ``[P]`` on ``f``'s device: ``g`` on the lines' slots, ``inf`` elsewhere.
    """
    _check(f, start, length)
    return kernel(f.device, lower_envelope_torch, "triton_envelope:lower_envelope_triton")(f, start, length)


def lower_envelope_torch(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Same Args/Returns as :func:`lower_envelope`; pure torch (host loop over the slots of a line)."""
    _check(f, start, length)
    out = torch.full_like(f, math.inf)
    if start.numel() == 0 or f.numel() == 0:
        return out
    length = length.to(torch.int64)
    start = start.to(torch.int64)
    # groups of lines of similar length (in (2^(g-1), 2^g]), longest first within a group
    group = torch.ceil(torch.log2(length.clamp(min=1).to(torch.float64))).to(torch.int64)
    group = torch.where(length > 0, group, torch.full_like(group, -1))
    for g in torch.unique(group).tolist():
        if g < 0:
            continue
        idx = (group == g).nonzero().squeeze(1)
        idx = idx[torch.argsort(length[idx], descending=True, stable=True)]
        step = max(BATCH_SLOTS >> g, 1)  # lines per batch: bounded temporaries
        for b in range(0, idx.numel(), step):
            sel = idx[b : b + step]
            _envelope_lines(f, out, start[sel], length[sel])
    return out


def takeover(sv: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """First integer ``p`` where stack entry ``k`` (slot ``sv[..., k]``, value ``sf[..., k]``) is at least as
    low as entry ``k - 1`` (float32 values, as the result), for ``k >= 1``: int64 ``[..., K - 1]``.

    ``s`` = their crossing in float64 and ``c = ceil(s)``; the rounded comparison is monotone in ``p`` and
    first holds at ``c - 1``, ``c`` or ``c + 1`` (the same expressions in the Triton kernel)."""
    v0, v1 = sv[..., :-1], sv[..., 1:]
    f0, f1 = sf[..., :-1], sf[..., 1:]
    num = (f1.to(torch.float64) - f0.to(torch.float64)) + (v1 * v1 - v0 * v0).to(torch.float64)
    den = (2 * (v1 - v0)).to(torch.float64)
    ok = v1 > v0
    c = torch.ceil(torch.where(ok, num / torch.where(ok, den, 1.0), 0.0)).clamp(-(1 << 40), 1 << 40)
    c = c.to(torch.int64)

    def lower(p):
        d1, d0 = p - v1, p - v0
        return f1 + (d1 * d1).to(torch.float32) <= f0 + (d0 * d0).to(torch.float32)

    t = torch.where(lower(c), c, c + 1)
    return torch.where(lower(c - 1), c - 1, t)


def _envelope_lines(f, out, start, length) -> None:
    """Lines ``start``/``length`` (int64 ``[L]``, decreasing lengths) of ``f`` -> their slots of ``out``."""
    dev = f.device
    nl = start.numel()
    n = int(length[0])
    ar = torch.arange(n, device=dev)
    valid = ar[None, :] < length[:, None]
    pos = torch.where(valid, start[:, None] + ar[None, :], 0)
    vals = torch.where(valid, f[pos], math.inf)  # [L, n]
    # lines still running at step q: a prefix (lengths decrease)
    running = torch.searchsorted(-length, -ar, side="left").tolist()  # lines longer than q
    sv = torch.zeros((nl, n), dtype=torch.int64, device=dev)  # stack: slot offsets in the line
    sf = torch.zeros((nl, n), dtype=torch.float32, device=dev)  # stack: their values
    top = torch.full((nl,), -1, dtype=torch.int64, device=dev)
    for q in range(n):
        m = running[q]
        fq = vals[:m, q]
        push = ~torch.isinf(fq)
        if not bool(push.any()):
            continue
        fq64 = fq.to(torch.float64)
        tp, svm, sfm = top[:m], sv[:m], sf[:m]
        while True:
            at = torch.stack((tp - 1, tp), dim=1).clamp_(min=0)
            uv, fuv = svm.gather(1, at), sfm.gather(1, at).to(torch.float64)
            u, v = uv[:, 0], uv[:, 1]
            a, b = q - v, v - u
            t = ((b * fq64 + a * fuv[:, 0]) - (a + b) * fuv[:, 1]) + (a * b * (a + b)).to(torch.float64)
            pop = push & (tp >= 1) & (t <= 0)
            if not bool(pop.any()):
                break
            tp -= pop.to(torch.int64)
        tp += push.to(torch.int64)
        r = push.nonzero().squeeze(1)
        svm[r, tp[r]] = q
        sfm[r, tp[r]] = fq[r]
    # the envelope's entry at p: the last k whose takeover (made non-decreasing) is <= p
    t = takeover(sv, sf)
    t = torch.where(torch.arange(1, n, device=dev)[None, :] <= top[:, None], t, 1 << 62)
    t = torch.cummax(t, dim=1)[0].contiguous()
    k = torch.searchsorted(t, ar[None, :].expand(nl, n).contiguous(), right=True)
    d = ar[None, :] - sv.gather(1, k)
    res = torch.where(top[:, None] >= 0, sf.gather(1, k) + (d * d).to(torch.float32), math.inf)
    out[pos[valid]] = res[valid]


def window_min_torch(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor, window: int) -> torch.Tensor:
    """``g[p] = min over slots q of p's line with |p - q| <= window of fl(f[q] + (p - q)^2)`` (pure torch).

    Same arguments and result layout as :func:`lower_envelope` (``inf`` outside the lines), plus
    ``window >= 0``. Each candidate is the same float32 sum as the envelope's, so where the nearest-in-value
    candidate lies within the window the two are equal bit for bit; with ``f >= 0`` that holds wherever
    either result is below ``(window + 1)^2``. Work: per distinct line length ``n``, ``min(window, n - 1)``
    rounds of four vectorised ops over the lines of that length (a ``[lines, n]`` block; no host loop over
    lines or slots, lines without a finite value skipped).
    """
    _check(f, start, length)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise InvalidArgument(f"window: expected an int >= 0, got {window!r}")
    out = torch.full_like(f, math.inf)
    if start.numel() == 0 or f.numel() == 0:
        return out
    dev = f.device
    length = length.to(torch.int64)
    start = start.to(torch.int64)
    # lines of one length side by side as the rows of a [lines, n] block: round d is two shifted adds and
    # two minimums over the block (no per-slot masks, no line bookkeeping); rows that hold no finite value
    # stay inf and are skipped; blocks of ~BATCH_SLOTS slots (bounded temporaries, cache-sized)
    ns, counts = torch.unique(length, return_counts=True)
    order = torch.argsort(length, stable=True)
    ends = torch.cumsum(counts, 0).tolist()
    for n, e, cnt in zip(ns.tolist(), ends, counts.tolist(), strict=True):
        if n <= 0:
            continue
        lines = start[order[e - cnt : e]]
        ar = torch.arange(n, device=dev)
        rounds = min(window, n - 1)
        step = max(BATCH_SLOTS // n, 1)
        s0 = int(lines.min())
        block = int(lines.max()) - s0 == (cnt - 1) * n  # non-overlapping lines: they tile [s0, s0 + cnt n)
        for b in range(0, cnt, step):
            dst = None
            if block:  # a [lines, n] view of f (rows in slot order: each row is a line, any order will do)
                sl = slice(s0 + b * n, s0 + min(b + step, cnt) * n)
                c, dst = f[sl].view(-1, n), out[sl].view(-1, n)
            else:
                idx = lines[b : b + step, None] + ar[None, :]
                c = f[idx]
            act = None
            if rounds:
                act = (c < math.inf).any(dim=1)
                if bool(act.all()):
                    act = None
                else:
                    c = c[act]
                    if c.shape[0] == 0:
                        continue
                g = c.clone()
                tmp = torch.empty_like(c)
                for d in range(1, rounds + 1):
                    sq = float(d * d)  # exact in float32 for d <= 4096
                    k = n - d
                    t = torch.add(c[:, d:], sq, out=tmp[:, :k])  # q = p + d
                    torch.minimum(g[:, :k], t, out=g[:, :k])
                    t = torch.add(c[:, :k], sq, out=tmp[:, :k])  # q = p - d
                    torch.minimum(g[:, d:], t, out=g[:, d:])
                c = g
            if dst is None:
                out[idx if act is None else idx[act]] = c
            elif act is None:
                dst.copy_(c)
            else:
                dst[act] = c
    return out


def distance_pass(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor, window: int) -> torch.Tensor:
    """The ESDF's 1-D pass: :func:`lower_envelope` where values below ``(window + 1)^2`` must be exact
    (``f >= 0``; larger results may be any value ``>= (window + 1)^2``).

    Triton envelope where Triton runs (no host sync); otherwise :func:`window_min_torch` or
    :func:`lower_envelope_torch`, whichever is expected to cost less: on the CPU the envelope's host loop
    (one step per slot of the longest line) only wins for long windows over long lines.

    The expected work decides: the min-plus rounds cost one step per pair of slots ``(p, p + d)`` of a line
    with ``d <= window``; the envelope about ``MINPLUS_PAIRS_PER_SLOT`` of them per slot."""
    _check(f, start, length)
    if use_triton(f.device):
        return triton_twin("triton_envelope:lower_envelope_triton")(f, start, length)
    # values >= (window + 1)^2 only give results >= (window + 1)^2: as inf they leave the exact results as
    # they are, and lines holding nothing below the cap are skipped whole by the min-plus form
    f = f.masked_fill(f >= float((window + 1) ** 2), math.inf)
    n = length.to(torch.int64)
    r = torch.clamp(torch.clamp(n - 1, min=0), max=max(int(window), 0))  # rounds each line needs
    pairs = int((r * n - r * (r + 1) // 2).sum())
    if pairs <= MINPLUS_PAIRS_PER_SLOT * int(n.sum()):
        return window_min_torch(f, start, length, window)
    return lower_envelope_torch(f, start, length)

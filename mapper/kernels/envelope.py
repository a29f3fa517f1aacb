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

**Reading it.** A pointer walks the envelope as ``p`` grows and advances while the next parabola's
rounded value at ``p`` is ``<=`` the current one's (the envelope's parabolas take over in order).

* :func:`lower_envelope_torch` - reference, vectorised over the lines (lines grouped by length, one
  step per slot of the longest line of a group); the CPU path.
* :func:`mapper.kernels.triton_envelope.lower_envelope_triton` - one Triton program per 32 lines.
* :func:`lower_envelope` - dispatch (``mapper.kernels.dispatch.use_triton``).
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from .dispatch import use_triton


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
    if use_triton(f.device):
        from .triton_envelope import lower_envelope_triton

        return lower_envelope_triton(f, start, length)
    return lower_envelope_torch(f, start, length)


def lower_envelope_torch(f: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Same Args/Returns as :func:`lower_envelope`; pure torch (host loop over the slots of a line)."""
    _check(f, start, length)
    out = torch.full_like(f, math.inf)
    if start.numel() == 0 or f.numel() == 0:
        return out
    length = length.to(torch.int64)
    start = start.to(torch.int64)
    # groups of lines of similar length: lengths in (2^(g-1), 2^g]
    group = torch.ceil(torch.log2(length.clamp(min=1).to(torch.float64))).to(torch.int64)
    group = torch.where(length > 0, group, torch.full_like(group, -1))
    for g in torch.unique(group).tolist():
        if g < 0:
            continue
        idx = (group == g).nonzero().squeeze(1)
        _envelope_lines(f, out, start[idx], length[idx], int(length[idx].max()))
    return out


def _envelope_lines(f, out, start, length, n: int) -> None:
    """Lines ``start``/``length`` (int64 ``[L]``, lengths ``<= n``) of ``f`` -> their slots of ``out``."""
    dev = f.device
    nl = start.numel()
    rows = torch.arange(nl, device=dev)
    ar = torch.arange(n, device=dev)
    valid = ar[None, :] < length[:, None]
    pos = torch.where(valid, start[:, None] + ar[None, :], 0)
    vals = torch.where(valid, f[pos], math.inf)  # [L, n]
    sv = torch.zeros((nl, n), dtype=torch.int64, device=dev)  # stack: slot offsets in the line
    sf = torch.zeros((nl, n), dtype=torch.float32, device=dev)  # stack: their values
    top = torch.full((nl,), -1, dtype=torch.int64, device=dev)
    for q in range(n):
        fq = vals[:, q]
        push = ~torch.isinf(fq)
        if not bool(push.any()):
            continue
        fq64 = fq.to(torch.float64)
        while True:
            t1, t0 = top.clamp(min=0), (top - 1).clamp(min=0)
            v, u = sv[rows, t1], sv[rows, t0]
            a, b = q - v, v - u
            t = (
                (b * fq64 + a * sf[rows, t0].to(torch.float64)) - (a + b) * sf[rows, t1].to(torch.float64)
            ) + (a * b * (a + b)).to(torch.float64)
            pop = push & (top >= 1) & (t <= 0)
            if not bool(pop.any()):
                break
            top -= pop.to(torch.int64)
        top += push.to(torch.int64)
        at = top.clamp(min=0)
        sv[rows, at] = torch.where(push, q, sv[rows, at])
        sf[rows, at] = torch.where(push, fq, sf[rows, at])
    k = torch.zeros(nl, dtype=torch.int64, device=dev)
    res = torch.empty((nl, n), dtype=torch.float32, device=dev)

    def value(kk, p):
        d = p - sv[rows, kk]
        return sf[rows, kk] + (d * d).to(torch.float32)

    for p in range(n):
        while True:
            nxt = torch.minimum(k + 1, top.clamp(min=0))
            adv = (k < top) & (value(nxt, p) <= value(k, p))
            if not bool(adv.any()):
                break
            k += adv.to(torch.int64)
        res[:, p] = torch.where(top >= 0, value(k, p), math.inf)
    out[pos[valid]] = res[valid]

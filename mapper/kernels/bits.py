"""Bit helpers on 64-bit words held in int64 tensors (torch has no uint64 arithmetic).

A leaf mask is ``int64 [L, 8]``: word ``w`` is the plane ``i & 7 == w``; inside a word bit ``(j & 7) * 8 +
(k & 7)``. So bit ``n`` of the flattened 512-bit mask is exactly the NanoVDB offset ``n``.
"""

from __future__ import annotations

import torch

from .dispatch import kernel


def _s64(u: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return u - (1 << 64) if u >= (1 << 63) else u


K0 = _s64(0x0101010101010101)  # bits with k == 0
K7 = _s64(0x8080808080808080)  # bits with k == 7
J0 = _s64(0x00000000000000FF)  # bits with j == 0
J7 = _s64(0xFF00000000000000)  # bits with j == 7
ALL = -1

_M1 = _s64(0x5555555555555555)
_M2 = _s64(0x3333333333333333)
_M4 = _s64(0x0F0F0F0F0F0F0F0F)
_H01 = _s64(0x0101010101010101)


def lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 words by a constant ``0 < n < 64``."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Number of set bits of each int64 word (SWAR), int64, same shape."""
    x = x - ((x >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    return (x * _H01) >> 56


def leaf_counts(masks: torch.Tensor) -> torch.Tensor:
    """Active voxels per leaf: int64 ``[L]`` from int64 ``[L, 8]`` masks."""
    if masks.shape[0] == 0:
        return leaf_counts_torch(masks)
    return kernel(masks.device, leaf_counts_torch, "triton_ops:leaf_counts_triton")(masks)


def leaf_counts_torch(masks: torch.Tensor) -> torch.Tensor:
    return popcount64(masks).sum(dim=1)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    t = _BYTE_BITS.get(device)
    if t is None:
        v = torch.arange(256, dtype=torch.int64)
        t = ((v[:, None] >> torch.arange(8)) & 1).bool().to(device)
        _BYTE_BITS[device] = t
    return t


def unpack_bits(masks: torch.Tensor) -> torch.Tensor:
    """Leaf masks int64 ``[L, 8]`` -> bool ``[L, 512]`` (column = NanoVDB offset)."""
    n = masks.shape[0]
    if n == 0:
        return torch.zeros((0, 512), dtype=torch.bool, device=masks.device)
    by = masks.contiguous().view(torch.uint8).reshape(n, 64).to(torch.int64)
    return _byte_table(masks.device)[by].reshape(n, 512)


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool ``[L, 512]`` -> int64 ``[L, 8]`` leaf masks (inverse of :func:`unpack_bits`)."""
    n = bits.shape[0]
    if n == 0:
        return torch.zeros((0, 8), dtype=torch.int64, device=bits.device)
    w = _BIT_WEIGHTS.get(bits.device)
    if w is None:
        w = (1 << torch.arange(8, dtype=torch.int64)).to(torch.uint8).to(bits.device)
        _BIT_WEIGHTS[bits.device] = w
    by = (bits.reshape(n, 64, 8).to(torch.uint8) * w).sum(dim=2, dtype=torch.uint8)
    return by.contiguous().view(torch.int64).reshape(n, 8)


def low_bits(b: torch.Tensor) -> torch.Tensor:
    """int64 words with the bits below position ``b`` (int64 tensor in [0, 64)) set."""
    return (torch.ones_like(b) << b) - 1

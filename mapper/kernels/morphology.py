"""Dilation and erosion of leaf masks by shifting bits (NanoVDB style), one voxel per call.

Stencils (as ``scipy.ndimage.generate_binary_structure(3, c)``): 6 = faces, 18 = faces + edges,
26 = the 3x3x3 box. With ``Dx`` the 1-D dilation along axis ``x`` (a voxel and its two axis neighbours):

* box:   ``D26 = Di(Dj(Dk(M)))`` (separable);
* faces: ``D6  = Di(M) | Dj(M) | Dk(M)``;
* edges: ``D18 = Di(Dj(M)) | Dj(Dk(M)) | Di(Dk(M)) = Di(Dk(M) | Dj(M)) | Dj(Dk(M))``;

and erosion is the dual with ``&`` (``Ex(M) = M & shift+(M) & shift-(M)``), voxels outside the grid being
inactive. Every intermediate of a dilation is a subset of the result, so it is enough to evaluate the
passes on the output's leaves; every intermediate of an erosion is a subset of the input.

The torch reference here is also the CPU implementation; ``dilate_triton``/``erode_triton`` in
``morphology_triton.py`` have the same signature.
"""

from __future__ import annotations

import itertools

import torch

from .bits import ALL, J0, J7, K0, K7, lsr
from .keys import shift_leaf_keys
from .topology import Leaves, lookup_leaves, make_leaves

CONNECTIVITIES = (6, 18, 26)


def stencil_directions(connectivity: int) -> list[tuple[int, int, int]]:
    """The leaf directions a one-voxel dilation with this stencil can spill into."""
    dirs = []
    for d in itertools.product((-1, 0, 1), repeat=3):
        n = sum(abs(c) for c in d)
        if n == 0:
            continue
        if connectivity == 6 and n > 1:
            continue
        if connectivity == 18 and n > 2:
            continue
        dirs.append(d)
    return dirs


def spill_flags(masks: torch.Tensor, d: tuple[int, int, int]) -> torch.Tensor:
    """bool ``[L]``: leaf has an active voxel on the boundary facing leaf direction ``d``."""
    di, dj, dk = d
    if di == 1:
        w = masks[:, 7]
    elif di == -1:
        w = masks[:, 0]
    else:
        w = (
            masks[:, 0]
            | masks[:, 1]
            | masks[:, 2]
            | masks[:, 3]
            | masks[:, 4]
            | masks[:, 5]
            | masks[:, 6]
            | masks[:, 7]
        )
    sel = ALL
    if dj == 1:
        sel &= J7
    elif dj == -1:
        sel &= J0
    if dk == 1:
        sel &= K7
    elif dk == -1:
        sel &= K0
    return (w & sel) != 0


class _Neighbours:
    """Face-neighbour gathers over one sorted key set (absent neighbour = all-zero mask)."""

    def __init__(self, keys: torch.Tensor):
        self.keys = keys
        self._idx: dict[tuple[int, int, int], torch.Tensor] = {}

    def index(self, d):
        idx = self._idx.get(d)
        if idx is None:
            idx = lookup_leaves(self.keys, shift_leaf_keys(self.keys, d))
            self._idx[d] = idx
        return idx

    def gather(self, masks: torch.Tensor, d, word: int | None = None) -> torch.Tensor:
        idx = self.index(d)
        src = masks if word is None else masks[:, word]
        g = src[idx.clamp(min=0)]
        present = idx >= 0
        return torch.where(present[:, None] if word is None else present, g, torch.zeros_like(g))


def _pass_k(M, nb: _Neighbours, erode: bool):
    lo = lsr(nb.gather(M, (0, 0, -1)), 7) & K0  # k-1 leaf's k=7 plane -> our k=0
    hi = (nb.gather(M, (0, 0, 1)) << 7) & K7  # k+1 leaf's k=0 plane -> our k=7
    up = ((M << 1) & ~K0) | lo  # voxel at k-1 (shifted +k)
    dn = (lsr(M, 1) & ~K7) | hi  # voxel at k+1 (shifted -k)
    return M & up & dn if erode else M | up | dn


def _pass_j(M, nb: _Neighbours, erode: bool):
    lo = lsr(nb.gather(M, (0, -1, 0)), 56)
    hi = nb.gather(M, (0, 1, 0)) << 56
    up = (M << 8) | lo
    dn = lsr(M, 8) | hi
    return M & up & dn if erode else M | up | dn


def _pass_i(M, nb: _Neighbours, erode: bool):
    lo = nb.gather(M, (-1, 0, 0), word=7)
    hi = nb.gather(M, (1, 0, 0), word=0)
    ext = torch.cat((lo[:, None], M, hi[:, None]), dim=1)
    up, dn = ext[:, 0:8], ext[:, 2:10]
    return M & up & dn if erode else M | up | dn


def _apply_stencil(M: torch.Tensor, nb: _Neighbours, connectivity: int, erode: bool) -> torch.Tensor:
    comb = torch.bitwise_and if erode else torch.bitwise_or
    if connectivity == 26:
        return _pass_i(_pass_j(_pass_k(M, nb, erode), nb, erode), nb, erode)
    x = _pass_k(M, nb, erode)
    y = _pass_j(M, nb, erode)
    if connectivity == 6:
        return comb(comb(x, y), _pass_i(M, nb, erode))
    return comb(_pass_i(comb(x, y), nb, erode), _pass_j(x, nb, erode))


def dilate_torch(leaves: Leaves, connectivity: int) -> Leaves:
    """One-voxel dilation. Output leaves: the input's plus every neighbour a boundary voxel spills into."""
    keys, masks = leaves.keys, leaves.masks
    if keys.numel() == 0:
        return leaves
    new = []
    for d in stencil_directions(connectivity):
        f = spill_flags(masks, d)
        cand = shift_leaf_keys(keys[f], d)
        new.append(cand[lookup_leaves(keys, cand) < 0])
    new_keys = torch.unique(torch.cat(new))
    out_keys, order = torch.sort(torch.cat((keys, new_keys)))
    M = torch.zeros((out_keys.numel(), 8), dtype=torch.int64, device=keys.device)
    M[torch.argsort(order)[: keys.numel()]] = masks  # positions of the input leaves in the output
    out = _apply_stencil(M, _Neighbours(out_keys), connectivity, erode=False)
    return make_leaves(out_keys, out)


def erode_torch(leaves: Leaves, connectivity: int) -> Leaves:
    """One-voxel erosion: a voxel stays iff every stencil neighbour is active."""
    if leaves.keys.numel() == 0:
        return leaves
    out = _apply_stencil(leaves.masks, _Neighbours(leaves.keys), connectivity, erode=True)
    return make_leaves(leaves.keys, out, drop_empty=True)

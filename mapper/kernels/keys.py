"""Every key format and coordinate range of the map: one module owns them all.

**Voxel keys** (the integrators' aggregation and de-duplication keys, the brick walk's keys): a voxel or
brick ``(i, j, k)`` packs into one int64 as ``(i + B) << 42 | (j + B) << 21 | (k + B)`` with
``VOXEL_KEY_BITS = 21`` bits per axis and bias ``B = VOXEL_KEY_BIAS = 2^20``; sorting keys sorts
coordinates i-major. Coordinates within ``+-VOXEL_KEY_LIMIT`` (``2^20``) pack; the map keeps voxel
coordinates inside ``[-COORD_LIMIT_VOX, COORD_LIMIT_VOX)`` with ``COORD_LIMIT_VOX = 2^20 - 8`` (a margin of
one leaf, so neighbour arithmetic never leaves the packable range): :func:`in_key_range`. Bricks (``voxel >>
2``) whose voxels all lie in that range are ``[BRICK_LO, BRICK_HI)`` per axis; :func:`brick_keys` gives
``-1`` outside it.

**Leaf and tile keys** (the index grid). Layout (see NOTES.md, "Index grid"):

* a **voxel** ``(i, j, k)`` lies in **leaf** ``(i >> 3, j >> 3, k >> 3)`` (8^3 voxels) at the NanoVDB
  offset ``((i & 7) << 6) | ((j & 7) << 3) | (k & 7)``;
* a leaf ``(a, b, c)`` lies in **tile** ``(a >> 2, b >> 2, c >> 2)`` (4^3 leaves) at the position
  ``((a & 3) << 4) | ((b & 3) << 2) | (c & 3)``;
* a tile key packs the three tile coordinates, biased by ``TILE_BIAS``, in 19 bits each (i major);
* a leaf key is ``tile_key << 6 | position``.

Sorting leaves by leaf key orders them tile by tile, i-major inside a tile; that is the grid's
voxel-sequential order. Valid voxel coordinates lie in ``[-VOXEL_LIMIT, VOXEL_LIMIT)`` per axis; the bias
leaves a margin of one full range on each side, so neighbour arithmetic on keys never overflows.
"""

from __future__ import annotations

import torch

VOXEL_LIMIT = 1 << 22  # valid voxel coordinates: [-2^22, 2^22) per axis
TILE_AXIS_BITS = 19
TILE_BIAS = 1 << 18  # tile coordinates lie in [-2^17, 2^17); biased they sit mid-range of 19 bits
_AXIS_MASK = (1 << TILE_AXIS_BITS) - 1
LEAF_POS_BITS = 6
INVALID_KEY = -1  # no valid key is negative

# voxel keys (module docstring)
VOXEL_KEY_BITS = 21
VOXEL_KEY_BIAS = 1 << 20
VOXEL_KEY_LIMIT = 1 << 20  # packable: |v| < 2^20 (biased into [0, 2^21))
VOXEL_KEY_MASK = (1 << VOXEL_KEY_BITS) - 1
COORD_MARGIN_VOX = 8
COORD_LIMIT_VOX = VOXEL_KEY_LIMIT - COORD_MARGIN_VOX  # map voxel coordinates: [-2^20 + 8, 2^20 - 8)
BRICK_LO = -(1 << 18) + 2  # bricks whose voxels all lie in [-COORD_LIMIT_VOX, COORD_LIMIT_VOX): [LO, HI)
BRICK_HI = (1 << 18) - 2
# mesh keys (mapper.mesh.edge_keys / block_keys): a lattice edge packs signed i << 43 | (j + 2^20) << 22 |
# (k + 2^19) << 2 | axis (i, j: 21 bits, k: 20 bits); a mesh block (brick) packs like a voxel key
EDGE_IJ_BITS, EDGE_K_BITS = 21, 20
EDGE_IJ_BIAS, EDGE_K_BIAS = 1 << 20, 1 << 19
BLOCK_KEY_BITS, BLOCK_KEY_BIAS = VOXEL_KEY_BITS, VOXEL_KEY_BIAS


def encode_leaf_keys(leaf_ijk: torch.Tensor) -> torch.Tensor:
    """Leaf keys of leaf coordinates.

    Args:
        leaf_ijk: int64 ``[N, 3]`` leaf coordinates (voxel coordinates ``>> 3``), any device.
    Returns:
        int64 ``[N]`` keys, same device.
    """
    t = leaf_ijk >> 2
    tile = (
        ((t[:, 0] + TILE_BIAS) << (2 * TILE_AXIS_BITS))
        | ((t[:, 1] + TILE_BIAS) << TILE_AXIS_BITS)
        | (t[:, 2] + TILE_BIAS)
    )
    p = leaf_ijk & 3
    return (tile << LEAF_POS_BITS) | (p[:, 0] << 4) | (p[:, 1] << 2) | p[:, 2]


def decode_leaf_keys(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_leaf_keys`: int64 ``[N]`` keys -> int64 ``[N, 3]`` leaf coordinates."""
    tile = keys >> LEAF_POS_BITS
    ti = ((tile >> (2 * TILE_AXIS_BITS)) & _AXIS_MASK) - TILE_BIAS
    tj = ((tile >> TILE_AXIS_BITS) & _AXIS_MASK) - TILE_BIAS
    tk = (tile & _AXIS_MASK) - TILE_BIAS
    return torch.stack((ti * 4 + ((keys >> 4) & 3), tj * 4 + ((keys >> 2) & 3), tk * 4 + (keys & 3)), dim=1)


def shift_leaf_keys(keys: torch.Tensor, delta: tuple[int, int, int]) -> torch.Tensor:
    """Keys of the leaves at leaf offset ``delta`` from ``keys`` (int64 ``[N]``)."""
    c = decode_leaf_keys(keys)
    c = c + torch.tensor(delta, dtype=torch.int64, device=keys.device)
    return encode_leaf_keys(c)


def voxel_offsets(ijk: torch.Tensor) -> torch.Tensor:
    """NanoVDB in-leaf offsets of int64 ``[N, 3]`` voxel coordinates -> int64 ``[N]`` in ``[0, 512)``."""
    return ((ijk[:, 0] & 7) << 6) | ((ijk[:, 1] & 7) << 3) | (ijk[:, 2] & 7)


def in_range(ijk: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: voxel coordinates inside the representable range."""
    return ((ijk >= -VOXEL_LIMIT) & (ijk < VOXEL_LIMIT)).all(dim=1)


# ------------------------------------------------------------------------------------------ voxel keys
def _check_ijk(name: str, ijk: torch.Tensor) -> torch.Tensor:
    """int64 ``[M, 3]`` (int32 is widened); anything else raises (shape and dtype only: no host sync)."""
    if not isinstance(ijk, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(ijk).__name__}")
    if ijk.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected int64 (or int32) coordinates, got {ijk.dtype}")
    if ijk.dim() != 2 or ijk.shape[1] != 3:
        raise ValueError(f"{name}: expected shape [M, 3], got {list(ijk.shape)}")
    return ijk.to(torch.int64)


def voxel_keys(ijk: torch.Tensor) -> torch.Tensor:
    """int64 ``[M]`` keys of int64 ``[M, 3]`` voxel (or brick) coordinates with ``|v| < VOXEL_KEY_LIMIT``
    (callers filter with :func:`in_key_range`; values outside wrap, they are not checked here)."""
    b = _check_ijk("ijk", ijk) + VOXEL_KEY_BIAS
    return (b[:, 0] << (2 * VOXEL_KEY_BITS)) | (b[:, 1] << VOXEL_KEY_BITS) | b[:, 2]


def keys_to_ijk(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`voxel_keys`: int64 ``[M]`` keys -> int64 ``[M, 3]`` coordinates."""
    m = VOXEL_KEY_MASK
    b = VOXEL_KEY_BITS
    return torch.stack(((keys >> (2 * b)) & m, (keys >> b) & m, keys & m), dim=1) - VOXEL_KEY_BIAS


def unique_voxels(ijk: torch.Tensor, max_dense_cells: int = 1 << 26) -> torch.Tensor:
    """Sorted-by-key unique rows of int64 ``[M, 3]`` voxel/brick coordinates.

    When the set's bounding box is small (``<= max_dense_cells`` cells) the de-duplication scatters
    into a dense bitmap over the box (linear time); otherwise it sorts keys.
    """
    if ijk.shape[0] == 0:
        return ijk.reshape(0, 3)
    lo = ijk.min(dim=0).values
    ext = ijk.max(dim=0).values - lo + 1
    e0, e1, e2 = ext.tolist()  # one sync for the box
    n_cells = e0 * e1 * e2
    if n_cells <= max_dense_cells:
        rel = ijk - lo
        flat = (rel[:, 0] * e1 + rel[:, 1]) * e2 + rel[:, 2]
        seen = torch.zeros(n_cells, dtype=torch.bool, device=ijk.device)
        seen[flat] = True
        idx = seen.nonzero().squeeze(1)
        a = idx // (e1 * e2)
        r = idx % (e1 * e2)
        return torch.stack((a, r // e2, r % e2), dim=1) + lo
    return keys_to_ijk(torch.unique(voxel_keys(ijk)))


def in_key_range(ijk: torch.Tensor) -> torch.Tensor:
    """bool ``[M]``: voxel coordinates ``[M, 3]`` inside the map's range ``[-COORD_LIMIT_VOX,
    COORD_LIMIT_VOX)`` on every axis."""
    return ((ijk >= -COORD_LIMIT_VOX) & (ijk < COORD_LIMIT_VOX)).all(dim=-1)


def key_offsets(neighbourhood: int, device: torch.device) -> torch.Tensor:
    """int64 ``[8]`` (``{0, 1}^3``) or ``[27]`` (``{-1, 0, 1}^3``): the :func:`voxel_keys` increments of the
    neighbour voxels of a voxel (``key(v + d) = key(v) + key_offsets(d)`` inside the packable range)."""
    r = (0, 1) if neighbourhood == 8 else (-1, 0, 1)
    d = torch.tensor([(a, b, c) for a in r for b in r for c in r], dtype=torch.int64, device=device)
    return (d[:, 0] << (2 * VOXEL_KEY_BITS)) + (d[:, 1] << VOXEL_KEY_BITS) + d[:, 2]


def brick_keys(bricks: torch.Tensor) -> torch.Tensor:
    """int64 ``[M]`` keys (:func:`voxel_keys`) of int64/int32 ``[M, 3]`` brick coordinates; ``-1`` for
    bricks outside ``[BRICK_LO, BRICK_HI)``."""
    b = _check_ijk("bricks", bricks)
    ok = ((b >= BRICK_LO) & (b < BRICK_HI)).all(dim=1)
    c = b + VOXEL_KEY_BIAS
    k = (c[:, 0] << (2 * VOXEL_KEY_BITS)) | (c[:, 1] << VOXEL_KEY_BITS) | c[:, 2]
    return torch.where(ok, k, torch.full_like(k, -1))

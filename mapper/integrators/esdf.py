"""Euclidean signed distance field (ESDF): exact distances to the fused surface, updated incrementally.

**Surface points.** From the TSDF: the zero crossings between observed (weight > 0) 6-neighbour voxels
whose values have opposite sign (positive = ``tsdf > 0``, as :func:`mapper.surface.zero_crossings`), at
``t = a / (a - b)`` along the edge between the two voxel centres. A crossing is filed under the edge
endpoint it is nearest to (``t <= 0.5``: the lower one), so it lies on a line of voxel centres within
half a voxel of its voxel, a **site voxel** (up to six crossings, one per edge direction). Without a TSDF
layer the occupied voxels (``log_odds > 0``) of the occupancy layer are the site voxels and their centres
the points.

**Value.** ``esdf = sign * min(max_distance, s * |x - p*|)`` with ``p*`` the crossing nearest to the
voxel centre ``x``: the exact Euclidean distance to the point set (float32 rounding aside), computed by
an exact separable transform, not by a path-length propagation. Every voxel of the layer farther than
``max_distance`` from every crossing holds exactly ``max_distance`` (float32) with its sign.

**Sign and observed.** Where the TSDF observed the voxel: its sign (``tsdf <= 0`` is inside, negative);
else where the occupancy layer knows it: occupied (``log_odds > 0``) is negative, free positive; else
positive. ``observed`` = TSDF weight > 0 or occupancy log-odds not NaN (nothing else is ever observed).

**Domain.** Let ``M = floor(max_distance / s + 1/2) + 1`` voxels: a crossing within ``max_distance`` of
``x`` has its site voxel within ``M - 1`` of ``x`` along every axis (the extra voxel keeps float
rounding at the cut-off from ever mattering). The layer holds the bricks within ``Rb = ceil(M / 4)``
bricks (box) of a brick with a site voxel: every voxel within ``M`` of a site voxel (``(c + M) >> 2 <=
(c >> 2) + ceil(M / 4)``). Bricks that leave the domain are freed; an empty layer gives its pages back.

**Transform.** Crossings on the lines along axis ``a`` form orientation ``a``. For each orientation: a
1-D pass along ``a`` (nearest crossing on the line, by a cumulative max/min of the nearest voxel with a
crossing on each side) followed by exact 1-D squared-distance passes ``g(p) = min_q f(q) + (p - q)^2``
along the other two axes, computed as the lower envelope of parabolas (Felzenszwalb-Huttenlocher,
:mod:`mapper.kernels.envelope`: ``O(n)`` per line of ``n`` voxels, a Triton kernel on CUDA); the result
is the minimum over the orientations. Orientations k and j share their last pass: k, j(k) + j, k(j),
i(min) + i, j(i), k(i): 3 line passes and 5 envelope passes (1 and 2 for an occupancy map, whose centres
are k-line points). Each pass lays the voxels out line by line (bricks sorted by the two other axes, each
run of ``n`` consecutive bricks giving 16 lines of ``4 n`` voxels). Work: ``O(N)`` per pass for ``N``
voxels, whatever the max distance; on the CPU the envelope passes run only on the bricks the stored ones
need (the stored bricks grown by ``Rb`` along the passes still to come, see :func:`squared_distances`), on
CUDA on the whole domain (fewer host ops; the same values).

**Working memory.** The line passes read the crossings through one int32 voxel -> site index and run in
chunks of whole brick runs (``CPU_ROWS`` / ``CUDA_ROWS`` slots; on CUDA the Triton line kernel of
:mod:`mapper.kernels.linemin`, no temporaries). A change of more than ``tile_bricks`` ESDF bricks (a cold
map, a backlog) and a cold ``recompute`` of a large map run in groups of whole ``2^TILE_SHIFT``-brick
tiles, each with its own regions (below), so the working set follows a group, not the map; each group is
exact, so the result is the one-pass result bit for bit.

**Incremental == cold**, bit for bit: a value depends only on the crossings whose site voxels lie within
``M`` (box) of the voxel, on the voxel's own source values, and on intermediate values on the lines
between the two, which are inside that box; every float is formed element-wise from the same operands
(integer slot differences, never absolute positions), and minima are exact (an envelope pass returns the
exact minimum of the float32 candidates of its line; a line cut shorter by the domain loses only candidates
farther than ``M``, whose values clamp to the max distance either way). ``update`` recomputes the
bricks that a change can reach with everything they need (see the margins in ``update``).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from ..grid import IndexGrid
from ..kernels.envelope import distance_pass
from ..kernels.keys import VOXEL_KEY_BITS
from ..kernels.linemin import index_dtype as _index_dtype
from ..kernels.linemin import line_min as _line_min
from ..kernels.linemin import nearest_marked as _nearest_marked  # noqa: F401 - tests compare its forms
from ..layers import BrickLayer, FieldSpec, brick_in_leaf, brick_local_coords, brick_offsets
from .common import keys_to_ijk, voxel_keys

log = logging.getLogger(__name__)

CPU_ROWS = 1 << 17  # slots per chunk of a line pass on the CPU (int32: 512 KB per array)
CUDA_ROWS = 1 << 23  # slots per chunk of a line pass on CUDA (~100 B of temporaries a slot)
CPU_BRICKS = 1 << 11  # bricks per chunk for site extraction and distances on the CPU
SUBSET_PASSES_CUDA = False  # CUDA: envelope passes on the stored bricks' subsets (True) or the domain
TILE_BRICKS = 1 << 18  # ESDF bricks of change (dirty or, cold, candidate) recomputed in one pass at most
TILE_SHIFT = 4  # tiles of 16^3 bricks: the unit a large change is grouped by
# coarse ESDF: fine crossings whose positive side reads >= this many fine voxels are no surface point (an
# SDF changes by <= 1 voxel between neighbours; the truncation, 3 voxels by default, is what a free-space
# voxel next to an occluded negative one reads where views merge)
FRONT_MAX_VOX = 2.5
DENSE_CELLS = 1 << 25  # largest bounding box (bricks) that brick-set dilation maps densely (64 MiB fp16)


def esdf_fields(max_distance_m: float) -> dict[str, FieldSpec]:
    """Per-voxel storage: float32 signed distance (metres) and a bool observed flag (5 B/voxel)."""
    return {"esdf": FieldSpec(torch.float32, (), max_distance_m), "observed": FieldSpec(torch.bool, (), 0)}


def _cuda_path(device: torch.device) -> bool:
    """Whether the update takes the CUDA path's choices (one chunk per pass, dense brick sets, prefix
    counts): on CUDA; ``benchmarks/tools/count_esdf_ops.py`` switches it on to count that path's ops on
    the CPU."""
    return device.type == "cuda"


def _chunks(n: int, device: torch.device, rows: int):
    step = n if _cuda_path(device) or n <= rows else rows
    for s in range(0, n, max(step, 1)):
        yield slice(s, min(s + step, n))


# ------------------------------------------------------------------------------------------ brick sets
def _unique_bricks(bricks: torch.Tensor) -> torch.Tensor:
    """Sorted (by key, i major) unique rows of int64 ``[M, 3]`` brick coordinates."""
    if bricks.shape[0] == 0:
        return bricks.reshape(0, 3)
    return keys_to_ijk(torch.unique(voxel_keys(bricks)))


def _member(query: torch.Tensor, sorted_keys: torch.Tensor) -> torch.Tensor:
    """bool ``[M]``: which int64 keys ``query`` occur in the sorted int64 ``sorted_keys``."""
    if sorted_keys.numel() == 0 or query.numel() == 0:
        return torch.zeros(query.shape, dtype=torch.bool, device=query.device)
    pos = torch.searchsorted(sorted_keys, query).clamp_(max=sorted_keys.numel() - 1)
    return sorted_keys[pos] == query


def _key_steps(device) -> torch.Tensor:
    """int64 ``[3]``: what a unit step along i / j / k adds to a voxel key (:func:`voxel_keys` is linear in
    the coordinates while they stay inside the key range, as every brick of a map and its margins do)."""
    b = VOXEL_KEY_BITS
    return torch.tensor([1 << (2 * b), 1 << b, 1], dtype=torch.int64, device=device)


def _dilate_axis(b: torch.Tensor, r: int, axis: int) -> torch.Tensor:
    """Unique int64 ``[M, 3]`` bricks grown by ``+-r`` along ``axis`` (union of merged intervals per line)."""
    u, v = (x for x in range(3) if x != axis)
    c = b[torch.argsort(voxel_keys(b[:, [u, v, axis]]))]
    ca = c[:, axis]
    new = torch.ones(c.shape[0], dtype=torch.bool, device=b.device)
    new[1:] = (c[1:, u] != c[:-1, u]) | (c[1:, v] != c[:-1, v]) | (ca[1:] - ca[:-1] > 2 * r + 1)
    first = new.nonzero().squeeze(1)
    last = torch.cat((first[1:] - 1, first.new_tensor([c.shape[0] - 1])))
    lo, hi = ca[first] - r, ca[last] + r
    length = hi - lo + 1
    seg = torch.repeat_interleave(torch.arange(first.numel(), device=b.device), length)
    start = torch.cumsum(length, 0) - length
    out = c[first][seg]
    out[:, axis] = torch.arange(seg.numel(), device=b.device) - start[seg] + lo[seg]
    return out


def _dense_sets(device: torch.device) -> bool:
    """Whether brick sets are dilated through a dense bitmap by default: on CUDA, where the interval merge's
    ~30 launches and 2 host syncs per axis cost more than the bitmap; on the CPU the merge is cheaper."""
    return _cuda_path(device)


def _dilate_dense(bricks: torch.Tensor, radii: tuple[int, int, int], then: int = 0):
    """Sorted unique int64 ``[M', 3]`` bricks within ``radii[a]`` of the unique ``bricks`` along each axis
    ``a`` (a box), through a bitmap over their grown bounding box and three separable max-pools: a fixed
    dozen launches and two host reads (the box, the result's size), whatever the set. None when the box
    has more than ``DENSE_CELLS`` cells (the caller takes the sparse path). ``then > 0``: returns that set
    and the set grown by ``then`` more on every axis, from the same bitmap (box dilations compose)."""
    dev = bricks.device
    rad = torch.tensor([r + then for r in radii], dtype=torch.int64, device=dev)
    lo_t = bricks.min(dim=0).values - rad
    box = torch.cat((lo_t, bricks.max(dim=0).values + rad)).tolist()  # one read of 6 integers
    ext = [box[3 + a] - box[a] + 1 for a in range(3)]
    if ext[0] * ext[1] * ext[2] > DENSE_CELLS:
        return None
    # float16 max-pools on CUDA (2 B a cell); the CPU has no half max-pool
    grid = torch.zeros(ext, dtype=torch.float16 if dev.type == "cuda" else torch.float32, device=dev)
    b = bricks - lo_t
    grid[b[:, 0], b[:, 1], b[:, 2]] = 1
    x = grid[None, None]

    def grow(x, radii):
        for a, r in enumerate(radii):
            if r:
                k, pad = [1, 1, 1], [0, 0, 0]
                k[a], pad[a] = 2 * r + 1, r
                x = torch.nn.functional.max_pool3d(x, k, stride=1, padding=pad)
        return x

    x = grow(x, radii)
    first = x[0, 0].nonzero() + lo_t  # row-major order of the box = key order (i major)
    if not then:
        return first
    return first, grow(x, (then, then, then))[0, 0].nonzero() + lo_t


def _dilate_pair(bricks: torch.Tensor, r1: int, r2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`_dilate_bricks` by ``r1``, by ``r2 > r1``) of the unique ``bricks``: one bitmap for both
    on the dense path (one box read, one grid)."""
    if bricks.shape[0] and r1 and r2 > r1 and _dense_sets(bricks.device):
        out = _dilate_dense(bricks, (r1, r1, r1), then=r2 - r1)
        if out is not None:
            return out
    return _dilate_bricks(bricks, r1), _dilate_bricks(bricks, r2)


def _dilate_bricks(bricks: torch.Tensor, r: int, dense: bool | None = None) -> torch.Tensor:
    """Sorted unique int64 ``[M', 3]`` bricks within Chebyshev distance ``r`` of the unique ``bricks``.

    ``dense`` (default: on CUDA): by :func:`_dilate_dense` where the box is small enough, else by merged
    intervals per line (the same set)."""
    if bricks.shape[0] == 0 or r == 0:
        return _unique_bricks(bricks)
    if _dense_sets(bricks.device) if dense is None else dense:
        out = _dilate_dense(bricks, (r, r, r))
        if out is not None:
            return out
    for axis in range(3):
        bricks = _dilate_axis(bricks, r, axis)
    return _unique_bricks(bricks)


def _grow_axis(bricks: torch.Tensor, r: int, axis: int, dense: bool | None = None) -> torch.Tensor:
    """Sorted unique bricks of ``bricks`` grown by ``+-r`` along ``axis`` (dense where
    :func:`_dilate_bricks` is)."""
    if bricks.shape[0] == 0 or r == 0:
        return _unique_bricks(bricks)
    if _dense_sets(bricks.device) if dense is None else dense:
        radii = [0, 0, 0]
        radii[axis] = r
        out = _dilate_dense(bricks, tuple(radii))
        if out is not None:
            return out
    return _unique_bricks(_dilate_axis(bricks, r, axis))


# ------------------------------------------------------------------------------------- source values
def _gather_bricks(layer: BrickLayer | None, bricks: torch.Tensor, name, fill):
    """Field ``name`` of whole bricks (int64 ``[M, 3]`` brick coordinates) -> ``[M, 64]`` in the field's
    dtype; absent bricks (or no layer) read ``fill``. ``name`` and ``fill`` may be tuples: a list of
    fields then, from one lookup of the bricks."""
    if isinstance(name, tuple):
        names, fills = name, fill
    else:
        names, fills = (name,), (fill,)
    m = bricks.shape[0]
    if layer is None:
        out = [torch.full((m, 64), f, device=bricks.device) for f in fills]
    elif m == 0 or layer.grid.num_leaves == 0 or layer.pool.capacity == 0:
        out = [
            torch.full((m, 64), f, dtype=layer.pool.fields[n].dtype, device=bricks.device)
            for n, f in zip(names, fills, strict=True)
        ]
    else:
        slot, _ = layer.voxel_slots(bricks << 2)
        have = (slot >= 0)[:, None]
        slot = slot.clamp(min=0)
        out = []
        for n, f in zip(names, fills, strict=True):
            vals = layer.pool.gather(n, slot)
            out.append(torch.where(have, vals, torch.full_like(vals, f)))
    return out if isinstance(name, tuple) else out[0]


def _existing_bricks(layer: BrickLayer, bricks: torch.Tensor) -> torch.Tensor:
    """The rows of int64 ``[M, 3]`` ``bricks`` that are allocated in ``layer``."""
    return _existing_slots(layer, bricks)[0]


def _existing_slots(layer: BrickLayer, bricks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of int64 ``[M, 3]`` ``bricks`` allocated in ``layer``, their pool slots int64): one grid
    lookup for the set and its values."""
    if bricks.shape[0] == 0 or layer.grid.num_leaves == 0:
        return bricks[:0], torch.zeros(0, dtype=torch.int64, device=bricks.device)
    slot, _ = layer.voxel_slots(bricks << 2)
    keep = slot >= 0
    return bricks[keep], slot[keep]


def _gather_slots(layer: BrickLayer, slot: torch.Tensor, name: str) -> torch.Tensor:
    """Field ``name`` of whole bricks at allocated ``slot`` (int64 ``[M]``) -> ``[M, 64]``."""
    if slot.shape[0] == 0:
        return torch.zeros((0, 64), dtype=layer.pool.fields[name].dtype, device=slot.device)
    return layer.pool.gather(name, slot)


def tsdf_sites(
    layer: BrickLayer, bricks: torch.Tensor, rows: int = CPU_BRICKS, front_max: float | None = None
):
    """Site voxels of a TSDF layer inside the given bricks.

    Args:
        layer: TSDF layer (fields ``tsdf``, ``weight``).
        bricks: int64 ``[M, 3]`` unique brick coordinates (absent ones hold no site).
        front_max: where given, crossings whose positive side reads ``>= front_max`` are left out.
    Returns:
        int64 ``[S, 3]`` site voxels and float32 ``[S, 6]`` crossing offsets per edge direction
        ``(+i, -i, +j, -j, +k, -k)`` in voxels, in ``[0, 0.5]`` (NaN: no crossing on that edge).
    """
    dev = bricks.device
    local = brick_local_coords(dev)
    none = torch.zeros((0, 3), dtype=torch.int64, device=dev), torch.zeros((0, 6), device=dev)
    if bricks.shape[0] == 0 or layer.grid.num_leaves == 0:
        return none
    # the bricks and their face neighbours that exist, gathered once; row ``len(ext)`` = "absent". Keys
    # are linear in the coordinates (``_key_steps``): a neighbour's key is the brick's plus a constant.
    step_keys = _key_steps(dev)
    nkeys = voxel_keys(bricks)[:, None] + torch.cat((step_keys[:1] * 0, step_keys, -step_keys))[None, :]
    ext, ext_slot = _existing_slots(layer, keys_to_ijk(torch.unique(nkeys)))
    keys = voxel_keys(ext)
    # unobserved (weight 0) and absent voxels read NaN: every comparison with it is False, so an edge has a
    # sign change only between two observed voxels (one array instead of values and observed flags)
    t_all = _gather_slots(layer, ext_slot, "tsdf").to(torch.float32)
    t_all = torch.where(_gather_slots(layer, ext_slot, "weight") > 0, t_all, math.nan)
    t_all = torch.cat((t_all, t_all.new_full((1, 64), math.nan))).reshape(-1, 4, 4, 4)
    # rows of the brick (column 0) and of its neighbours +i, +j, +k, -i, -j, -k (columns 1..6), one search
    pos = torch.searchsorted(keys, nkeys).clamp_(max=max(keys.numel() - 1, 0))
    nrows = torch.where(keys[pos] == nkeys, pos, keys.numel()) if keys.numel() else pos

    out_v, out_t = [], []
    inner = slice(1, 5)
    for sl in _chunks(bricks.shape[0], dev, rows):
        b = bricks[sl]
        m = b.shape[0]
        # the brick padded by one voxel from its six face neighbours ([m, 6, 6, 6]; edges unused): the values
        # at v + e_a / v - e_a are shifted windows of it
        g = t_all[nrows[sl]]  # [m, 7, 4, 4, 4]
        pad = torch.full((m, 6, 6, 6), math.nan, dtype=t_all.dtype, device=dev)
        pad[:, inner, inner, inner] = g[:, 0]
        pad[:, 5, inner, inner] = g[:, 1, 0]  # +i neighbour: its i = 0 face
        pad[:, inner, 5, inner] = g[:, 2, :, 0]
        pad[:, inner, inner, 5] = g[:, 3, :, :, 0]
        pad[:, 0, inner, inner] = g[:, 4, 3]  # -i neighbour: its i = 3 face
        pad[:, inner, 0, inner] = g[:, 5, :, 3]
        pad[:, inner, inner, 0] = g[:, 6, :, :, 3]

        gt, le = pad > 0, pad <= 0  # both False where unobserved
        if front_max is not None:  # a sign change's larger value is its positive one: < front_max
            gt &= pad < front_max
        cols = []
        for ax in range(3):
            # the edges (lo, hi) = (v, v + e_a) along axis a from pad index 0 to 4 (the first from the -
            # neighbour): t = lo / (lo - hi) from lo, a sign change between two observed voxels; voxel v
            # (pad index 1..4) owns its upper edge's crossing when t <= 0.5 (offset t), its lower edge's
            # when t > 0.5 (offset 1 - t): each edge's values formed once for both of its voxels
            def win(lo_at, ax=ax):
                w = [inner, inner, inner]
                w[ax] = slice(lo_at, lo_at + 5)
                return (slice(None), *w)

            lo, hi = pad[win(0)], pad[win(1)]
            cross = (gt[win(0)] & le[win(1)]) | (le[win(0)] & gt[win(1)])
            t = torch.where(cross, lo / (lo - hi), math.nan)
            sel_up = [slice(None)] * 4
            sel_up[ax + 1] = slice(1, 5)
            sel_dn = [slice(None)] * 4
            sel_dn[ax + 1] = slice(0, 4)
            t_up, t_dn = t[tuple(sel_up)], t[tuple(sel_dn)]
            cols.append(torch.where(t_up <= 0.5, t_up, math.nan))
            cols.append(torch.where(t_dn > 0.5, 1.0 - t_dn, math.nan))
        # columns (+i, -i, +j, -j, +k, -k), gathered at the site voxels only (those with any crossing)
        cols = [c.reshape(-1, 64) for c in cols]
        site = ~torch.isnan(cols[0])
        for c in cols[1:]:
            site |= ~torch.isnan(c)
        bi, oi = site.nonzero(as_tuple=True)
        out_v.append(b[bi] * 4 + local[oi])
        out_t.append(torch.stack([c[bi, oi] for c in cols], dim=1))
    return torch.cat(out_v), torch.cat(out_t)


def occupancy_sites(layer: BrickLayer, bricks: torch.Tensor, rows: int = CPU_BRICKS):
    """Occupied voxels (``log_odds > 0``) of an occupancy layer inside the given bricks, as site voxels
    whose only point is the centre: (int64 ``[S, 3]``, float32 ``[S, 6]``: 0 in the ``+k`` slot, NaN)."""
    dev = bricks.device
    local = brick_local_coords(dev)
    out = []
    for sl in _chunks(bricks.shape[0], dev, rows):
        b = bricks[sl]
        lo = _gather_bricks(layer, b, "log_odds", math.nan)
        bi, oi = (lo > 0).nonzero(as_tuple=True)
        out.append(b[bi] * 4 + local[oi])
    v = torch.cat(out) if out else torch.zeros((0, 3), dtype=torch.int64, device=dev)
    t = torch.full((v.shape[0], 6), math.nan, device=dev)
    t[:, 4] = 0.0  # the centre, as a crossing on the k line
    return v, t


def sign_observed(tsdf: BrickLayer | None, occ: BrickLayer | None, bricks: torch.Tensor):
    """(bool inside ``[M, 64]``, bool observed ``[M, 64]``) of whole bricks from the source layers."""
    m = bricks.shape[0]
    obs_t = torch.zeros((m, 64), dtype=torch.bool, device=bricks.device)
    inside_t = torch.zeros_like(obs_t)
    if tsdf is not None:
        w, t = _gather_bricks(tsdf, bricks, ("weight", "tsdf"), (0.0, 0.0))
        obs_t, inside_t = w > 0, t <= 0
    known = torch.zeros_like(obs_t)
    occupied = torch.zeros_like(obs_t)
    if occ is not None:
        lo = _gather_bricks(occ, bricks, "log_odds", math.nan)
        known = ~torch.isnan(lo)
        occupied = lo > 0
    return torch.where(obs_t, inside_t, occupied), obs_t | known


def edge_sites(site_t: torch.Tensor) -> torch.Tensor:
    """Per-edge crossings (float32 ``[S, 6]``: ``+a`` / ``-a`` offsets in ``[0, 1/2]`` per axis, NaN =
    none, as :func:`tsdf_sites`) -> the transform's per-line form (float32 ``[S, 9]``: leftmost, rightmost,
    nearest signed offset per line axis)."""
    t = site_t.reshape(-1, 3, 2)  # the three axes at once
    dp, dm = t[:, :, 0], t[:, :, 1]
    ndm = -dm
    lo = torch.where(torch.isnan(dm), dp, ndm)
    hi = torch.where(torch.isnan(dp), ndm, dp)
    near = torch.where(torch.isnan(dp) | (dm < dp), ndm, dp)
    return torch.stack((lo, hi, near), dim=2).reshape(-1, 9)


# ------------------------------------------------------------------- ESDF coarser than the source layers
# The ESDF lattice has its own voxel ``S >= s`` (``s``: the TSDF / occupancy voxel); ``ratio = S / s``.
# Coarse voxel ``I`` has its centre at fine coordinate ``x = (I + 1/2) * ratio - 1/2`` (fine coordinates:
# fine voxel ``v``'s centre is at ``v``). The sites are (a) the zero crossings of the fine TSDF's trilinear
# interpolant along the coarse lattice lines: on such a line the interpolant is bilinear across it (fixed
# weights) and piecewise linear along it between fine centres, so its crossings are exact linear
# interpolations between consecutive breakpoints (all corners with a non-zero weight observed); and (b)
# every fine surface point (:func:`tsdf_sites`' crossings; occupied fine centres), snapped to the coarse
# voxel holding it: projected onto that voxel's centre line along the axis where it lies farthest from
# the centre (the nearest point a site can be), so no observed fine surface is lost where (a) finds no
# crossing (partly observed cells, thin objects between coarse lines, grazing ground). A surface point
# ``p`` is then within ``sqrt(e_u^2 + e_v^2) <= S / sqrt(2)`` of a site (``e``: ``p`` minus the centre;
# ``(S - s) / sqrt(2)`` at integer ratios), which is ``<= S / 2 + sqrt(3) / 2 s`` up to ``ratio`` 4.18 (7.6 at
# integer ratios): the ESDF never reads farther than ``d_true + S / 2 + sqrt(3) / 2 s`` there. With
# ``ratio == 1`` the sites are the fine sites of :func:`tsdf_sites` (that path is kept, bit for bit).


def _coarse_of_fine(v: torch.Tensor, ratio: float):
    """For fine coordinates ``v`` (int64), the coarse lattice line ``I`` whose centre ``x`` has
    ``floor(x) == v`` (at most one when ``ratio >= 1``): (I int64, x - v float64, exists bool)."""
    i0 = torch.floor((v.to(torch.float64) + 0.5) / ratio - 0.5).to(torch.int64)
    x0 = (i0.to(torch.float64) + 0.5) * ratio - 0.5
    x1 = (i0.to(torch.float64) + 1.5) * ratio - 0.5
    f0, f1 = torch.floor(x0).to(torch.int64), torch.floor(x1).to(torch.int64)
    first = f0 == v
    idx = torch.where(first, i0, i0 + 1)
    frac = torch.where(first, x0, x1) - v.to(torch.float64)
    return idx, frac, first | (f1 == v)


def _gather_voxels(
    layer: BrickLayer, ijk: torch.Tensor, names, fills
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(float32 values of the fields ``names`` at int64 ``[M, 3]`` voxels, ``fills`` where absent;
    present)."""
    m = ijk.shape[0]
    if layer.grid.num_leaves == 0 or layer.pool.capacity == 0 or m == 0:
        vals = [torch.full((m,), f, dtype=torch.float32, device=ijk.device) for f in fills]
        return vals, torch.zeros(m, dtype=torch.bool, device=ijk.device)
    slot, off = layer.voxel_slots(ijk)
    present = slot >= 0
    out = []
    for name, fill in zip(names, fills, strict=True):
        v = layer.pool.gather(name, slot.clamp(min=0), off).to(torch.float32)
        out.append(torch.where(present, v, torch.full_like(v, fill)))
    return out, present


def fine_to_coarse_bricks(fine_bricks: torch.Tensor, ratio: float, pad: int) -> torch.Tensor:
    """Unique coarse bricks whose voxels' samples (centre corners, line breakpoints) can read a fine voxel
    within ``pad`` fine voxels of the given fine bricks (int64 ``[B, 3]``)."""
    if fine_bricks.shape[0] == 0:
        return fine_bricks.reshape(0, 3)
    lo_v = (fine_bricks * 4 - pad).to(torch.float64)
    hi_v = (fine_bricks * 4 + 3 + pad).to(torch.float64)
    lo = torch.floor((lo_v - 1.5) / ratio - 0.5).to(torch.int64) >> 2
    hi = torch.floor((hi_v + 1.5) / ratio - 0.5).to(torch.int64) >> 2
    span = int((hi - lo).max()) + 1
    rng = torch.arange(span, device=fine_bricks.device)
    off = torch.stack(torch.meshgrid(rng, rng, rng, indexing="ij"), dim=-1).reshape(-1, 3)
    cand = lo[:, None, :] + off[None]
    ok = (cand <= hi[:, None, :]).all(dim=2)
    return _unique_bricks(cand[ok])


def _padded_bricks(layer: BrickLayer, bricks: torch.Tensor):
    """tsdf (float64) and observed (bool) of whole bricks extended by one voxel on the + side of every axis
    (from the 7 upper neighbour bricks; absent = unobserved): ``[M, 5, 5, 5]`` each."""
    m = bricks.shape[0]
    dev = bricks.device
    corners = _corner_offsets(dev)
    ext, slot = _existing_slots(layer, _unique_bricks((bricks[:, None, :] + corners[None]).reshape(-1, 3)))
    keys = voxel_keys(ext)
    t_all = _gather_slots(layer, slot, "tsdf").to(torch.float64)
    o_all = _gather_slots(layer, slot, "weight") > 0
    t_all = torch.cat((t_all, t_all.new_zeros((1, 64)))).view(-1, 4, 4, 4)
    o_all = torch.cat((o_all, o_all.new_zeros((1, 64)))).view(-1, 4, 4, 4)
    t = torch.zeros((m, 5, 5, 5), dtype=torch.float64, device=dev)
    o = torch.zeros((m, 5, 5, 5), dtype=torch.bool, device=dev)
    # the rows of the 8 corner bricks at once (``len(ext)``: absent)
    k = voxel_keys((bricks[:, None, :] + corners[None]).reshape(-1, 3))
    pos = torch.searchsorted(keys, k).clamp_(max=max(keys.numel() - 1, 0))
    rows = torch.where(keys[pos] == k, pos, keys.numel()) if keys.numel() else pos
    rows = rows.view(m, 8)
    for c in range(8):
        d = ((c >> 2) & 1, (c >> 1) & 1, c & 1)  # as ``corners[c]``, without reading the device
        src = tuple(slice(0, 4) if x == 0 else slice(0, 1) for x in d)
        dst = tuple(slice(0, 4) if x == 0 else slice(4, 5) for x in d)
        t[(slice(None), *dst)] = t_all[rows[:, c]][(slice(None), *src)]
        o[(slice(None), *dst)] = o_all[rows[:, c]][(slice(None), *src)]
    return t, o


_AXES_UV = ((0, 1, 2), (1, 0, 2), (2, 0, 1))  # line axis a and the other two (u < v)
_PAD_STRIDE = (25, 5, 1)  # element strides along i, j, k of a [5, 5, 5] padded brick


def coarse_tsdf_sites(
    layer: BrickLayer,
    fine_bricks: torch.Tensor,
    ratio: float,
    rows: int = CPU_BRICKS // 4,
    front_max: float | None = None,
):
    """Sites of a TSDF layer on a coarser ESDF lattice (``ratio = S / s > 1``), from the fine voxels of
    ``fine_bricks``: (a) the crossings of the trilinear interpolant on the coarse lines through the cells
    whose lower corners they are, and (b) their own fine crossings (:func:`tsdf_sites`), each snapped to
    the coarse voxel holding it (:func:`_snapped_points`; see the section's comment for the bound), those
    whose positive side reads ``>= front_max`` (metres, None: all) left out: the sign changes between a
    voxel at the truncation and a negative one where views merge at an occlusion edge, not a surface.

    Returns:
        int64 ``[S, 3]`` coarse site voxels and float32 ``[S, 9]`` per line axis: leftmost, rightmost and
        nearest crossing (signed offsets in coarse voxels, ``[-1/2, 1/2)``) on the coarse line through the
        site voxel's centre (NaN: none on that line).
    """
    dev = fine_bricks.device
    keys, axes, offs = [], [], []
    ar4 = torch.arange(4, device=dev)
    ar5 = torch.arange(5, device=dev)
    uu = torch.tensor([u for _, u, _ in _AXES_UV], device=dev)  # the other two axes of each line axis
    vv = torch.tensor([v for _, _, v in _AXES_UV], device=dev)
    for sl in _chunks(fine_bricks.shape[0], dev, rows):
        b = fine_bricks[sl]
        t, o = _padded_bricks(layer, b)
        # per axis and brick: the coarse line (index, fraction) through each of the 4 fine cells, if any
        lines = [_coarse_of_fine(b[:, x, None] * 4 + ar4[None, :], ratio) for x in range(3)]  # [m, 4] each
        # the three line axes a at once (axis-major), with u, v the other two: (a, u, v) = (0, 1, 2),
        # (1, 0, 2), (2, 0, 1); every value is formed as it would be for one axis alone
        i_all, f_all, ok_all = (torch.stack([ln[j] for ln in lines]) for j in range(3))  # [3, m, 4]
        iu, fu, oku = i_all[uu], f_all[uu], ok_all[uu]
        iv, fv, okv = i_all[vv], f_all[vv], ok_all[vv]
        has = oku[:, :, :, None] & okv[:, :, None, :]  # [3, m, 4(u), 4(v)]
        ax, bi, cu, cv = has.nonzero(as_tuple=True)
        if bi.numel() == 0:
            continue
        fu_, fv_ = fu[ax, bi, cu][:, None], fv[ax, bi, cv][:, None]  # [L, 1]
        # values on the line at the 5 breakpoints k = 0..4 of the brick (bilinear across the line)
        # (flat indices into the [m, 5, 5, 5] blocks: strides 25, 5, 1 along i, j, k; no per-axis copies)
        t_flat, o_flat = t.reshape(-1), o.reshape(-1)
        strides = torch.tensor(_PAD_STRIDE, device=dev)
        s_u, s_v, s_a = (strides[x][ax] for x in (uu, vv, torch.arange(3, device=dev)))
        along = ar5[None, :] * s_a[:, None]  # [L, 5]
        acc = torch.zeros((bi.numel(), 5), dtype=torch.float64, device=dev)
        ok = torch.ones((bi.numel(), 5), dtype=torch.bool, device=dev)
        for du in (0, 1):
            for dv in (0, 1):
                wgt = (fu_ if du else 1.0 - fu_) * (fv_ if dv else 1.0 - fv_)
                at = (bi * 125 + (cu + du) * s_u + (cv + dv) * s_v)[:, None] + along
                tv, ov = t_flat[at], o_flat[at]  # [L, 5]: t[bi, ...] along the line axis
                need = wgt > 0
                ok &= ~need | ov
                acc = acc + torch.where(need, wgt * tv, torch.zeros_like(acc))
        va, vb = acc[:, :4], acc[:, 1:]
        cross = ok[:, :4] & ok[:, 1:] & ((va > 0) != (vb > 0))
        li, k = cross.nonzero(as_tuple=True)
        if li.numel() == 0:
            continue
        va, vb = va[li, k], vb[li, k]
        tt = va / (va - vb)
        a_l, b_l = ax[li], bi[li]
        kk = (b[b_l, a_l] * 4 + k).to(torch.float64)
        q = (kk + tt + 0.5) / ratio  # coarse units: voxel c spans [c, c + 1)
        c = torch.floor(q)
        site = torch.empty((li.numel(), 3), dtype=torch.int64, device=dev)
        site.scatter_(1, a_l[:, None], c.to(torch.int64)[:, None])
        site.scatter_(1, uu[a_l][:, None], iu[a_l, b_l, cu[li]][:, None])
        site.scatter_(1, vv[a_l][:, None], iv[a_l, b_l, cv[li]][:, None])
        keys.append(voxel_keys(site))
        axes.append(a_l)
        offs.append((q - c - 0.5).to(torch.float32))
    # (b) every fine crossing that no site of (a) covers within the bound, snapped to the coarse voxel
    # holding it (where (a) covers a crossing, its site lies on the surface; a snapped one may not)
    fine_vox, fine_t = tsdf_sites(layer, fine_bricks, front_max=front_max)
    ok = ~torch.isnan(fine_t)  # [F, 6]: columns (+i, -i, +j, -j, +k, -k)
    si, col = ok.nonzero(as_tuple=True)
    p = fine_vox[si].to(torch.float64)
    step = fine_t[si, col].to(torch.float64) * (1 - 2 * (col % 2)).to(torch.float64)
    p.scatter_add_(1, (col // 2)[:, None], step[:, None])
    owner = fine_vox[si]
    reach = 0.5 + math.sqrt(3) / 2 / ratio  # the bound, coarse voxels: S / 2 + sqrt(3) / 2 s
    if keys:
        a_vox, a_t = _reduce_sites(torch.cat(keys), torch.cat(axes), torch.cat(offs))
        far = _uncovered((p + 0.5) / ratio, voxel_keys(a_vox), a_t, reach)
        p, owner = p[far], owner[far]
    k_b, a_b, o_b = _snapped_points(p, ratio, normal=_fine_gradient(layer, owner), reach=reach)
    keys.append(k_b)
    axes.append(a_b)
    offs.append(o_b)
    return _reduce_sites(torch.cat(keys), torch.cat(axes), torch.cat(offs))


def _neighbours_27(device) -> torch.Tensor:
    """int64 ``[27, 3]``: the offsets ``{-1, 0, 1}^3`` (one host-to-device copy; rows are views)."""
    r = (-1, 0, 1)
    return torch.tensor([(i, j, k) for i in r for j in r for k in r], dtype=torch.int64, device=device)


def _uncovered(q: torch.Tensor, site_keys: torch.Tensor, site_t: torch.Tensor, reach: float) -> torch.Tensor:
    """Indices (int64) of the points ``q`` (float64 ``[P, 3]``, coarse units: voxel ``c`` spans ``[c, c +
    1)``) with no site point within ``reach`` (``<= 1``) coarse voxels: the site points of the 27 voxels
    around the one holding the point (every point within ``reach`` lies in one of them). ``site_keys``:
    sorted int64 ``[S]`` keys of the site voxels, ``site_t``: their float32 ``[S, 9]``
    (:func:`_reduce_sites`)."""
    dev = q.device
    c = torch.floor(q)
    e = q - c - 0.5  # [P, 3], from the centre
    k = voxel_keys(c.to(torch.int64))
    steps = _key_steps(dev)
    best = torch.full((q.shape[0],), math.inf, dtype=torch.float64, device=dev)
    if site_keys.numel() == 0:
        return torch.arange(q.shape[0], device=dev)
    # no crossing (NaN) and no site (the extra last row) read +inf: ``(r - inf)^2 = inf``, as NaN -> inf did
    table = torch.cat((site_t, site_t.new_full((1, 9), math.nan))).to(torch.float64)
    table = torch.nan_to_num_(table, nan=math.inf, posinf=math.inf, neginf=-math.inf).view(-1, 3, 3)
    nbr = _neighbours_27(dev)
    key_off = (nbr * steps).sum(dim=1)
    nbr_f = nbr.to(torch.float64)
    last = site_keys.numel() - 1
    for i in range(27):
        kk = k + key_off[i]
        pos = torch.searchsorted(site_keys, kk).clamp_(max=last)
        row = torch.where(site_keys[pos] == kk, pos, last + 1)
        r = e - nbr_f[i]  # from the neighbour's centre
        rr = r * r
        along = r[:, :, None] - table[row]  # [P, 3 axes, 3 values]: offset along each line
        d2 = rr.sum(dim=1, keepdim=True) - rr + (along * along).amin(dim=2)  # [P, 3]
        best = torch.minimum(best, d2.amin(dim=1))
    return (best > reach * reach).nonzero().squeeze(1)


def _fine_gradient(layer: BrickLayer, v: torch.Tensor) -> torch.Tensor:
    """float64 ``[P, 3]``: the fine TSDF's gradient at observed voxels ``v`` (int64 ``[P, 3]``) by central
    differences over the observed neighbours (one-sided where one is unobserved, 0 where both are)."""
    dev = v.device
    if v.shape[0] == 0:
        return torch.zeros((0, 3), dtype=torch.float64, device=dev)
    eye = torch.eye(3, dtype=torch.int64, device=dev)
    ijk = torch.cat((v[None], v[None] + eye[:, None], v[None] - eye[:, None])).reshape(-1, 3)  # [7 P, 3]
    (t, w), present = _gather_voxels(layer, ijk, ("tsdf", "weight"), (0.0, 0.0))
    t, ok = t.to(torch.float64).view(7, -1), (present & (w > 0)).view(7, -1)
    t0, tp, tm, op, om = t[0], t[1:4], t[4:7], ok[1:4], ok[4:7]
    g = torch.where(op & om, (tp - tm) / 2, torch.where(op, tp - t0, torch.where(om, t0 - tm, 0.0)))
    return g.T


def _snapped_points(
    p: torch.Tensor,
    ratio: float,
    axis: int | None = None,
    normal: torch.Tensor | None = None,
    reach: float = 0.0,
):
    """Fine points (float64 ``[P, 3]``, fine coordinates) as sites of the coarse voxels holding them:
    (int64 keys ``[P]`` of those voxels, int64 line axes ``[P]``, float32 offsets ``[P]`` in coarse voxels,
    ``[-1/2, 1/2]``).

    With ``axis``: the voxel holding the point, the point's projection onto its centre line along ``axis``.
    With ``normal`` (float64 ``[P, 3]``, the surface's normal there, any length): of the centre lines of the
    27 voxels around the one holding the point, each within its own voxel (offsets in ``[-1/2, 1/2]``), the
    point within ``reach`` (``<= 1``) coarse voxels of the point that lies closest to the surface's tangent
    plane through it (a site as near the surface as the lines allow); where no line comes within
    ``reach``, as without ``normal``: the nearest of the three projections onto the lines of the voxel
    holding the point (along the axis on which it lies farthest from the centre)."""
    q = (p + 0.5) / ratio  # coarse units: voxel c spans [c, c + 1)
    c = torch.floor(q)
    e = q - c - 0.5
    ci = c.to(torch.int64)
    if axis is not None:
        line = torch.full((p.shape[0],), axis, dtype=torch.int64, device=p.device)
        return voxel_keys(ci), line, e[:, axis].to(torch.float32)
    line = e.abs().argmax(dim=1)
    off = e.gather(1, line[:, None]).squeeze(1)
    if normal is not None and p.shape[0]:
        dev = p.device
        n = normal / normal.norm(dim=1, keepdim=True).clamp(min=1e-30)
        safe = torch.where(n == 0, torch.ones_like(n), n)
        best = torch.full((p.shape[0],), math.inf, dtype=torch.float64, device=dev)
        shift = torch.zeros_like(ci)
        nbr = _neighbours_27(dev)
        nbr_f = nbr.to(torch.float64)
        flat = n == 0
        for i in range(27):
            d = nbr[i]
            r = e - nbr_f[i]  # the point from this neighbour's centre
            rr = r * r
            across = rr.sum(dim=1, keepdim=True) - rr  # [P, 3]: squared distance to each line
            half = torch.sqrt((reach * reach - across).clamp(min=0.0))
            lo, hi = (r - half).clamp(min=-0.5), (r + half).clamp(max=0.5)
            nr = n * r
            rest = nr.sum(dim=1, keepdim=True) - nr  # the tangent plane: n_a (t - r_a) = rest
            t = torch.where(flat, r, r + rest / safe)
            t = torch.minimum(torch.maximum(t, lo), hi)
            tr = t - r
            miss = (n * tr - rest).abs() + 1e-9 * (across + tr * tr)  # nearest to the plane, then p
            miss = torch.where((across <= reach * reach) & (lo <= hi), miss, math.inf)
            m, a = miss.min(dim=1)
            better = m < best
            best = torch.where(better, m, best)
            line = torch.where(better, a, line)
            off = torch.where(better, t.gather(1, a[:, None]).squeeze(1), off)
            shift = torch.where(better[:, None], d[None], shift)
        ci = ci + shift
    return voxel_keys(ci), line, off.to(torch.float32)


def _reduce_sites(keys: torch.Tensor, axes: torch.Tensor, offs: torch.Tensor):
    """Per (site voxel, axis): leftmost, rightmost and nearest (by ``|offset|``; at a tie the positive one)
    of the offsets -> (int64 ``[S, 3]`` sorted site voxels, float32 ``[S, 9]``)."""
    uk, inv = torch.unique(keys, return_inverse=True)
    col = inv * 9 + axes * 3
    n = uk.numel() * 9
    out = torch.full((n,), math.nan, dtype=torch.float32, device=keys.device)
    out = out.scatter_reduce(0, col, offs, "amin", include_self=False)
    out = out.scatter_reduce(0, col + 1, offs, "amax", include_self=False)
    mag = torch.full((n,), math.inf, dtype=torch.float32, device=keys.device)
    mag = mag.scatter_reduce(0, col + 2, offs.abs(), "amin", include_self=True)
    best = offs.abs() == mag[col + 2]
    out = out.scatter_reduce(0, (col + 2)[best], offs[best], "amax", include_self=False)
    return keys_to_ijk(uk), out.view(-1, 9)


def coarse_occupancy_sites(
    layer: BrickLayer, fine_bricks: torch.Tensor, ratio: float, rows: int = CPU_BRICKS
):
    """Occupied fine voxels (``log_odds > 0``) on a coarser lattice: the coarse voxels holding an occupied
    fine voxel's centre, each centre projected onto the coarse voxel's ``k`` line (int64 ``[S, 3]`` sorted
    site voxels, float32 ``[S, 9]``: leftmost, rightmost, nearest offset on the ``k`` line, NaN elsewhere;
    only ``k`` lines, so the transform runs the ``k`` orientation alone). A centre is within ``S / sqrt(2)``
    of its site point."""
    dev = fine_bricks.device
    local = brick_local_coords(dev)
    keys, offs = [], []
    for sl in _chunks(fine_bricks.shape[0], dev, rows):
        b = fine_bricks[sl]
        lo = _gather_bricks(layer, b, "log_odds", math.nan)
        bi, oi = (lo > 0).nonzero(as_tuple=True)
        k, _, o = _snapped_points((b[bi] * 4 + local[oi]).to(torch.float64), ratio, axis=2)
        keys.append(k)
        offs.append(o)
    if not keys:
        return torch.zeros((0, 3), dtype=torch.int64, device=dev), torch.zeros((0, 9), device=dev)
    k = torch.cat(keys)
    return _reduce_sites(k, torch.full_like(k, 2), torch.cat(offs))


class _FineBlock:
    """Whole-brick values of a source layer around a set of ESDF bricks, with a dense brick table over
    their bounding box, for many voxel lookups at once (a gather per lookup instead of a grid search)."""

    def __init__(self, layer: BrickLayer, coarse_bricks: torch.Tensor, ratio: float, names, fills):
        dev = coarse_bricks.device
        lo = torch.floor((coarse_bricks.to(torch.float64) * 4 + 0.5) * ratio - 0.5).to(torch.int64) - 1
        hi = torch.floor((coarse_bricks.to(torch.float64) * 4 + 4.0) * ratio).to(torch.int64) + 1
        lo, hi = lo >> 2, hi >> 2
        span = int((hi - lo).max()) + 1 if coarse_bricks.shape[0] else 1
        rng = torch.arange(span, device=dev)
        off = torch.stack(torch.meshgrid(rng, rng, rng, indexing="ij"), dim=-1).reshape(-1, 3)
        cand = lo[:, None, :] + off[None]
        fine, slot = _existing_slots(layer, _unique_bricks(cand[(cand <= hi[:, None, :]).all(dim=2)]))
        self.names, self.fills = list(names), list(fills)
        self.vals = []
        for n, f in zip(self.names, self.fills, strict=True):
            v = _gather_slots(layer, slot, n).to(torch.float32)
            self.vals.append(torch.cat((v, torch.full((1, 64), f, dtype=torch.float32, device=dev))))
        self.absent = fine.shape[0]
        if fine.shape[0]:
            self.lo = fine.min(dim=0).values
            self.ext = fine.max(dim=0).values - self.lo + 1
        else:
            self.lo = torch.zeros(3, dtype=torch.int64, device=dev)
            self.ext = torch.ones(3, dtype=torch.int64, device=dev)
        cells = int(self.ext.prod())
        self.table = torch.full((cells,), self.absent, dtype=torch.int64, device=dev)
        if fine.shape[0]:
            self.table[self._flat(fine - self.lo)] = torch.arange(fine.shape[0], device=dev)

    def _flat(self, b: torch.Tensor) -> torch.Tensor:
        return (b[:, 0] * self.ext[1] + b[:, 1]) * self.ext[2] + b[:, 2]

    def lookup(self, ijk: torch.Tensor):
        """(float32 values per name at int64 ``[M, 3]`` fine voxels, present bool ``[M]``)."""
        b = (ijk >> 2) - self.lo
        inside = ((b >= 0) & (b < self.ext)).all(dim=1)
        row = torch.where(inside, self.table[self._flat(torch.where(inside[:, None], b, 0))], self.absent)
        off = brick_offsets(ijk)
        return [v[row, off] for v in self.vals], row < self.absent


def _corner_offsets(device) -> torch.Tensor:
    """int64 ``[8, 3]``: the corners ``(c >> 2 & 1, c >> 1 & 1, c & 1)`` of a cell, ``c = 0..7``."""
    c = torch.arange(8, device=device)
    return torch.stack(((c >> 2) & 1, (c >> 1) & 1, c & 1), dim=1)


def coarse_sign_observed(tsdf, occ, free, bricks: torch.Tensor, ratio: float, rows: int = CPU_BRICKS):
    """(bool inside ``[M, 64]``, bool observed ``[M, 64]``) of whole coarse bricks.

    TSDF: trilinear at the coarse centre over its 8 fine corners with a non-zero weight that are observed
    (observed: any such corner; inside: the weighted mean ``<= 0``); occupancy: the fine voxel holding the
    centre (known / occupied); free record: the coarse voxel itself (known = crossed by a ray before its
    return). Sign: positive where the free record knows the voxel, else the TSDF where it observed, else the
    occupancy, else positive. With ``ratio == 1`` the corners reduce to
    the voxel itself (:func:`sign_observed`)."""
    dev = bricks.device
    local = brick_local_coords(dev)
    ins_out, obs_out = [], []
    for sl in _chunks(bricks.shape[0], dev, rows):
        b = bricks[sl]
        m = b.shape[0]
        vox = (b[:, None, :] * 4 + local[None]).reshape(-1, 3)
        obs = torch.zeros(vox.shape[0], dtype=torch.bool, device=dev)
        inside = torch.zeros_like(obs)
        if tsdf is not None:
            block = _FineBlock(tsdf, b, ratio, ("tsdf", "weight"), (0.0, 0.0))
            x = (vox.to(torch.float64) + 0.5) * ratio - 0.5
            base = torch.floor(x)
            f = x - base
            base = base.to(torch.int64)
            # the 8 corners in one lookup ([V, 8]); sums accumulated corner by corner (fixed order)
            d = _corner_offsets(dev)
            wgt = torch.where(d[None] == 1, f[:, None, :], 1.0 - f[:, None, :]).prod(dim=2)  # [V, 8]
            (t, w), present = block.lookup((base[:, None, :] + d[None]).reshape(-1, 3))
            use = (wgt > 0) & (present & (w > 0)).view(-1, 8)
            terms = torch.where(use, wgt * t.to(torch.float64).view(-1, 8), 0.0)
            wsum = torch.where(use, wgt, 0.0)
            num, den = terms[:, 0] + 0.0, wsum[:, 0] + 0.0
            for c in range(1, 8):
                num = num + terms[:, c]
                den = den + wsum[:, c]
            obs = den > 0
            inside = obs & (num <= 0)
        if occ is not None:
            block = _FineBlock(occ, b, ratio, ("log_odds",), (math.nan,))
            fine = torch.floor((vox.to(torch.float64) + 0.5) * ratio).to(torch.int64)
            (lo,), _ = block.lookup(fine)
            known = ~torch.isnan(lo)
            inside = torch.where(obs, inside, lo > 0)
            obs = obs | known
        if (
            free is not None
        ):  # crossed by a ray before its return: free, whatever the TSDF's occluded band says
            known = ~torch.isnan(_gather_bricks(free, b, "log_odds", math.nan).to(torch.float32).reshape(-1))
            obs = obs | known
            inside = inside & ~known
        ins_out.append(inside.view(m, 64))
        obs_out.append(obs.view(m, 64))
    if not ins_out:
        z = torch.zeros((0, 64), dtype=torch.bool, device=dev)
        return z, z
    return torch.cat(ins_out), torch.cat(obs_out)


# ----------------------------------------------------------------------------------------- transform
def _line_layout(
    bricks: torch.Tensor, axis: int, rows: int, index: torch.Tensor | None = None, index_range: int = 0
):
    """Slot layout of the voxels of the sorted unique ``bricks`` (``[B, 3]``) as lines along ``axis``.

    Each maximal run of ``n`` consecutive bricks along ``axis`` (same other two coordinates) gives 16
    lines of ``4 n`` voxels, laid one after the other (no gaps: ``64 B`` slots); on the CPU the runs by
    increasing ``n`` (the lines of one length are one contiguous block of slots). Returns ``perm`` (int32
    where it fits, else int64, ``[64 B]``: slot -> voxel index ``brick * 64 + offset``, a permutation;
    ``index`` (``[B]``, optional, values below ``index_range``): the brick numbers to use there instead of
    the rows of ``bricks``), the
    lines' ``start`` and ``length`` (int64 ``[L]``, in slot order) and the chunks as ``(first slot, end
    slot, first line, end line)``; a chunk holds whole runs and about ``rows`` slots (one chunk on CUDA).
    """
    dev = bricks.device
    nb = bricks.shape[0]
    u, v = (x for x in range(3) if x != axis)
    if axis == 2:  # (u, v, axis) = (i, j, k): the key order the bricks come in
        sk, order = voxel_keys(bricks), torch.arange(nb, device=dev)
    else:
        sk, order = torch.sort(voxel_keys(bricks[:, [u, v, axis]]))
    # a run continues where the next key (axis in the low bits) is the key + 1: same u, v, next brick
    new = torch.ones(nb, dtype=torch.bool, device=dev)
    new[1:] = (sk[1:] - sk[:-1]) != 1
    run = torch.cumsum(new, 0) - 1
    first = new.nonzero().squeeze(1)
    count = torch.diff(first, append=first.new_tensor([nb]))
    line = 4 * count  # voxels per line of the run
    # on the CPU, runs laid out by increasing length (stable): the lines of one length form one contiguous
    # block, which the min-plus pass reads as a [lines, length] view (no gather); CUDA: key order
    if _cuda_path(dev):
        cs = count
        base_s = base = torch.cumsum(64 * cs, 0) - 64 * cs
    else:
        rorder = torch.argsort(count, stable=True)
        cs = count[rorder]
        base_s = torch.cumsum(64 * cs, 0) - 64 * cs  # each run's first slot, runs in slot order
        base = torch.empty_like(base_s)
        base[rorder] = base_s  # the same, runs in key order
    local = brick_local_coords(dev)
    sub = local[:, u] * 4 + local[:, v]
    t = torch.arange(nb, device=dev) - first[run]
    start = base[run] + 4 * t
    step = line[run]
    top = nb if index is None else index_range
    perm = torch.empty(nb * 64, dtype=_index_dtype(top * 64), device=dev)
    ar64 = torch.arange(64, device=dev)
    step_b = max(rows // 64, CPU_BRICKS)  # bricks per chunk (8 B temporaries a slot): bounded on CUDA too
    for sl in (slice(s0, min(s0 + step_b, nb)) for s0 in range(0, nb, step_b)):
        pos = start[sl, None] + sub[None, :] * step[sl, None] + local[None, :, axis]
        brick = order[sl] if index is None else index[order[sl]]
        perm[pos.reshape(-1)] = (brick[:, None] * 64 + ar64).reshape(-1).to(perm.dtype)
    ar16 = torch.arange(16, device=dev)
    starts = (base_s[:, None] + ar16[None, :] * (4 * cs)[:, None]).reshape(-1)
    lengths = (4 * cs)[:, None].expand(-1, 16).reshape(-1)
    total = nb * 64
    if total <= rows:  # one chunk (CUDA: ``CUDA_ROWS``, a bound on the line passes' temporaries)
        return perm, starts, lengths, [(0, total, 0, starts.numel())]
    cut = torch.ones(base_s.numel(), dtype=torch.bool, device=dev)
    cut[1:] = (base_s[1:] // rows) != (base_s[:-1] // rows)
    run0 = cut.nonzero().squeeze(1)
    bounds = torch.cat((base_s[run0], base_s.new_tensor([total]))).tolist()
    lines = torch.cat((run0 * 16, run0.new_tensor([starts.numel()]))).tolist()
    return perm, starts, lengths, list(zip(bounds[:-1], bounds[1:], lines[:-1], lines[1:], strict=True))


def _runs_with(bricks: torch.Tensor, axis: int, marked: torch.Tensor) -> torch.Tensor | None:
    """Rows (sorted, int64) of ``bricks`` (sorted unique ``[B, 3]``) in the runs along ``axis`` (as in
    :func:`_line_layout`) that hold a ``marked`` (bool ``[B]``) brick; None when that is every row. A run
    without one has no crossing on any of its lines: its line pass gives inf, the value it starts with."""
    nb = bricks.shape[0]
    u, v = (x for x in range(3) if x != axis)
    order = torch.argsort(voxel_keys(bricks[:, [u, v, axis]]))
    c = bricks[order]
    new = torch.ones(nb, dtype=torch.bool, device=bricks.device)
    new[1:] = (c[1:, u] != c[:-1, u]) | (c[1:, v] != c[:-1, v]) | (c[1:, axis] != c[:-1, axis] + 1)
    run = torch.cumsum(new, 0) - 1
    has = torch.zeros(nb, dtype=torch.bool, device=bricks.device)
    has[run[marked[order]]] = True
    keep = has[run]
    if bool(keep.all()):
        return None
    return torch.sort(order[keep])[0]


def squared_distances(
    bricks: torch.Tensor,
    site_vox: torch.Tensor,
    site_t: torch.Tensor,
    margin: int,
    axes: tuple[int, ...] = (2, 1, 0),
    rows: int = CPU_ROWS,
    out_bricks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact squared Euclidean distance (voxels^2) from every voxel centre of a brick domain to the
    nearest crossing point.

    Args:
        bricks: int64 ``[B, 3]`` sorted (by key) unique bricks; must contain every site voxel's brick.
        site_vox: int64 ``[S, 3]`` site voxels; ``site_t``: float32 ``[S, 9]`` their crossings per line
            axis ``a``: columns ``3a, 3a + 1, 3a + 2`` = leftmost, rightmost and nearest crossing on the
            line through the centre along ``a``, as signed offsets in ``[-1/2, 1/2]`` voxels (NaN = none;
            see :func:`edge_sites`).
        margin: ``M``: values up to ``(M - 1/2)^2`` are exact where the domain holds the box of half-width
            ``M`` around the voxel.
        axes: the crossing orientations present (an occupancy map's centres are ``+k`` slots only).
        out_bricks: int64 ``[W, 3]`` sorted unique rows of ``bricks`` whose values are wanted (None: all);
            the passes then run only on the bricks they need (below).
    Returns:
        float32 ``[B, 64]`` (brick offset order); exact (up to float32 rounding of the per-crossing sum)
        for every crossing whose voxel lies within the box of half-width ``M`` around the voxel when the
        domain holds that box; values from farther crossings are larger than ``(M - 1/2)^2`` (inf where
        none is reachable). Only the rows of ``out_bricks`` are meaningful when it is given.

    Per orientation ``a`` (crossings on the lines along ``a``): a 1-D pass along ``a`` on the crossings
    (nearest left/right by a cumulative max/min), then exact 1-D squared-distance passes (lower envelope of
    parabolas, :func:`mapper.kernels.envelope.lower_envelope`, ``O(n)`` per line of ``n`` voxels) along the
    other two axes. Orientations k and j share their last pass (along i): k, j(k), j, k(j), i(min), then
    i, j, k. A pass along ``x`` whose results are wanted on a brick set ``W`` reads its input on ``W``
    grown by ``Rb = ceil(M / 4)`` bricks along ``x`` (inside the domain): beyond that every candidate is
    farther than ``M``. So with ``W = out_bricks`` the last passes run on ``W + i`` / ``W + k`` and the
    middle ones on ``W + i + j``, ``W + i + k``, ``W + k + j``; only the line passes span the domain.
    That is the CPU path; on CUDA (``_cuda_path``, unless ``SUBSET_PASSES_CUDA``) the envelope passes run on
    the whole domain's layouts (the same values on ``W``; the subsets' host ops cost more there) and the
    three line passes run as one batch.
    """
    dev = bricks.device
    nb = bricks.shape[0]
    n = nb * 64
    if _cuda_path(dev):
        rows = CUDA_ROWS
    keys = voxel_keys(bricks)
    at = torch.searchsorted(keys, voxel_keys(site_vox >> 2)) * 64 + brick_offsets(site_vox)
    rb = -(-margin // 4)
    layouts: dict = {}
    sets: dict = {}

    def subset(name):
        """Brick sets by name: "" = the domain, "W" = out_bricks, then grown along i / j / k (axis 0..2).
        Prefixes first, in a loop: a recursive closure would be a reference cycle (function <-> its cell),
        garbage for the cyclic collector after every update, with its tensors."""
        for end in range(len(name) + 1):
            key = name[:end]
            if key in sets:
                continue
            if key == "":
                sets[key] = None
            elif key == "W":
                sets[key] = out_bricks
            else:
                base = sets[key[:-1]]
                if base is None:
                    sets[key] = None
                else:
                    g = _grow_axis(base, rb, "ijk".index(key[-1])) if base.shape[0] else base
                    g = g[_member(voxel_keys(g), keys)]
                    sets[key] = None if g.shape[0] == nb else g
        return sets[name]

    def layout(axis, name=""):
        sub = subset(name) if name != "lines" else lines_of(axis)
        if sub is not None:  # used once: not kept
            row = torch.searchsorted(keys, voxel_keys(sub))  # subset brick -> domain brick
            return _line_layout(sub, axis, rows, row, nb)
        if axis not in layouts:
            layouts[axis] = _line_layout(bricks, axis, rows)
        return layouts[axis]

    if not _cuda_path(dev):  # the domain bricks holding a site
        marked = torch.zeros(nb, dtype=torch.bool, device=dev)
        marked[at // 64] = True

    def lines_of(axis):
        """On the CPU the line pass along ``axis`` runs on the runs of bricks that hold a site only (CUDA:
        the whole domain, one pass, no host read)."""
        if _cuda_path(dev):
            return None
        rows_ = _runs_with(bricks, axis, marked)
        return None if rows_ is None else bricks[rows_]

    # voxel -> its site row (``S``: none), 4 B a voxel shared by the three axes (was a float32 [n + 1, 3]
    # table of crossings per axis, 12 B a voxel each): a slot's crossings are one gather through it
    n_sites = site_t.shape[0]
    site_of = torch.full((n + 1,), n_sites, dtype=_index_dtype(n_sites + 1), device=dev)
    site_of[at] = torch.arange(n_sites, dtype=site_of.dtype, device=dev)

    def crossings(axis):
        """float32 ``[S + 1, 3]``: leftmost, rightmost, nearest crossing per site row (NaN: none; row ``S``
        = no site), read through ``site_of``."""
        d = site_t[:, 3 * axis : 3 * axis + 3]
        return torch.cat((d, d.new_full((1, 3), math.nan)))

    def run(axis, jobs, name=""):
        perm, starts, lengths, chunks = layout(axis, name)
        whole = (0, perm.numel(), 0, starts.numel())
        for job in jobs:
            # line passes in chunks of ``rows`` slots (bounded temporaries); an envelope pass at once (its
            # host loop steps once per slot of a line: chunks would repeat it; it bounds its own batches)
            for s, e, l0, l1 in chunks if job.chunked else [whole]:
                job(perm[s:e], starts[l0:l1] - s, lengths[l0:l1])  # voxels in slot order, lines in the chunk

    def line_job(out, axis):
        cr = crossings(axis)

        def job(idx, start, length):
            c = cr[site_of[idx]]  # one gather of the three columns
            out[idx] = _line_min(c[:, 0], c[:, 1], c[:, 2], start, length)

        job.chunked = True
        return job

    def window_job(arr):
        def job(idx, start, length):
            arr[idx] = distance_pass(arr[idx], start, length, margin)

        job.chunked = False
        return job

    def fresh():
        return torch.full((n + 1,), math.inf, dtype=torch.float32, device=dev)

    # CUDA: the envelope passes on the whole domain (its three layouts, built once for the line passes:
    # exact, as the cold path; the per-pass subsets below cost ~70 host ops and 3 syncs each, more than
    # the passes they save there); the CPU keeps the subsets (its passes cost per slot)
    batched = _cuda_path(dev) and not SUBSET_PASSES_CUDA
    w = "" if out_bricks is None or batched else "W"
    pre: dict = {}
    a = b = c = None
    if 2 in axes:
        a = pre.get(2)
        if a is None:
            a = fresh()
            run(2, [line_job(a, 2)], "lines")
        run(1, [window_job(a)], w + "ij")
    if 1 in axes:
        b = pre.get(1)
        if b is None:
            b = fresh()
            run(1, [line_job(b, 1)], "lines")
        run(2, [window_job(b)], w + "ik")
        a = b if a is None else torch.minimum(a, b, out=a)
        del b
    if a is not None:
        run(0, [window_job(a)], w + "i")
    if 0 in axes:
        c = pre.get(0)
        if c is None:
            c = fresh()
            run(0, [line_job(c, 0)], "lines")
            if not batched:  # the CPU rebuilds the two layouts below rather than keep all three
                layouts.clear()
        run(1, [window_job(c)], w + "kj")
        run(2, [window_job(c)], w + "k")
        a = c if a is None else torch.minimum(a, c, out=a)
    if a is None:
        a = fresh()
    return a[:n].reshape(nb, 64)


# ---------------------------------------------------------------------------------------- integrator
class EsdfIntegrator:
    """Maintains the ESDF layer of a map from its TSDF (or occupancy) layer and its free record.

    Args:
        voxel_size_m: the ESDF's voxel edge (metres), ``>=`` the source layers' voxel.
        max_distance_m: distances beyond this are stored as this value (with their sign).
        device: where the layer lives.
        cpu_rows: slots per chunk of a line pass on the CPU (bounds the temporaries; results do not
            depend on it).
        source_voxel_size_m: the TSDF / occupancy voxel edge (default: ``voxel_size_m``).
    """

    def __init__(
        self,
        voxel_size_m: float,
        max_distance_m: float,
        device: torch.device,
        cpu_rows: int = CPU_ROWS,
        source_voxel_size_m: float | None = None,
    ):
        if source_voxel_size_m is None:
            source_voxel_size_m = voxel_size_m
        for name, x in (
            ("voxel_size_m", voxel_size_m),
            ("max_distance_m", max_distance_m),
            ("source_voxel_size_m", source_voxel_size_m),
        ):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
            if not math.isfinite(x) or x <= 0:
                raise InvalidArgument(f"{name}: expected a finite value > 0, got {x}")
        if voxel_size_m < source_voxel_size_m:
            raise InvalidArgument(
                f"esdf_voxel_size_m: {voxel_size_m} m is finer than the map's voxel ({source_voxel_size_m} m)"
            )
        self.voxel_size_m = float(voxel_size_m)
        self.source_voxel_size_m = float(source_voxel_size_m)
        self.ratio = self.voxel_size_m / self.source_voxel_size_m
        self.max_distance_m = float(max_distance_m)
        reach = self.max_distance_m / self.voxel_size_m
        if reach > 4096:
            raise InvalidArgument(
                f"max_distance_m: {max_distance_m} m is {reach:.0f} voxels; at most 4096 voxels are supported"
            )
        self.device = torch.device(device)
        self.cpu_rows = int(cpu_rows)
        # M: a crossing within max_distance of a voxel lies in a site voxel within floor(reach + 1/2) of it
        # along every axis; one more voxel keeps float rounding at the cut-off out of the question.
        self.margin = math.floor(reach + 0.5) + 1
        self.brick_radius = -(-self.margin // 4)  # Rb = ceil(M / 4)
        self.layer = BrickLayer(esdf_fields(self.max_distance_m), self.device)
        self.last: dict = {}
        self.tile_bricks = TILE_BRICKS  # a larger change is recomputed in tiles (bounded working memory)

    @property
    def same_lattice(self) -> bool:
        """True when the ESDF voxel is the source layers' voxel (the sites are the fine crossings)."""
        return self.ratio == 1.0

    # ------------------------------------------------------------------------------------------ API
    def update(
        self,
        tsdf: BrickLayer | None,
        occupancy: BrickLayer | None,
        dirty,
        tsdf_config=None,
        free: BrickLayer | None = None,
        dirty_free=(),
    ) -> dict:
        """Bring the ESDF up to date after the source voxels in the ``dirty`` bricks changed.

        Args:
            tsdf, occupancy: the map's source layers (None when absent); the TSDF gives the surface
                when present, else the occupancy layer.
            dirty: list of int64 ``[B, 3]`` brick coordinates (``voxel >> 2``, source voxels) whose source
                data changed since the previous call (duplicates allowed).
            tsdf_config: unused (the surface comes from the stored values); accepted for the Map's call.
            free: the free record (ESDF voxels, see :mod:`mapper.integrators.free`) or None.
            dirty_free: list of int64 ``[B, 3]`` ESDF bricks whose free-record state (known or not) changed.
        Returns:
            ``{"skipped", "recomputed_voxels", "computed_voxels", "sites", "bricks_freed", "ms"}``;
            ``skipped`` (nothing dirty: returns at once, no tensor touched).
        """
        dirty = [self._check_dirty(t) for t in dirty]
        dirty_free = [self._check_dirty(t) for t in dirty_free]
        if not any(t.shape[0] for t in dirty) and not any(t.shape[0] for t in dirty_free):
            return {"skipped": True, "recomputed_voxels": 0, "computed_voxels": 0, "sites": 0, "ms": 0.0}
        t0 = time.perf_counter()
        parts = [t for t in dirty if t.shape[0]]
        if parts and not self.same_lattice:
            parts = [fine_to_coarse_bricks(_unique_bricks(torch.cat(parts)), self.ratio, 2)]
        delta = _unique_bricks(torch.cat(parts + [t for t in dirty_free if t.shape[0]]))
        # Margins (ESDF voxels: M voxels, Rb = ceil(M / 4) bricks). Source values changed only in the delta
        # bricks (fine changes mapped to every ESDF brick whose samples can read them). The sites filed
        # under a voxel depend on it and its neighbours, so site voxels change only within 1 brick of delta:
        # S = delta + 1. A stored value depends on the site voxels within M (box) of the voxel, the computed
        # domain and the stored set on those within Rb bricks and on the observed flags there: all change
        # only in O = S + Rb (sign/observed change in delta, inside O). Recomputing O exactly needs every
        # site voxel within M of O and the intermediate values on the lines between a voxel and such a site
        # voxel, all inside the box of half-width M around the voxel: R = O + Rb. The domain computed is
        # (site bricks in R) + Rb and (observed bricks in R) + Rb, restricted to R, which holds every
        # intermediate of those boxes.
        # A change larger than ``tile_bricks`` (a cold map after an import or a restart, a long drive's
        # backlog) is recomputed tile by tile: every tile's regions are its own delta's, so the working set
        # follows the tile, and the union of the tiles' outputs is the whole delta's (each exact).
        res = self._tiled(
            delta, 1 + self.brick_radius, lambda o, r: self._recompute(tsdf, occupancy, free, r, o)
        )
        res["ms"] = (time.perf_counter() - t0) * 1e3
        self.last = res
        return dict(res)

    def recompute(
        self, tsdf: BrickLayer | None, occupancy: BrickLayer | None, free: BrickLayer | None = None
    ):
        """Rebuild the whole ESDF from the source layers (cold); same result as the incremental path.

        A map of more than ``tile_bricks`` candidate ESDF bricks is rebuilt tile by tile (bounded working
        memory, progress in the log): every ESDF brick that may hold an observed voxel or is stored now is
        one tile's output, computed from its tile grown by ``Rb`` (every site and intermediate it needs)."""
        t0 = time.perf_counter()
        cand = self._cold_candidates(tsdf, occupancy, free)
        if cand is None:
            res = self._recompute(tsdf, occupancy, free, None, None)
        else:
            res = self._tiled(cand, 0, lambda o, r: self._recompute(tsdf, occupancy, free, r, o))
        res["ms"] = (time.perf_counter() - t0) * 1e3
        self.last = res
        return dict(res)

    def _cold_candidates(self, tsdf, occ, free) -> torch.Tensor | None:
        """Sorted unique ESDF bricks a cold rebuild must visit (those that may hold an observed voxel, and
        the stored ones), or None when the map is small enough for one pass (``tile_bricks``)."""
        n = sum(la.num_bricks for la in (tsdf, occ, free, self.layer) if la is not None)
        if n <= self.tile_bricks:
            return None
        parts = [self.layer.brick_table()[0]] if self.layer.grid.num_leaves else []
        for la in (tsdf, occ):
            if la is not None and la.grid.num_leaves:
                b = la.brick_table()[0]
                parts.append(
                    b if self.same_lattice else fine_to_coarse_bricks(_unique_bricks(b), self.ratio, 2)
                )
        if free is not None and free.grid.num_leaves:
            parts.append(free.brick_table()[0])
        if not parts:
            return None
        return _unique_bricks(torch.cat(parts))

    def _tiled(self, delta: torch.Tensor, grow: int, step) -> dict:
        """``step(out_region, region)`` over ``delta`` (sorted unique ESDF bricks) grown by ``grow`` (output)
        and ``grow + Rb`` (sources): at once when ``delta`` has at most ``tile_bricks`` bricks, else over
        groups of whole tiles (``2^TILE_SHIFT`` bricks a side, in key order) of about ``tile_bricks`` delta
        bricks each, logging progress. Returns the summed counts."""
        rb = self.brick_radius
        if delta.shape[0] <= self.tile_bricks:
            if grow:
                out_region, region = _dilate_pair(delta, grow, grow + rb)
            else:
                out_region, region = delta, _dilate_bricks(delta, rb)
            return step(out_region, region)
        tile = voxel_keys(delta >> TILE_SHIFT)
        tile, order = torch.sort(tile, stable=True)
        _, counts = torch.unique_consecutive(tile, return_counts=True)
        bounds, acc = [0], 0
        for c in counts.tolist():  # one read: whole tiles per group, about tile_bricks delta bricks each
            if acc and acc + c > self.tile_bricks:
                bounds.append(bounds[-1] + acc)
                acc = 0
            acc += c
        bounds.append(bounds[-1] + acc)
        n_groups = len(bounds) - 1
        t0 = time.perf_counter()
        log.info("esdf: updating %d bricks in %d tile groups", delta.shape[0], n_groups)
        total: dict = {
            "skipped": False,
            "recomputed_voxels": 0,
            "computed_voxels": 0,
            "sites": 0,
            "bricks_freed": 0,
        }
        for g in range(n_groups):
            part = _unique_bricks(delta[order[bounds[g] : bounds[g + 1]]])
            if grow:
                out_region, region = _dilate_pair(part, grow, grow + rb)
            else:
                out_region, region = part, _dilate_bricks(part, rb)
            res = step(out_region, region)
            for k in ("recomputed_voxels", "computed_voxels", "sites", "bricks_freed"):
                total[k] += res[k]
            del out_region, region, part, res
            if g + 1 == n_groups or (g + 1) % max(n_groups // 10, 1) == 0:
                log.info(
                    "esdf: tile group %d / %d done (%.1f s, %d voxels written so far)",
                    g + 1,
                    n_groups,
                    time.perf_counter() - t0,
                    total["recomputed_voxels"],
                )
        total["tiles"] = n_groups
        return total

    def sites(
        self, tsdf: BrickLayer | None, occupancy: BrickLayer | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All site points (float64 ``[P, 3]``, ESDF voxel units: voxel ``v``'s centre is ``v + 1/2``):
        the point set whose exact distance the ESDF stores (for tests and inspection)."""
        vox, t = self._sites(tsdf, occupancy, None)
        pts = []
        for a in range(3):
            for c in range(3):
                off = t[:, 3 * a + c]
                ok = ~torch.isnan(off)
                p = vox[ok].to(torch.float64) + 0.5
                p[:, a] += off[ok].to(torch.float64)
                pts.append(p)
        return torch.unique(torch.cat(pts), dim=0), vox

    def view(self) -> tuple[IndexGrid, dict[str, torch.Tensor]]:
        """(grid of the ESDF voxels, {"esdf": float32 [N] metres, "observed": bool [N]}) in voxel order."""
        return self.layer.voxel_view(["esdf", "observed"])

    def stats(self) -> dict:
        la = self.layer
        return {
            "voxels": la.grid.num_voxels,
            "bricks": la.num_bricks,
            "bytes": la.nbytes,
            "topology_bytes": la.grid.nbytes + la.slots.numel() * la.slots.element_size(),
            "voxel_size_m": self.voxel_size_m,
            "max_distance_m": self.max_distance_m,
            "margin_vox": self.margin,
            "last_update": dict(self.last),
        }

    # ------------------------------------------------------------------------------------- internals
    def _check_dirty(self, t) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentType(f"dirty: expected int64 [B, 3] tensors, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] != 3:
            raise InvalidArgument(f"dirty: expected shape [B, 3], got {list(t.shape)}")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise InvalidArgumentType(f"dirty: expected integer brick coordinates, got {t.dtype}")
        return t.to(device=self.device, dtype=torch.int64)

    def _fine_bricks(self, la: BrickLayer, near, cache: dict | None) -> torch.Tensor:
        """Sorted unique bricks of a source layer whose home ESDF brick is in ``near`` (None: all); kept in
        ``cache`` for the other readers of the same update (sites and observed candidates)."""
        if cache is not None and id(la) in cache:
            return cache[id(la)]
        b = la.brick_table()[0]
        b = _unique_bricks(b if near is None else b[self._fine_near(b, near)])
        if cache is not None:
            cache[id(la)] = b
        return b

    def _sites(self, tsdf, occ, region, near=None, cache: dict | None = None):
        """Site voxels (ESDF lattice) and their crossings ``[S, 9]`` in ``region`` (None: all)."""
        src = tsdf if tsdf is not None else occ
        if src is None:
            raise InvalidArgument("esdf: needs a tsdf or occupancy layer for its surface sites")
        if self.same_lattice:
            if region is None:
                src_bricks = _unique_bricks(src.brick_table()[0])
            else:
                src_bricks = region[(self._region_slots(src, region, cache) >= 0).nonzero().squeeze(1)]
            if tsdf is not None:
                vox, t = tsdf_sites(tsdf, src_bricks)
            else:
                vox, t = occupancy_sites(occ, src_bricks)
            return vox, edge_sites(t)
        # fine bricks within 2 ESDF bricks of the region (all without one): every source of its sites
        if region is not None and near is None:
            near = self._near_keys(region)
        fine = self._fine_bricks(src, near, cache)
        if tsdf is not None:
            vox, t = coarse_tsdf_sites(
                tsdf, fine, self.ratio, front_max=FRONT_MAX_VOX * self.source_voxel_size_m
            )
        else:
            vox, t = coarse_occupancy_sites(occ, fine, self.ratio)
        if region is not None:
            keep = _member(voxel_keys(vox >> 2), voxel_keys(region))
            vox, t = vox[keep], t[keep]
        return vox, t

    def _fine_near(self, fine: torch.Tensor, near: torch.Tensor) -> torch.Tensor:
        """bool ``[F]``: which fine bricks have their home ESDF brick (the one holding their first voxel's
        centre) in ``near`` (sorted keys of the region grown by 2 bricks): every fine brick whose samples an
        ESDF voxel of the region can read (sites: pad 2 fine voxels; signs: the 8 corners; ``ratio > 1``)."""
        at = torch.floor((fine.to(torch.float64) * 4 + 0.5) / self.ratio).to(torch.int64) >> 2
        return _member(voxel_keys(at), near)

    def _near_keys(self, region):
        """Sorted keys of ``region`` grown by 2 bricks (None: no region, or the same lattice)."""
        if region is None or self.same_lattice:
            return None
        return voxel_keys(_dilate_bricks(region, 2))

    def _observed_candidates(
        self, tsdf, occ, free, region, near=None, cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ESDF bricks that may hold an observed voxel (sorted unique), in ``region`` (None: all), and
        which of them the source layers can reach (the others are known through the free record only)."""
        if region is not None and self.same_lattice:
            return self._region_candidates(tsdf, occ, free, region, cache)
        parts = []
        for la in (tsdf, occ):
            if la is None or la.grid.num_leaves == 0:
                continue
            if self.same_lattice:
                b = la.brick_table()[0]
            else:  # only the fine bricks near the region (not the whole map's)
                b = fine_to_coarse_bricks(self._fine_bricks(la, near, cache), self.ratio, 1)
            parts.append(b)
        src = (
            _unique_bricks(torch.cat(parts))
            if parts
            else torch.zeros((0, 3), dtype=torch.int64, device=self.device)
        )
        if free is not None and free.grid.num_leaves:
            cand = _unique_bricks(torch.cat((src, free.brick_table()[0])))
        else:
            cand = src
        if region is not None:
            cand = cand[_member(voxel_keys(cand), voxel_keys(region))]
        return cand, _member(voxel_keys(cand), voxel_keys(src))

    @staticmethod
    def _region_slots(la: BrickLayer, region: torch.Tensor, cache: dict | None) -> torch.Tensor:
        """int64 ``[R]`` slots of the region's bricks in ``la`` (-1: absent); one lookup per layer and
        update (``cache``)."""
        key = ("slots", id(la))
        if cache is not None and key in cache:
            return cache[key]
        if la.grid.num_leaves == 0 or region.shape[0] == 0:
            slot = torch.full((region.shape[0],), -1, dtype=torch.int64, device=region.device)
        else:
            slot = la.voxel_slots(region << 2)[0]
        if cache is not None:
            cache[key] = slot
        return slot

    def _region_candidates(self, tsdf, occ, free, region, cache: dict | None = None):
        """:meth:`_observed_candidates` on the same lattice with a region: the region's bricks allocated in
        a source layer or the free record, found by looking the region up in each (a few launches, work
        O(region)) instead of merging the layers' whole brick tables (O(map), ~90 ops)."""
        src = torch.zeros(region.shape[0], dtype=torch.bool, device=self.device)
        for la in (tsdf, occ):
            if la is not None and la.grid.num_leaves:
                src |= self._region_slots(la, region, cache) >= 0
        known = src
        if free is not None and free.grid.num_leaves:
            known = src | (free.voxel_slots(region << 2)[0] >= 0)
        rows = known.nonzero().squeeze(1)
        return region[rows], src[rows]

    def _sign_observed(self, tsdf, occ, free, bricks, near_src):
        """(inside, observed) ``[M, 64]`` of ESDF bricks; the source layers are read only where
        ``near_src`` (bool ``[M]``)."""
        if self.same_lattice:
            inside, observed = sign_observed(tsdf, occ, bricks)
            if free is not None:
                known = ~torch.isnan(_gather_bricks(free, bricks, "log_odds", math.nan).float())
                return inside & ~known, observed | known
            return inside, observed
        inside = torch.zeros((bricks.shape[0], 64), dtype=torch.bool, device=self.device)
        observed = torch.zeros_like(inside)
        idx = near_src.nonzero().squeeze(1)
        if idx.numel():
            inside[idx], observed[idx] = coarse_sign_observed(tsdf, occ, free, bricks[idx], self.ratio)
        idx = (~near_src).nonzero().squeeze(1)
        if idx.numel() and free is not None:
            observed[idx] = ~torch.isnan(_gather_bricks(free, bricks[idx], "log_odds", math.nan).float())
        return inside, observed

    def _recompute(self, tsdf, occ, free, region, out_region) -> dict:
        """Recompute the bricks of ``out_region`` (None: all) from the sources in ``region`` (None: all).

        Stored: the bricks with an observed voxel that lie within ``Rb`` bricks of a site brick; computed:
        (site bricks + Rb) and (observed bricks + Rb), which holds every intermediate value of the
        separable transform for a stored voxel and every site within ``M`` of it (exact values)."""
        near = self._near_keys(region)
        cache: dict = {}  # the source layers' bricks near the region, read once
        site_vox, site_t = self._sites(tsdf, occ, region, near, cache)
        site_bricks = _unique_bricks(site_vox >> 2)
        cand, near_src = self._observed_candidates(tsdf, occ, free, region, near, cache)
        inside, observed = self._sign_observed(tsdf, occ, free, cand, near_src)
        # selections by one index each (one nonzero), not by a boolean mask per tensor (a sync each)
        seen = observed.any(dim=1).nonzero().squeeze(1)
        obs_bricks = cand[seen]
        inside, observed = inside[seen], observed[seen]
        domain = _dilate_bricks(site_bricks, self.brick_radius)
        dk = voxel_keys(domain)  # keys of each set computed once (sorted: the sets are)
        in_dom = _member(dk, voxel_keys(_dilate_bricks(obs_bricks, self.brick_radius)))
        if region is not None:
            in_dom &= _member(dk, voxel_keys(region))
        in_dom = in_dom.nonzero().squeeze(1)
        domain, dk = domain[in_dom], dk[in_dom]
        ok = voxel_keys(obs_bricks)
        keep = _member(ok, dk)
        if out_region is not None:
            keep &= _member(ok, voxel_keys(out_region))
        keep = keep.nonzero().squeeze(1)
        write, inside, observed = obs_bricks[keep], inside[keep], observed[keep]
        freed = self._free_outside(write, out_region)
        n_write = write.shape[0]
        if n_write:
            in_dom = _member(voxel_keys(site_vox >> 2), dk).nonzero().squeeze(1)
            axes = (2, 1, 0) if tsdf is not None else (2,)
            d2 = squared_distances(
                domain, site_vox[in_dom], site_t[in_dom], self.margin, axes, self.cpu_rows, write
            )
            d2 = d2[torch.searchsorted(dk, ok[keep])]  # the written bricks' rows (all in the domain)
            dist = torch.clamp(torch.sqrt(d2) * self.voxel_size_m, max=self.max_distance_m)
            slots = self.layer.allocate(write)
            self.layer.pool.scatter("esdf", slots, torch.where(inside, -dist, dist))
            self.layer.pool.scatter("observed", slots, observed)
        if self.layer.num_bricks == 0 and self.layer.pool.capacity:
            self.layer = BrickLayer(esdf_fields(self.max_distance_m), self.device)  # give the pages back
        return {
            "skipped": False,
            "recomputed_voxels": 64 * n_write,
            "computed_voxels": 64 * domain.shape[0],
            "sites": int(site_vox.shape[0]),
            "bricks_freed": freed,
        }

    def _free_outside(self, keep: torch.Tensor, out_region: torch.Tensor | None) -> int:
        """Free the ESDF bricks of ``out_region`` (None: all) that are not in ``keep`` (sorted)."""
        la = self.layer
        if la.grid.num_leaves == 0:
            return 0
        have = la.brick_table()[0] if out_region is None else _existing_bricks(la, out_region)
        drop = have[~_member(voxel_keys(have), voxel_keys(keep))]
        if drop.shape[0] == 0:
            return 0
        mask = torch.zeros_like(la.slots, dtype=torch.bool)
        mask[la.grid.ijk_to_leaf(drop << 2), brick_in_leaf(drop << 2)] = True
        la.release_bricks(mask)
        return int(drop.shape[0])

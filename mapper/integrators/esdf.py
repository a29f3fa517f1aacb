"""Euclidean signed distance field (ESDF): exact distances to the fused surface, updated incrementally.

**Surface sites.** From the TSDF: the zero crossings between observed (weight > 0) 6-neighbour voxels
whose values have opposite sign (positive = ``tsdf > 0``, as :func:`mapper.surface.zero_crossings`), at
the point ``t = a / (a - b)`` of the edge between the two voxel centres. A crossing belongs to the
endpoint voxel it is nearest to (``t <= 0.5``: the lower one), so it lies within half a voxel of that
voxel's centre; a voxel holding at least one crossing is a **site voxel** with up to six crossings (one
per edge direction). Without a TSDF layer, the occupied voxels (``log_odds > 0``) of the occupancy layer
are site voxels whose only point is their centre.

**Distance.** Let ``Dc = max_distance / s + 1/2`` (voxels). For a voxel ``x`` the nearest site voxel
``s*`` by centre distance, among those with ``|x - s|^2 <= floor(Dc^2)``, ties broken by the smallest
``(i, j, k)``, is found by an exact separable squared-distance transform; the stored value is the
Euclidean distance from ``x``'s centre to the nearest crossing *of that site voxel* (the one nearest to
the querying voxel), clamped to ``max_distance``, and exactly ``max_distance`` when there is no such
site. (A crossing within ``max_distance`` has its site voxel's centre within ``Dc``, so no surface point
closer than ``max_distance`` is missed; the result can exceed the distance to the nearest crossing only
when that crossing belongs to another site voxel than the nearest centre, by a small fraction of a voxel.)

**Sign and observed.** Where the TSDF observed the voxel: its sign (``tsdf <= 0`` is inside, negative);
else where the occupancy layer knows it: occupied (``log_odds > 0``) is negative, free positive; else
positive. ``observed`` = TSDF weight > 0 or occupancy log-odds not NaN.

**Domain.** The ESDF layer holds the bricks within ``Rb = ceil(W / 4)`` bricks (box) of a brick holding
a site, ``W = floor(sqrt(floor(Dc^2)))``: exactly the bricks that can hold a voxel with a site within
``Dc`` (a voxel within ``W`` of site voxel ``c`` along an axis lies in brick ``(c + W) >> 2 <=
(c >> 2) + ceil(W / 4)``). Bricks that leave the domain are freed.

**Algorithm** (exact, order independent). Three 1-D passes over the domain's voxels, along k, then j,
then i. Each pass lays the voxels out line by line (bricks sorted by the other two axes, each maximal run
of consecutive bricks gives 16 lines of ``4 n`` voxels, every line followed by ``W`` empty slots), and
takes, for every voxel, the minimum over the offsets ``|d| <= W`` of ``f(p + d) + d^2`` with shifted
slices of one flat array (no gathers). Values are packed integers ``(d2 << b) | (d + W)`` so the minimum
also breaks ties towards the smallest coordinate, which makes the argmin the lexicographically smallest
site among the nearest (pass k first: within a pass the candidates differ only in the axis being
processed). Values above ``floor(Dc^2)`` are dropped after every pass. The argmin's site index travels
with the minimum. Work: ``O(N W)`` integer min/add per pass on ``N (1 + W / (4 n))`` slots, no sorting
of voxels (only of bricks); on the CPU the lines are processed in chunks of ``cpu_rows`` slots.

Why any exact method would be enough for incremental == cold: every stored value is a function of the
site voxels within ``W`` (box) of the voxel, of their crossings and of the voxel's own source values;
the passes only ever combine exact candidates, and floating point work is element-wise.
"""

from __future__ import annotations

import math
import time

import torch

from ..errors import InvalidArgument, InvalidArgumentType
from ..grid import IndexGrid
from ..layers import BrickLayer, FieldSpec, brick_in_leaf, brick_offsets
from .common import keys_to_ijk, voxel_keys

CPU_ROWS = 1 << 17  # slots per chunk of a pass on the CPU (int32: 512 KB per array)
CPU_BRICKS = 1 << 11  # bricks per chunk for site extraction and distances on the CPU
_INT32_MAX = (1 << 31) - 1
# crossing slots of a site voxel: (+i, -i, +j, -j, +k, -k)
_SLOT_AXIS = (0, 0, 1, 1, 2, 2)
_SLOT_SIGN = (1.0, -1.0, 1.0, -1.0, 1.0, -1.0)

_LOCAL: dict[torch.device, torch.Tensor] = {}


def esdf_fields(max_distance_m: float) -> dict[str, FieldSpec]:
    """Per-voxel storage: float32 signed distance (metres) and a bool observed flag (5 B/voxel)."""
    return {"esdf": FieldSpec(torch.float32, (), max_distance_m), "observed": FieldSpec(torch.bool, (), 0)}


def _brick_local(device: torch.device) -> torch.Tensor:
    """int64 ``[64, 3]``: voxel coordinates inside a brick, in brick-offset order ``(i << 4 | j << 2 | k)``."""
    t = _LOCAL.get(device)
    if t is None:
        o = torch.arange(64)
        t = torch.stack((o >> 4, (o >> 2) & 3, o & 3), dim=1).to(device)
        _LOCAL[device] = t
    return t


def _chunks(n: int, device: torch.device, rows: int):
    step = n if device.type == "cuda" or n <= rows else rows
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


def _dilate_bricks(bricks: torch.Tensor, r: int) -> torch.Tensor:
    """Sorted unique int64 ``[M', 3]`` bricks within Chebyshev distance ``r`` of the unique ``bricks``."""
    if bricks.shape[0] == 0 or r == 0:
        return _unique_bricks(bricks)
    for axis in range(3):
        bricks = _dilate_axis(bricks, r, axis)
    return _unique_bricks(bricks)


# ------------------------------------------------------------------------------------- source values
def _gather_bricks(layer: BrickLayer | None, bricks: torch.Tensor, name: str, fill) -> torch.Tensor:
    """Field ``name`` of whole bricks (int64 ``[M, 3]`` brick coordinates) -> ``[M, 64]`` in the field's
    dtype; absent bricks (or no layer) read ``fill``."""
    if layer is None:
        return torch.full((bricks.shape[0], 64), fill, device=bricks.device)
    dtype = layer.pool.fields[name].dtype
    if bricks.shape[0] == 0 or layer.grid.num_leaves == 0 or layer.pool.capacity == 0:
        return torch.full((bricks.shape[0], 64), fill, dtype=dtype, device=bricks.device)
    slot, _ = layer.voxel_slots(bricks << 2)
    vals = layer.pool.gather(name, slot.clamp(min=0))
    return torch.where((slot >= 0)[:, None], vals, torch.full_like(vals, fill))


def _existing_bricks(layer: BrickLayer, bricks: torch.Tensor) -> torch.Tensor:
    """The rows of int64 ``[M, 3]`` ``bricks`` that are allocated in ``layer``."""
    if bricks.shape[0] == 0 or layer.grid.num_leaves == 0:
        return bricks[:0]
    slot, _ = layer.voxel_slots(bricks << 2)
    return bricks[slot >= 0]


def _tsdf_bricks(layer: BrickLayer, bricks: torch.Tensor):
    """(float32 tsdf, bool observed), each ``[M, 4, 4, 4]`` (i, j, k), of whole bricks."""
    t = _gather_bricks(layer, bricks, "tsdf", 0.0).to(torch.float32).reshape(-1, 4, 4, 4)
    w = _gather_bricks(layer, bricks, "weight", 0.0).reshape(-1, 4, 4, 4)
    return t, w > 0


def tsdf_sites(layer: BrickLayer, bricks: torch.Tensor, rows: int = CPU_BRICKS):
    """Site voxels of a TSDF layer inside the given bricks.

    Args:
        layer: TSDF layer (fields ``tsdf``, ``weight``).
        bricks: int64 ``[M, 3]`` unique brick coordinates (absent ones hold no site).
    Returns:
        int64 ``[S, 3]`` site voxels and float32 ``[S, 6]`` crossing offsets per edge direction
        ``(+i, -i, +j, -j, +k, -k)`` in voxels, in ``[0, 0.5]`` (NaN: no crossing on that edge).
    """
    dev = bricks.device
    local = _brick_local(dev)
    out_v, out_t = [], []
    for sl in _chunks(bricks.shape[0], dev, rows):
        b = bricks[sl]
        tv, ov = _tsdf_bricks(layer, b)
        slots = []
        for axis in range(3):
            d = axis + 1
            e = torch.zeros(3, dtype=torch.int64, device=dev)
            e[axis] = 1
            tp, op = _tsdf_bricks(layer, b + e)
            tm, om = _tsdf_bricks(layer, b - e)
            # values at v + e_axis and at v - e_axis (the neighbour brick's face where v is on the border)
            t_next = torch.cat((tv.narrow(d, 1, 3), tp.narrow(d, 0, 1)), dim=d)
            o_next = torch.cat((ov.narrow(d, 1, 3), op.narrow(d, 0, 1)), dim=d)
            t_prev = torch.cat((tm.narrow(d, 3, 1), tv.narrow(d, 0, 3)), dim=d)
            o_prev = torch.cat((om.narrow(d, 3, 1), ov.narrow(d, 0, 3)), dim=d)
            pos = tv > 0
            # edge (v, v + e): t = a / (a - b) from v; it is v's crossing when t <= 0.5
            cross = ov & o_next & (pos != (t_next > 0))
            t = tv / (tv - t_next)
            slots.append(torch.where(cross & (t <= 0.5), t, torch.full_like(t, math.nan)))
            # edge (v - e, v): the same expression evaluated from the lower voxel; v's when t > 0.5
            cross = o_prev & ov & ((t_prev > 0) != pos)
            t = t_prev / (t_prev - tv)
            slots.append(torch.where(cross & (t > 0.5), 1.0 - t, torch.full_like(t, math.nan)))
        tt = torch.stack(slots, dim=-1).reshape(-1, 64, 6)
        site = ~torch.isnan(tt).all(dim=2)
        bi, oi = site.nonzero(as_tuple=True)
        out_v.append(b[bi] * 4 + local[oi])
        out_t.append(tt[bi, oi])
    if not out_v:
        return torch.zeros((0, 3), dtype=torch.int64, device=dev), torch.zeros((0, 6), device=dev)
    return torch.cat(out_v), torch.cat(out_t)


def occupancy_sites(layer: BrickLayer, bricks: torch.Tensor, rows: int = CPU_BRICKS):
    """Occupied voxels (``log_odds > 0``) of an occupancy layer inside the given bricks, as site voxels
    whose only point is the centre: (int64 ``[S, 3]``, float32 ``[S, 6]`` = ``(0, NaN, ..., NaN)``)."""
    dev = bricks.device
    local = _brick_local(dev)
    out = []
    for sl in _chunks(bricks.shape[0], dev, rows):
        b = bricks[sl]
        lo = _gather_bricks(layer, b, "log_odds", math.nan)
        bi, oi = (lo > 0).nonzero(as_tuple=True)
        out.append(b[bi] * 4 + local[oi])
    v = torch.cat(out) if out else torch.zeros((0, 3), dtype=torch.int64, device=dev)
    t = torch.full((v.shape[0], 6), math.nan, device=dev)
    t[:, 0] = 0.0
    return v, t


def sign_observed(tsdf: BrickLayer | None, occ: BrickLayer | None, bricks: torch.Tensor):
    """(bool inside ``[M, 64]``, bool observed ``[M, 64]``) of whole bricks from the source layers."""
    m = bricks.shape[0]
    obs_t = torch.zeros((m, 64), dtype=torch.bool, device=bricks.device)
    inside_t = torch.zeros_like(obs_t)
    if tsdf is not None:
        obs_t = _gather_bricks(tsdf, bricks, "weight", 0.0) > 0
        inside_t = _gather_bricks(tsdf, bricks, "tsdf", 0.0) <= 0
    known = torch.zeros_like(obs_t)
    occupied = torch.zeros_like(obs_t)
    if occ is not None:
        lo = _gather_bricks(occ, bricks, "log_odds", math.nan)
        known = ~torch.isnan(lo)
        occupied = lo > 0
    return torch.where(obs_t, inside_t, occupied), obs_t | known


# ----------------------------------------------------------------------------------------- transform
class _Packing:
    """Integer packing of a pass value: ``(d2 << bits) | (d + W)``; ``inf`` marks "no site within Dc"."""

    def __init__(self, dc2: int, window: int):
        self.dc2 = dc2
        self.window = window
        self.bits = (2 * window + 1).bit_length()
        self.mask = (1 << self.bits) - 1
        self.inf = (dc2 + 1) << self.bits
        worst = (2 * dc2 + 2) << self.bits  # inf + the largest offset cost
        self.dtype = torch.int32 if worst <= _INT32_MAX else torch.int64


def _line_layout(bricks: torch.Tensor, axis: int, window: int, rows: int):
    """Slot layout of the voxels of the sorted unique ``bricks`` (``[B, 3]``) as lines along ``axis``.

    Returns int64 ``[P]`` ``perm`` (slot -> voxel index ``brick * 64 + offset``, ``64 B`` for an empty
    slot) and the chunk boundaries (a list of slot indices, chunks never split a run of bricks).
    """
    dev = bricks.device
    nb = bricks.shape[0]
    u, v = (x for x in range(3) if x != axis)
    order = torch.argsort(voxel_keys(bricks[:, [u, v, axis]]))
    c = bricks[order]
    ca = c[:, axis]
    new = torch.ones(nb, dtype=torch.bool, device=dev)
    new[1:] = (c[1:, u] != c[:-1, u]) | (c[1:, v] != c[:-1, v]) | (ca[1:] != ca[:-1] + 1)
    run = torch.cumsum(new, 0) - 1
    first = new.nonzero().squeeze(1)
    count = torch.diff(first, append=first.new_tensor([nb]))
    line = 4 * count + window  # a line of the run and its trailing empty slots
    size = 16 * line
    base = torch.cumsum(size, 0) - size
    total = int(base[-1] + size[-1])
    local = _brick_local(dev)
    sub = local[:, u] * 4 + local[:, v]
    t = torch.arange(nb, device=dev) - first[run]
    pos = (base[run] + 4 * t)[:, None] + sub[None, :] * line[run][:, None] + local[None, :, axis]
    perm = torch.full((total,), nb * 64, dtype=torch.int64, device=dev)
    perm[pos.reshape(-1)] = (order[:, None] * 64 + torch.arange(64, device=dev)).reshape(-1)
    if dev.type == "cuda" or total <= rows:
        return perm, [0, total]
    cut = torch.ones(base.numel(), dtype=torch.bool, device=dev)
    cut[1:] = (base[1:] // rows) != (base[:-1] // rows)
    return perm, base[cut].tolist() + [total]


def _pass(g: torch.Tensor, site: torch.Tensor, perm: torch.Tensor, bounds: list[int], pk: _Packing) -> None:
    """One 1-D pass in place: ``g[x] <- min_d g[x + d e] + d^2`` (packed, see module doc), ``site[x]`` <-
    the site of the argmin. ``g``/``site`` have one extra entry (the empty slot) at the end."""
    n_vox = g.numel() - 1
    w = pk.window
    dev = g.device
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        idx = perm[s:e]
        n = e - s
        src = g[idx]
        best = src + w
        tmp = torch.empty_like(best)
        for d in range(1, min(w, n - 1) + 1):
            c = (d * d) << pk.bits
            m = n - d
            torch.add(src[d:], c + w + d, out=tmp[:m])
            torch.minimum(best[:m], tmp[:m], out=best[:m])
            torch.add(src[:m], c + w - d, out=tmp[:m])
            torch.minimum(best[d:], tmp[:m], out=best[d:])
        d2 = best >> pk.bits
        ok = d2 <= pk.dc2
        at = (torch.arange(n, device=dev) + (best & pk.mask) - w).clamp_(0, n - 1)
        new_site = torch.where(ok, site[idx[at]], torch.full_like(best, -1, dtype=site.dtype))
        g[idx] = torch.where(ok, d2 << pk.bits, torch.full_like(best, pk.inf))
        site[idx] = new_site
        g[n_vox] = pk.inf  # empty slots wrote into the sentinel
        site[n_vox] = -1


def nearest_sites(
    bricks: torch.Tensor, site_vox: torch.Tensor, dc2: int, rows: int = CPU_ROWS
) -> torch.Tensor:
    """Exact nearest site voxel of every voxel of a brick domain.

    Args:
        bricks: int64 ``[B, 3]`` sorted (by key) unique bricks; must contain every site's brick.
        site_vox: int64 ``[S, 3]`` site voxels.
        dc2: squared cut-off (voxels^2): sites farther than ``sqrt(dc2)`` are ignored.
    Returns:
        int64 ``[B, 64]`` (brick offset order): index into ``site_vox`` of the nearest site by centre
        distance, ties to the smallest ``(i, j, k)``, among the sites reachable through the domain's
        voxels (all sites within the box of half-width ``floor(sqrt(dc2))`` around the voxel when the
        domain contains that box's intermediate lines); -1 where none is within ``sqrt(dc2)``.
    """
    dev = bricks.device
    nb = bricks.shape[0]
    pk = _Packing(dc2, math.isqrt(dc2))
    g = torch.full((nb * 64 + 1,), pk.inf, dtype=pk.dtype, device=dev)
    site = torch.full((nb * 64 + 1,), -1, dtype=pk.dtype, device=dev)
    if site_vox.shape[0]:
        b = torch.searchsorted(voxel_keys(bricks), voxel_keys(site_vox >> 2))
        at = b * 64 + brick_offsets(site_vox)
        g[at] = 0
        site[at] = torch.arange(site_vox.shape[0], device=dev, dtype=pk.dtype)
    for axis in (2, 1, 0):
        perm, bounds = _line_layout(bricks, axis, pk.window, rows)
        _pass(g, site, perm, bounds, pk)
        del perm
    return site[:-1].reshape(nb, 64).to(torch.int64)


def site_distances(
    bricks: torch.Tensor,
    nearest: torch.Tensor,
    site_vox: torch.Tensor,
    site_t: torch.Tensor,
    rows: int = CPU_BRICKS,
) -> torch.Tensor:
    """float32 ``[B, 64]`` distance (voxels) from each voxel centre of ``bricks`` (int64 ``[B, 3]``) to the
    nearest crossing of its site voxel ``nearest`` (int64 ``[B, 64]``, -1: none -> inf). Element-wise
    float32 arithmetic only, so equal inputs give equal bits whatever the batch."""
    dev = bricks.device
    out = torch.empty(nearest.shape, dtype=torch.float32, device=dev)
    local = _brick_local(dev)
    for sl in _chunks(bricks.shape[0], dev, rows):
        sid = nearest[sl]
        ok = sid >= 0
        s = sid.clamp(min=0)
        dv = (site_vox[s] - (bricks[sl, None, :] * 4 + local[None])).to(torch.float32)  # [m, 64, 3]
        tt = site_t[s]  # [m, 64, 6]
        best = torch.full(sid.shape, math.inf, device=dev)
        for k in range(6):
            comps = [dv[..., a] for a in range(3)]
            a = _SLOT_AXIS[k]
            comps[a] = comps[a] + tt[..., k] * _SLOT_SIGN[k]
            d2 = comps[0] * comps[0] + comps[1] * comps[1] + comps[2] * comps[2]
            best = torch.minimum(best, torch.where(torch.isnan(d2), torch.full_like(d2, math.inf), d2))
        out[sl] = torch.where(ok, torch.sqrt(best), torch.full_like(best, math.inf))
    return out


# ---------------------------------------------------------------------------------------- integrator
class EsdfIntegrator:
    """Maintains the ESDF layer of a map from its TSDF (or occupancy) layer.

    Args:
        voxel_size_m: voxel edge (metres), the same as the source layers'.
        max_distance_m: distances beyond this are stored as this value (with their sign).
        device: where the layer lives.
        cpu_rows: slots per chunk of a transform pass on the CPU (bounds the temporaries; results do not
            depend on it).
    """

    def __init__(
        self, voxel_size_m: float, max_distance_m: float, device: torch.device, cpu_rows: int = CPU_ROWS
    ):
        for name, x in (("voxel_size_m", voxel_size_m), ("max_distance_m", max_distance_m)):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise InvalidArgumentType(f"{name}: expected a number, got {type(x).__name__}")
            if not math.isfinite(x) or x <= 0:
                raise InvalidArgument(f"{name}: expected a finite value > 0, got {x}")
        self.voxel_size_m = float(voxel_size_m)
        self.max_distance_m = float(max_distance_m)
        dc = self.max_distance_m / self.voxel_size_m + 0.5
        if dc > 4096:
            raise InvalidArgument(
                f"max_distance_m: {max_distance_m} m is {dc:.0f} voxels; at most 4096 voxels are supported"
            )
        self.device = torch.device(device)
        self.cpu_rows = int(cpu_rows)
        self.dc2 = math.floor(dc * dc)  # squared cut-off on site-centre distances, voxels^2
        self.window = math.isqrt(self.dc2)  # W: the largest offset along one axis
        self.brick_radius = -(-self.window // 4)  # Rb = ceil(W / 4)
        self.layer = BrickLayer(esdf_fields(self.max_distance_m), self.device)
        self.last: dict = {}

    # ------------------------------------------------------------------------------------------ API
    def update(self, tsdf: BrickLayer | None, occupancy: BrickLayer | None, dirty, tsdf_config=None) -> dict:
        """Bring the ESDF up to date after the source voxels in the ``dirty`` bricks changed.

        Args:
            tsdf, occupancy: the map's source layers (None when absent); the TSDF gives the sites when
                present, else the occupancy layer.
            dirty: list of int64 ``[B, 3]`` brick coordinates (``voxel >> 2``) whose source data changed
                since the previous call (duplicates allowed).
            tsdf_config: unused (sites come from the stored values); accepted for the Map's call.
        Returns:
            ``{"skipped", "recomputed_voxels", "computed_voxels", "sites", "bricks_freed", "ms"}``;
            ``skipped`` (nothing dirty: returns at once, no tensor touched).
        """
        if not dirty or all(t.shape[0] == 0 for t in dirty):
            return {"skipped": True, "recomputed_voxels": 0, "computed_voxels": 0, "sites": 0, "ms": 0.0}
        t0 = time.perf_counter()
        delta = _unique_bricks(torch.cat([self._check_dirty(t) for t in dirty]))
        # Margins. Source data changed only in the delta bricks. A site voxel depends on its own voxel and
        # its 6 neighbours, so sites can change only within 1 brick of delta (S = delta + 1). A stored
        # value depends on the sites within W (box) of the voxel, and domain membership on the sites
        # within Rb bricks; both change only in O = S + Rb bricks (sign/observed: in delta, inside O).
        # Recomputing O needs every site within W of O and the transform's intermediate values on the
        # lines between a voxel and such a site, all inside the box of half-width W around the voxel:
        # R = O + Rb bricks. The domain there is (sites in R) + Rb, intersected with R.
        out_region = _dilate_bricks(delta, 1 + self.brick_radius)
        region = _dilate_bricks(delta, 1 + 2 * self.brick_radius)
        res = self._recompute(tsdf, occupancy, region, out_region)
        res["ms"] = (time.perf_counter() - t0) * 1e3
        self.last = res
        return dict(res)

    def recompute(self, tsdf: BrickLayer | None, occupancy: BrickLayer | None) -> dict:
        """Rebuild the whole ESDF from the source layers (cold); same result as the incremental path."""
        t0 = time.perf_counter()
        res = self._recompute(tsdf, occupancy, None, None)
        res["ms"] = (time.perf_counter() - t0) * 1e3
        self.last = res
        return dict(res)

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
            "max_distance_m": self.max_distance_m,
            "window_vox": self.window,
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

    def _recompute(self, tsdf, occ, region, out_region) -> dict:
        """Recompute the bricks of ``out_region`` (None: all) from the sites in ``region`` (None: all)."""
        dev = self.device
        src = tsdf if tsdf is not None else occ
        if src is None:
            raise InvalidArgument("esdf: needs a tsdf or occupancy layer for its surface sites")
        if region is None:
            src_bricks = _unique_bricks(src.brick_table()[0])
        else:
            src_bricks = _existing_bricks(src, region)
        if tsdf is not None:
            site_vox, site_t = tsdf_sites(tsdf, src_bricks)
        else:
            site_vox, site_t = occupancy_sites(occ, src_bricks)
        domain = _dilate_bricks(_unique_bricks(site_vox >> 2), self.brick_radius)
        if region is not None:
            domain = domain[_member(voxel_keys(domain), voxel_keys(region))]
        write = domain if out_region is None else domain[_member(voxel_keys(domain), voxel_keys(out_region))]
        freed = self._free_outside(write, out_region)
        n_write = write.shape[0]
        if n_write:
            nearest = nearest_sites(domain, site_vox, self.dc2, self.cpu_rows)
            if out_region is not None:
                nearest = nearest[_member(voxel_keys(domain), voxel_keys(write))]
            dist = site_distances(write, nearest, site_vox, site_t) * self.voxel_size_m
            dist = torch.clamp(dist, max=self.max_distance_m)
            inside, observed = sign_observed(tsdf, occ, write)
            slots = self.layer.allocate(write)
            self.layer.pool.scatter("esdf", slots, torch.where(inside, -dist, dist))
            self.layer.pool.scatter("observed", slots, observed)
        if self.layer.num_bricks == 0 and self.layer.pool.capacity:
            self.layer = BrickLayer(esdf_fields(self.max_distance_m), dev)  # give the pages back
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

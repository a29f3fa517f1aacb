"""Memory budgets: the machine's memory, what a map holds, and upper bounds on what a frame can add.

Everything here is computed *before* the allocation it bounds, from the request's parameters (a frame's
rays, a slice's cell count, a map's ESDF reach), so that a caller can refuse in time. The bounds are
conservative: the real growth is usually several times smaller (NOTES.md, "Memory budgets").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InsufficientStorage, RequestTooLarge  # noqa: F401 (re-exported for callers)

BRICK_VOXELS = 64
# topology per brick in the worst case (one brick per leaf): grid leaf key + masks + offset (80 B), slot
# table (32 B) and brick versions (64 B) of its leaf
BRICK_TOPOLOGY_BYTES = 176
ESDF_VOXEL_BYTES = 5  # float32 distance + bool observed
# working memory of an ESDF update per voxel of the domain it recomputes (line layouts, crossings, three
# distance arrays): measured 52-74 B on the CPU (NOTES.md); rounded up
ESDF_UPDATE_BYTES_PER_VOXEL = 80
# the CPU update's working memory as a fixed part + bytes per computed voxel, rounded up from the peak
# resident size of updates of 0.9 M - 128 M voxels (esdf_working_bytes)
ESDF_CPU_FIXED_BYTES = 96 << 20
ESDF_CPU_BYTES_PER_VOXEL = 32
MEASURED_BRICKS = 4096  # a layer with at least this many bricks prices a new brick at its own average
_SQRT3 = math.sqrt(3.0)


# --------------------------------------------------------------------------------------------- machine
def total_memory_bytes() -> int:
    """Physical memory of the host, or the cgroup's memory limit when lower."""
    n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = Path(path).read_text().strip()
        except OSError:
            continue
        if v.isdigit():
            n = min(n, int(v))
    return n


def device_memory_bytes(device: torch.device) -> int:
    """Memory of the device the maps live on: the GPU's for CUDA, else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return total_memory_bytes()


def rss_bytes() -> int:
    """Resident memory of this process (``/proc/self/statm``; 0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------------- map
def layer_voxel_bytes(fields) -> int:
    """Bytes per voxel of a layer's fields (``{name: FieldSpec}``)."""
    return sum(torch.empty((), dtype=f.dtype).element_size() * math.prod(f.shape) for f in fields.values())


def esdf_site_domain(voxel_size_m: float, esdf_max_distance_m: float) -> tuple[int, int]:
    """(bricks, bytes while updating) of the ESDF domain around one isolated surface brick: the
    ``(2 Rb + 1)^3`` bricks within ``Rb = ceil(M / 4)`` bricks, ``M = floor(d / s + 1/2) + 1`` voxels
    (``mapper.integrators.esdf``), each voxel stored and recomputed."""
    margin = math.floor(esdf_max_distance_m / voxel_size_m + 0.5) + 1
    rb = -(-margin // 4)
    bricks = (2 * rb + 1) ** 3
    per_brick = BRICK_VOXELS * (ESDF_VOXEL_BYTES + ESDF_UPDATE_BYTES_PER_VOXEL) + BRICK_TOPOLOGY_BYTES
    return bricks, bricks * per_brick


def check_esdf_reach(voxel_size_m: float, esdf_max_distance_m: float, budget_bytes: int) -> None:
    """Raise ``RequestTooLarge`` when the ESDF of a single surface brick would exceed ``budget_bytes``
    (the map could not take one isolated observation)."""
    bricks, need = esdf_site_domain(voxel_size_m, esdf_max_distance_m)
    if need > budget_bytes:
        raise RequestTooLarge(
            f"esdf_max_distance_m: {esdf_max_distance_m} m at {voxel_size_m} m voxels gives every surface "
            f"brick an ESDF domain of {bricks} bricks ({bricks * BRICK_VOXELS} voxels, "
            f"{fmt_bytes(need)} while updating), more than the map's memory budget of "
            f"{fmt_bytes(budget_bytes)} ({budget_bytes} bytes); lower esdf_max_distance_m or raise the budget"
        )


# ---------------------------------------------------------------------------------------------- frames
@dataclass
class Growth:
    """Upper bounds for one frame: bytes its layers can add (``bytes``), working memory on top while it is
    integrated (``transient``), and the bricks per layer behind them."""

    bytes: int = 0
    transient: int = 0
    bricks: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in self.bricks.items())
        return f"up to {fmt_bytes(self.bytes + self.transient)} ({parts} bricks)"


def _box(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-axis min and max of ``[N, 3]`` rows (reduced along contiguous rows: a column reduction of an
    ``[N, 3]`` tensor is ~10x slower on the CPU)."""
    lo, hi = torch.aminmax(x.T.contiguous(), dim=1)
    return lo, hi


def _box_bricks(lo: torch.Tensor, hi: torch.Tensor, brick_m: float, pad: float = 0.0) -> float:
    """Bricks of the axis-aligned box ``[lo - pad, hi + pad]`` (float)."""
    a = torch.floor((lo - pad) / brick_m)
    b = torch.floor((hi + pad) / brick_m)
    return float(torch.prod(b - a + 1))


def _band_bricks(ranges: torch.Tensor, tau: float, brick_m: float) -> float:
    """Bricks crossed by the segments ``[r - tau, r + tau]``: a segment of length ``L`` crosses at most
    ``4 + |dx| / B + |dy| / B + |dz| / B <= 4 + sqrt(3) L / B`` cells of edge ``B``."""
    length = torch.minimum(ranges + tau, torch.full_like(ranges, 2 * tau))
    return float((4 + _SQRT3 * length / brick_m).sum())


def _free_space_bricks(ranges: torch.Tensor, brick_m: float, bins: int = 64) -> float:
    """Bricks crossed by rays from one origin to their ranges: min over ``rho`` of the bricks meeting the
    ball of radius ``rho`` plus, for each ray longer than ``rho``, the bricks of its part beyond
    ``rho`` (``4 + sqrt(3) (r - rho) / B``). ``rho`` runs over ``bins`` quantile-free bin edges."""
    n = ranges.numel()
    if n == 0:
        return 0.0
    rmax = float(ranges.max())
    edges = torch.linspace(0.0, rmax, bins + 1, dtype=torch.float64)
    idx = torch.clamp(torch.floor(ranges / max(rmax, 1e-12) * bins).long(), max=bins - 1)
    cnt = torch.bincount(idx, minlength=bins).to(torch.float64)
    tot = torch.bincount(idx, weights=ranges, minlength=bins)
    # rays in bins >= k (ranges >= edges[k]) count whole from edges[k]; the rest lie inside the ball
    cnt_ge = torch.flip(torch.cumsum(torch.flip(cnt, (0,)), 0), (0,))
    tot_ge = torch.flip(torch.cumsum(torch.flip(tot, (0,)), 0), (0,))
    rho = edges[:-1]
    ball = (4.0 / 3.0) * math.pi * (rho / brick_m + _SQRT3 + 1) ** 3
    beyond = 4 * cnt_ge + _SQRT3 * (tot_ge - cnt_ge * rho) / brick_m
    return float(torch.min(ball + beyond))


def _dilate_line(occ: torch.Tensor, k: int, axis: int) -> None:
    """In place: ``occ`` (bool) dilated by ``k`` along ``axis`` in O(log k) shifted ORs (a set dilated by
    ``d`` ORed with itself shifted by ``+-s``, ``s <= d + 1``, is the set dilated by ``d + s``)."""
    d = 0
    n = occ.shape[axis]
    while d < k:
        s = min(d + 1, k - d)
        if s >= n:
            s = n - 1
            if s <= 0:
                return
        cur = occ.clone()
        occ.narrow(axis, s, n - s).logical_or_(cur.narrow(axis, 0, n - s))
        occ.narrow(axis, 0, n - s).logical_or_(cur.narrow(axis, s, n - s))
        d += s


FINE_CELLS = 1 << 22  # bitmap cells of the dilation bound (the tightest bound, what refusals rest on)
COARSE_CELLS = 1 << 15  # the first try when the caller gives room: 128x fewer cells, a looser bound


def _dilated_bricks(bricks: torch.Tensor, radius: int, max_cells: int = FINE_CELLS) -> float:
    """Upper bound on the bricks within Chebyshev distance ``radius`` of int64 ``[N, 3]`` bricks (exact
    when the frame is small enough): a bitmap of cells of ``c`` bricks (``c = 1``, doubled until the
    bitmap has at most ``max_cells`` cells), dilated by ``k = ceil(radius / c)`` cells with a separable
    max filter; a brick within ``radius`` of a brick lies within ``k`` cells of that brick's cell."""
    if bricks.shape[0] == 0:
        return 0.0
    lo, hi = _box(bricks)
    c = 1
    while True:
        k = -(-radius // c)
        e = [int(x) + 1 + 2 * k for x in (hi // c - lo // c)]
        if e[0] * e[1] * e[2] <= max_cells:
            break
        c *= 2
    cells = torch.div(bricks, c, rounding_mode="floor") - lo // c + k
    occ = torch.zeros(e, dtype=torch.bool)
    occ[cells[:, 0], cells[:, 1], cells[:, 2]] = True
    for axis in range(3):
        _dilate_line(occ, k, axis)
    return float(occ.sum(dtype=torch.int64)) * c**3


def _rays_growth(
    m,
    origin: torch.Tensor,
    ends: torch.Tensor,
    ranges: torch.Tensor,
    room: float | None = None,
    band: float | None = None,
) -> Growth:
    """Growth bound for rays from ``origin`` (float64 [3]) to ``ends`` (float64 [N, 3], ranges [N]).
    With ``room`` (bytes): the cheapest bound that fits in it (the bounding box, a few ms; then the
    per-ray bounds with a coarse dilation), else the tightest (~10-100 ms per 10^5 rays on a CPU).
    ``band``: the TSDF band's half length along a ray (default ``tau``)."""
    if ranges.numel() == 0:
        return Growth()
    s = m.voxel_size_m
    bm = 4 * s
    tau = m.tsdf_config.tau
    band = tau if band is None else band
    lo_e, hi_e = _box(ends)
    lo, hi = torch.minimum(lo_e, origin), torch.maximum(hi_e, origin)
    radius = m.esdf_brick_radius
    reach = radius + math.ceil(tau / bm) + 1 if radius is not None else 0
    box = {"tsdf": _box_bricks(lo, hi, bm, band), "occupancy": _box_bricks(lo, hi, bm, s)}
    box["esdf"] = _box_bricks(lo_e, hi_e, bm, reach * bm)
    bf = 4 * getattr(m, "esdf_voxel_size_m", s)  # the free record's bricks (ESDF voxels)
    box["free"] = _box_bricks(lo, hi, bf, bf)
    g = _growth_of(m, box)
    if room is not None and g.bytes + g.transient <= room:
        return g
    end_bricks = torch.floor(ends / bm).to(torch.int64)
    n: dict[str, float] = {}
    tsdf = m.stored_layer("tsdf")
    if m.stored_layer("occupancy") is not None:
        n["occupancy"] = min(_free_space_bricks(ranges, bm), box["occupancy"])
    if m.stored_layer("free") is not None:  # the rays' free space, walked at the ESDF's voxel
        n["free"] = min(_free_space_bricks(ranges, bf), box["free"])
    along = _band_bricks(ranges, band, bm) if tsdf is not None else 0.0
    # the dilations, on a coarse bitmap first (~1 ms; a looser bound) when the caller gives room, then on
    # the fine one (10-100 ms per 10^5 rays): the fine bound decides whenever the coarse one does not fit
    for cells in ((COARSE_CELLS,) if room is not None else ()) + (FINE_CELLS,):
        if tsdf is not None:  # the band's bricks lie within ceil(tau / B) bricks of the return's brick
            near = _dilated_bricks(end_bricks, math.ceil(band / bm), cells)
            n["tsdf"] = min(along, near, box["tsdf"])
        if m.has_esdf:
            # surface sites lie within the band (+1 brick for the crossings' neighbours), the domain within
            # Rb bricks of a site brick
            n["esdf"] = min(_dilated_bricks(end_bricks, reach, cells), box["esdf"])
        g = _growth_of(m, n)
        if room is not None and g.bytes + g.transient <= room:
            return g
    # the tightest: the frame's own footprint (the bricks its rays cross, less those the map has; ~1-10 s
    # for a 41 k-ray scan at 0.1 m on a loaded CPU), run only when the per-ray bounds do not fit and it
    # could: it lowers the stored bricks, not the ESDF update's domain, and the returns' own new bricks
    # (each return's voxel is in its band) are a floor it cannot go under
    if room is not None and (g.transient > room or _floor_bytes(m, end_bricks) > room):
        return g
    return _growth_of(m, _footprint_bricks(m, origin, ends, ranges, band, n))


def _floor_bytes(m, end_bricks: torch.Tensor) -> int:
    """A lower bound on the bytes a frame adds: the voxels of the TSDF and ESDF bricks of its returns
    that the map lacks (int64 ``[N, 3]`` brick of each return; 0 without a TSDF)."""
    tsdf = m.stored_layer("tsdf")
    if tsdf is None:
        return 0
    new = _absent(tsdf, _union(end_bricks)).shape[0]
    per = BRICK_VOXELS * layer_voxel_bytes(tsdf.pool.fields)
    if m.has_esdf and abs(getattr(m, "esdf_voxel_size_m", m.voxel_size_m) - m.voxel_size_m) < 1e-12:
        per += BRICK_VOXELS * ESDF_VOXEL_BYTES
    return new * per


FOOTPRINT_ROWS = 1 << 23  # segment rows (brick crossings) past which a layer keeps its per-ray bound
FOOTPRINT_CHUNK_ROWS = 1 << 19  # rows per pass (~8 MB; rays in chunks): the check's working memory


def _segment_bricks(origin: torch.Tensor, dirs: torch.Tensor, t0, t1, cell: float, max_length=None):
    """Unique bricks (int64 ``[U, 3]``, edge ``cell``) crossed by the segments ``origin + t dirs``, ``t in
    [t0, t1]``: the integrators' own brick pass (``FrameSegments``), so exactly the bricks they touch.
    None when the segments cross more than ``FOOTPRINT_ROWS`` bricks in all (``4 + sqrt(3) L / B`` per
    segment at most): too slow to count on the CPU, and such a frame's per-ray bound is what decides."""
    from .kernels.segments import FrameSegments

    if dirs.shape[0] == 0:
        return torch.zeros((0, 3), dtype=torch.int64)
    if float((4 + _SQRT3 * (t1 - t0).clamp(min=0.0) / cell).sum()) > FOOTPRINT_ROWS:
        return None
    o = origin.to(torch.float64).contiguous().expand(dirs.shape[0], 3)
    return FrameSegments(o, dirs, t0, t1, cell, budget=FOOTPRINT_CHUNK_ROWS).bricks


def _union(*sets: torch.Tensor) -> torch.Tensor:
    """Unique rows of int64 ``[U_i, 3]`` brick sets (by their keys: ``torch.unique(dim=0)`` is ~10x
    slower)."""
    from .kernels.keys import brick_keys, keys_to_ijk

    keys = torch.cat([brick_keys(b) for b in sets if b.shape[0]] or [torch.zeros(0, dtype=torch.int64)])
    keys = torch.unique(keys[keys >= 0])
    return keys_to_ijk(keys) if keys.numel() else torch.zeros((0, 3), dtype=torch.int64)


def _absent(layer, bricks: torch.Tensor) -> torch.Tensor:
    """The rows of int64 ``[U, 3]`` ``bricks`` that ``layer`` has not allocated (all without a layer)."""
    if layer is None or bricks.shape[0] == 0 or layer.grid.num_leaves == 0:
        return bricks
    slot, _ = layer.voxel_slots(bricks.to(layer.device) << 2)
    return bricks[(slot < 0).cpu()]


def _to_lattice(bricks: torch.Tensor, edge_m: float, to_edge_m: float) -> torch.Tensor:
    """Unique bricks of edge ``to_edge_m`` (>= ``edge_m``) that overlap int64 ``[U, 3]`` bricks of edge
    ``edge_m`` (each lies in at most 2 per axis)."""
    if abs(edge_m - to_edge_m) < 1e-12 or bricks.shape[0] == 0:
        return bricks
    lo = torch.floor(bricks.to(torch.float64) * edge_m / to_edge_m + 1e-9).to(torch.int64)
    hi = torch.floor((bricks + 1).to(torch.float64) * edge_m / to_edge_m - 1e-9).to(torch.int64)
    return _union(*[torch.where(torch.tensor(c, dtype=torch.bool), hi, lo) for c in _CORNERS])


_CORNERS = [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]


def _footprint_bricks(m, origin, ends, ranges, band: float, bound: dict[str, float]) -> dict[str, float]:
    """New bricks per layer from the frame's own footprint, each capped by ``bound`` (the per-ray bounds):
    the bricks its rays cross in each layer (the integrators' segments: TSDF ``[r - band, r + band]``,
    occupancy ``[0, r + s]``, free record ``[0, r - gap]``) less those the map has allocated. The ESDF
    stores observed bricks within ``Rb`` bricks of a site: at most the frame's new observed bricks plus the
    map's observed bricks it does not store yet (``esdf``); its update computes at most the per-ray bound's
    domain (``esdf_domain``)."""
    from .integrators.free import free_gap

    n = dict(bound)
    if ranges.numel() == 0:
        return n
    s = m.voxel_size_m
    bm = 4 * s
    dirs = (ends - origin) / ranges[:, None]
    band_b = torch.zeros((0, 3), dtype=torch.int64)
    tsdf, occ, free = (m.stored_layer(k) for k in ("tsdf", "occupancy", "free"))
    if tsdf is not None:
        band_b = _segment_bricks(
            origin, dirs, (ranges - band).clamp(min=0.0), ranges + band, bm, max_length=2 * band
        )
        if band_b is None:
            return n
        n["tsdf"] = min(n["tsdf"], float(_absent(tsdf, band_b).shape[0]))
    if occ is not None:
        occ_b = _segment_bricks(origin, dirs, torch.zeros_like(ranges), ranges + s, bm)
        if occ_b is None:
            return n
        n["occupancy"] = min(n["occupancy"], float(_absent(occ, occ_b).shape[0]))
    se = getattr(m, "esdf_voxel_size_m", s)
    be = 4 * se
    free_b = torch.zeros((0, 3), dtype=torch.int64)
    if free is not None:
        gap = free_gap(m.tsdf_config.tau if tsdf is not None else 0.0, se)
        length = ranges - gap
        keep = length > 0
        free_b = _segment_bricks(origin, dirs[keep], torch.zeros_like(length[keep]), length[keep], be)
        if free_b is None:
            return n
        n["free"] = min(n["free"], float(_absent(free, free_b).shape[0]))
    esdf = m.esdf_layer
    if esdf is not None:
        # stored: observed bricks within Rb of a site; sites also lie on the free record's edges, so the
        # domain (the working memory) keeps the per-ray bound (the returns' bricks dilated by the reach)
        sources = [_to_lattice(band_b, bm, be), free_b]
        if occ is not None:
            sources.append(_to_lattice(occ_b, bm, be))
        seen = _union(*sources)
        observed = sum(la.num_bricks for la in (tsdf, occ, free) if la is not None)
        backlog = max(0, observed - esdf.num_bricks)  # observed bricks the ESDF does not store (yet)
        n["esdf_domain"] = n["esdf"]
        n["esdf"] = min(n["esdf"], float(_absent(esdf, seen).shape[0] + backlog))
    return n


def _growth_of(m, bricks: dict[str, float]) -> Growth:
    """Bytes of up to ``bricks[layer]`` new bricks per layer of ``m`` (layers it lacks are skipped)."""
    g = Growth()
    for name in ("tsdf", "occupancy", "free"):
        layer = m.stored_layer(name)
        if layer is None:
            continue
        n = bricks[name]
        vb = layer_voxel_bytes(layer.pool.fields)
        g.bricks[name] = int(n)
        # plus one page: pools grow by whole pages
        g.bytes += int(n * brick_bytes(layer, BRICK_VOXELS * vb)) + layer.pool.page_bricks * BRICK_VOXELS * vb
    esdf = m.esdf_layer
    if esdf is not None:
        n = bricks["esdf"]
        g.bricks["esdf"] = int(n)
        g.bytes += int(n * brick_bytes(esdf, BRICK_VOXELS * ESDF_VOXEL_BYTES))
        domain = bricks.get("esdf_domain", n)
        g.transient += esdf_working_bytes(int(domain * BRICK_VOXELS), m.device)
    return g


def brick_bytes(layer, voxel_bytes: int) -> float:
    """Bytes one more brick costs in ``layer``: its voxels plus its share of the topology, measured on the
    layer as it is (``nbytes`` over its bricks, pool slack and all) once it holds ``MEASURED_BRICKS``
    bricks, else the worst case (``BRICK_TOPOLOGY_BYTES``: one brick per leaf)."""
    worst = voxel_bytes + BRICK_TOPOLOGY_BYTES
    n = getattr(layer, "num_bricks", 0)
    if n < MEASURED_BRICKS:
        return worst
    return min(worst, max(voxel_bytes, layer.nbytes / n))


def esdf_working_bytes(domain_voxels: int, device) -> int:
    """Working memory of an ESDF update over ``domain_voxels`` computed voxels:
    ``ESDF_UPDATE_BYTES_PER_VOXEL`` each, on the CPU at most ``ESDF_CPU_FIXED_BYTES`` plus
    ``ESDF_CPU_BYTES_PER_VOXEL`` each (its line passes run in chunks of rows: measured 47-56 B per voxel
    at 0.9-4 M voxels, <= 28 B per voxel at 128 M: benchmarks/results/admission_cpu.md). CUDA runs each
    pass at once (not measured there: the larger constant)."""
    if domain_voxels <= 0:
        return 0
    per_voxel = ESDF_UPDATE_BYTES_PER_VOXEL * domain_voxels
    if torch.device(device).type == "cpu":
        return min(per_voxel, ESDF_CPU_FIXED_BYTES + ESDF_CPU_BYTES_PER_VOXEL * domain_voxels)
    return per_voxel


def lidar_growth(m, points_sensor, T_world_sensor, room: float | None = None) -> Growth:
    """Upper bound on what ``m.integrate_lidar(points_sensor, T_world_sensor)`` can add (CPU arithmetic).

    Args:
        m: the :class:`~mapper.map.Map`.
        points_sensor: ``[N, 3|4]`` float array or tensor (sensor frame); ``T_world_sensor``: ``[4, 4]``.
        room: bytes the caller can spare; a cheaper, looser bound is returned when it fits (see
            ``_rays_growth``). None: always the tightest bound.
    """
    p = torch.as_tensor(points_sensor).detach()[:, :3].to("cpu", torch.float64)  # [N, 3] contiguous
    T = torch.as_tensor(T_world_sensor).detach().to("cpu", torch.float64)
    r = torch.linalg.vector_norm(p, dim=1)
    ok = torch.isfinite(r) & (r > 1e-6) & (r <= m.max_range_m)  # a NaN/Inf coordinate makes r NaN/Inf
    if not bool(ok.all()):
        p, r = p[ok], r[ok]
    # a view of [3, N] rows (the box reduces them without a copy); addmm, not `R @ p.T + t`: the same
    # values, ~5x less time on the CPU (the matmul of a [3, N] transposed view took a slow path)
    ends = torch.addmm(T[:3, 3:], T[:3, :3], p.T).T
    band = m.tsdf_config.lidar_band_m  # longer than tau: the band reaches further at grazing incidence
    return _rays_growth(m, T[:3, 3], ends, r, room, band)


def depth_growth(m, depth_m, K, T_world_sensor, room: float | None = None) -> Growth:
    """Upper bound on what ``m.integrate_depth(depth_m, K, T_world_sensor)`` can add (CPU arithmetic);
    ``room`` as in :func:`lidar_growth`."""
    from .integrators.common import check_intrinsics
    from .integrators.tsdf import pixel_rays

    cpu = torch.device("cpu")
    d = torch.as_tensor(depth_m).detach().to(cpu, torch.float32)
    Kt = check_intrinsics("K", K, cpu)
    T = torch.as_tensor(T_world_sensor).detach().to(cpu, torch.float64)
    _, origin, dirs, rng = pixel_rays(d, Kt, T, m.max_range_m)
    return _rays_growth(m, origin, origin + dirs * rng[:, None], rng, room)


# ----------------------------------------------------------------------------------------------- reads
# bytes per output element of a read, by response format, measured on the service (NOTES.md) and rounded
# up: the float32 result, its encoding and the response body; JSON holds a Python float per number
SLICE_CELL_BYTES = {"png": 16, "msgpack": 16, "json": 100}
BOX_VOXEL_BYTES = {"msgpack": 64, "json": 400}
QUERY_POINT_BYTES = {"msgpack": 96, "json": 400}  # input points + outputs (distance, gradient, flag)
MESH_VOXEL_BYTES = (
    16  # a mesh per TSDF voxel: 6 B measured on norlab scans (PLY, incl. the working set) x 2.5
)
READ_WORKING_BYTES = 64 << 20  # one query chunk's working set (``map_reads.QUERY_CHUNK`` points) and slack


def check_read(what: str, count: int, unit: str, per_item: int, limit_bytes: int, setting: str) -> None:
    """Raise ``RequestTooLarge`` naming the numbers when ``count`` items at ``per_item`` bytes exceed
    ``limit_bytes``."""
    need = count * per_item + READ_WORKING_BYTES
    if need > limit_bytes:
        most = max(0, (limit_bytes - READ_WORKING_BYTES) // per_item)
        raise RequestTooLarge(
            f"{what}: {count} {unit} need about {fmt_bytes(need)} ({per_item} B per {unit[:-1]}), over "
            f"{setting}={limit_bytes} ({fmt_bytes(limit_bytes)}); at most {most} {unit} fit"
        )


def esdf_update_bytes(m) -> int:
    """Working memory of the map's next ESDF update, estimated from its last one
    (``ESDF_UPDATE_BYTES_PER_VOXEL`` per voxel it computed; a replayed or similar frame recomputes a
    similar region); 0 without an ESDF or before its first update."""
    return ESDF_UPDATE_BYTES_PER_VOXEL * int(m.esdf_last_update.get("computed_voxels", 0))

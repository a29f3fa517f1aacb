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
    reach = m._esdf.brick_radius + math.ceil(tau / bm) + 1 if m._esdf is not None else 0
    box = {"tsdf": _box_bricks(lo, hi, bm, band), "occupancy": _box_bricks(lo, hi, bm, s)}
    box["esdf"] = _box_bricks(lo_e, hi_e, bm, reach * bm)
    bf = 4 * getattr(m, "esdf_voxel_size_m", s)  # the free record's bricks (ESDF voxels)
    box["free"] = _box_bricks(lo, hi, bf, bf)
    g = _growth_of(m, box)
    if room is not None and g.bytes + g.transient <= room:
        return g
    end_bricks = torch.floor(ends / bm).to(torch.int64)
    n: dict[str, float] = {}
    if m._occ is not None:
        n["occupancy"] = min(_free_space_bricks(ranges, bm), box["occupancy"])
    if getattr(m, "_free", None) is not None:  # the rays' free space, walked at the ESDF's voxel
        n["free"] = min(_free_space_bricks(ranges, bf), box["free"])
    along = _band_bricks(ranges, band, bm) if m._tsdf is not None else 0.0
    # the dilations, on a coarse bitmap first (~1 ms; a looser bound) when the caller gives room, then on
    # the fine one (10-100 ms per 10^5 rays): the fine bound decides whenever the coarse one does not fit
    for cells in ((COARSE_CELLS,) if room is not None else ()) + (FINE_CELLS,):
        if m._tsdf is not None:  # the band's bricks lie within ceil(tau / B) bricks of the return's brick
            near = _dilated_bricks(end_bricks, math.ceil(band / bm), cells)
            n["tsdf"] = min(along, near, box["tsdf"])
        if m._esdf is not None:
            # surface sites lie within the band (+1 brick for the crossings' neighbours), the domain within
            # Rb bricks of a site brick
            n["esdf"] = min(_dilated_bricks(end_bricks, reach, cells), box["esdf"])
        g = _growth_of(m, n)
        if room is not None and g.bytes + g.transient <= room:
            return g
    return g


def _growth_of(m, bricks: dict[str, float]) -> Growth:
    """Bytes of up to ``bricks[layer]`` new bricks per layer of ``m`` (layers it lacks are skipped)."""
    g = Growth()
    for name, layer in (("tsdf", m._tsdf), ("occupancy", m._occ), ("free", getattr(m, "_free", None))):
        if layer is None:
            continue
        n = bricks[name]
        vb = layer_voxel_bytes(layer.pool.fields)
        g.bricks[name] = int(n)
        # plus one page: pools grow by whole pages
        g.bytes += (
            int(n * (BRICK_VOXELS * vb + BRICK_TOPOLOGY_BYTES)) + layer.pool.page_bricks * BRICK_VOXELS * vb
        )
    if m._esdf is not None:
        n = bricks["esdf"]
        g.bricks["esdf"] = int(n)
        g.bytes += int(n * (BRICK_VOXELS * ESDF_VOXEL_BYTES + BRICK_TOPOLOGY_BYTES))
        g.transient += int(n * BRICK_VOXELS * ESDF_UPDATE_BYTES_PER_VOXEL)
    return g


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
    esdf = getattr(m, "_esdf", None)
    if esdf is None:
        return 0
    return ESDF_UPDATE_BYTES_PER_VOXEL * int(esdf.last.get("computed_voxels", 0))

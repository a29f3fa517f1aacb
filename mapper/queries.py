"""Point queries on map layers: trilinear interpolation with the gradient of the interpolant, nearest-voxel
occupancy, dense slices and boxes of the ESDF (ray casting of the TSDF: :mod:`mapper.raycast`).

Unknown is never reported as free or as a distance: a value interpolates the observed ones of its 8 corner
voxels (trilinear weights renormalised over them, :func:`observed_trilinear`); with none observed
``observed`` is False and the value NaN; occupancy reports -1 for never-observed voxels.
Voxel (i, j, k) has its centre at ((i, j, k) + 0.5) * s, so a point p interpolates between the voxels
``floor(p / s - 0.5) + {0, 1}^3``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._validation import finite_vector, positive
from .errors import InvalidArgument, RequestTooLarge
from .integrators.common import check_points
from .kernels.dispatch import use_triton
from .kernels.keys import COORD_LIMIT_VOX
from .layers import BrickLayer

_CORNERS: dict[torch.device, torch.Tensor] = {}


def _corners(device: torch.device) -> torch.Tensor:
    t = _CORNERS.get(device)
    if t is None:
        r = torch.arange(2)
        t = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(8, 3).to(device)
        _CORNERS[device] = t
    return t


def check_query_points(
    name: str, points, device: torch.device, max_points: int | None = None
) -> torch.Tensor:
    """``[M, 3]`` float points -> float64 on ``device``. Non-finite points are allowed (they are unknown)."""
    p = check_points(name, points, device)
    if p.shape[1] != 3:
        raise InvalidArgument(f"{name}: expected shape [M, 3], got {list(p.shape)}")
    if max_points is not None and p.shape[0] > max_points:
        raise InvalidArgument(f"{name}: {p.shape[0]} points exceed the limit of {max_points}")
    return p.to(torch.float64)


def voxel_of(points: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 voxel coordinates, bool finite-and-in-range) of float64 points."""
    ok = torch.isfinite(points).all(dim=1)
    q = torch.where(ok[:, None], points / s, torch.zeros_like(points))
    ok &= (q.abs() < COORD_LIMIT_VOX).all(dim=1)
    q = torch.where(ok[:, None], q, torch.zeros_like(q))
    return torch.floor(q).to(torch.int64), ok


def gather_voxels(layer: BrickLayer, ijk: torch.Tensor, names: list[str], fills: list):
    """Values of ``names`` at int64 ``[M, 3]`` voxels (``fills`` where the brick is absent) and presence."""
    slot, off = layer.voxel_slots(ijk)
    present = slot >= 0
    out = []
    for n, fill in zip(names, fills, strict=True):
        if layer.pool.capacity == 0:
            vals = torch.full((ijk.shape[0],), fill, dtype=torch.float32, device=ijk.device)
        else:  # read slot 0 for absent voxels and mask: no compaction, no host sync
            v = layer.pool.gather(n, slot.clamp(min=0), off).to(torch.float32)
            vals = torch.where(present, v, torch.full_like(v, fill))
        out.append(vals)
    return out, present


def trilinear(values: torch.Tensor, frac: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Interpolate ``[M, 8]`` corner values (corner order ``(a, b, c)`` in {0,1}^3, i-major) at fractional
    offsets ``[M, 3]``; returns the value ``[M]`` and the gradient of the interpolant ``[M, 3]`` per metre."""
    c = _corners(values.device).to(values.dtype)  # [8, 3]
    f = frac[:, None, :].to(values.dtype)
    w_axis = torch.where(c[None] == 1, f, 1 - f)  # [M, 8, 3]
    w = w_axis.prod(dim=2)
    val = (w * values).sum(dim=1)
    sgn = torch.where(c == 1, 1.0, -1.0).to(values.dtype)  # d w_axis / d f
    grads = []
    for a in range(3):
        others = [b for b in range(3) if b != a]
        dw = sgn[None, :, a] * w_axis[:, :, others[0]] * w_axis[:, :, others[1]]
        grads.append((dw * values).sum(dim=1) / s)
    return val, torch.stack(grads, dim=1)


def _corner_voxels(points: torch.Tensor, s: float):
    ok = torch.isfinite(points).all(dim=1)
    q = torch.where(ok[:, None], points / s - 0.5, torch.zeros_like(points))
    ok &= (q.abs() < COORD_LIMIT_VOX).all(dim=1)
    q = torch.where(ok[:, None], q, torch.zeros_like(q))
    base = torch.floor(q)
    frac = q - base
    ijk = base.to(torch.int64)[:, None, :] + _corners(points.device)[None]  # [M, 8, 3]
    return ijk.reshape(-1, 3), frac, ok


def gather_corners(layer: BrickLayer, points: torch.Tensor, s: float, names: list[str], fills: list):
    """The 8 interpolation corners of float64 ``[M, 3]`` points: (corner voxels int64 ``[M, 8, 3]``,
    fractional offsets ``[M, 3]``, finite-and-in-range ``[M]``, {name: float32 ``[M, 8]``}, present
    ``[M, 8]``)."""
    m = points.shape[0]
    ijk, frac, ok = _corner_voxels(points, s)
    vals, present = gather_voxels(layer, ijk, names, fills)
    return (
        ijk.reshape(m, 8, 3),
        frac,
        ok,
        {n: v.reshape(m, 8) for n, v in zip(names, vals, strict=True)},
        (present.reshape(m, 8)),
    )


def masked_trilinear(values: torch.Tensor, frac: torch.Tensor, observed: torch.Tensor, s: float):
    """``trilinear`` where all 8 corners are observed (``observed [M]``), NaN / zero gradient elsewhere."""
    val, grad = trilinear(values.to(torch.float64), frac, s)
    val = torch.where(observed, val, torch.full_like(val, float("nan")))
    grad = torch.where(observed[:, None], grad, torch.zeros_like(grad))
    return val.to(torch.float32), grad.to(torch.float32)


def observed_trilinear(values: torch.Tensor, frac: torch.Tensor, observed: torch.Tensor, s: float):
    """Trilinear interpolation over the observed corners only.

    Args:
        values: float ``[M, 8]`` corner values (corner order of :func:`trilinear`); frac: ``[M, 3]``
            fractional offsets; observed: bool ``[M, 8]`` per corner; s: voxel size (metres).
    Returns:
        (value float32 ``[M]``, gradient float32 ``[M, 3]`` per metre, known bool ``[M]``). All 8 observed:
        plain :func:`trilinear`. Some: the trilinear weights of the observed corners renormalised to sum
        to 1 (``sum w_c v_c / sum w_c``) and the gradient of that quotient; where those weights sum to 0
        (the point lies on the far face of the observed corners) the nearest observed corner's value and a
        zero gradient. None: NaN, zero gradient, not known.
    """
    v = values.to(torch.float64)
    c = _corners(v.device).to(torch.float64)
    f = frac[:, None, :].to(torch.float64)
    w_axis = torch.where(c[None] == 1, f, 1 - f)  # [M, 8, 3]
    o = observed.to(torch.float64)
    wo = w_axis.prod(dim=2) * o
    wsum = wo.sum(dim=1)
    num = (wo * v).sum(dim=1)
    sgn = torch.where(c == 1, 1.0, -1.0).to(torch.float64)
    dnum, dw = [], []
    for a in range(3):
        others = [b for b in range(3) if b != a]
        d = sgn[None, :, a] * w_axis[:, :, others[0]] * w_axis[:, :, others[1]] * o
        dnum.append((d * v).sum(dim=1))
        dw.append(d.sum(dim=1))
    dnum_t, dw_t = torch.stack(dnum, dim=1), torch.stack(dw, dim=1)
    full = observed.all(dim=1)
    known = observed.any(dim=1)
    part = wsum > 0
    safe = torch.where(part, wsum, torch.ones_like(wsum))
    val = torch.where(full, num, num / safe)
    grad = (
        torch.where(
            full[:, None], dnum_t, (dnum_t * safe[:, None] - num[:, None] * dw_t) / (safe * safe)[:, None]
        )
        / s
    )
    # the far face: the nearest observed corner (squared distance in voxels; unobserved ones never)
    d2 = ((c[None] - f) ** 2).sum(dim=2)
    d2 = torch.where(observed, d2, torch.full_like(d2, math.inf))
    near = v.gather(1, d2.argmin(dim=1, keepdim=True)).squeeze(1)
    val = torch.where(part, val, torch.where(known, near, torch.full_like(val, math.nan)))
    grad = torch.where(part[:, None], grad, torch.zeros_like(grad))
    return val.to(torch.float32), grad.to(torch.float32), known


# --------------------------------------------------------------------------------------- point queries
def tsdf_at(layer: BrickLayer, p: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trilinear TSDF of ``layer`` (voxel ``s`` metres) at float64 ``[M, 3]`` points over the observed
    corners (:func:`observed_trilinear`): (tsdf float32 ``[M]`` metres, NaN where no corner voxel is
    observed; weight float32 ``[M]``, 0 there)."""
    _, frac, ok, vals, present = gather_corners(layer, p, s, ["tsdf", "weight"], [0.0, 0.0])
    obs = present & (vals["weight"] > 0) & ok[:, None]
    t, _, _ = observed_trilinear(vals["tsdf"], frac, obs, s)
    w, _, _ = observed_trilinear(vals["weight"], frac, obs, s)
    return t, torch.nan_to_num(w, nan=0.0)


def occupancy_at(layer: BrickLayer, p: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Occupancy of the voxel holding each float64 ``[M, 3]`` point: (state int8 ``[M]``: -1 unknown, 0 free,
    1 occupied; probability float32 ``[M]``, 0.5 where unknown)."""
    ijk, ok = voxel_of(p, s)
    (lo,), present = gather_voxels(layer, ijk, ["log_odds"], [float("nan")])
    known = ok & present & ~torch.isnan(lo)
    state = torch.where(known, torch.where(lo > 0, 1, 0), -1).to(torch.int8)
    prob = torch.where(known, torch.sigmoid(torch.nan_to_num(lo)), torch.full_like(lo, 0.5))
    return state, prob


def distance_at(
    esdf: BrickLayer,
    p: torch.Tensor,
    s: float,
    max_distance_m: float,
    tsdf: BrickLayer | None = None,
    occupancy: BrickLayer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed distance of the ESDF layer ``esdf`` (voxel ``s``) at float64 ``[M, 3]`` points, trilinear:
    (distance float32 ``[M]`` metres, NaN where no corner is observed; gradient float32 ``[M, 3]``; observed
    bool ``[M]``: some corner observed), over the observed corners (:func:`observed_trilinear`).
    A corner voxel absent from the layer holds ``max_distance_m`` and counts as observed where ``tsdf``
    (weight > 0) or ``occupancy`` (log-odds not NaN) saw it (layers at the ESDF's voxel, or None).
    One fused Triton launch on CUDA (``mapper.kernels.triton_query``), :func:`distance_at_torch` elsewhere."""
    if use_triton(p.device):
        # lazy: Triton is optional (a CPU install imports this module without it)
        from .kernels.triton_query import distance_launch

        ev = esdf.kernel_view(("esdf", "observed"))
        if ev is not None:
            tv = None if tsdf is None else tsdf.kernel_view(("weight",))
            ov = None if occupancy is None else occupancy.kernel_view(("log_odds",))
            return distance_launch(p, s, max_distance_m, ev, tv, ov)
    return distance_at_torch(esdf, p, s, max_distance_m, tsdf, occupancy)


def distance_at_torch(
    esdf: BrickLayer,
    p: torch.Tensor,
    s: float,
    max_distance_m: float,
    tsdf: BrickLayer | None = None,
    occupancy: BrickLayer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`distance_at` (same Args/Returns)."""
    md = max_distance_m
    ijk, frac, ok, vals, present = gather_corners(esdf, p, s, ["esdf", "observed"], [md, 0.0])
    d = vals["esdf"]
    obs = present & (vals["observed"] > 0)
    absent = ~present
    if bool(absent.any()):
        a_ijk = ijk[absent]
        seen = torch.zeros(a_ijk.shape[0], dtype=torch.bool, device=p.device)
        if tsdf is not None:
            (w,), pr = gather_voxels(tsdf, a_ijk, ["weight"], [0.0])
            seen |= pr & (w > 0)
        if occupancy is not None:
            (lo,), pr = gather_voxels(occupancy, a_ijk, ["log_odds"], [float("nan")])
            seen |= pr & ~torch.isnan(lo)
        obs[absent] = seen
        d[absent] = md
    dist, grad, known = observed_trilinear(d, frac, obs & ok[:, None], s)
    return dist, grad, known


def lattice_points(axes, xyz: tuple[int, int, int]):
    """``(start, end) -> float64 [end - start, 3]``: the points of the lattice of three 1-D coordinate
    tensors ``axes`` (C order over them) with flat indices in ``[start, end)``; column ``c`` takes its
    coordinate from ``axes[xyz[c]]`` (so a slice or box never holds all its points at once)."""
    n1, n2 = axes[1].numel(), axes[2].numel()

    def points(a: int, b: int) -> torch.Tensor:
        idx = torch.arange(a, b, device=axes[0].device)
        ijk = (idx // (n1 * n2), (idx // n2) % n1, idx % n2)
        return torch.stack([axes[xyz[c]][ijk[xyz[c]]] for c in range(3)], dim=1)

    return points


def chunked(fn, p, n: int | None = None, step: int = 1 << 15) -> tuple[torch.Tensor, ...]:
    """``fn(points [m, 3]) -> tuple of [m, ...] tensors`` over ``step`` points at a time, into preallocated
    outputs (a query costs its outputs plus one chunk's working set). ``p``: float64 ``[n, 3]`` points, or
    a callable ``(start, end) -> points`` (then ``n`` is the count), so lattice queries never hold all
    their points at once."""
    if n is None:
        n = p.shape[0]
    points = p if callable(p) else (lambda a, b: p[a:b])
    if n <= step:
        return tuple(fn(points(0, n)))
    outs = None
    for a in range(0, n, step):
        b = min(a + step, n)
        part = fn(points(a, b))
        if outs is None:
            outs = tuple(torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in part)
        for o, x in zip(outs, part, strict=True):
            o[a:b] = x
    return outs


def esdf_slice(
    distance,
    bounds,
    device,
    step: int,
    voxel_size_m: float,
    z_m,
    aabb_min_xy,
    aabb_max_xy,
    resolution_m,
    max_pixels,
) -> Slice:
    """The ESDF on the plane ``z = z_m`` over ``[aabb_min_xy, aabb_max_xy]`` (default: ``bounds()``, the
    ESDF's extent ``(min [3], max [3])``) at ``resolution_m`` (default: the ESDF voxel ``voxel_size_m``);
    ``distance()``, called once the arguments are checked, gives the query ``points float64 [m, 3] ->
    (distance, ...)``, run per chunk of ``step`` points. NaN = unknown. More than ``max_pixels`` samples
    raise ``RequestTooLarge``."""
    z = float(z_m)
    if not math.isfinite(z):
        raise InvalidArgument(f"z_m: expected a finite number, got {z_m}")
    res = voxel_size_m if resolution_m is None else positive("resolution_m", resolution_m)
    if aabb_min_xy is None or aabb_max_xy is None:
        lo3, hi3 = bounds()
    lo = finite_vector("aabb_min_xy", aabb_min_xy, 2, device) if aabb_min_xy is not None else lo3[:2]
    hi = finite_vector("aabb_max_xy", aabb_max_xy, 2, device) if aabb_max_xy is not None else hi3[:2]
    if bool((hi <= lo).any()):
        raise InvalidArgument("aabb_max_xy: must exceed aabb_min_xy on both axes")
    w = max(1, math.ceil(float(hi[0] - lo[0]) / res))
    h = max(1, math.ceil(float(hi[1] - lo[1]) / res))
    if w * h > max_pixels:
        raise RequestTooLarge(
            f"resolution_m: the slice would have {w}x{h} = {w * h} pixels (limit {max_pixels})"
        )
    xs = lo[0] + (torch.arange(w, device=device, dtype=torch.float64) + 0.5) * res
    ys = lo[1] + (torch.arange(h, device=device, dtype=torch.float64) + 0.5) * res
    zs = torch.full((1,), z, dtype=torch.float64, device=device)
    query = distance()
    (d,) = chunked(lambda q: query(q)[:1], lattice_points((ys, xs, zs), (1, 0, 2)), h * w, step)
    return Slice(d.reshape(h, w), (float(lo[0]), float(lo[1])), res, z)


def esdf_box(
    distance, device, step: int, voxel_size_m: float, aabb_min, aabb_max, resolution_m, max_voxels
) -> EsdfBox:
    """Dense ESDF, its gradient and the observed mask on the box ``[aabb_min, aabb_max]`` (metres) at
    ``resolution_m`` spacing (default: the ESDF voxel ``voxel_size_m``), like nvblox's EsdfAndGradients
    service; ``distance`` and ``step`` as in :func:`esdf_slice`. More than ``max_voxels`` samples raise
    ``RequestTooLarge``."""
    lo = finite_vector("aabb_min", aabb_min, 3, device)
    hi = finite_vector("aabb_max", aabb_max, 3, device)
    if bool((hi <= lo).any()):
        raise InvalidArgument("aabb_max: must exceed aabb_min on every axis")
    res = voxel_size_m if resolution_m is None else positive("resolution_m", resolution_m)
    n = [max(1, math.ceil(float(hi[a] - lo[a]) / res)) for a in range(3)]
    if n[0] * n[1] * n[2] > max_voxels:
        raise RequestTooLarge(
            f"aabb_max: the box would have {n} = {n[0] * n[1] * n[2]} samples (limit {max_voxels})"
        )
    axes = [lo[a] + (torch.arange(n[a], device=device, dtype=torch.float64) + 0.5) * res for a in range(3)]
    d, g, o = chunked(distance(), lattice_points(axes, (0, 1, 2)), n[0] * n[1] * n[2], step)
    return EsdfBox(d.reshape(*n), g.reshape(*n, 3), o.reshape(*n), tuple(lo.tolist()), res)


@dataclass
class Slice:
    """A horizontal ESDF slice: ``distance[r, c]`` at ``(origin_xy[0] + (c + 0.5) * res, origin_xy[1] +
    (r + 0.5) * res, z_m)``; NaN = unknown."""

    distance: torch.Tensor  # float32 [H, W]
    origin_xy: tuple[float, float]
    resolution_m: float
    z_m: float


@dataclass
class EsdfBox:
    """Dense ESDF samples at ``origin + (idx + 0.5) * resolution_m`` for idx in [0, shape)."""

    distance: torch.Tensor  # float32 [X, Y, Z], NaN = unknown
    gradient: torch.Tensor  # float32 [X, Y, Z, 3]
    observed: torch.Tensor  # bool [X, Y, Z]
    origin: tuple[float, float, float]
    resolution_m: float


@dataclass
class RaycastResult:
    depth: torch.Tensor  # float32 [H, W] metres along the optical axis, 0 = no surface
    normals: torch.Tensor  # float32 [H, W, 3] world frame, zeros where no surface

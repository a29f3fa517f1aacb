"""Per-primitive math, broadcasting over leading dims: ray intervals (``(t_near, t_far)`` of the ray's line
inside the solid; NaN or ``t_near > t_far`` means no intersection) and signed distances."""

from __future__ import annotations

import math

import torch

_INF = math.inf


def _plane_interval(s: torch.Tensor, dn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``s``: signed distance of the origin, ``dn``: direction . normal."""
    t0 = -s / dn
    tn = torch.where(dn < 0, t0, -_INF)
    tf = torch.where(dn > 0, t0, _INF)
    outside_parallel = (dn == 0) & (s >= 0)
    return torch.where(outside_parallel, _INF, tn), torch.where(outside_parallel, -_INF, tf)


def _sphere_interval(oc: torch.Tensor, d: torch.Tensor, r: torch.Tensor):
    """``oc``: origin - centre ``[..., 3]``, ``d`` unit ``[..., 3]``. Discriminant as r^2 - |perp|^2 (no
    cancellation for distant spheres)."""
    b = (oc * d).sum(-1)
    perp = oc - b.unsqueeze(-1) * d
    sq = torch.sqrt(r * r - (perp * perp).sum(-1))  # NaN = miss
    return -b - sq, -b + sq


def _box_interval(o_loc: torch.Tensor, d_loc: torch.Tensor, h: torch.Tensor):
    """Slab test in the box frame (``o_loc``, ``d_loc`` ``[..., 3]``, half extents ``h``)."""
    inv = torch.reciprocal(d_loc)
    t1 = (-h - o_loc) * inv
    t2 = (h - o_loc) * inv
    return torch.minimum(t1, t2).amax(-1), torch.maximum(t1, t2).amin(-1)


def _cylinder_interval(ox, oy, oz, dx, dy, dz, r, z0, z1):
    """Origin relative to the axis (``ox, oy``), absolute ``oz``; ``dx, dy`` must not both be 0 (callers
    tilt vertical rays by 1e-6 rad, which changes no intersection inside the caps by more than ~1e-5 m).
    Discriminant in the stable form a r^2 - (o x d)^2."""
    a = dx * dx + dy * dy
    b = ox * dx + oy * dy
    cr = ox * dy - oy * dx
    sq = torch.sqrt(a * r * r - cr * cr)  # NaN = miss
    tn = (-b - sq) / a
    tf = (-b + sq) / a
    inv = torch.reciprocal(dz)
    t1 = (z0 - oz) * inv
    t2 = (z1 - oz) * inv
    return torch.maximum(tn, torch.minimum(t1, t2)), torch.minimum(tf, torch.maximum(t1, t2))


def _tilt_vertical(d: torch.Tensor) -> torch.Tensor:
    """Give exactly vertical rays a 1e-6 horizontal component (cylinder intervals divide by |d_xy|^2)."""
    small = d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1] < 1e-12
    if bool(small.any()):
        d = d.clone()
        d[..., 0] = torch.where(small, torch.full_like(d[..., 0], 1e-6), d[..., 0])
    return d


def _first_hit(tn: torch.Tensor, tf: torch.Tensor, max_range: float) -> torch.Tensor:
    """Nearest positive crossing of the interval's boundary (entry, or exit for an origin inside), inf if
    none within ``max_range``."""
    t = torch.where(tn > 0, tn, tf)
    ok = (tn <= tf) & (t > 0) & (t <= max_range)
    return torch.where(ok, t, _INF)


def _box_sdf_local(q: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    q = q.abs() - h
    return torch.linalg.vector_norm(q.clamp_min(0), dim=-1) + q.amax(-1).clamp_max(0)


def _cylinder_sdf(px, py, pz, cx, cy, r, zc, hz):
    dxy = torch.hypot(px - cx, py - cy) - r
    dz = (pz - zc).abs() - hz
    return torch.hypot(dxy.clamp_min(0), dz.clamp_min(0)) + torch.maximum(dxy, dz).clamp_max(0)

"""The :class:`Scene`: a union of analytic primitives on one device, its exact signed distance, normals
and batched ray casting (a float32 broad pass over culled (ray, primitive) pairs, the winner refined in
float64)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .._validation import as_tensor, resolve_device
from ..errors import InvalidArgument, InvalidArgumentType
from .checks import _float_tensor, _max_range
from .intersect import (
    _INF,
    _box_interval,
    _box_sdf_local,
    _cylinder_interval,
    _cylinder_sdf,
    _first_hit,
    _plane_interval,
    _sphere_interval,
    _tilt_vertical,
)
from .primitives import Box, Cylinder, Plane, Primitive, Sphere

# (ray, primitive) pairs per chunk of the float32 pass. On the CPU, 2^20 pairs (12 MB per [pairs, 3]
# float32 temporary) was the fastest of 2^16..2^20 on a 2-core machine; on CUDA, 2^26 pairs is ~0.8 GB per
# such temporary and a handful of launches per chunk.
_PAIRS_PER_CHUNK = {"cpu": 1 << 20, "cuda": 1 << 26}
_MIN_RAYS_PER_CHUNK = 1024


class Scene:
    """Union of analytic primitives on one device. Build with :meth:`from_primitives` or the factories
    :func:`outdoor_scene` / :func:`indoor_scene`. Immutable; :meth:`to` returns a copy on another device."""

    def __init__(self, primitives: tuple[Primitive, ...], device: torch.device, layout):
        self._primitives = primitives
        self._device = device
        self.layout = layout
        self._f64 = self._pack(primitives, device)
        self._f32 = {k: v.float() for k, v in self._f64.items()}

    @classmethod
    def from_primitives(
        cls, primitives: Sequence[Primitive], *, device: str | torch.device = "cpu", layout=None
    ) -> Scene:
        """Scene of ``primitives`` (:class:`Plane`, :class:`Sphere`, :class:`Box`, :class:`Cylinder`), with
        tensors on ``device``. ``layout`` (a :class:`Road`, :class:`Room` or ``None``) is kept for the
        trajectory generators."""
        prims = tuple(primitives)
        if not prims:
            raise InvalidArgument("primitives: need at least one primitive")
        for i, p in enumerate(prims):
            if not isinstance(p, (Plane, Sphere, Box, Cylinder)):
                raise InvalidArgumentType(
                    f"primitives[{i}]: expected Plane, Sphere, Box or Cylinder, got {type(p).__name__}"
                )
        return cls(prims, resolve_device(device, torch.device("cpu")), layout)

    def to(self, device: str | torch.device) -> Scene:
        return Scene(self._primitives, resolve_device(device, self._device), self.layout)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def primitives(self) -> tuple[Primitive, ...]:
        return self._primitives

    def __len__(self) -> int:
        return len(self._primitives)

    def __repr__(self) -> str:
        counts = {k: self._f64[k].shape[0] for k in ("plane_n", "sph_r", "box_h", "cyl_r")}
        return (
            f"Scene(planes={counts['plane_n']}, spheres={counts['sph_r']}, boxes={counts['box_h']}, "
            f"cylinders={counts['cyl_r']}, device={self._device})"
        )

    @staticmethod
    def _pack(prims, device) -> dict[str, torch.Tensor]:
        planes = [p for p in prims if isinstance(p, Plane)]
        spheres = [p for p in prims if isinstance(p, Sphere)]
        boxes = [p for p in prims if isinstance(p, Box)]
        cyls = [p for p in prims if isinstance(p, Cylinder)]

        def arr(rows, width):
            return np.asarray(rows, dtype=np.float64).reshape(-1, *width)

        n = arr([p.normal for p in planes], (3,))
        off = (n * arr([p.point_m for p in planes], (3,))).sum(1)
        sph_c, sph_r = arr([p.center_m for p in spheres], (3,)), arr([p.radius_m for p in spheres], ())
        box_c, box_h = arr([b.center_m for b in boxes], (3,)), arr([b.half_extents_m for b in boxes], (3,))
        box_R = arr([b.rotation_matrix() for b in boxes], (3, 3))
        cyl_c = arr([c.center_xy_m for c in cyls], (2,))
        cyl_z = arr([(c.z_min_m, c.z_max_m) for c in cyls], (2,))
        cyl_r = arr([c.radius_m for c in cyls], ())
        # bounding spheres of the finite primitives, in the order spheres, boxes, cylinders
        cyl_zc, cyl_hz = cyl_z.mean(1), (cyl_z[:, 1] - cyl_z[:, 0]) / 2
        bound_c = np.concatenate([sph_c, box_c, np.concatenate([cyl_c, cyl_zc[:, None]], 1)])
        bound_r = np.concatenate([sph_r, np.linalg.norm(box_h, axis=1), np.hypot(cyl_r, cyl_hz)])
        d = {
            "plane_n": n,
            "plane_off": off,
            "sph_c": sph_c,
            "sph_r": sph_r,
            "box_c": box_c,
            "box_R": box_R,
            "box_h": box_h,
            "box_oc": np.einsum("pi,pij->pj", box_c, box_R),  # R^T c: box centre in box axes
            "cyl_c": cyl_c,
            "cyl_z": cyl_z,
            "cyl_zc": cyl_zc,
            "cyl_hz": cyl_hz,
            "cyl_r": cyl_r,
            "bound_c": bound_c,
            "bound_r": bound_r,
        }
        return {k: torch.as_tensor(v, dtype=torch.float64, device=device) for k, v in d.items()}

    # -- signed distance -------------------------------------------------------------------------------

    def sdf(self, points_world) -> torch.Tensor:
        """Signed distance (m, negative inside) of ``points_world`` (float ``[M, 3]``, any device; moved to
        the scene's device) -> ``[M]`` in the points' dtype (float32 or float64) on the scene's device.

        Exact outside the union; inside, a lower bound of the depth (see the module docstring)."""
        p = _float_tensor("points_world", points_world, self._device, (3,))
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        p = p.to(dtype)
        P = self._f64 if dtype == torch.float64 else self._f32
        n_prims = len(self._primitives)
        step = max(_MIN_RAYS_PER_CHUNK, _PAIRS_PER_CHUNK.get(self._device.type, 1 << 22) // n_prims)
        out = torch.empty(p.shape[0], dtype=dtype, device=self._device)
        for s in range(0, p.shape[0], step):
            out[s : s + step] = self._sdf_chunk(p[s : s + step], P)
        return out

    def _sdf_chunk(self, p: torch.Tensor, P: dict[str, torch.Tensor]) -> torch.Tensor:
        best = torch.full((p.shape[0],), _INF, dtype=p.dtype, device=p.device)
        if P["plane_n"].shape[0]:
            best = torch.minimum(best, (p @ P["plane_n"].T - P["plane_off"]).amin(1))
        if P["sph_r"].shape[0]:
            d = torch.linalg.vector_norm(p[:, None, :] - P["sph_c"][None], dim=-1) - P["sph_r"]
            best = torch.minimum(best, d.amin(1))
        if P["box_h"].shape[0]:
            B = P["box_h"].shape[0]
            rcat = P["box_R"].permute(1, 0, 2).reshape(3, 3 * B)
            q = (p @ rcat).view(-1, B, 3) - P["box_oc"]
            best = torch.minimum(best, _box_sdf_local(q, P["box_h"]).amin(1))
        if P["cyl_r"].shape[0]:
            c = P["cyl_c"]
            d = _cylinder_sdf(
                p[:, 0:1], p[:, 1:2], p[:, 2:3], c[:, 0], c[:, 1], P["cyl_r"], P["cyl_zc"], P["cyl_hz"]
            )
            best = torch.minimum(best, d.amin(1))
        return best

    def normals(self, points_world) -> torch.Tensor:
        """Unit SDF gradient ``[M, 3]`` at ``points_world`` (float ``[M, 3]``): the outward surface normal
        at surface points. Central differences of the float64 SDF with a 1e-6 m step (so within 1e-6 m of
        an edge the result blends the faces). dtype follows the input (float32 or float64)."""
        p = _float_tensor("points_world", points_world, self._device, (3,))
        p64 = p.to(torch.float64)
        eps = 1e-6
        g = torch.empty_like(p64)
        for a in range(3):
            e = torch.zeros(3, dtype=torch.float64, device=self._device)
            e[a] = eps
            g[:, a] = (self.sdf(p64 + e) - self.sdf(p64 - e)) / (2 * eps)
        g = g / torch.linalg.vector_norm(g, dim=1, keepdim=True).clamp_min(1e-30)
        return g if p.dtype == torch.float64 else g.float()

    # -- ray casting -----------------------------------------------------------------------------------

    def raycast(self, origins_world, dirs_world, max_range_m: float = _INF) -> torch.Tensor:
        """Distance (m) along each ray to its nearest surface crossing, ``inf`` where there is none within
        ``max_range_m``.

        Args:
            origins_world: float ``[M, 3]``, or ``[3]`` for one origin shared by all rays.
            dirs_world: float ``[M, 3]``, non-zero; normalised here, so ``t`` is Euclidean distance.
            max_range_m: hits farther than this are reported as ``inf``.

        Returns:
            ``t`` ``[M]`` on the scene's device, float64 if ``origins_world`` is float64, else float32.
            A ray starting inside a primitive returns where it leaves that primitive.
        """
        max_range = _max_range("max_range_m", max_range_m)
        d_in = _float_tensor("dirs_world", dirs_world, self._device, (3,))
        o_in = as_tensor("origins_world", origins_world, self._device)
        if o_in.dim() == 1:
            o_in = o_in.reshape(1, 3) if o_in.shape[0] == 3 else o_in
        o_in = _float_tensor("origins_world", o_in, self._device, (3,))
        if o_in.shape[0] not in (1, d_in.shape[0]):
            raise InvalidArgument(
                f"origins_world: expected [3], [1, 3] or [{d_in.shape[0]}, 3] to match dirs_world, "
                f"got {list(o_in.shape)}"
            )
        out_dtype = torch.float64 if o_in.dtype == torch.float64 else torch.float32
        d64 = d_in.to(torch.float64)
        norm = torch.linalg.vector_norm(d64, dim=1, keepdim=True)
        if bool((norm < 1e-12).any()):
            raise InvalidArgument("dirs_world: contains zero-length directions")
        d64 = d64 / norm
        o64 = o_in.to(torch.float64).expand(d64.shape[0], 3)
        return self._raycast(o64, d64, max_range).to(out_dtype)

    def _raycast(self, o64: torch.Tensor, d64: torch.Tensor, max_range: float) -> torch.Tensor:
        M = d64.shape[0]
        dev = self._device
        n_prims = len(self._primitives)
        step = max(_MIN_RAYS_PER_CHUNK, _PAIRS_PER_CHUNK.get(dev.type, 1 << 22) // n_prims)
        t_broad = torch.full((M,), _INF, dtype=torch.float64, device=dev)
        kind = torch.zeros(M, dtype=torch.int64, device=dev)
        index = torch.zeros(M, dtype=torch.int64, device=dev)
        for s in range(0, M, step):
            e = min(s + step, M)
            t, k, i = self._broad_chunk(o64[s:e], d64[s:e], max_range)
            t_broad[s:e], kind[s:e], index[s:e] = t, k, i
        # float64 recomputation of each ray's winning primitive
        t_out = torch.full((M,), _INF, dtype=torch.float64, device=dev)
        hit = torch.isfinite(t_broad)
        for k, refine in enumerate(
            (self._refine_plane, self._refine_sphere, self._refine_box, self._refine_cyl)
        ):
            rows = torch.nonzero(hit & (kind == k)).squeeze(1)
            if rows.numel() == 0:
                continue
            t = refine(o64[rows], d64[rows], index[rows], max_range)
            t_out[rows] = torch.where(torch.isfinite(t), t, t_broad[rows])
        return t_out

    def _cull(self, o64, d64, max_range) -> torch.Tensor:
        """Indices (into the bounding-sphere list) of finite primitives that some ray of the chunk may hit
        within ``max_range``: distance test against the origins' bounding ball, and a cone test when the
        chunk's directions lie within 78 degrees of their mean (LiDAR wedges, camera tiles)."""
        bc, br = self._f64["bound_c"], self._f64["bound_r"]
        lo, hi = o64.amin(0), o64.amax(0)
        oc, ro = (lo + hi) / 2, float(torch.linalg.vector_norm(hi - lo)) / 2
        v = bc - oc
        dist = torch.linalg.vector_norm(v, dim=1)
        rr = br + ro
        keep = dist - rr <= max_range
        a = d64.sum(0)
        an = torch.linalg.vector_norm(a)
        if float(an) > 1e-9:
            a = a / an
            cosmin = float((d64 @ a).min())
            if cosmin > 0.2:
                half = math.acos(min(1.0, cosmin))
                ang = torch.acos(((v @ a) / dist.clamp_min(1e-12)).clamp(-1, 1))
                spread = torch.asin((rr / dist.clamp_min(1e-12)).clamp(max=1.0))
                keep &= (dist <= rr) | (ang <= half + spread + 1e-4)
        return torch.nonzero(keep).squeeze(1)

    def _broad_chunk(self, o64, d64, max_range):
        P = self._f32
        R = o64.shape[0]
        o, d = o64.float(), d64.float()
        ts, idxs = [], []
        if P["plane_n"].shape[0]:
            s = o @ P["plane_n"].T - P["plane_off"]
            dn = d @ P["plane_n"].T
            t, i = _first_hit(*_plane_interval(s, dn), max_range).min(1)
            ts.append(t)
            idxs.append(i)
        else:
            ts.append(torch.full((R,), _INF, device=o.device))
            idxs.append(torch.zeros(R, dtype=torch.int64, device=o.device))
        kept = self._cull(o64, d64, max_range)
        n_s, n_b = P["sph_r"].shape[0], P["box_h"].shape[0]
        ks = kept[kept < n_s]
        kb = kept[(kept >= n_s) & (kept < n_s + n_b)] - n_s
        kc = kept[kept >= n_s + n_b] - n_s - n_b
        for sel, fn in ((ks, self._broad_sphere), (kb, self._broad_box), (kc, self._broad_cyl)):
            if sel.numel() == 0:
                ts.append(torch.full((R,), _INF, device=o.device))
                idxs.append(torch.zeros(R, dtype=torch.int64, device=o.device))
                continue
            t, i = _first_hit(*fn(o, d, sel, P), max_range).min(1)
            ts.append(t)
            idxs.append(sel[i])
        t_all = torch.stack(ts, 1)
        t, kind = t_all.min(1)
        index = torch.stack(idxs, 1).gather(1, kind[:, None]).squeeze(1)
        return t, kind, index

    @staticmethod
    def _broad_sphere(o, d, sel, P):
        oc = o[:, None, :] - P["sph_c"][sel][None]
        return _sphere_interval(oc, d[:, None, :], P["sph_r"][sel])

    @staticmethod
    def _broad_box(o, d, sel, P):
        Rm = P["box_R"][sel]
        K = Rm.shape[0]
        rcat = Rm.permute(1, 0, 2).reshape(3, 3 * K)  # column block p = R_p, so o @ rcat = R_p^T o
        o_loc = (o @ rcat).view(-1, K, 3) - P["box_oc"][sel]
        d_loc = (d @ rcat).view(-1, K, 3)
        return _box_interval(o_loc, d_loc, P["box_h"][sel])

    @staticmethod
    def _broad_cyl(o, d, sel, P):
        d = _tilt_vertical(d)
        c, z = P["cyl_c"][sel], P["cyl_z"][sel]
        return _cylinder_interval(
            o[:, 0:1] - c[:, 0],
            o[:, 1:2] - c[:, 1],
            o[:, 2:3],
            d[:, 0:1],
            d[:, 1:2],
            d[:, 2:3],
            P["cyl_r"][sel],
            z[:, 0],
            z[:, 1],
        )

    def _refine_plane(self, o, d, i, max_range):
        n = self._f64["plane_n"][i]
        s = (o * n).sum(1) - self._f64["plane_off"][i]
        return _first_hit(*_plane_interval(s, (d * n).sum(1)), max_range)

    def _refine_sphere(self, o, d, i, max_range):
        return _first_hit(*_sphere_interval(o - self._f64["sph_c"][i], d, self._f64["sph_r"][i]), max_range)

    def _refine_box(self, o, d, i, max_range):
        Rm = self._f64["box_R"][i]
        o_loc = torch.einsum("ki,kij->kj", o - self._f64["box_c"][i], Rm)
        d_loc = torch.einsum("ki,kij->kj", d, Rm)
        return _first_hit(*_box_interval(o_loc, d_loc, self._f64["box_h"][i]), max_range)

    def _refine_cyl(self, o, d, i, max_range):
        d = _tilt_vertical(d)
        c, z = self._f64["cyl_c"][i], self._f64["cyl_z"][i]
        tn, tf = _cylinder_interval(
            o[:, 0] - c[:, 0],
            o[:, 1] - c[:, 1],
            o[:, 2],
            d[:, 0],
            d[:, 1],
            d[:, 2],
            self._f64["cyl_r"][i],
            z[:, 0],
            z[:, 1],
        )
        return _first_hit(tn, tf, max_range)

"""Ray casting: the TSDF surface seen by a pinhole camera, by sphere tracing the trilinear TSDF."""

from __future__ import annotations

import torch

from . import queries as Q


def raycast_tsdf(layer, T, K, width, height, s, tau, max_range_m, chunk=1 << 16) -> Q.RaycastResult:
    """Sphere tracing: step by the (positive) trilinear TSDF, at least half a voxel, one brick through
    unallocated space, until the TSDF changes sign; the hit is the linear zero crossing."""
    dev = T.device
    u = torch.arange(width, device=dev, dtype=torch.float64)
    vv = torch.arange(height, device=dev, dtype=torch.float64)
    gv, gu = torch.meshgrid(vv, u, indexing="ij")
    x = (gu - K[0, 2]) / K[0, 0]
    y = (gv - K[1, 2]) / K[1, 1]
    ray_c = torch.stack((x, y, torch.ones_like(x)), dim=-1).reshape(-1, 3)
    znorm = torch.linalg.vector_norm(ray_c, dim=1)
    dirs = (ray_c / znorm[:, None]) @ T[:3, :3].T
    origin = T[:3, 3]
    n = dirs.shape[0]
    depth = torch.zeros(n, dtype=torch.float64, device=dev)
    normals = torch.zeros((n, 3), dtype=torch.float64, device=dev)
    max_steps = int(max_range_m / (0.5 * s)) + 2
    for c0 in range(0, n, chunk):
        idx = torch.arange(c0, min(c0 + chunk, n), device=dev)
        t = torch.full((idx.numel(),), 0.5 * s, dtype=torch.float64, device=dev)
        prev_t = t.clone()
        prev_v = torch.full_like(t, float("nan"))
        for _ in range(max_steps):
            if idx.numel() == 0:
                break
            p = origin + dirs[idx] * t[:, None]
            _, frac, ok, vals, present = Q.gather_corners(layer, p, s, ["tsdf", "weight"], [0.0, 0.0])
            obs = (present & (vals["weight"] > 0)).all(dim=1) & ok
            val, _ = Q.masked_trilinear(vals["tsdf"], frac, obs, s)
            val = val.to(torch.float64)
            hit = obs & (val <= 0) & torch.isfinite(prev_v) & (prev_v > 0)
            if bool(hit.any()):
                hi = hit.nonzero().squeeze(1)
                th = prev_t[hi] + (t[hi] - prev_t[hi]) * prev_v[hi] / (prev_v[hi] - val[hi])
                ph = origin + dirs[idx[hi]] * th[:, None]
                _, fr2, _, v2, _ = Q.gather_corners(layer, ph, s, ["tsdf"], [0.0])
                _, grad = Q.trilinear(v2["tsdf"].to(torch.float64), fr2, s)
                nrm = grad / torch.linalg.vector_norm(grad, dim=1, keepdim=True).clamp(min=1e-12)
                depth[idx[hi]] = th / znorm[idx[hi]]
                normals[idx[hi]] = nrm
            any_alloc = present.any(dim=1)
            step = torch.where(
                obs & (val > 0),
                (0.8 * val).clamp(min=0.5 * s, max=tau),
                torch.where(any_alloc, torch.full_like(t, 0.5 * s), torch.full_like(t, 2.0 * s)),
            )
            prev_t = torch.where(obs, t, prev_t)
            prev_v = torch.where(obs, val, torch.where(any_alloc, prev_v, torch.full_like(val, float("nan"))))
            t = t + step
            live = ~hit & (t < max_range_m)
            idx, t, prev_t, prev_v = idx[live], t[live], prev_t[live], prev_v[live]
    return Q.RaycastResult(
        depth.reshape(height, width).to(torch.float32), normals.reshape(height, width, 3).to(torch.float32)
    )

"""SE(3) helpers: :func:`se3_exp`, :func:`se3_log` (float64, batched), twist = ``(translation, rotation)``;
poses (float64 4x4) live on the host, whatever the points' device."""

from __future__ import annotations

import math

import numpy as np
import torch

_HOST = torch.device("cpu")  # poses (float64 4x4) live on the host, whatever the points' device


def skew(w: torch.Tensor) -> torch.Tensor:
    """``[..., 3] -> [..., 3, 3]`` cross-product matrices (``skew(a) @ b = a x b``)."""
    z = torch.zeros_like(w[..., 0])
    x, y, zz = w[..., 0], w[..., 1], w[..., 2]
    return torch.stack([z, -zz, y, zz, z, -x, -y, x, z], dim=-1).reshape(*w.shape[:-1], 3, 3)


def _so3_coeffs(theta: torch.Tensor):
    """(sin t / t, (1 - cos t) / t^2, (t - sin t) / t^3) with Taylor series near 0."""
    t2 = theta * theta
    small = theta < 1e-4
    ts = torch.where(small, torch.ones_like(theta), theta)
    a = torch.where(small, 1 - t2 / 6, torch.sin(ts) / ts)
    b = torch.where(small, 0.5 - t2 / 24, (1 - torch.cos(ts)) / (ts * ts))
    c = torch.where(small, 1.0 / 6 - t2 / 120, (ts - torch.sin(ts)) / (ts * ts * ts))
    return a, b, c


def se3_exp(xi: torch.Tensor) -> torch.Tensor:
    """Exponential map: twists ``[..., 6]`` = (translation-like ``rho``, rotation vector ``phi``) ->
    float64 ``[..., 4, 4]``: ``R = exp([phi]x)``, ``t = V(phi) rho``."""
    xi = xi.to(torch.float64)
    rho, phi = xi[..., :3], xi[..., 3:]
    theta = torch.linalg.vector_norm(phi, dim=-1)
    a, b, c = _so3_coeffs(theta)
    K = skew(phi)
    K2 = K @ K
    eye = torch.eye(3, dtype=torch.float64, device=xi.device).expand(K.shape)
    R = eye + a[..., None, None] * K + b[..., None, None] * K2
    V = eye + b[..., None, None] * K + c[..., None, None] * K2
    T = torch.zeros(*xi.shape[:-1], 4, 4, dtype=torch.float64, device=xi.device)
    T[..., :3, :3] = R
    T[..., :3, 3] = (V @ rho[..., None])[..., 0]
    T[..., 3, 3] = 1.0
    return T


def se3_log(T: torch.Tensor) -> torch.Tensor:
    """Logarithm: float ``[..., 4, 4]`` rigid transforms -> twists ``[..., 6]`` (inverse of :func:`se3_exp`
    for rotation angles in ``[0, pi)``; at exactly ``pi`` the sign of the axis is arbitrary)."""
    T = T.to(torch.float64)
    R, t = T[..., :3, :3], T[..., :3, 3]
    cos = ((R.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    vee = torch.stack(
        [R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0], R[..., 1, 0] - R[..., 0, 1]], -1
    )
    a, b, _ = _so3_coeffs(theta)
    phi = vee / (2 * a[..., None])
    # near pi, sin(theta) ~ 0 loses the axis: take it from the symmetric part (R + I) / 2 = cos-term + u u^T
    near_pi = theta > math.pi - 1e-3
    if bool(near_pi.any()):
        S = (R + torch.eye(3, dtype=torch.float64, device=T.device)) / 2
        d = S.diagonal(dim1=-2, dim2=-1)
        k = d.argmax(-1, keepdim=True)
        col = torch.gather(S, -1, k[..., None, :].expand(*S.shape[:-1], 1))[..., 0]
        axis = col / torch.linalg.vector_norm(col, dim=-1, keepdim=True).clamp_min(1e-12)
        sgn = torch.where((axis * vee).sum(-1, keepdim=True) < 0, -1.0, 1.0)
        phi = torch.where(near_pi[..., None], sgn * axis * theta[..., None], phi)
    K = skew(phi)
    th = torch.linalg.vector_norm(phi, dim=-1)
    a, b, _ = _so3_coeffs(th)
    small = th < 1e-4
    bs = torch.where(small, torch.ones_like(b), b)
    ths = torch.where(small, torch.ones_like(th), th)
    d = torch.where(small, torch.full_like(th, 1.0 / 12), (1 - a / (2 * bs)) / (ths * ths))
    eye = torch.eye(3, dtype=torch.float64, device=T.device).expand(K.shape)
    V_inv = eye - 0.5 * K + d[..., None, None] * (K @ K)
    rho = (V_inv @ t[..., None])[..., 0]
    return torch.cat([rho, phi], -1)


def _skew_np(w: np.ndarray) -> np.ndarray:
    return np.array([[0.0, -w[2], w[1]], [w[2], 0.0, -w[0]], [-w[1], w[0], 0.0]])


def _se3_exp_np(xi: np.ndarray) -> np.ndarray:
    """:func:`se3_exp` of one twist on the host (numpy float64 ``[6] -> [4, 4]``)."""
    rho, phi = xi[:3], xi[3:]
    th = float(np.linalg.norm(phi))
    if th < 1e-4:
        a, b, c = 1 - th * th / 6, 0.5 - th * th / 24, 1.0 / 6 - th * th / 120
    else:
        a, b, c = math.sin(th) / th, (1 - math.cos(th)) / th**2, (th - math.sin(th)) / th**3
    K = _skew_np(phi)
    K2 = K @ K
    T = np.eye(4)
    T[:3, :3] = np.eye(3) + a * K + b * K2
    T[:3, 3] = (np.eye(3) + b * K + c * K2) @ rho
    return T


def _rotation_angle(T: torch.Tensor) -> float:
    cos = float(((torch.trace(T[:3, :3]) - 1) / 2).clamp(-1.0, 1.0))
    return math.acos(cos)

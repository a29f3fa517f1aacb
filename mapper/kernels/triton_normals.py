"""The LiDAR normal fit as Triton kernels (imported lazily: triton is optional).

:func:`cell_normals_triton` (reference :func:`mapper.kernels.normals.cell_normals_torch`), every scale at
once (grid axis 1): ``_cell_moments_kernel`` gives each sorted position its cell index (the first position
of its key, a binary search) and adds the return's moments to that row (float64 atomics);
``_cell_normals_kernel`` runs one lane per cell (the cell number's first position is a binary search in
the running cell count, so the lanes of a warp are all busy; lanes past the last cell idle); each distinct
valid cell sums the moments of the 27 cells around it (a binary search of each neighbour key in the
sorted keys, a fixed number of steps, sizes unspecialised: scans of any size below 2^20 returns share one
compiled variant), forms the covariance, finds its smallest eigenvalue and eigenvector in closed form and
writes the normal (zero where the neighbourhood is not a plane) at the cell's index. No host sync; float64
throughout.

The eigenvalues: with ``B = (C - q I) / p`` (``q`` the mean eigenvalue, ``p`` the spread), the eigenvalues
``beta`` of ``B`` are the roots of ``beta^3 - 3 beta - det B`` in ``[-2, 2]``. Triton has no ``acos``, so
the smallest root comes from Newton's method started at ``-2`` (the cubic is increasing and concave on
``[-2, -1]``: the iterates rise monotonically to the root), the other two from the deflated quadratic;
the reference's trigonometric form gives the same values to rounding.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .keys import BRICK_HI, BRICK_LO
from .keys import VOXEL_KEY_BIAS as KEY_BIAS
from .keys import VOXEL_KEY_BITS as KEY_BITS
from .normals import CELL_OFFSET, MIN_POINTS, PLANE_RATIO, SPREAD_RATIO

SEARCH_STEPS = 20  # binary-search steps: one variant for scans of < 2^20 returns (32 beyond)
NEWTON_STEPS = 40  # from -2: quadratic convergence in ~6 steps; a (non-planar) double root at -1 needs more


@triton.jit(do_not_specialize=["n"])
def _cell_moments_kernel(
    x_ptr, keys_ptr, order_ptr, inv_ptr, new_ptr, mom_ptr, n, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # scale s (grid axis 1); lane i = sorted position i: its key's first position f (lower bound in the
    # sorted keys, <= i) is the cell index; the return's moments go to row f (atomics, float64)
    sc = tl.program_id(1).to(tl.int64) * n
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    key = tl.load(keys_ptr + sc + i, mask=m, other=0)
    lo = tl.zeros_like(i)
    hi = tl.where(m, i, lo)
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        open_ = lo < hi
        v = tl.load(keys_ptr + sc + mid, mask=open_, other=0)
        go = v < key
        lo = tl.where(open_ & go, mid + 1, lo)
        hi = tl.where(open_ & ~go, mid, hi)
    p = tl.load(order_ptr + sc + i, mask=m, other=0)
    tl.store(inv_ptr + sc + p, lo, mask=m)
    tl.store(new_ptr + sc + i, (lo == i).to(tl.int64), mask=m)
    x = tl.load(x_ptr + p * 3, mask=m, other=0.0)
    y = tl.load(x_ptr + p * 3 + 1, mask=m, other=0.0)
    z = tl.load(x_ptr + p * 3 + 2, mask=m, other=0.0)
    dst = mom_ptr + (sc + lo) * 10
    tl.atomic_add(dst, x * 0.0 + 1.0, mask=m, sem="relaxed")
    tl.atomic_add(dst + 1, x, mask=m, sem="relaxed")
    tl.atomic_add(dst + 2, y, mask=m, sem="relaxed")
    tl.atomic_add(dst + 3, z, mask=m, sem="relaxed")
    tl.atomic_add(dst + 4, x * x, mask=m, sem="relaxed")
    tl.atomic_add(dst + 5, x * y, mask=m, sem="relaxed")
    tl.atomic_add(dst + 6, x * z, mask=m, sem="relaxed")
    tl.atomic_add(dst + 7, y * y, mask=m, sem="relaxed")
    tl.atomic_add(dst + 8, y * z, mask=m, sem="relaxed")
    tl.atomic_add(dst + 9, z * z, mask=m, sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _cell_normals_kernel(
    keys_ptr, cnt_ptr, mom_ptr, prm_ptr, out_ptr, n,
    KB: tl.constexpr, MIN_PTS: tl.constexpr,
    STEPS: tl.constexpr, NEWTON: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # scale s (grid axis 1); lane j = cell number j of that scale, so a warp's lanes are all busy: its first
    # sorted position is the lower bound of j + 1 in the running cell count (n past the last cell)
    sc = tl.program_id(1).to(tl.int64) * n
    keys_ptr += sc
    cnt_ptr += sc
    mom_ptr += sc * 10
    out_ptr += sc * 3
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    want = j + 1
    lo = tl.zeros_like(j)
    hi = tl.where(j < n, lo + n, lo)  # int64, as the loop keeps it
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        open_ = lo < hi
        v = tl.load(cnt_ptr + mid, mask=open_, other=0)
        go = v < want
        lo = tl.where(open_ & go, mid + 1, lo)
        hi = tl.where(open_ & ~go, mid, hi)
    i = tl.where(j < n, lo, n)
    m = i < n
    key = tl.load(keys_ptr + i, mask=m, other=-1)
    act = m & (key >= 0)
    c0 = tl.zeros([BLOCK], dtype=tl.float64)
    s1 = c0
    s2 = c0
    s3 = c0
    s4 = c0
    s5 = c0
    s6 = c0
    s7 = c0
    s8 = c0
    s9 = c0
    for d in tl.static_range(27):
        nk = key + (((d // 9 - 1) << (2 * KB)) + (((d // 3) % 3 - 1) << KB) + (d % 3 - 1))
        lo = tl.zeros_like(i)
        hi = tl.zeros_like(i) + n
        for _ in range(STEPS):  # lower bound of nk in the sorted keys
            mid = (lo + hi) // 2
            open_ = lo < hi
            v = tl.load(keys_ptr + mid, mask=act & open_, other=0)
            go = v < nk
            lo = tl.where(open_ & go, mid + 1, lo)
            hi = tl.where(open_ & ~go, mid, hi)
        inb = act & (lo < n)
        hit = inb & (tl.load(keys_ptr + lo, mask=inb, other=-3) == nk)
        row = lo * 10  # the neighbour's first sorted position: its moments' row
        c0 += tl.load(mom_ptr + row, mask=hit, other=0.0)
        s1 += tl.load(mom_ptr + row + 1, mask=hit, other=0.0)
        s2 += tl.load(mom_ptr + row + 2, mask=hit, other=0.0)
        s3 += tl.load(mom_ptr + row + 3, mask=hit, other=0.0)
        s4 += tl.load(mom_ptr + row + 4, mask=hit, other=0.0)
        s5 += tl.load(mom_ptr + row + 5, mask=hit, other=0.0)
        s6 += tl.load(mom_ptr + row + 6, mask=hit, other=0.0)
        s7 += tl.load(mom_ptr + row + 7, mask=hit, other=0.0)
        s8 += tl.load(mom_ptr + row + 8, mask=hit, other=0.0)
        s9 += tl.load(mom_ptr + row + 9, mask=hit, other=0.0)
    cs = tl.maximum(c0, 1.0)
    mx = s1 / cs
    my = s2 / cs
    mz = s3 / cs
    a00 = s4 / cs - mx * mx
    a01 = s5 / cs - mx * my
    a02 = s6 / cs - mx * mz
    a11 = s7 / cs - my * my
    a12 = s8 / cs - my * mz
    a22 = s9 / cs - mz * mz
    q = (a00 + a11 + a22) / 3.0
    p1 = a01 * a01 + a02 * a02 + a12 * a12
    p2 = (a00 - q) * (a00 - q) + (a11 - q) * (a11 - q) + (a22 - q) * (a22 - q) + 2.0 * p1
    p = tl.sqrt(p2 / 6.0)
    ps = tl.where(p > 0, p, 1.0)
    b00 = (a00 - q) / ps
    b11 = (a11 - q) / ps
    b22 = (a22 - q) / ps
    b01 = a01 / ps
    b02 = a02 / ps
    b12 = a12 / ps
    det = b00 * (b11 * b22 - b12 * b12) - b01 * (b01 * b22 - b12 * b02) + b02 * (b01 * b12 - b11 * b02)
    det = tl.minimum(tl.maximum(det, -2.0), 2.0)
    beta = c0 * 0.0 - 2.0
    for _ in range(NEWTON):
        g = beta * beta * beta - 3.0 * beta - det
        dg = 3.0 * beta * beta - 3.0
        step = tl.where(dg > 0, g / tl.where(dg > 0, dg, 1.0), 0.0)
        beta = tl.minimum(beta - step, -1.0)
    disc = tl.sqrt(tl.maximum(12.0 - 3.0 * beta * beta, 0.0))
    l0 = q + p * beta
    l2 = q + p * (-beta + disc) / 2.0
    l1 = 3.0 * q - l2 - l0
    # eigenvector of l0: the longest cross product of two rows of C - l0 I
    r00 = a00 - l0
    r11 = a11 - l0
    r22 = a22 - l0
    ax = a01 * a12 - a02 * r11  # r0 x r1, r0 = (r00, a01, a02), r1 = (a01, r11, a12)
    ay = a02 * a01 - r00 * a12
    az = r00 * r11 - a01 * a01
    bx = a01 * r22 - a02 * a12  # r0 x r2, r2 = (a02, a12, r22)
    by = a02 * a02 - r00 * r22
    bz = r00 * a12 - a01 * a02
    cx = r11 * r22 - a12 * a12  # r1 x r2
    cy = a12 * a02 - a01 * r22
    cz = a01 * a12 - r11 * a02
    na = tl.sqrt(ax * ax + ay * ay + az * az)
    nb = tl.sqrt(bx * bx + by * by + bz * bz)
    nc = tl.sqrt(cx * cx + cy * cy + cz * cz)
    use_a = (na >= nb) & (na >= nc)
    use_b = ~use_a & (nb >= nc)
    vx = tl.where(use_a, ax, tl.where(use_b, bx, cx))
    vy = tl.where(use_a, ay, tl.where(use_b, by, cy))
    vz = tl.where(use_a, az, tl.where(use_b, bz, cz))
    nv = tl.where(use_a, na, tl.where(use_b, nb, nc))
    nv = tl.where(nv > 0, nv, 1.0)
    plane = tl.load(prm_ptr)  # float64 ratios from memory: a float constexpr would be rounded to float32
    spread = tl.load(prm_ptr + 1)
    ok = (c0 >= MIN_PTS) & (l0 <= plane * l1) & (l1 >= spread * l2) & (l2 > 0)
    w = tl.where(ok, 1.0 / nv, 0.0)
    dst = i * 3
    tl.store(out_ptr + dst, vx * w, mask=act)
    tl.store(out_ptr + dst + 1, vy * w, mask=act)
    tl.store(out_ptr + dst + 2, vz * w, mask=act)


@functools.cache
def _params(device: torch.device) -> torch.Tensor:
    """float64 [PLANE_RATIO, SPREAD_RATIO, CELL_OFFSET] on ``device`` (uploaded once)."""
    return torch.tensor([PLANE_RATIO, SPREAD_RATIO, CELL_OFFSET], dtype=torch.float64).to(device)


def cell_normals_triton(x: torch.Tensor, sorted_keys: torch.Tensor, order: torch.Tensor):
    """Triton version of :func:`mapper.kernels.normals.cell_normals_torch` (same arguments and result): the
    moments (one launch for every scale), the running cell count (one ``cumsum``), the normals (one launch
    for every scale); no host sync."""
    s, n = sorted_keys.shape
    dev = x.device
    tables = torch.zeros((s, n, 3), dtype=torch.float64, device=dev)
    inv = torch.empty((s, n), dtype=torch.int64, device=dev)
    if n == 0 or s == 0:
        return tables, inv
    keys = sorted_keys.contiguous()
    new = torch.empty((s, n), dtype=torch.int64, device=dev)
    mom = torch.zeros((s, n, 10), dtype=torch.float64, device=dev)
    steps = SEARCH_STEPS if n < (1 << SEARCH_STEPS) else 32
    block = 256 if x.is_cuda else 1024  # the interpreter's cost is per block
    _cell_moments_kernel[(triton.cdiv(n, block), s)](
        x.to(torch.float64).contiguous(), keys, order.contiguous(), inv, new, mom, n,
        STEPS=steps, BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    cnt = torch.cumsum(new, dim=1)
    block = 128 if x.is_cuda else 1024
    _cell_normals_kernel[(triton.cdiv(n, block), s)](
        keys, cnt, mom, _params(dev), tables, n,
        KB=KEY_BITS, MIN_PTS=MIN_POINTS, STEPS=steps, NEWTON=NEWTON_STEPS, BLOCK=block,
    )  # fmt: skip
    return tables, inv


@triton.jit(do_not_specialize=["n"])
def _cell_keys_kernel(
    p_ptr, inv_ptr, prm_ptr, keys_ptr, n,
    S: tl.constexpr, KB: tl.constexpr, BIAS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(p_ptr + i * 3, mask=m, other=0.0)
    y = tl.load(p_ptr + i * 3 + 1, mask=m, other=0.0)
    z = tl.load(p_ptr + i * 3 + 2, mask=m, other=0.0)
    off = tl.load(prm_ptr + 2)
    for k in tl.static_range(S):
        inv = tl.load(inv_ptr + k)
        cx = tl.floor(x * inv + off).to(tl.int64)  # launched without fp fusion: mul, then add, as torch
        cy = tl.floor(y * inv + off).to(tl.int64)
        cz = tl.floor(z * inv + off).to(tl.int64)
        ok = (cx >= LO) & (cx < HI) & (cy >= LO) & (cy < HI) & (cz >= LO) & (cz < HI)
        key = ((cx + BIAS) << (2 * KB)) | ((cy + BIAS) << KB) | (cz + BIAS)
        tl.store(keys_ptr + k * n + i, tl.where(ok, key, -1), mask=m)


def cell_keys_triton(points_w: torch.Tensor, inv_cell: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`mapper.kernels.normals.cell_keys_torch` (same arguments and result; one
    launch for all scales)."""
    n, s = points_w.shape[0], inv_cell.shape[0]
    out = torch.empty((s, n), dtype=torch.int64, device=points_w.device)
    if n == 0 or s == 0:
        return out
    block = 256 if points_w.is_cuda else 1024
    _cell_keys_kernel[(triton.cdiv(n, block),)](
        points_w.to(torch.float64).contiguous(), inv_cell.to(torch.float64).contiguous(),
        _params(points_w.device), out, n,
        S=s, KB=KEY_BITS, BIAS=KEY_BIAS, LO=BRICK_LO, HI=BRICK_HI, BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n"])
def _combine_kernel(
    x_ptr, nrm_ptr, inv_ptr, edge_ptr, out_ptr, sup_ptr, n, S: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    ox = tl.zeros([BLOCK], dtype=tl.float64)
    oy = ox
    oz = ox
    sup = ox
    have = i < 0
    for k in tl.static_range(S):
        c = tl.load(inv_ptr + k * n + i, mask=m, other=0)
        base = nrm_ptr + (k * n + c) * 3
        nx = tl.load(base, mask=m, other=0.0)
        ny = tl.load(base + 1, mask=m, other=0.0)
        nz = tl.load(base + 2, mask=m, other=0.0)
        planar = (nx != 0) | (ny != 0) | (nz != 0)
        take = planar & ~have
        ox = tl.where(take, nx, ox)
        oy = tl.where(take, ny, oy)
        oz = tl.where(take, nz, oz)
        have = have | planar
        sup = tl.where(planar, tl.maximum(sup, tl.load(edge_ptr + k)), sup)
    x = tl.load(x_ptr + i * 3, mask=m, other=0.0)
    y = tl.load(x_ptr + i * 3 + 1, mask=m, other=0.0)
    z = tl.load(x_ptr + i * 3 + 2, mask=m, other=0.0)
    sgn = tl.where(ox * x + oy * y + oz * z > 0, -1.0, 1.0)
    tl.store(out_ptr + i * 3, ox * sgn, mask=m)
    tl.store(out_ptr + i * 3 + 1, oy * sgn, mask=m)
    tl.store(out_ptr + i * 3 + 2, oz * sgn, mask=m)
    tl.store(sup_ptr + i, sup, mask=m)


def combine_normals_triton(
    x: torch.Tensor, cell_normals: torch.Tensor, inv: torch.Tensor, edges: torch.Tensor
):
    """Triton version of :func:`mapper.kernels.normals.combine_normals_torch` (same arguments and result;
    one launch)."""
    n, s = x.shape[0], cell_normals.shape[0]
    out = torch.empty((n, 3), dtype=torch.float64, device=x.device)
    sup = torch.empty(n, dtype=torch.float64, device=x.device)
    if n == 0:
        return out, sup
    block = 256 if x.is_cuda else 1024
    _combine_kernel[(triton.cdiv(n, block),)](
        x.to(torch.float64).contiguous(), cell_normals.contiguous(), inv.contiguous(),
        edges.to(torch.float64).contiguous(), out, sup, n, S=s, BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    return out, sup


@triton.jit(do_not_specialize=["n"])
def _ray_bands_kernel(
    x_ptr, nrm_ptr, sup_ptr, prm_ptr, dirs_ptr, r_ptr, t0_ptr, t1_ptr, nout_ptr, w_ptr, n,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i * 3, mask=m, other=1.0)
    y = tl.load(x_ptr + i * 3 + 1, mask=m, other=0.0)
    z = tl.load(x_ptr + i * 3 + 2, mask=m, other=0.0)
    nx = tl.load(nrm_ptr + i * 3, mask=m, other=0.0)
    ny = tl.load(nrm_ptr + i * 3 + 1, mask=m, other=0.0)
    nz = tl.load(nrm_ptr + i * 3 + 2, mask=m, other=0.0)
    sup = tl.load(sup_ptr + i, mask=m, other=0.0)
    tau = tl.load(prm_ptr)
    longest = tl.load(prm_ptr + 1)
    reach = tl.load(prm_ptr + 2)
    w_min = tl.load(prm_ptr + 3)
    w_obs = tl.load(prm_ptr + 4)
    r = tl.sqrt(x * x + y * y + z * z)
    dx = x / r
    dy = y / r
    dz = z / r
    cos = -(dx * nx + dy * ny + dz * nz)
    has = ((nx != 0) | (ny != 0) | (nz != 0)) & (cos > 0)
    keep = tl.where(has, 1.0, 0.0)
    within = tl.minimum(tl.maximum(sup, tau), longest)
    half = tl.where(has, tl.maximum(tl.minimum(reach / tl.maximum(cos, 1e-6), within), tau), tau)
    w = tl.where(has, tl.minimum(tl.maximum(cos, w_min), 1.0), 1.0) * w_obs
    tl.store(dirs_ptr + i * 3, dx, mask=m)
    tl.store(dirs_ptr + i * 3 + 1, dy, mask=m)
    tl.store(dirs_ptr + i * 3 + 2, dz, mask=m)
    tl.store(r_ptr + i, r, mask=m)
    tl.store(t0_ptr + i, tl.maximum(r - half, 0.0), mask=m)
    tl.store(t1_ptr + i, r + half, mask=m)
    tl.store(nout_ptr + i * 3, nx * keep, mask=m)
    tl.store(nout_ptr + i * 3 + 1, ny * keep, mask=m)
    tl.store(nout_ptr + i * 3 + 2, nz * keep, mask=m)
    tl.store(w_ptr + i, w.to(tl.float32), mask=m)


def ray_bands_triton(x: torch.Tensor, nrm: torch.Tensor, support: torch.Tensor, prm: torch.Tensor):
    """Triton version of :func:`mapper.kernels.normals.ray_bands_torch` (same arguments and result, to
    rounding: one launch)."""
    n = x.shape[0]
    dev = x.device
    f64 = torch.float64
    dirs, nout = torch.empty((n, 3), dtype=f64, device=dev), torch.empty((n, 3), dtype=f64, device=dev)
    r, t0, t1 = (torch.empty(n, dtype=f64, device=dev) for _ in range(3))
    w = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        block = 256 if x.is_cuda else 1024
        _ray_bands_kernel[(triton.cdiv(n, block),)](
            x.to(f64).contiguous(), nrm.to(f64).contiguous(), support.to(f64).contiguous(),
            prm.to(f64).contiguous(), dirs, r, t0, t1, nout, w, n, BLOCK=block, enable_fp_fusion=False,
        )  # fmt: skip
    return dirs, r, t0, t1, nout, w

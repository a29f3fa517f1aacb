"""ESDF layer (``mapper/integrators/esdf.py``) against independent oracles.

* Sites at voxel centres (occupancy only): ``scipy.ndimage.distance_transform_edt`` on a dense box.
* Sub-voxel TSDF sites: the zero crossings are extracted here with NumPy from the TSDF values (not with
  the library), and the nearest one is found by brute force (``scipy.spatial.cKDTree``).
* The true surface: analytic sphere / box / plane distances.
* Incremental == cold: after every edit (additions, moves, decay, clears, LiDAR frames), the layer equals
  a fresh integrator's full recompute of the same source layers, bit for bit.

Sizes stay small (voxel 0.1 m, max distance 0.4-0.6 m) so the file runs in well under a minute on a
2-core CPU.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from scipy import ndimage
from scipy.spatial import cKDTree

import mapper
from mapper.errors import InvalidArgument, InvalidArgumentType
from mapper.integrators.esdf import EsdfIntegrator
from mapper.integrators.occupancy import occupancy_fields
from mapper.integrators.tsdf import TsdfConfig, tsdf_fields
from mapper.layers import BrickLayer

VOX = 0.1
TAU = 0.3

# ------------------------------------------------------------------------------------------ helpers
_OFF = np.arange(64)
LOCAL = np.stack((_OFF >> 4, (_OFF >> 2) & 3, _OFF & 3), axis=1)  # brick offset -> (i, j, k)


def block_bricks(lo_m, hi_m) -> np.ndarray:
    """All bricks overlapping the box [lo_m, hi_m] (metres)."""
    lo = np.floor(np.asarray(lo_m) / (4 * VOX)).astype(np.int64)
    hi = np.floor(np.asarray(hi_m) / (4 * VOX)).astype(np.int64)
    axes = [np.arange(lo[a], hi[a] + 1) for a in range(3)]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)


def brick_centres(bricks: np.ndarray) -> np.ndarray:
    """Voxel centres (metres) ``[B, 64, 3]`` of bricks, in brick offset order."""
    return ((bricks[:, None, :] * 4 + LOCAL[None]) + 0.5) * VOX


def sphere_sdf(c, r):
    c = np.asarray(c, dtype=np.float64)
    return lambda p: np.linalg.norm(p - c, axis=-1) - r


def box_sdf(c, h):
    c, h = np.asarray(c, dtype=np.float64), np.asarray(h, dtype=np.float64)

    def f(p):
        q = np.abs(p - c) - h
        return np.linalg.norm(np.maximum(q, 0), axis=-1) + np.minimum(q.max(axis=-1), 0)

    return f


def plane_sdf(n, p0):
    n = np.asarray(n, dtype=np.float64)
    n = n / np.linalg.norm(n)
    return lambda p: (p - np.asarray(p0)) @ n


def tsdf_layer(device, bricks: np.ndarray, sdf_fn, band_only: bool = False, seed: int | None = None):
    """A TSDF layer holding ``clamp(sdf, +-TAU)`` at the voxel centres of ``bricks``; weight 1 everywhere
    (or only where ``|sdf| < TAU``); optional noise (seed) on the values."""
    layer = BrickLayer(tsdf_fields(TsdfConfig(VOX)), device)
    write_tsdf(layer, bricks, sdf_fn, band_only, seed)
    return layer


def write_tsdf(layer, bricks: np.ndarray, sdf_fn, band_only=False, seed=None, weight=1.0):
    sdf = sdf_fn(brick_centres(bricks))
    if seed is not None:
        sdf = sdf + np.random.default_rng(seed).normal(0, 0.02, sdf.shape)
    w = np.where(np.abs(sdf) < TAU, weight, 0.0 if band_only else weight)
    b = torch.as_tensor(bricks, device=layer.device)
    slots = layer.allocate(b)
    layer.pool.scatter("tsdf", slots, torch.as_tensor(np.clip(sdf, -TAU, TAU), device=layer.device).float())
    layer.pool.scatter("weight", slots, torch.as_tensor(w, device=layer.device).float())
    return b


def esdf_np(integ: EsdfIntegrator):
    """(ijk int64 [N, 3], esdf float32 [N], observed bool [N]) of an integrator's view."""
    g, d = integ.view()
    return g.ijk.cpu().numpy().astype(np.int64), d["esdf"].cpu().numpy(), d["observed"].cpu().numpy()


def layer_np(layer, names):
    g, d = layer.voxel_view(names)
    return g.ijk.cpu().numpy().astype(np.int64), {k: v.float().cpu().numpy() for k, v in d.items()}


def _keys(ijk: np.ndarray) -> np.ndarray:
    b = ijk + (1 << 20)
    return (b[:, 0] << 42) | (b[:, 1] << 21) | b[:, 2]


def lookup(ijk_table: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Row of each query voxel in ``ijk_table``, -1 where absent (NumPy, sort + searchsorted)."""
    k = _keys(ijk_table)
    order = np.argsort(k)
    ks = k[order]
    q = _keys(query)
    pos = np.minimum(np.searchsorted(ks, q), max(len(ks) - 1, 0))
    if len(ks) == 0:
        return np.full(len(query), -1)
    return np.where(ks[pos] == q, order[pos], -1)


def crossings_np(ijk, tsdf, weight) -> np.ndarray:
    """Zero crossings (voxel units, centre of voxel v = v + 0.5) between observed 6-neighbours of
    opposite sign (positive = tsdf > 0), by linear interpolation along the edge."""
    pts = []
    for axis in range(3):
        nb = ijk.copy()
        nb[:, axis] += 1
        j = lookup(ijk, nb)
        ok = (j >= 0) & (weight > 0)
        ok[ok] &= weight[j[ok]] > 0
        i = np.nonzero(ok)[0]
        a, b = tsdf[i].astype(np.float64), tsdf[j[i]].astype(np.float64)
        cross = (a > 0) != (b > 0)
        p = ijk[i[cross]] + 0.5
        p[:, axis] += a[cross] / (a[cross] - b[cross])
        pts.append(p)
    return np.concatenate(pts)


def assert_same_layer(a: EsdfIntegrator, b: EsdfIntegrator):
    """Same voxel set and bit-identical values and flags."""
    ga, da = a.view()
    gb, db = b.view()
    assert torch.equal(ga.leaves.keys, gb.leaves.keys)
    assert torch.equal(ga.leaves.masks, gb.leaves.masks)
    assert torch.equal(da["esdf"].view(torch.int32), db["esdf"].view(torch.int32))
    assert torch.equal(da["observed"], db["observed"])


def cold_of(integ: EsdfIntegrator, tsdf, occ, free=None, **kw) -> EsdfIntegrator:
    fresh = EsdfIntegrator(
        integ.voxel_size_m,
        integ.max_distance_m,
        integ.device,
        source_voxel_size_m=integ.source_voxel_size_m,
        **kw,
    )
    fresh.recompute(tsdf, occ, free)
    return fresh


# ------------------------------------------------------------------------------- exactness: oracles
def test_occupancy_sites_match_scipy_edt(device):
    """Sites at occupied voxel centres: |esdf| is the exact EDT (scipy) clamped to the max distance;
    occupied voxels are inside (negative), free ones positive, unknown ones unobserved and positive."""
    rng = np.random.default_rng(1)
    maxd = 0.5
    occ = BrickLayer(occupancy_fields(), device)
    bricks = block_bricks([-1.0, -0.6, -0.6], [1.0, 0.6, 0.6])
    lo = rng.uniform(-2.0, 1.0, (len(bricks), 64))  # 1/3 occupied
    lo[rng.random(lo.shape) < 0.85] = np.nan  # sparse known voxels
    lo[:8] = np.nan
    slots = occ.allocate(torch.as_tensor(bricks, device=device))
    occ.pool.scatter("log_odds", slots, torch.as_tensor(lo, device=device).float())
    integ = EsdfIntegrator(VOX, maxd, device)
    res = integ.recompute(None, occ)
    ijk, esdf, observed = esdf_np(integ)
    assert res["sites"] == int(np.sum(lo > 0)) and len(ijk) > 0

    src_ijk, src = layer_np(occ, ["log_odds"])
    site = src_ijk[src["log_odds"] > 0]
    lo_box = np.minimum(site.min(0), ijk.min(0))
    hi_box = np.maximum(site.max(0), ijk.max(0))
    occupied = np.zeros(hi_box - lo_box + 1, dtype=bool)
    occupied[tuple((site - lo_box).T)] = True
    edt = ndimage.distance_transform_edt(~occupied)[tuple((ijk - lo_box).T)]
    expect = np.minimum(edt * VOX, np.float32(maxd))
    err = np.abs(np.abs(esdf) - expect) / VOX
    assert err.mean() <= 0.05 and err.max() < 1e-5

    row = lookup(src_ijk, ijk)
    known_lo = np.where(row >= 0, src["log_odds"][np.maximum(row, 0)], np.nan)
    np.testing.assert_array_equal(observed, ~np.isnan(known_lo))
    inside = known_lo > 0
    assert np.all(np.signbit(esdf[inside])) and not np.any(np.signbit(esdf[~inside]))
    # the stored domain: exactly the bricks with an observed voxel within ceil(M / 4) bricks (box) of a
    # site's brick
    rb = integ.brick_radius
    offsets = np.indices((2 * rb + 1,) * 3).reshape(3, -1).T - rb
    near = np.unique((np.unique(site >> 2, axis=0)[:, None, :] + offsets[None]).reshape(-1, 3), axis=0)
    seen = np.unique(src_ijk[~np.isnan(src["log_odds"])] >> 2, axis=0)
    expected = seen[lookup(near, seen) >= 0]
    np.testing.assert_array_equal(np.unique(ijk >> 2, axis=0), expected)


@pytest.mark.parametrize("maxd", [0.47, 0.6])
def test_tsdf_sites_match_bruteforce(device, maxd):
    """Sub-voxel sites: the ESDF is the distance to the nearest zero crossing (extracted here), clamped."""
    sphere, box = sphere_sdf([0.05, 0.13, -0.21], 0.55), box_sdf([0.9, -0.2, 0.1], [0.3, 0.5, 0.25])

    def sdf(p):
        return np.minimum(sphere(p), box(p))

    bricks = block_bricks([-1.2, -1.4, -1.4], [1.9, 1.2, 1.2])
    layer = tsdf_layer(device, bricks, sdf, band_only=True, seed=3)
    integ = EsdfIntegrator(VOX, maxd, device)
    integ.recompute(layer, None)
    ijk, esdf, _ = esdf_np(integ)
    t_ijk, t = layer_np(layer, ["tsdf", "weight"])
    pts = crossings_np(t_ijk, t["tsdf"], t["weight"])
    dist, _ = cKDTree(pts).query(ijk + 0.5)
    expect = np.minimum(dist * VOX, np.float32(maxd))
    err = np.abs(np.abs(esdf) - expect) / VOX
    assert err.mean() <= 0.05
    assert err.max() < 1e-4  # exact up to float32 rounding
    # every voxel within the max distance of a crossing whose brick holds an observed voxel is in the layer
    seen = np.unique(t_ijk[t["weight"] > 0] >> 2, axis=0)
    centres = brick_centres(seen).reshape(-1, 3) / VOX
    d_all, _ = cKDTree(pts).query(centres)
    inside = np.floor(centres[d_all * VOX < maxd]).astype(np.int64)
    assert len(inside) > 1000 and np.all(lookup(ijk, inside) >= 0)
    assert np.all(lookup(seen, np.unique(ijk >> 2, axis=0)) >= 0)  # and nothing unobserved is stored


@pytest.mark.parametrize(
    "shape",
    [
        ("sphere", sphere_sdf([0.03, -0.07, 0.11], 0.62)),
        ("box", box_sdf([0.0, 0.05, -0.02], [0.55, 0.35, 0.42])),
        ("plane", plane_sdf([0.3, -0.2, 1.0], [0.0, 0.0, 0.04])),
    ],
    ids=lambda s: s[0],
)
def test_analytic_surfaces(device, shape):
    """Against the true surface over observed voxels within the max distance: mean <= 0.3 voxel,
    max <= 1.5 voxels; inside negative, outside positive; clamped exactly at the max distance."""
    name, sdf = shape
    maxd = 0.5
    ext = 1.5 if name != "plane" else 2.0
    bricks = block_bricks([-ext] * 3, [ext] * 3)
    layer = tsdf_layer(device, bricks, sdf)
    integ = EsdfIntegrator(VOX, maxd, device)
    integ.recompute(layer, None)
    ijk, esdf, observed = esdf_np(integ)
    centres = (ijk + 0.5) * VOX
    true = sdf(centres)
    m = observed & (np.abs(true) < maxd - VOX)
    if name == "plane":  # stay away from the edges of the written patch
        m &= np.all(np.abs(centres) < ext - maxd - 0.3, axis=1)
    assert m.sum() > 1000
    err = np.abs(esdf[m] - true[m]) / VOX
    assert err.mean() <= 0.3, err.mean()
    assert err.max() <= 1.5, err.max()
    in_block = np.all((ijk >= bricks.min(0) * 4) & (ijk <= bricks.max(0) * 4 + 3), axis=1)
    np.testing.assert_array_equal(observed, in_block)  # the TSDF saw the whole block, nothing else
    clear = observed & (np.abs(true) > 1e-3)  # a few centres lie on the sphere (fp16 stores 0: inside)
    np.testing.assert_array_equal(np.signbit(esdf[clear]), true[clear] < 0)
    assert not np.any(np.signbit(esdf[~observed]))
    far = np.abs(true) > maxd + VOX
    assert far.sum() > 100
    np.testing.assert_array_equal(np.abs(esdf[far]), np.float32(maxd))
    assert np.all(np.abs(esdf) <= np.float32(maxd))


def test_sign_and_observed_flags(device):
    """observed = TSDF weight > 0 or occupancy known; sign from the TSDF where it observed, else from the
    occupancy (occupied negative), else positive; unobserved voxels are never reported as observed."""
    maxd = 0.4
    sdf = sphere_sdf([0.0, 0.0, 0.0], 0.5)
    bricks = block_bricks([-0.8] * 3, [0.8] * 3)
    tsdf = tsdf_layer(device, bricks, sdf, band_only=True)  # the interior beyond TAU is unobserved
    occ = BrickLayer(occupancy_fields(), device)
    ob = block_bricks([-0.8, -0.8, 0.0], [0.8, 0.8, 0.8])  # the upper half is also in the occupancy map
    lo = np.where(sdf(brick_centres(ob)) < 0, 2.0, -1.0)
    lo[np.random.default_rng(0).random(lo.shape) < 0.3] = np.nan
    occ.pool.scatter(
        "log_odds",
        occ.allocate(torch.as_tensor(ob, device=device)),
        torch.as_tensor(lo, device=device).float(),
    )
    integ = EsdfIntegrator(VOX, maxd, device)
    integ.recompute(tsdf, occ)
    ijk, esdf, observed = esdf_np(integ)
    t_ijk, t = layer_np(tsdf, ["tsdf", "weight"])
    o_ijk, o = layer_np(occ, ["log_odds"])
    rt, ro = lookup(t_ijk, ijk), lookup(o_ijk, ijk)
    w = np.where(rt >= 0, t["weight"][np.maximum(rt, 0)], 0.0)
    tv = np.where(rt >= 0, t["tsdf"][np.maximum(rt, 0)], 0.0)
    lov = np.where(ro >= 0, o["log_odds"][np.maximum(ro, 0)], np.nan)
    np.testing.assert_array_equal(observed, (w > 0) | ~np.isnan(lov))
    inside = np.where(w > 0, tv <= 0, lov > 0)
    np.testing.assert_array_equal(np.signbit(esdf), inside)
    assert (~observed).sum() > 100 and not np.any(np.signbit(esdf[~observed]))
    assert np.all(np.signbit(esdf[(w == 0) & (lov > 0)]))  # occupancy-only interior is inside


def test_clamp_and_single_site(device):
    """One occupied voxel: every distance is the exact centre distance, capped at exactly max_distance."""
    maxd = 0.43
    occ = BrickLayer(occupancy_fields(), device)
    bricks = np.stack(np.meshgrid(*(np.arange(-2, 3),) * 3, indexing="ij"), -1).reshape(-1, 3) + [-3, 2, 0]
    lo = np.full((len(bricks), 64), -1.0)  # known free around it (so the whole box is stored) ...
    lo[np.all(bricks == [-3, 2, 0], axis=1).nonzero()[0][0], 21] = (
        1.0  # ... voxel (1, 1, 1) of brick (-3, 2, 0)
    )
    occ.pool.scatter(
        "log_odds", occ.allocate(torch.tensor(bricks, device=device)), torch.tensor(lo, device=device)
    )
    integ = EsdfIntegrator(VOX, maxd, device)
    integ.recompute(None, occ)
    ijk, esdf, observed = esdf_np(integ)
    site = np.array([-12 + 1, 8 + 1, 1])
    d = np.linalg.norm(ijk - site, axis=1) * VOX
    np.testing.assert_allclose(np.abs(esdf), np.minimum(d, np.float32(maxd)), rtol=1e-6)
    assert np.all(esdf[d > maxd] == np.float32(maxd))
    assert observed.all() and np.signbit(esdf).sum() == 1 and esdf[np.signbit(esdf)][0] == 0
    assert integ.brick_radius == 2 and len(ijk) == 64 * (2 * integ.brick_radius + 1) ** 3


# ------------------------------------------------------------------------------ incremental == cold
def test_incremental_equals_cold_edits(device):
    """Additions, value changes, a moving object, freed bricks and partial resets: after each step the
    incrementally updated layer equals a cold recompute bit for bit (also with tiny CPU chunks)."""
    maxd = 0.45
    integ = EsdfIntegrator(VOX, maxd, device)
    layer = BrickLayer(tsdf_fields(TsdfConfig(VOX)), device)

    def step(dirty, check_chunks=False):
        res = integ.update(layer, None, dirty, None)
        assert not res["skipped"]
        assert_same_layer(integ, cold_of(integ, layer, None))
        if check_chunks:
            assert_same_layer(integ, cold_of(integ, layer, None, cpu_rows=1 << 9))
        return res

    b1 = write_tsdf(layer, block_bricks([-0.9] * 3, [0.9] * 3), sphere_sdf([0, 0, 0], 0.5), band_only=True)
    step([b1], check_chunks=True)
    b2 = write_tsdf(
        layer, block_bricks([1.0, -0.5, -0.5], [2.6, 0.5, 0.5]), box_sdf([1.8, 0, 0], [0.4, 0.2, 0.3])
    )
    res = step([b2])
    assert res["recomputed_voxels"] < 64 * integ.layer.num_bricks  # the far side of the sphere is kept
    # the sphere moves: the old bricks are reset (unobserved), the new ones written
    slot_old, _ = layer.voxel_slots(b1 << 2)
    layer.pool.scatter("weight", slot_old, torch.zeros((len(slot_old), 64), device=device))
    b3 = write_tsdf(
        layer, block_bricks([-0.6, -0.7, -0.9], [1.0, 0.7, 0.9]), sphere_sdf([0.2, 0, 0], 0.5), True
    )
    step([b1, b3])
    # small noise on a few bricks (sites shift by fractions of a voxel)
    few = b3[::7]
    s, _ = layer.voxel_slots(few << 2)
    t = layer.pool.gather("tsdf", s).float()
    g = torch.Generator().manual_seed(5)
    layer.pool.scatter("tsdf", s, t + 0.03 * torch.randn(t.shape, generator=g).to(device))
    step([few, few[:1]])  # duplicates are fine
    # free the box's bricks entirely: its surface disappears, ESDF bricks around it are freed
    before = integ.layer.num_bricks
    drop = torch.zeros_like(layer.slots, dtype=torch.bool)
    from mapper.layers import brick_in_leaf

    drop[layer.grid.ijk_to_leaf(b2 << 2), brick_in_leaf(b2 << 2)] = True
    layer.release_bricks(drop)
    res = step([b2])
    assert res["bricks_freed"] > 0 and integ.layer.num_bricks < before
    # unchanged data reported dirty: no change at all
    grid_before, vals_before = integ.view()
    step([b3[:3]])
    assert torch.equal(integ.view()[1]["esdf"], vals_before["esdf"])


def source_scene(source: str):
    """A CPU layer of ``source`` ("tsdf" or "occupancy") and ``write(bricks, sdf) -> bricks``, which fills
    whole bricks from an SDF (TSDF: the band; occupancy: +-log-odds with 20 % unknown), plus the
    ``(tsdf, occ)`` arguments of ``EsdfIntegrator.update`` for it."""
    layer = BrickLayer(
        tsdf_fields(TsdfConfig(VOX)) if source == "tsdf" else occupancy_fields(), torch.device("cpu")
    )

    def write(bricks, sdf):
        if source == "tsdf":
            return write_tsdf(layer, bricks, sdf, band_only=True, seed=2)
        lo = np.where(sdf(brick_centres(bricks)) < 0, 1.5, -0.5)
        lo[np.random.default_rng(3).random(lo.shape) < 0.2] = np.nan
        b = torch.as_tensor(bricks)
        layer.pool.scatter("log_odds", layer.allocate(b), torch.as_tensor(lo).float())
        return b

    return write, ((layer, None) if source == "tsdf" else (None, layer))


@pytest.mark.parametrize("source", ["tsdf", "occupancy"])
def test_cuda_path_choices_equal_cpu_path(monkeypatch, source):
    """The CUDA path's choices taken on the CPU (``esdf._cuda_path``: one chunk per pass, dense brick
    sets, prefix counts, the line passes in chunks of ``CUDA_ROWS`` slots, the envelope passes on the
    whole domain) give the CPU path's layer bit for bit, cold and incremental (the CPU path is checked
    against SciPy / brute force above; CUDA runs these choices)."""
    from mapper.integrators import esdf as esdf_mod

    maxd = 0.45
    write, args = source_scene(source)
    cpu, cuda = EsdfIntegrator(VOX, maxd, "cpu"), EsdfIntegrator(VOX, maxd, "cpu")

    def both(dirty):
        cpu.update(*args, dirty)
        with monkeypatch.context() as mp:
            mp.setattr(esdf_mod, "_cuda_path", lambda device: True)
            cuda.update(*args, dirty)
            cold = cold_of(cpu, *args)
        assert_same_layer(cpu, cuda)
        assert_same_layer(cpu, cold)

    b1 = write(block_bricks([-0.9] * 3, [0.9] * 3), sphere_sdf([0, 0, 0], 0.5))
    both([b1])
    b2 = write(block_bricks([1.0, -0.5, -0.5], [2.6, 0.5, 0.5]), box_sdf([1.8, 0, 0], [0.4, 0.2, 0.3]))
    both([b2])
    assert cpu.layer.num_bricks > 0 and cpu.last["recomputed_voxels"] < 64 * cpu.layer.num_bricks


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("source", ["tsdf", "occupancy"])
def test_incremental_equals_cold_random(device, source, seed):
    """Random edits (objects written, bricks freed, voxels reset) with random max distances; the dirty
    lists hold exactly the edited bricks."""
    rng = np.random.default_rng(seed)
    maxd = float(rng.uniform(0.15, 0.55))
    integ = EsdfIntegrator(VOX, maxd, device)
    fields = tsdf_fields(TsdfConfig(VOX)) if source == "tsdf" else occupancy_fields()
    layer = BrickLayer(fields, device)
    args = (layer, None) if source == "tsdf" else (None, layer)
    for _ in range(5):
        dirty = []
        for _ in range(rng.integers(1, 3)):
            c = rng.uniform(-1.5, 1.5, 3)
            h = rng.uniform(0.1, 0.4, 3)
            bricks = block_bricks(c - h - 0.3, c + h + 0.3)
            kind = rng.integers(3)
            if kind == 0 or layer.num_bricks == 0:  # an object
                sdf = box_sdf(c, h) if rng.random() < 0.5 else sphere_sdf(c, h.mean())
                if source == "tsdf":
                    dirty.append(write_tsdf(layer, bricks, sdf, band_only=rng.random() < 0.5, seed=seed))
                else:
                    lo = np.where(sdf(brick_centres(bricks)) < 0, 1.5, -0.5)
                    lo[rng.random(lo.shape) < 0.2] = np.nan
                    b = torch.as_tensor(bricks, device=device)
                    layer.pool.scatter(
                        "log_odds", layer.allocate(b), torch.as_tensor(lo, device=device).float()
                    )
                    dirty.append(b)
            else:
                b = torch.as_tensor(bricks, device=device)
                slot, _ = layer.voxel_slots(b << 2)
                b, slot = b[slot >= 0], slot[slot >= 0]
                if kind == 1:  # free the bricks
                    from mapper.layers import brick_in_leaf

                    drop = torch.zeros_like(layer.slots, dtype=torch.bool)
                    drop[layer.grid.ijk_to_leaf(b << 2), brick_in_leaf(b << 2)] = True
                    layer.release_bricks(drop)
                else:  # reset random voxels (unobserved)
                    reset = torch.as_tensor(rng.random((len(b), 64)) < 0.3, device=device)
                    name, val = ("weight", 0.0) if source == "tsdf" else ("log_odds", math.nan)
                    v = layer.pool.gather(name, slot).float()
                    layer.pool.scatter(name, slot, torch.where(reset, torch.full_like(v, val), v))
                dirty.append(b)
        integ.update(*args, dirty)
        assert_same_layer(integ, cold_of(integ, *args))


def _lidar_points(origin, objects, n_az=90, n_el=24):
    """Returns of a toy spinning LiDAR at ``origin`` (metres) on spheres ``[(centre, radius)]`` and the
    floor z = -0.6: world points ``[N, 3]`` (float64 numpy), analytic ray casting."""
    az = np.linspace(-np.pi, np.pi, n_az, endpoint=False)
    el = np.linspace(-0.6, 0.4, n_el)
    a, e = np.meshgrid(az, el, indexing="ij")
    d = np.stack((np.cos(e) * np.cos(a), np.cos(e) * np.sin(a), np.sin(e)), -1).reshape(-1, 3)
    o = np.asarray(origin, dtype=np.float64)
    t = np.full(len(d), np.inf)
    floor = np.where(d[:, 2] < -1e-6, (-0.6 - o[2]) / np.minimum(d[:, 2], -1e-6), np.inf)
    t = np.minimum(t, floor)
    for c, r in objects:
        oc = o - np.asarray(c)
        b = d @ oc
        disc = b * b - (oc @ oc - r * r)
        hit = np.where(disc > 0, -b - np.sqrt(np.maximum(disc, 0)), np.inf)
        t = np.minimum(t, np.where(hit > 0, hit, np.inf))
    ok = t < 3.0
    return o + d[ok] * t[ok, None]


def _pose(origin):
    T = np.eye(4)
    T[:3, 3] = origin
    return T


def _map_equals_cold(m: mapper.Map):
    cold = cold_of(m._esdf, m._tsdf, m._occ, m._free)
    assert_same_layer(m._esdf, cold)
    g, d = m.layer("esdf")
    assert d["esdf"].dtype == torch.float32 and d["observed"].dtype == torch.bool
    assert g.num_voxels == m.stats()["layers"]["esdf"]["voxels"]


@pytest.mark.parametrize("layers", [("tsdf", "esdf"), ("occupancy", "esdf"), ("tsdf", "occupancy", "esdf")])
def test_incremental_equals_cold_map(layers):
    """Through ``Map``: LiDAR frames from moving poses with a moving object, a clear of a box, a decay
    that frees whole bricks, and a full clear; ``update_esdf`` after each equals a cold recompute."""
    m = mapper.Map(VOX, layers=layers, device="cpu", esdf_max_distance_m=0.4, max_range_m=5.0)
    for k, x in enumerate((0.0, 0.3, 0.6)):
        pts = _lidar_points([x, 0.0, 0.0], [([1.2, 0.2 + 0.25 * k, -0.2], 0.35), ([-1.0, -0.8, 0.0], 0.3)])
        m.integrate_lidar(pts - [x, 0.0, 0.0], _pose([x, 0.0, 0.0]))
        res = m.update_esdf()
        assert not res["skipped"] and res["recomputed_voxels"] > 0
        _map_equals_cold(m)
    assert m.update_esdf()["skipped"]
    m.clear([0.5, -0.5, -0.7], [2.0, 1.5, 0.5])
    m.update_esdf()
    _map_equals_cold(m)
    m.decay(factor=0.5, threshold=1e6)  # every voxel dies: bricks are freed
    m.update_esdf()
    _map_equals_cold(m)
    assert m.stats()["layers"]["esdf"]["voxels"] == 0
    pts = _lidar_points([0.0, 0.0, 0.0], [([0.9, 0.0, 0.0], 0.3)])
    m.integrate_lidar(pts, _pose([0.0, 0.0, 0.0]))
    m.update_esdf()
    _map_equals_cold(m)
    m.clear()
    m.update_esdf()
    _map_equals_cold(m)
    st = m.stats()["layers"]["esdf"]
    assert st["voxels"] == 0 and st["bytes"] < 1024  # the pages are given back


def test_incremental_equals_cold_partial_decay():
    """Voxels of a brick die while the brick survives: the surface changes, so the ESDF must follow."""
    m = mapper.Map(VOX, layers=("tsdf", "esdf"), device="cpu", esdf_max_distance_m=0.3)
    sdf = sphere_sdf([0, 0, 0], 1.0)
    bricks = block_bricks([-1.4] * 3, [1.4] * 3)
    bricks = torch.as_tensor(bricks[np.any(np.abs(sdf(brick_centres(bricks))) < TAU, axis=1)])
    write_tsdf(m._tsdf, bricks.numpy(), sdf, band_only=True)
    slots = m._tsdf.brick_table()[1]
    w = m._tsdf.pool.gather("weight", slots).float()
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    keep[torch.arange(len(w)), (w > 0).to(torch.int8).argmax(dim=1)] = True  # one survivor per brick
    m._tsdf.pool.scatter("weight", slots, torch.where(w > 0, torch.where(keep, 2.0, 0.4), 0.0))
    m._esdf.update(m._tsdf, None, [bricks])
    assert m.decay(factor=0.5, threshold=0.3)["bricks_freed"]["tsdf"] == 0
    m.update_esdf()
    _map_equals_cold(m)


# ---------------------------------------------------------------------------- fast path, empty, API
def test_no_change_fast_path(device):
    integ = EsdfIntegrator(VOX, 0.5, device)
    bricks = block_bricks([-0.5] * 3, [0.5] * 3)
    layer = tsdf_layer(device, bricks, sphere_sdf([0, 0, 0], 0.3))
    assert integ.update(layer, None, [torch.as_tensor(bricks, device=device)])["recomputed_voxels"] > 0
    empty = torch.zeros((0, 3), dtype=torch.int64, device=device)
    for dirty in ([], [empty], [empty, empty]):
        res = integ.update(layer, None, dirty)
        assert res["skipped"] and res["recomputed_voxels"] == 0 and res["computed_voxels"] == 0
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        integ.update(layer, None, [])
    assert (time.perf_counter() - t0) / n < 1e-4  # well under 0.1 ms per call


def test_empty_map(device):
    m = mapper.Map(VOX, layers=("tsdf", "esdf"), device=device)
    assert m.update_esdf()["skipped"]
    g, d = m.layer("esdf")
    assert g.num_voxels == 0 and d["esdf"].shape == (0,) and d["observed"].dtype == torch.bool
    res = m._esdf.recompute(m._tsdf, None)
    assert res["recomputed_voxels"] == 0 and res["sites"] == 0
    st = m.stats()["layers"]["esdf"]
    assert st["voxels"] == 0 and "bytes" in st
    # observed voxels but no surface (all free space): no ESDF voxel
    write_tsdf(m._tsdf, block_bricks([0, 0, 0], [0.5, 0.5, 0.5]), lambda p: np.full(p.shape[:-1], 0.25))
    res = m._esdf.update(m._tsdf, None, [m._tsdf.brick_table()[0]])
    assert res["sites"] == 0 and m.layer("esdf")[0].num_voxels == 0


def test_values_reachable_by_voxel_lookup(device):
    """The stored layer answers per-voxel lookups (``voxel_slots`` + ``pool.gather``), as the later
    trilinear queries will; the view is the same data in grid order."""
    bricks = block_bricks([-0.6] * 3, [0.6] * 3)
    layer = tsdf_layer(device, bricks, sphere_sdf([0, 0, 0], 0.3))
    integ = EsdfIntegrator(VOX, 0.4, device)
    integ.recompute(layer, None)
    g, d = integ.view()
    ijk = g.ijk.to(torch.int64)
    slot, off = integ.layer.voxel_slots(ijk)
    assert bool((slot >= 0).all())
    assert torch.equal(integ.layer.pool.gather("esdf", slot, off), d["esdf"])
    assert torch.equal(integ.layer.pool.gather("observed", slot, off), d["observed"])
    st = integ.stats()
    assert st["voxels"] == g.num_voxels and st["bytes"] >= 5 * g.num_voxels


@pytest.mark.parametrize("p", [0.0, 0.02, 0.5, 1.0])
def test_nearest_marked_forms_agree(device, p):
    """The two forms of the nearest-marked-slot search (prefix count on CUDA, running max on the CPU)."""
    from mapper.integrators.esdf import _nearest_marked

    g = torch.Generator().manual_seed(int(p * 100))
    for n in (1, 2, 5, 3000):
        has = (torch.rand(n, generator=g) < p).to(device)
        ar = torch.arange(n, dtype=torch.int32, device=device)
        a = _nearest_marked(has, ar, 1 << 30, by_count=True)
        b = _nearest_marked(has, ar, 1 << 30, by_count=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        marked = has.nonzero().squeeze(1).tolist()
        for i in range(0, n, max(n // 50, 1)):
            lefts = [m for m in marked if m < i]
            rights = [m for m in marked if m > i]
            assert int(a[0][i]) == (lefts[-1] if lefts else -(1 << 30))
            assert int(a[1][i]) == (rights[0] if rights else 1 << 30)


def test_argument_errors():
    with pytest.raises(InvalidArgument, match="voxel_size_m"):
        EsdfIntegrator(0.0, 1.0, torch.device("cpu"))
    with pytest.raises(InvalidArgument, match="max_distance_m"):
        EsdfIntegrator(0.1, math.inf, torch.device("cpu"))
    with pytest.raises(InvalidArgument, match="at most 4096 voxels"):
        EsdfIntegrator(0.001, 10.0, torch.device("cpu"))
    with pytest.raises(InvalidArgumentType, match="max_distance_m"):
        EsdfIntegrator(0.1, "1", torch.device("cpu"))
    integ = EsdfIntegrator(0.1, 0.5, torch.device("cpu"))
    layer = BrickLayer(tsdf_fields(TsdfConfig(0.1)), torch.device("cpu"))
    with pytest.raises(InvalidArgument, match=r"dirty: expected shape \[B, 3\]"):
        integ.update(layer, None, [torch.zeros((2, 2), dtype=torch.int64)])
    with pytest.raises(InvalidArgumentType, match="dirty: expected integer"):
        integ.update(layer, None, [torch.zeros((2, 3))])
    with pytest.raises(InvalidArgument, match="needs a tsdf or occupancy layer"):
        integ.update(None, None, [torch.zeros((1, 3), dtype=torch.int64)])


@pytest.mark.parametrize("r", [1, 3])
def test_dense_dilation_equals_intervals_and_bruteforce(device, r, monkeypatch):
    """Brick-set growth by a dense bitmap (CUDA's default) and by merged intervals (the CPU's) give the same
    sorted set as a NumPy brute force (every offset of the box), negative coordinates included; a box over
    ``DENSE_CELLS`` falls back to the intervals."""
    from mapper.integrators import esdf as E

    rng = np.random.default_rng(r)
    b = np.unique(rng.integers(-9, 7, (60, 3)), axis=0)
    b = np.concatenate((b, [[40, -30, 2]]))  # a far brick: a sparse box
    t = torch.as_tensor(b, device=device)

    def brute(radii):
        rng3 = [np.arange(-x, x + 1) for x in radii]
        off = np.stack(np.meshgrid(*rng3, indexing="ij"), -1).reshape(-1, 3)
        return np.unique((b[:, None, :] + off[None]).reshape(-1, 3), axis=0)  # lexicographic = key order

    want = brute((r, r, r))
    for dense in (True, False):
        got = E._dilate_bricks(t, r, dense=dense).cpu().numpy()
        np.testing.assert_array_equal(got, want)
    for axis in range(3):
        radii = [0, 0, 0]
        radii[axis] = r
        want = brute(radii)
        for dense in (True, False):
            np.testing.assert_array_equal(E._grow_axis(t, r, axis, dense=dense).cpu().numpy(), want)
    # the pair from one bitmap (the update's stored / computed regions), and its sparse fallback
    with monkeypatch.context() as mp:
        mp.setattr(E, "_dense_sets", lambda device: True)
        near, far = E._dilate_pair(t, r, r + 2)
    np.testing.assert_array_equal(near.cpu().numpy(), brute((r, r, r)))
    np.testing.assert_array_equal(far.cpu().numpy(), brute((r + 2,) * 3))
    monkeypatch.setattr(E, "DENSE_CELLS", 10)
    assert E._dilate_dense(t, (r, r, r)) is None
    np.testing.assert_array_equal(E._dilate_bricks(t, r, dense=True).cpu().numpy(), brute((r, r, r)))
    with monkeypatch.context() as mp:
        mp.setattr(E, "_dense_sets", lambda device: True)
        near, far = E._dilate_pair(t, r, r + 2)
    np.testing.assert_array_equal(far.cpu().numpy(), brute((r + 2,) * 3))


def test_incremental_equals_cold_with_dense_sets(monkeypatch):
    """The CUDA brick-set path (dense dilation) on the CPU: LiDAR frames with a moving object, then a clear;
    incremental == cold bit for bit, and equal to the interval path's layer."""
    from mapper.integrators import esdf as E

    def frames(m):
        for i, x in enumerate((0.0, 0.3, 0.6)):
            pts = _lidar_points([x, 0.0, 0.0], [([1.2 - 0.2 * i, 0.4, -0.2], 0.35)], n_az=60, n_el=16)
            m.integrate_lidar(pts - [x, 0.0, 0.0], _pose([x, 0.0, 0.0]))
            m.update_esdf()
        m.clear([0.8, 0.0, -0.6], [1.6, 0.8, 0.2])
        m.update_esdf()

    maps = []
    for dense in (True, False):
        monkeypatch.setattr(E, "_dense_sets", lambda device, dense=dense: dense)
        m = mapper.Map(VOX, layers=("tsdf", "esdf"), device="cpu", esdf_max_distance_m=0.5, max_range_m=5.0)
        frames(m)
        _map_equals_cold(m)
        maps.append(m)
    assert_same_layer(maps[0]._esdf, maps[1]._esdf)


def test_runs_with_sites_bruteforce():
    """``_runs_with``: the rows of the brick runs along an axis (consecutive bricks, same other two
    coordinates) that hold a marked brick, against a hand-built case and a Python brute force."""
    from mapper.integrators.esdf import _runs_with

    # along k: run A = (0,0,0..2), run B = (0,0,4) (gap at 3), run C = (0,1,0..1), run D = (1,0,-1)
    b = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 1, 1], [1, 0, -1]])
    marked = torch.tensor([False, True, False, False, False, False, True])
    assert _runs_with(b, 2, marked).tolist() == [0, 1, 2, 6]
    assert _runs_with(b, 2, torch.ones(7, dtype=torch.bool)) is None  # every run: no subset
    assert _runs_with(b, 0, marked).tolist() == [1, 6]  # along i no two are neighbours: the marked alone
    rng = np.random.default_rng(3)
    bb = np.unique(rng.integers(-4, 4, (150, 3)), axis=0)
    mk = rng.random(len(bb)) < 0.05
    for axis in range(3):
        u, v = (x for x in range(3) if x != axis)
        members = {tuple(x) for x in bb}
        want = set()
        for r, x in enumerate(bb):
            if not mk[r]:
                continue
            for step in (1, -1):  # walk the run both ways from the marked brick
                y = x.copy()
                while tuple(y) in members:
                    want.add(tuple(y))
                    y[axis] += step
        got = _runs_with(torch.as_tensor(bb), axis, torch.as_tensor(mk))
        rows = range(len(bb)) if got is None else got.tolist()
        assert {tuple(bb[r]) for r in rows} == want, (axis, u, v)


def test_line_passes_on_site_runs_change_nothing(monkeypatch):
    """The line passes restricted to the runs that hold a site give the same bits as over the whole domain
    (the runs without one read inf either way): a sparse domain, a few sites, with and without out_bricks."""
    from mapper.integrators import esdf as E

    rng = np.random.default_rng(5)
    bricks = torch.as_tensor(np.unique(rng.integers(-5, 5, (300, 3)), axis=0))
    keys = E.voxel_keys(bricks)
    bricks = bricks[torch.argsort(keys)]
    pick = bricks[torch.as_tensor(rng.choice(len(bricks), 6, replace=False))]
    vox = (pick * 4 + torch.as_tensor(rng.integers(0, 4, (6, 3)))).to(torch.int64)
    t = torch.as_tensor((rng.random((6, 9)) - 0.5).astype(np.float32))
    t[:, 1::3] = torch.maximum(t[:, 0::3], t[:, 1::3])  # rightmost >= leftmost
    out = bricks[::3].contiguous()
    got = [E.squared_distances(bricks, vox, t, 6), E.squared_distances(bricks, vox, t, 6, out_bricks=out)]
    assert E._runs_with(bricks, 0, torch.zeros(len(bricks), dtype=torch.bool)).numel() == 0
    monkeypatch.setattr(E, "_runs_with", lambda *a: None)
    want = [E.squared_distances(bricks, vox, t, 6), E.squared_distances(bricks, vox, t, 6, out_bricks=out)]
    assert torch.isfinite(want[0]).any() and torch.isinf(want[0]).any()
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    rows = E._member(E.voxel_keys(bricks), E.voxel_keys(out))
    assert torch.equal(got[1][rows].view(torch.int32), want[1][rows].view(torch.int32))

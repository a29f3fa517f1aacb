"""Algebraic properties of the ``IndexGrid`` operators, checked with Hypothesis.

Each test runs through the ``backend`` and ``device`` fixtures; the Hypothesis loop runs inside the test
(:func:`check`), so the fixtures are set up once per case. Example counts are modest; morphology under
the Triton *interpreter* (Triton on CPU tensors) costs ~0.1-0.3 s per 32^3 tile and iteration, so those
tests draw sets inside one tile (crossing its 8^3 leaves), shifted by multiples of 32 to negative, large
(+-2^20) and extreme (-2^22, 2^22 - 32) positions, and run fewer examples there.
"""

from __future__ import annotations

import numpy as np
import oracles
import torch
from grid_helpers import assert_same_grid, assert_valid_grid, grid_of, ijk_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mapper import IndexGrid

LIMIT = oracles.VOXEL_LIMIT
CONNECTIVITIES = (6, 18, 26)


def check(backend, device, prop, *strategies, heavy: bool = False) -> None:
    """Run ``prop`` over Hypothesis examples of ``strategies`` (fewer for morphology in the interpreter)."""
    interpreted = backend == "triton" and torch.device(device).type == "cpu"
    n = (6 if heavy else 25) if interpreted else (25 if heavy else 40)
    settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(*strategies)(prop))()


# ------------------------------------------------------------------------------- strategies
WIDE_COORD = st.one_of(st.integers(-40, 40), st.sampled_from(oracles.LEAF_BOUNDARY))
# keep |coord + shift| inside the range; +-2^21 - 64 also keeps refinement representable
WIDE_SHIFTS = (0, 1 << 20, -(1 << 20), (1 << 21) - 64, -(1 << 21) + 64)
EXTREME_VOXEL = st.tuples(*(st.sampled_from((-LIMIT, -LIMIT + 1, LIMIT - 9, LIMIT - 1)),) * 3)
VOXEL = st.tuples(WIDE_COORD, WIDE_COORD, WIDE_COORD)


def _arr(pts) -> np.ndarray:
    return np.array(pts, dtype=np.int64).reshape(-1, 3)


@st.composite
def related_sets(draw, k: int = 2, extremes: bool = True, shifts=WIDE_SHIFTS):
    """``k`` voxel sets that overlap: subsets of a common pool plus their own voxels, one common shift
    (mixed signs, up to ~2^21), and optionally a few voxels at the range extremes (+-(2^22 - 1), -2^22)."""
    pool = draw(st.lists(VOXEL, max_size=20))
    shift = _arr(draw(st.tuples(*(st.sampled_from(shifts),) * 3)))
    out = []
    for _ in range(k):
        take = draw(st.lists(st.booleans(), min_size=len(pool), max_size=len(pool)))
        own = draw(st.lists(VOXEL, max_size=8))
        pts = _arr([p for p, t in zip(pool, take, strict=True) if t] + own) + shift
        if extremes:
            pts = np.concatenate([pts, _arr(draw(st.lists(EXTREME_VOXEL, max_size=2)))])
        out.append(pts)
    return out


voxel_sets = related_sets(k=1).map(lambda s: s[0])
refinable_sets = related_sets(k=1, extremes=False).map(lambda s: s[0])

# morphology: one 32^3 tile, [lo, hi) per axis, shifted by multiples of 32 (dilation by 3 reaches 2^22 - 1)
TILE_SHIFTS = (0, -64, 1 << 20, -(1 << 20), LIMIT - 32, -LIMIT)


@st.composite
def tile_sets(draw, lo: int = 3, hi: int = 29, shifts=TILE_SHIFTS):
    """Solid boxes and scattered voxels in ``[lo, hi)^3`` (crossing leaf boundaries), shifted."""
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        size = draw(st.tuples(*(st.integers(1, min(7, hi - lo)),) * 3))
        corner = [draw(st.integers(lo, hi - s)) for s in size]
        parts.append(oracles.box(corner, size))
    c = st.integers(lo, hi - 1)
    parts.append(_arr(draw(st.lists(st.tuples(c, c, c), max_size=15))))
    shift = _arr(draw(st.tuples(*(st.sampled_from(shifts),) * 3)))
    return np.concatenate(parts) + shift


# ---------------------------------------------------------------------------- construction
def test_order_is_canonical(backend, device):
    def prop(pts, seed):
        rng = np.random.default_rng(seed)
        grid = grid_of(pts, device)
        order = assert_valid_grid(grid, device)  # voxel-sequential, ijk_to_index(ijk) == arange
        assert oracles.as_set(order) == oracles.as_set(pts)
        shuffled = np.concatenate([pts, pts[: len(pts) // 2]])
        shuffled = shuffled[rng.permutation(len(shuffled))]
        assert_same_grid(grid_of(shuffled, device), grid)
        assert_same_grid(IndexGrid.from_ijk(order.astype(np.int32), device=device), grid)

    check(backend, device, prop, voxel_sets, st.integers(0, 2**32 - 1))


# ---------------------------------------------------------------------------------- merge
def test_merge_commutative(backend, device):
    def prop(sets):
        a, b = (grid_of(s, device) for s in sets)
        ab, ba = a.merged_grid(b), b.merged_grid(a)
        assert oracles.as_set(ijk_np(ab)) == oracles.as_set(oracles.union(*sets))
        assert_same_grid(ab, ba)

    check(backend, device, prop, related_sets(k=2))


def test_merge_associative(backend, device):
    def prop(sets):
        a, b, c = (grid_of(s, device) for s in sets)
        left = a.merged_grid(b).merged_grid(c)
        right = a.merged_grid(b.merged_grid(c))
        assert_same_grid(left, right)
        assert_same_grid(left, grid_of(oracles.union(*sets), device))

    check(backend, device, prop, related_sets(k=3))


def test_merge_idempotent_with_empty_identity(backend, device):
    def prop(pts):
        a = grid_of(pts, device)
        assert_same_grid(a.merged_grid(a), a)
        assert_same_grid(a.merged_grid(IndexGrid.empty(device)), a)
        assert_same_grid(IndexGrid.empty(device).merged_grid(a), a)

    check(backend, device, prop, voxel_sets)


# ---------------------------------------------------------------------------------- prune
def test_prune_partitions_the_grid(backend, device):
    def prop(pts, data):
        grid = grid_of(pts, device)
        n = grid.num_voxels
        keep_np = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
        keep = torch.as_tensor(keep_np).to(device)
        order = ijk_np(grid)
        kept, dropped = grid.pruned_grid(keep), grid.pruned_grid(~keep)
        assert oracles.as_set(ijk_np(kept)) == oracles.as_set(order[keep_np])
        assert_same_grid(kept.merged_grid(dropped), grid)
        assert kept.num_voxels + dropped.num_voxels == n
        assert_same_grid(grid.pruned_grid(torch.ones(n, dtype=torch.bool, device=device)), grid)
        assert grid.pruned_grid(torch.zeros(n, dtype=torch.bool, device=device)).num_voxels == 0
        # pruning keeps the relative order of the kept voxels
        np.testing.assert_array_equal(ijk_np(kept), order[keep_np])

    check(backend, device, prop, voxel_sets, st.data())


# --------------------------------------------------------------------------------- inject
def test_inject_round_trip(backend, device):
    def prop(sets):
        a, b = (grid_of(s, device) for s in sets)
        a_ijk, b_ijk = ijk_np(a), ijk_np(b)
        in_a = oracles.index_of(a_ijk, b_ijk) >= 0  # per b voxel
        in_b = oracles.index_of(b_ijk, a_ijk) >= 0  # per a voxel
        values = torch.arange(1, a.num_voxels + 1, dtype=torch.float64, device=device)
        on_b = a.inject_to(b, values, fill=-1.0)
        back = b.inject_to(a, on_b, fill=-2.0)
        v = values.cpu().numpy()
        np.testing.assert_array_equal(back.cpu().numpy(), np.where(in_b, v, -2.0))
        assert ((on_b.cpu().numpy() == -1.0) == ~in_a).all()
        # inject_index is ijk_to_index of the destination voxels
        np.testing.assert_array_equal(a.inject_index(b).cpu(), a.ijk_to_index(b.ijk).cpu())
        # same grid: identity
        np.testing.assert_array_equal(a.inject_to(a, values).cpu(), values.cpu())

    check(backend, device, prop, related_sets(k=2))


# ------------------------------------------------------------------------ coarsen / refine
def test_refine_then_coarsen_is_identity(backend, device):
    def prop(pts):
        grid = grid_of(pts, device)
        fine = grid.refined_grid()
        assert fine.num_voxels == 8 * grid.num_voxels
        assert_same_grid(fine.coarsened_grid(), grid)
        assert oracles.as_set(ijk_np(fine)) == oracles.as_set(oracles.refine(pts))

    check(backend, device, prop, refinable_sets)


def test_coarsen_distributes_over_merge(backend, device):
    def prop(sets):
        a, b = (grid_of(s, device) for s in sets)
        assert_same_grid(
            a.merged_grid(b).coarsened_grid(), a.coarsened_grid().merged_grid(b.coarsened_grid())
        )
        # coarsening then refining covers the grid
        cov = a.coarsened_grid().refined_grid()
        assert oracles.is_subset(ijk_np(a), ijk_np(cov))

    check(backend, device, prop, related_sets(k=2, shifts=(0, -(1 << 20), (1 << 21) - 64)))


# ----------------------------------------------------------------------------- morphology
def test_dilation_extensive_erosion_antiextensive(backend, device):
    """A <= D(A), E(A) <= A, A <= E(D(A)) (closing), D(E(A)) <= A (opening): the stencils are symmetric."""

    def prop(pts, connectivity):
        a = grid_of(pts, device)
        d, e = a.dilated_grid(1, connectivity), a.eroded_grid(1, connectivity)
        A, D, E = ijk_np(a), ijk_np(d), ijk_np(e)
        assert oracles.is_subset(A, D) and oracles.is_subset(E, A)
        assert oracles.is_subset(A, ijk_np(d.eroded_grid(1, connectivity)))
        assert oracles.is_subset(ijk_np(e.dilated_grid(1, connectivity)), A)

    check(backend, device, prop, tile_sets(), st.sampled_from(CONNECTIVITIES), heavy=True)


def test_morphology_monotone_in_connectivity(backend, device):
    """D6 <= D18 <= D26 and E26 <= E18 <= E6 (the stencils are nested)."""

    def prop(pts, erode):
        a = grid_of(pts, device)
        op = a.eroded_grid if erode else a.dilated_grid
        s6, s18, s26 = (oracles.as_set(ijk_np(op(1, c))) for c in CONNECTIVITIES)
        assert (s26 <= s18 <= s6) if erode else (s6 <= s18 <= s26)

    check(backend, device, prop, tile_sets(), st.booleans(), heavy=True)


def test_radius_is_iteration(backend, device):
    """radius r == r successive one-voxel steps (same grid, same order)."""

    def prop(pts, connectivity, erode):
        a = grid_of(pts, device)
        if erode:
            assert_same_grid(
                a.eroded_grid(2, connectivity), a.eroded_grid(1, connectivity).eroded_grid(1, connectivity)
            )
        else:
            assert_same_grid(
                a.dilated_grid(2, connectivity), a.dilated_grid(1, connectivity).dilated_grid(1, connectivity)
            )

    check(backend, device, prop, tile_sets(), st.sampled_from(CONNECTIVITIES), st.booleans(), heavy=True)


def test_erosion_is_dual_of_dilation(backend, device):
    """E(A) = A minus D(B \\ A) for a box B holding A and its stencil neighbours (outside is inactive)."""

    def prop(pts, connectivity):
        a = grid_of(pts, device)
        if a.num_voxels == 0:
            return
        A = oracles.canon(pts)
        bbox = oracles.box(A.min(axis=0) - 1, A.max(axis=0) - A.min(axis=0) + 3)
        complement = np.array(sorted(oracles.as_set(bbox) - oracles.as_set(A)), dtype=np.int64).reshape(-1, 3)
        dc = oracles.as_set(ijk_np(grid_of(complement, device).dilated_grid(1, connectivity)))
        expected = oracles.as_set(A) - dc
        assert oracles.as_set(ijk_np(a.eroded_grid(1, connectivity))) == expected

    check(backend, device, prop, tile_sets(), st.sampled_from(CONNECTIVITIES), heavy=True)


def test_coarsen_of_box_dilation(backend, device):
    """C(D26(A, 2)) == D26(C(A), 1): per axis floor((2c + b + [-2, 2]) / 2) == c + [-1, 1]."""

    def prop(pts):
        a = grid_of(pts, device)
        assert_same_grid(a.dilated_grid(2, 26).coarsened_grid(), a.coarsened_grid().dilated_grid(1, 26))

    check(backend, device, prop, tile_sets(), heavy=True)


def test_refine_commutes_with_box_morphology(backend, device):
    """R(D26(A, 1)) == D26(R(A), 2) and R(E26(A, 1)) == E26(R(A), 2) (children of a voxel fill 2^3)."""

    def prop(pts, erode):
        a = grid_of(pts, device)
        if erode:
            assert_same_grid(a.eroded_grid(1, 26).refined_grid(), a.refined_grid().eroded_grid(2, 26))
        else:
            assert_same_grid(a.dilated_grid(1, 26).refined_grid(), a.refined_grid().dilated_grid(2, 26))

    # refined voxels of [3, 13) lie in [6, 27): with radius 2 still inside one tile
    small = tile_sets(lo=3, hi=13, shifts=(0, -32, 1 << 19, -(1 << 21)))
    check(backend, device, prop, small, st.booleans(), heavy=True)

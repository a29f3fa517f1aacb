"""Grid-side test helpers: turn grids into NumPy voxel arrays and check a grid against an oracle set.

The expected values always come from :mod:`oracles` (which never imports ``mapper``); this module only
reads the object under test.
"""

from __future__ import annotations

import numpy as np
import oracles
import torch

from mapper import IndexGrid


def ijk_np(grid: IndexGrid) -> np.ndarray:
    """The grid's voxels, int64 ``[N, 3]``, in the grid's voxel order."""
    return grid.ijk.cpu().numpy().astype(np.int64)


def tensor(a, device, dtype=torch.int64) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=dtype).to(device)


def grid_of(points, device) -> IndexGrid:
    return IndexGrid.from_ijk(tensor(points, device), device=device)


def assert_valid_grid(grid: IndexGrid, device) -> np.ndarray:
    """Structural invariants of any grid (on ``device``); returns its voxels as NumPy (grid order)."""
    assert grid.device.type == torch.device(device).type
    ijk = grid.ijk
    assert ijk.dtype == torch.int32
    assert ijk.device.type == grid.device.type
    assert ijk.dim() == 2 and ijk.shape[1] == 3
    n = ijk.shape[0]
    assert grid.num_voxels == n == len(grid)
    a = ijk.cpu().numpy().astype(np.int64)
    assert oracles.order_violations(a) == []
    leaf = grid.leaf_ijk
    assert leaf.dtype == torch.int32 and leaf.shape == (grid.num_leaves, 3)
    np.testing.assert_array_equal(leaf.cpu().numpy().astype(np.int64), oracles.leaves_in_order(a))
    if n:
        idx = grid.ijk_to_index(ijk)
        assert idx.dtype == torch.int64 and idx.device.type == grid.device.type
        np.testing.assert_array_equal(idx.cpu().numpy(), np.arange(n))
    return a


def assert_grid_equals(grid: IndexGrid, expected, device, canonical: bool = True) -> np.ndarray:
    """``grid`` holds exactly the voxel set ``expected`` (oracle output), in the canonical order.

    ``canonical``: also check that the order equals that of a grid built from the expected set shuffled,
    i.e. the order depends only on the voxel set.
    """
    a = assert_valid_grid(grid, device)
    exp = oracles.canon(expected)
    got = oracles.canon(a)
    if got.shape != exp.shape or not np.array_equal(got, exp):
        missing = oracles.as_set(exp) - oracles.as_set(got)
        extra = oracles.as_set(got) - oracles.as_set(exp)
        raise AssertionError(
            f"voxel sets differ: {len(missing)} missing (e.g. {sorted(missing)[:5]}), "
            f"{len(extra)} extra (e.g. {sorted(extra)[:5]})"
        )
    if canonical and exp.shape[0]:
        rng = np.random.default_rng(exp.shape[0])
        ref = grid_of(exp[rng.permutation(exp.shape[0])], device)
        np.testing.assert_array_equal(a, ijk_np(ref), err_msg="voxel order is not canonical")
    return a


def assert_same_grid(g1: IndexGrid, g2: IndexGrid) -> None:
    """Identical voxel sets in identical order."""
    assert g1.num_voxels == g2.num_voxels and g1.num_leaves == g2.num_leaves
    np.testing.assert_array_equal(ijk_np(g1), ijk_np(g2))

"""Bad arguments to ``IndexGrid`` raise ``InvalidArgument`` (a ``ValueError``) or ``InvalidArgumentType`` (a
``TypeError``) with a message naming the argument; operators never mutate their grid or their inputs."""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch
from grid_helpers import assert_same_grid, grid_of, ijk_np, tensor

from mapper import IndexGrid, InvalidArgument, InvalidArgumentType, MapperError

LIMIT = oracles.VOXEL_LIMIT
META = torch.device("meta")  # a device no grid lives on, available without CUDA


@pytest.fixture
def grid(backend, device) -> IndexGrid:
    pts = np.concatenate([oracles.ball((3, -4, 7), 2.5), [[-9, 8, -33], [0, -1, 16]]])
    return grid_of(pts, device)


def test_error_hierarchy():
    assert issubclass(InvalidArgument, ValueError) and issubclass(InvalidArgument, MapperError)
    assert issubclass(InvalidArgumentType, TypeError) and issubclass(InvalidArgumentType, MapperError)


# ------------------------------------------------------------------------------------ from_ijk
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.zeros((4, 3), dtype=torch.float32), id="torch-float32"),
        pytest.param(torch.zeros((4, 3), dtype=torch.float64), id="torch-float64"),
        pytest.param(torch.zeros((4, 3), dtype=torch.bool), id="torch-bool"),
        pytest.param(np.zeros((4, 3), dtype=np.float64), id="numpy-float64"),
        pytest.param(np.zeros((4, 3), dtype=np.float16), id="numpy-float16"),
        pytest.param(np.empty((2, 3), dtype=object), id="numpy-object"),
        pytest.param(None, id="None"),
        pytest.param("0 0 0", id="str"),
        pytest.param(7, id="int"),
        pytest.param({"i": 0}, id="dict"),
    ],
)
def test_from_ijk_wrong_type(bad, backend, device):
    with pytest.raises(InvalidArgumentType, match=r"\bijk\b"):
        IndexGrid.from_ijk(bad, device=device)


@pytest.mark.parametrize(
    "shape",
    [(5, 2), (5, 4), (3,), (5, 3, 1), (1, 5, 3), (0,), ()],
    ids=lambda s: "x".join(map(str, s)) or "0d",
)
def test_from_ijk_wrong_shape(shape, backend, device):
    for bad in (torch.zeros(shape, dtype=torch.int64, device=device), np.zeros(shape, dtype=np.int32)):
        with pytest.raises(InvalidArgument, match=r"\bijk\b.*shape"):
            IndexGrid.from_ijk(bad, device=device)


@pytest.mark.parametrize(
    "voxel",
    [[LIMIT, 0, 0], [0, -LIMIT - 1, 0], [0, 0, 1 << 40], [-(1 << 62), 0, 0], [LIMIT, LIMIT, LIMIT]],
)
@pytest.mark.parametrize("dtype", [torch.int64, "numpy"])
def test_from_ijk_out_of_range(voxel, dtype, backend, device):
    pts = np.array([[0, 0, 0], voxel], dtype=np.int64)
    bad = pts if dtype == "numpy" else tensor(pts, device)
    with pytest.raises(InvalidArgument, match=r"\bijk\b.*4194304"):
        IndexGrid.from_ijk(bad, device=device)


def test_from_ijk_range_edges_accepted(backend, device):
    pts = np.array([[LIMIT - 1, -LIMIT, 0], [-LIMIT, LIMIT - 1, LIMIT - 1]])
    assert grid_of(pts, device).num_voxels == 2
    # int32 inputs cannot be out of range beyond int32 but can exceed 2^22
    with pytest.raises(InvalidArgument, match="ijk"):
        IndexGrid.from_ijk(torch.tensor([[LIMIT, 0, 0]], dtype=torch.int32, device=device))


@pytest.mark.parametrize("dev", ["bogus", "cuda:x", 3.5])
def test_bad_device_string(dev):
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="device"):
        IndexGrid.from_ijk(np.zeros((1, 3), dtype=np.int64), device=dev)
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="device"):
        IndexGrid.empty(device=dev)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(InvalidArgument, match="device.*CUDA"):
        IndexGrid.from_ijk(np.zeros((1, 3), dtype=np.int64), device="cuda")
    with pytest.raises(InvalidArgument, match="device"):
        IndexGrid.empty(device="cuda")
    with pytest.raises(InvalidArgument, match="device"):
        IndexGrid.empty().to("cuda")


def test_to_bad_device(grid):
    with pytest.raises(InvalidArgument, match="device"):
        grid.to("bogus")


# --------------------------------------------------------------------------------- ijk_to_index
def test_ijk_to_index_bad_arguments(grid, device):
    with pytest.raises(InvalidArgumentType, match=r"\bijk\b"):
        grid.ijk_to_index(torch.zeros((2, 3), dtype=torch.float32, device=device))
    with pytest.raises(InvalidArgumentType, match=r"\bijk\b"):
        grid.ijk_to_index("not coordinates")
    with pytest.raises(InvalidArgument, match=r"\bijk\b.*shape"):
        grid.ijk_to_index(torch.zeros((2, 2), dtype=torch.int64, device=device))
    with pytest.raises(InvalidArgument, match=r"\bijk\b.*shape"):
        grid.ijk_to_index(torch.zeros(3, dtype=torch.int64, device=device))


def test_ijk_to_index_tensor_on_other_device(grid):
    with pytest.raises(InvalidArgument, match=r"\bijk\b.*meta"):
        grid.ijk_to_index(torch.zeros((2, 3), dtype=torch.int64, device=META))


@pytest.mark.gpu
def test_other_device_arguments_cuda(backend):
    cpu = grid_of([[0, 0, 0], [1, 2, 3]], "cpu")
    gpu = cpu.to("cuda")
    with pytest.raises(InvalidArgument, match=r"\bijk\b"):
        cpu.ijk_to_index(torch.zeros((1, 3), dtype=torch.int64, device="cuda"))
    with pytest.raises(InvalidArgument, match=r"\bijk\b"):
        gpu.ijk_to_index(torch.zeros((1, 3), dtype=torch.int64))
    with pytest.raises(InvalidArgument, match=r"\bother\b"):
        cpu.merged_grid(gpu)
    with pytest.raises(InvalidArgument, match=r"\bother\b"):
        gpu.inject_to(cpu, torch.zeros(2, device="cuda"))
    with pytest.raises(InvalidArgument, match=r"\bkeep\b"):
        gpu.pruned_grid(torch.ones(2, dtype=torch.bool))
    with pytest.raises(InvalidArgument, match=r"\bvalues\b"):
        gpu.inject_to(gpu, torch.zeros(2))


# ----------------------------------------------------------------------------------- morphology
@pytest.mark.parametrize("op", ["dilated_grid", "eroded_grid"])
@pytest.mark.parametrize("radius", [0, 9, -1, 100])
def test_bad_radius_value(op, radius, grid, device):
    for g in (grid, IndexGrid.empty(device)):
        with pytest.raises(InvalidArgument, match=r"\bradius\b"):
            getattr(g, op)(radius=radius)


@pytest.mark.parametrize("op", ["dilated_grid", "eroded_grid"])
@pytest.mark.parametrize("radius", [1.5, 2.0, "2", True, None, torch.tensor(2)], ids=repr)
def test_bad_radius_type(op, radius, grid, device):
    for g in (grid, IndexGrid.empty(device)):
        with pytest.raises(InvalidArgumentType, match=r"\bradius\b"):
            getattr(g, op)(radius=radius)


@pytest.mark.parametrize("op", ["dilated_grid", "eroded_grid"])
@pytest.mark.parametrize("connectivity", [8, 0, 4, 27, -6])
def test_bad_connectivity_value(op, connectivity, grid, device):
    for g in (grid, IndexGrid.empty(device)):
        with pytest.raises(InvalidArgument, match=r"\bconnectivity\b"):
            getattr(g, op)(connectivity=connectivity)


@pytest.mark.parametrize("op", ["dilated_grid", "eroded_grid"])
@pytest.mark.parametrize("connectivity", [6.0, "26", False], ids=repr)
def test_bad_connectivity_type(op, connectivity, grid):
    with pytest.raises(InvalidArgumentType, match=r"\bconnectivity\b"):
        getattr(grid, op)(connectivity=connectivity)


def test_numpy_integer_radius_accepted(grid):
    a = grid.dilated_grid(radius=np.int64(2), connectivity=np.int32(6))
    b = grid.dilated_grid(radius=2, connectivity=6)
    assert_same_grid(a, b)


# ----------------------------------------------------------------------------------------- prune
def test_prune_bad_keep(grid, device):
    n = grid.num_voxels
    for length in (n - 1, n + 1, 0):
        with pytest.raises(InvalidArgument, match=rf"\bkeep\b.*\[{n}\]"):
            grid.pruned_grid(torch.ones(length, dtype=torch.bool, device=device))
    with pytest.raises(InvalidArgument, match=r"\bkeep\b"):
        grid.pruned_grid(torch.ones((n, 1), dtype=torch.bool, device=device))
    for dtype in (torch.uint8, torch.int64, torch.float32):
        with pytest.raises(InvalidArgumentType, match=r"\bkeep\b.*bool"):
            grid.pruned_grid(torch.ones(n, dtype=dtype, device=device))
    with pytest.raises(InvalidArgumentType, match=r"\bkeep\b"):
        grid.pruned_grid(None)
    with pytest.raises(InvalidArgument, match=r"\bkeep\b.*meta"):
        grid.pruned_grid(torch.ones(n, dtype=torch.bool, device=META))


def test_prune_bad_keep_on_empty_grid(backend, device):
    e = IndexGrid.empty(device)
    with pytest.raises(InvalidArgument, match=r"\bkeep\b"):
        e.pruned_grid(torch.ones(1, dtype=torch.bool, device=device))
    with pytest.raises(InvalidArgumentType, match=r"\bkeep\b"):
        e.pruned_grid(torch.ones(0, dtype=torch.int32, device=device))


# -------------------------------------------------------------------------------- merge / inject
@pytest.mark.parametrize(
    "other", [None, "grid", torch.zeros((2, 3), dtype=torch.int64), np.zeros((2, 3))], ids=repr
)
def test_non_grid_other(other, grid):
    with pytest.raises(InvalidArgumentType, match=r"\bother\b"):
        grid.merged_grid(other)
    with pytest.raises(InvalidArgumentType, match=r"\bother\b"):
        grid.inject_to(other, torch.zeros(grid.num_voxels))
    with pytest.raises(InvalidArgumentType, match=r"\bother\b"):
        grid.inject_index(other)


def test_inject_bad_values(grid, device):
    n = grid.num_voxels
    dst = grid_of([[0, 0, 0], [3, -4, 7]], device)
    for bad in (torch.zeros(n - 1, device=device), torch.zeros(n + 1, 2, device=device)):
        with pytest.raises(InvalidArgument, match=rf"\bvalues\b.*\[{n}"):
            grid.inject_to(dst, bad)
    with pytest.raises(InvalidArgument, match=r"\bvalues\b"):
        grid.inject_to(dst, torch.tensor(1.0, device=device))
    with pytest.raises(InvalidArgument, match=r"\bvalues\b"):
        grid.inject_to(dst, torch.zeros(0, n, device=device))  # one row per voxel along dim 0
    with pytest.raises(InvalidArgumentType, match=r"\bvalues\b"):
        grid.inject_to(dst, np.zeros(n, dtype=np.float32))
    with pytest.raises(InvalidArgumentType, match=r"\bvalues\b"):
        grid.inject_to(dst, [0.0] * n)
    with pytest.raises(InvalidArgument, match=r"\bvalues\b.*meta"):
        grid.inject_to(dst, torch.zeros(n, device=META))


def test_inject_bad_fill(grid, device):
    values = torch.zeros(grid.num_voxels, dtype=torch.float32, device=device)
    with pytest.raises(InvalidArgument, match=r"\bfill\b"):
        grid.inject_to(grid, values, fill="zero")


# -------------------------------------------------------------------------------------- refine
@pytest.mark.parametrize("voxel", [[1 << 21, 0, 0], [0, -(1 << 21) - 1, 0], [0, 0, LIMIT - 1], [-LIMIT] * 3])
def test_refine_out_of_range(voxel, backend, device):
    g = grid_of([[0, 0, 0], voxel], device)
    with pytest.raises(InvalidArgument, match="range"):
        g.refined_grid()


def test_refine_range_edges_accepted(backend, device):
    edge = oracles.REFINE_LIMIT
    g = grid_of([[edge - 1, -edge, edge - 1], [-edge, -edge, -edge]], device)
    fine = g.refined_grid()
    assert fine.num_voxels == 16
    assert int(fine.ijk.max()) == LIMIT - 1 and int(fine.ijk.min()) == -LIMIT


@pytest.mark.parametrize("connectivity", [6, 26])
def test_dilation_past_range_edge_is_rejected(connectivity, backend, device):
    for pts in ([[LIMIT - 1, 0, 0]], [[-LIMIT, 5, 5]], [[3, LIMIT - 1, -LIMIT]]):
        g = grid_of(pts, device)
        with pytest.raises(InvalidArgument, match="range"):
            g.dilated_grid(1, connectivity)
    # one voxel inside the edge still dilates, and stays consistent
    d = grid_of([[LIMIT - 2, 0, 0], [-LIMIT + 1, 5, 5]], device).dilated_grid(1, connectivity)
    ijk = ijk_np(d)
    assert ijk.min() >= -LIMIT and ijk.max() < LIMIT
    np.testing.assert_array_equal(d.ijk_to_index(d.ijk).cpu().numpy(), np.arange(d.num_voxels))


# -------------------------------------------------------------------------------- immutability
def test_operators_do_not_mutate(backend, device):
    rng = np.random.default_rng(7)
    pts = np.concatenate([oracles.blobs(rng, 2, max_r=3, lo=-10, hi=10), [[-9, 8, -33]]])
    ijk_in = tensor(pts, device)
    ijk_in_copy = ijk_in.clone()
    g = IndexGrid.from_ijk(ijk_in)
    other_pts = oracles.scatter(rng, 30, -12, 12)
    other = grid_of(other_pts, device)
    snap, leaf_snap, n, nl = g.ijk.clone(), g.leaf_ijk.clone(), g.num_voxels, g.num_leaves
    other_snap = other.ijk.clone()
    keep = torch.as_tensor(rng.random(n) < 0.5).to(device)
    keep_copy = keep.clone()
    values = torch.arange(n, dtype=torch.float32, device=device)
    values_copy = values.clone()
    query = ijk_in[:5].clone()

    results = [
        g.merged_grid(other),
        other.merged_grid(g),
        g.pruned_grid(keep),
        g.dilated_grid(1, 26),
        g.eroded_grid(1, 6),
        g.coarsened_grid(),
        g.refined_grid(),
        g.to(device),
    ]
    out = g.inject_to(other, values, fill=-1.0)
    g.inject_index(other)
    other.inject_index(g)
    g.ijk_to_index(query)
    for r in results[:-1]:
        assert r is not g
    out.fill_(123.0)  # the result is a fresh tensor: writing to it changes nothing else

    torch.testing.assert_close(g.ijk, snap, rtol=0, atol=0)
    torch.testing.assert_close(g.leaf_ijk, leaf_snap, rtol=0, atol=0)
    assert (g.num_voxels, g.num_leaves) == (n, nl)
    torch.testing.assert_close(other.ijk, other_snap, rtol=0, atol=0)
    torch.testing.assert_close(ijk_in, ijk_in_copy, rtol=0, atol=0)
    torch.testing.assert_close(keep, keep_copy, rtol=0, atol=0)
    torch.testing.assert_close(values, values_copy, rtol=0, atol=0)
    assert oracles.as_set(ijk_np(g)) == oracles.as_set(pts)


def test_grid_does_not_alias_inputs_or_outputs(backend, device):
    pts = np.array([[0, 0, 0], [-1, 7, 8], [15, -9, 16]])
    ijk_in = tensor(pts, device).clone()
    g = IndexGrid.from_ijk(ijk_in)
    before = ijk_np(g)
    ijk_in.fill_(5)  # the caller reuses its buffer
    np.testing.assert_array_equal(ijk_np(g), before)
    ijk = g.ijk
    ijk.fill_(-3)  # writing to the returned coordinates does not reach the grid
    leaf = g.leaf_ijk
    leaf.fill_(-3)
    np.testing.assert_array_equal(ijk_np(g), before)
    assert oracles.as_set(g.leaf_ijk.cpu().numpy()) == oracles.as_set(np.floor_divide(pts, 8))
    idx = g.ijk_to_index(tensor(pts, device))
    idx.fill_(0)
    np.testing.assert_array_equal(
        g.ijk_to_index(tensor(pts, device)).cpu().numpy(), oracles.index_of(before, pts)
    )

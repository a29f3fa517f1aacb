"""The voxel key format and the map's coordinate range (mapper.kernels.keys), against hand-computed keys and
a pure-Python oracle that does not import the library's packing: round trips, order, range limits, bad
input; and every module that packs voxel keys agrees with it."""

from __future__ import annotations

import pytest
import torch

from mapper.kernels import keys as K


def _oracle_key(i: int, j: int, k: int) -> int:
    return ((i + 2**20) << 42) | ((j + 2**20) << 21) | (k + 2**20)


def test_constants_are_the_documented_format():
    assert (K.VOXEL_KEY_BITS, K.VOXEL_KEY_BIAS, K.VOXEL_KEY_LIMIT) == (21, 2**20, 2**20)
    assert K.COORD_LIMIT_VOX == 2**20 - 8
    # a brick is in range exactly when all its voxels are: 4 * HI - 1 < COORD_LIMIT, 4 * LO >= -COORD_LIMIT
    assert 4 * K.BRICK_HI - 1 < K.COORD_LIMIT_VOX <= 4 * (K.BRICK_HI + 1) - 1
    assert 4 * K.BRICK_LO >= -K.COORD_LIMIT_VOX > 4 * (K.BRICK_LO - 1)


def test_round_trip_and_hand_computed_keys():
    lim = K.COORD_LIMIT_VOX
    edge = [[0, 0, 0], [-1, -1, -1], [lim - 1, -lim, 7], [-lim, lim - 1, -lim], [2**20 - 1, -(2**20), 0]]
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-(2**20), 2**20, (500, 3), generator=g)
    ijk = torch.cat((torch.tensor(edge), rand))
    keys = K.voxel_keys(ijk)
    assert keys.dtype == torch.int64
    assert keys.tolist() == [_oracle_key(*row) for row in ijk.tolist()]
    assert torch.equal(K.keys_to_ijk(keys), ijk)
    assert K.voxel_keys(torch.tensor([[0, 0, 0]])).item() == (2**20 << 42) | (2**20 << 21) | 2**20
    # int32 coordinates are widened, not overflowed
    assert torch.equal(K.voxel_keys(ijk.to(torch.int32)), keys)


def test_keys_sort_like_coordinates_i_major():
    g = torch.Generator().manual_seed(1)
    ijk = torch.randint(-50, 50, (400, 3), generator=g)
    order = torch.argsort(K.voxel_keys(ijk), stable=True)
    rows = [tuple(r) for r in ijk[order].tolist()]
    assert rows == sorted(rows)


def test_range_limits_at_the_boundary():
    lim = K.COORD_LIMIT_VOX
    ijk = torch.tensor([[lim - 1, 0, 0], [lim, 0, 0], [0, -lim, 0], [0, -lim - 1, 0], [0, 0, 2**40]])
    assert K.in_key_range(ijk).tolist() == [True, False, True, False, False]
    b = torch.tensor([[K.BRICK_HI - 1, 0, 0], [K.BRICK_HI, 0, 0], [0, K.BRICK_LO, 0], [0, 0, K.BRICK_LO - 1]])
    keys = K.brick_keys(b)
    assert keys[1].item() == -1 and keys[3].item() == -1
    assert keys[0].item() == _oracle_key(K.BRICK_HI - 1, 0, 0)
    assert keys[2].item() == _oracle_key(0, K.BRICK_LO, 0)
    # every voxel of an in-range brick is in the map's range
    for brick in (b[0], b[2]):
        vox = brick * 4 + torch.tensor([[0, 0, 0], [3, 3, 3]])
        assert bool(K.in_key_range(vox).all())


@pytest.mark.parametrize(
    "bad, err",
    [
        (torch.zeros((4, 3)), TypeError),  # float coordinates
        (torch.zeros((4, 2), dtype=torch.int64), ValueError),  # wrong shape
        (torch.zeros(3, dtype=torch.int64), ValueError),
        ([[0, 0, 0]], TypeError),  # not a tensor
    ],
)
def test_bad_input_raises(bad, err):
    with pytest.raises(err, match="ijk|bricks"):
        K.voxel_keys(bad)
    with pytest.raises(err, match="ijk|bricks"):
        K.brick_keys(bad)


def test_every_user_shares_the_format():
    from mapper.integrators import common
    from mapper.kernels import nn, segments

    ijk = torch.tensor([[3, -4, 5], [-(2**17), 2**17, 0]])
    expect = K.voxel_keys(ijk)
    assert torch.equal(common.voxel_keys(ijk), expect)
    assert torch.equal(nn.voxel_keys(ijk), expect)
    assert torch.equal(segments.brick_keys(ijk), expect)
    assert torch.equal(segments.keys_to_bricks(expect), ijk)
    assert (common.KEY_BITS, common.KEY_BIAS, nn.KEY_BIAS) == (21, 2**20, 2**20)


def test_mesh_edge_and_block_keys_use_the_documented_layouts():
    from mapper import mesh

    assert mesh.VOXEL_RANGE_IJ == (-(2**20), 2**20) and mesh.VOXEL_RANGE_K == (-(2**19), 2**19)
    v = torch.tensor([[-(2**20), 2**20 - 1, -(2**19)], [5, -6, 2**19 - 1], [0, 0, 0]])
    axis = torch.tensor([2, 0, 1])
    keys = mesh.edge_keys(v, axis)
    rows = zip(v.tolist(), [2, 0, 1], strict=True)
    expect = [(i << 43) + ((j + 2**20) << 22) + ((k + 2**19) << 2) + a for (i, j, k), a in rows]
    assert keys.tolist() == expect
    back, ax = mesh.decode_edge_keys(keys)
    assert torch.equal(back, v) and ax.tolist() == [2, 0, 1]
    blocks = torch.tensor([[-3, 4, 5], [2**18, -(2**18), 0]])
    assert torch.equal(mesh.block_keys(blocks), K.voxel_keys(blocks))
    assert torch.equal(mesh.decode_block_keys(mesh.block_keys(blocks)), blocks)


@pytest.mark.parametrize(
    "max_dense_cells, far", [(1 << 26, False), (0, False), (1 << 26, True)], ids=["bitmap", "sort", "wide"]
)
def test_unique_voxels_equals_a_python_set_in_key_order(max_dense_cells, far):
    """Every path (dense bitmap over the box, key sort, the sort for a box over the bitmap's size) gives the
    distinct rows in i-major order, as a plain Python set sorted by coordinates; the old import path
    (integrators.common) is the same function."""
    from mapper.integrators.common import unique_voxels as via_common

    g = torch.Generator().manual_seed(3)
    ijk = torch.randint(-40, 40, (3000, 3), generator=g)
    if far:
        ijk = torch.cat((ijk, torch.tensor([[-(2**19), 5, 2**19 - 1]])))
    ijk = torch.cat((ijk, ijk[:500]))  # duplicates
    got = K.unique_voxels(ijk, max_dense_cells=max_dense_cells)
    assert got.dtype == torch.int64 and got.shape[1] == 3
    assert got.tolist() == [list(r) for r in sorted({tuple(r) for r in ijk.tolist()})]
    assert K.unique_voxels(ijk[:0]).shape == (0, 3)
    assert via_common is K.unique_voxels

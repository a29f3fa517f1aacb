"""Sparse 3-D convolution (mapper.nn) against independent float64 references.

Oracles (they never call the library's convolution or lookups): a brute-force gather per voxel through a
Python dict of coordinates, and a dense NumPy convolution on a crop (inactive voxels are zeros; a
submanifold convolution is the dense one read at the active voxels). Error bound of the issue: maximum
absolute error <= 1e-5 x the output's scale (max |y|). The Triton kernel runs in the interpreter on the CPU
(``backend`` fixture), on small cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapper import IndexGrid
from mapper.errors import InvalidArgument, InvalidArgumentType
from mapper.nn import SparseConv3d, sparse_conv3d

WIDTHS = (16, 32, 64, 128)


@pytest.fixture(autouse=True)
def _exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# --------------------------------------------------------------------------------------------- oracles
def brute_force(ijk: np.ndarray, x: np.ndarray, w: np.ndarray, out_ijk=None, mode="subm") -> np.ndarray:
    """float64 per-voxel gather. ``mode``: ``subm`` (k odd, centred), ``down`` (k = 2, out = coarse
    voxels, inputs 2c + o), ``up`` (out = fine voxels, input its parent, weight of its parity)."""
    rows = {tuple(p): i for i, p in enumerate(ijk.tolist())}
    x, w = x.astype(np.float64), w.astype(np.float64)
    k = w.shape[0]
    out_ijk = ijk if out_ijk is None else out_ijk
    y = np.zeros((len(out_ijk), w.shape[4]))
    for o, p in enumerate(out_ijk.tolist()):
        if mode == "up":
            j = rows.get(tuple(v >> 1 for v in p))
            if j is not None:
                y[o] = x[j] @ w[p[0] & 1, p[1] & 1, p[2] & 1]
            continue
        for a in range(k):
            for b in range(k):
                for c in range(k):
                    if mode == "subm":
                        q = (p[0] + a - k // 2, p[1] + b - k // 2, p[2] + c - k // 2)
                    else:
                        q = (2 * p[0] + a, 2 * p[1] + b, 2 * p[2] + c)
                    j = rows.get(q)
                    if j is not None:
                        y[o] += x[j] @ w[a, b, c]
    return y


def dense_conv(ijk: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 dense 3x3x3 convolution (zero padding) of the crop holding ``ijk``, read at ``ijk``."""
    lo = ijk.min(0) - 1
    r = ijk - lo
    dims = r.max(0) + 2
    vol = np.zeros((*dims, x.shape[1]))
    vol[r[:, 0], r[:, 1], r[:, 2]] = x
    out = np.zeros((*(dims - 2), w.shape[4]))
    for a in range(3):
        for b in range(3):
            for c in range(3):
                sl = vol[a : a + dims[0] - 2, b : b + dims[1] - 2, c : c + dims[2] - 2]
                out += np.tensordot(sl, w[a, b, c].astype(np.float64), axes=([3], [0]))
    return out[r[:, 0] - 1, r[:, 1] - 1, r[:, 2] - 1]


def assert_close(y: torch.Tensor, ref: np.ndarray, tol=1e-5):
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(y.detach().double().cpu().numpy() - ref).max())
    assert err <= tol * scale, f"max abs error {err:.3e} > {tol} x scale {scale:.3e}"


def random_grid(n: int, extent: int, seed: int) -> IndexGrid:
    g = torch.Generator().manual_seed(seed)
    return IndexGrid.from_ijk(torch.randint(-extent, extent, (n, 3), generator=g))


def features(n: int, c_in: int, c_out: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c_in, generator=g)
    w = torch.randn(k, k, k, c_in, c_out, generator=g) / (c_in * k**3) ** 0.5
    return x, w


# ------------------------------------------------------------------------------- forward vs oracles
@pytest.mark.parametrize("c", WIDTHS)
def test_submanifold_matches_brute_force_random_grid(backend, c):
    # the interpreter runs the Triton kernel: keep its grid small
    grid = random_grid(350 if backend == "triton" else 6000, 5 if backend == "triton" else 14, seed=c)
    x, w = features(grid.num_voxels, c, c, 3, seed=c)
    out, y = sparse_conv3d(grid, x, w)
    assert out is grid and y.shape == (grid.num_voxels, c) and y.dtype == torch.float32
    assert_close(y, brute_force(grid.ijk.numpy(), x.numpy(), w.numpy()))


def test_odd_widths_and_pointwise_kernel(backend):
    grid = random_grid(500, 6, seed=3)
    for c_in, c_out, k in ((3, 5, 3), (1, 40, 3), (20, 7, 1)):
        x, w = features(grid.num_voxels, c_in, c_out, k, seed=c_in)
        b = torch.linspace(-1, 1, c_out)
        _, y = sparse_conv3d(grid, x, w, bias=b)
        assert_close(y, brute_force(grid.ijk.numpy(), x.numpy(), w.numpy()) + b.double().numpy())


@pytest.fixture(scope="module")
def real_grids(request):
    """TSDF grids of a real LiDAR scan (norlab, 0.2 m) and a real depth frame (3DMatch, 0.05 m)."""
    from conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    from mapper import Map
    from mapper.datasets import NorlabLidar, SevenScenesSequence

    out = {}
    ds = NorlabLidar(SHARED_DATA / "norlab_lidar")
    m = Map(0.2, layers=("tsdf",), device="cpu")
    m.integrate_lidar(ds[0]["points"], ds[0]["T_world_sensor"])
    out["lidar"] = m.layer("tsdf")
    rs = SevenScenesSequence(SHARED_DATA / "3dmatch_seq01")  # real Kinect depth (Replica: 3x slower)
    m = Map(0.05, layers=("tsdf",), device="cpu", max_range_m=4.0)
    f = rs[0]
    m.integrate_depth(f["depth_m"], f["K"], f["T_world_sensor"])
    out["depth"] = m.layer("tsdf")
    return out


def crop(grid: IndexGrid, n_max: int) -> IndexGrid:
    """The grid's voxels in a box around its first voxel holding at most ~n_max voxels."""
    ijk = grid.ijk.to(torch.int64)
    centre = ijk[grid.num_voxels // 2]
    d = (ijk - centre).abs().amax(1)
    r = int(torch.sort(d).values[min(n_max, grid.num_voxels) - 1])
    return grid.pruned_grid(d < r)


@pytest.mark.parametrize("kind", ["lidar", "depth"])
@pytest.mark.parametrize("c", WIDTHS)
def test_submanifold_on_real_map_grids_matches_dense_numpy(real_grids, kind, c):
    grid, data = real_grids[kind]
    assert grid.num_voxels > 20_000
    part = crop(grid, 6000 if c <= 32 else 2500)
    # features: the TSDF value and weight, then seeded noise
    tsdf = grid.inject_to(part, data["tsdf"].float())
    x, w = features(part.num_voxels, c, c, 3, seed=c)
    x[:, 0], x[:, 1] = tsdf, grid.inject_to(part, data["weight"].float()) / 10
    out, y = sparse_conv3d(part, x, w)
    ref = dense_conv(part.ijk.numpy().astype(np.int64), x.numpy(), w.numpy())
    assert_close(y, ref)


def test_triton_on_a_real_map_crop(real_grids, backend):
    grid, _ = real_grids["lidar"]
    with (
        pytest.MonkeyPatch.context() as mp
    ):  # crop with the torch ops (the interpreter on 1e5 voxels: minutes)
        mp.setenv("MAPPER_KERNELS", "torch")
        part = crop(grid, 400)
        part = IndexGrid.from_ijk(part.ijk)
    x, w = features(part.num_voxels, 32, 16, 3, seed=5)
    _, y = sparse_conv3d(part, x, w)
    assert_close(y, dense_conv(part.ijk.numpy().astype(np.int64), x.numpy(), w.numpy()))


def test_results_are_bit_identical_run_to_run(backend):
    grid = random_grid(400, 5, seed=9)
    x, w = features(grid.num_voxels, 16, 32, 3, seed=9)
    y1 = sparse_conv3d(grid, x, w)[1]
    y2 = sparse_conv3d(IndexGrid(grid.leaves), x.clone(), w.clone())[1]  # a new grid: maps rebuilt
    assert torch.equal(y1, y2)


def test_neighbour_map_is_cached_on_the_grid():
    from mapper.nn.conv import conv_plan

    grid = random_grid(300, 5, seed=1)
    _, m1, _ = conv_plan(grid, 3)
    _, m2, _ = conv_plan(grid, 3)
    assert m1 is m2
    assert conv_plan(IndexGrid(grid.leaves), 3)[1] is not m1
    # the mask of every row lists exactly its present offsets, rows sorted by mask
    bits = ((m1.masks[None, :] >> torch.arange(27)[:, None].int()) & 1).bool()
    assert torch.equal(bits, m1.nbr >= 0)
    assert bool((m1.masks[1:] >= m1.masks[:-1]).all())


def test_cpu_lookup_equals_ijk_to_index():
    from mapper.nn.conv import _lookup

    grid = random_grid(2000, 20, seed=4)
    g = torch.Generator().manual_seed(0)
    q = torch.cat((torch.randint(-22, 22, (5000, 3), generator=g), grid.ijk.long()[:100]))
    q = torch.cat((q, torch.tensor([[1 << 21, 0, 0], [-(1 << 22), 0, 0]])))
    assert torch.equal(_lookup(grid, q).long(), grid.ijk_to_index(q))


# ----------------------------------------------------------------------------- strided and transposed
def test_strided_and_transposed_round_trip_restores_the_grid(backend):
    grid = random_grid(800, 9, seed=11)
    x, w = features(grid.num_voxels, 16, 32, 2, seed=11)
    coarse, yc = sparse_conv3d(grid, x, w, stride=2)
    cijk = coarse.ijk.numpy()
    assert np.array_equal(np.unique(grid.ijk.numpy() >> 1, axis=0), np.unique(cijk, axis=0))
    assert_close(yc, brute_force(grid.ijk.numpy(), x.numpy(), w.numpy(), out_ijk=cijk, mode="down"))
    _, wt = features(1, 32, 16, 2, seed=12)
    fine, yf = sparse_conv3d(coarse, yc, wt, stride=2, transposed=True)
    assert fine is grid and yf.shape == (grid.num_voxels, 16)
    ref = brute_force(cijk, yc.detach().numpy(), wt.numpy(), out_ijk=grid.ijk.numpy(), mode="up")
    assert_close(yf, ref)
    # without a recorded fine grid: the full refinement; an explicit out_grid wins
    lone = IndexGrid(coarse.leaves)
    assert sparse_conv3d(lone, yc, wt, stride=2, transposed=True)[0].num_voxels == 8 * coarse.num_voxels
    assert sparse_conv3d(lone, yc, wt, stride=2, transposed=True, out_grid=grid)[0] is grid


# -------------------------------------------------------------------------------------------- autograd
@pytest.mark.parametrize("mode", ["subm", "down", "up"])
def test_gradcheck_float64(mode):
    grid = random_grid(25, 2, seed=21)
    stride, k, transposed, g_in = (1, 3, False, grid) if mode == "subm" else (2, 2, mode == "up", grid)
    if mode == "up":
        g_in, _ = sparse_conv3d(grid, torch.zeros(grid.num_voxels, 1, dtype=torch.float64),
                                torch.zeros(2, 2, 2, 1, 1, dtype=torch.float64), stride=2)  # fmt: skip
    x, w = features(g_in.num_voxels, 3, 2, k, seed=22)
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return sparse_conv3d(g_in, x, w, b, stride=stride, transposed=transposed)[1]

    assert torch.autograd.gradcheck(f, (x, w, b), eps=1e-6, atol=1e-8, fast_mode=True)


def test_float32_gradients_match_float64(backend):
    grid = random_grid(400, 5, seed=31)
    x, w = features(grid.num_voxels, 16, 16, 3, seed=31)
    grads = []
    for dt in (torch.float32, torch.float64):
        xx, ww = x.to(dt).clone().requires_grad_(), w.to(dt).clone().requires_grad_()
        bb = torch.zeros(16, dtype=dt, requires_grad=True)
        y = sparse_conv3d(grid, xx, ww, bb)[1]
        (y * torch.linspace(-1, 1, 16, dtype=dt)).sum().backward()
        grads.append((xx.grad, ww.grad, bb.grad))
    for g32, g64 in zip(*grads, strict=True):
        assert_close(g32, g64.numpy())


def test_module_forward_and_backward():
    grid = random_grid(300, 5, seed=41)
    net = SparseConv3d(4, 8)
    down = SparseConv3d(8, 16, kernel_size=2, stride=2)
    up = SparseConv3d(16, 8, kernel_size=2, stride=2, transposed=True)
    x = torch.randn(grid.num_voxels, 4)
    g1, h = net(grid, x)
    g2, h2 = down(g1, torch.relu(h))
    g3, h3 = up(g2, h2)
    assert g3 is grid and h3.shape == (grid.num_voxels, 8)
    h3.sum().backward()
    for m in (net, down, up):
        assert m.weight.grad is not None and m.bias.grad is not None and bool(m.weight.grad.abs().sum() > 0)
    assert "transposed=True" in repr(up)
    with pytest.raises(InvalidArgument, match="kernel_size"):
        SparseConv3d(4, 4, kernel_size=3, stride=2)
    with pytest.raises(InvalidArgument, match="in_channels"):
        SparseConv3d(0, 4)


def test_empty_grid():
    grid = IndexGrid.empty()
    _, y = sparse_conv3d(grid, torch.zeros(0, 16), torch.zeros(3, 3, 3, 16, 8))
    assert y.shape == (0, 8)
    c, yc = sparse_conv3d(grid, torch.zeros(0, 16), torch.zeros(2, 2, 2, 16, 8), stride=2)
    assert c.num_voxels == 0 and yc.shape == (0, 8)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_clear_errors():
    grid = random_grid(100, 4, seed=51)
    n = grid.num_voxels
    x, w = features(n, 8, 8, 3, seed=51)
    cases = [
        (dict(grid="grid"), InvalidArgumentType, "grid: expected an IndexGrid"),
        (dict(x=x.numpy()), InvalidArgumentType, "x: expected a torch.Tensor"),
        (dict(x=x.half()), InvalidArgumentType, "x: expected dtype"),
        (dict(x=x.int()), InvalidArgumentType, "x: expected dtype"),
        (dict(x=x[:-1]), InvalidArgument, r"x: expected shape \[grid.num_voxels"),
        (dict(x=x[:, :, None]), InvalidArgument, "x: expected shape"),
        (
            dict(x=torch.empty(n, 8, device="meta")),
            InvalidArgument,
            "x: expected a tensor on the grid's device",
        ),
        (dict(weight=w.double()), InvalidArgumentType, "weight: dtype"),
        (dict(weight=w[:, :, :, :4]), InvalidArgument, "C_in=4 does not match"),
        (dict(weight=w[:2, :2, :2]), InvalidArgument, "weight: expected shape"),
        (dict(weight=w[0]), InvalidArgument, "weight: expected shape"),
        (dict(stride=3), InvalidArgument, "stride"),
        (dict(stride=True), InvalidArgument, "stride"),
        (dict(stride=2), InvalidArgument, "weight: expected shape"),  # k = 3 with stride 2
        (dict(transposed=True), InvalidArgument, "transposed"),
        (dict(transposed=1), InvalidArgumentType, "transposed"),
        (dict(bias=torch.zeros(7)), InvalidArgument, r"bias: expected shape \[8\]"),
        (dict(bias=[0.0] * 8), InvalidArgumentType, "bias"),
        (dict(bias=torch.zeros(8, dtype=torch.float64)), InvalidArgumentType, "bias: dtype"),
        (dict(out_grid=grid), InvalidArgument, "out_grid"),
    ]
    for kw, err, msg in cases:
        args = dict(grid=grid, x=x, weight=w)
        args.update(kw)
        with pytest.raises(err, match=msg):
            sparse_conv3d(**args)
    # features of another grid (same size by chance is not detectable; a different size is)
    other = random_grid(100, 9, seed=52)
    with pytest.raises(InvalidArgument, match="one row per voxel"):
        sparse_conv3d(other, torch.zeros(other.num_voxels + 1, 8), w)


# ------------------------------------------------------------------------------------------- spconv
def test_matches_spconv_when_installed():
    spconv = pytest.importorskip("spconv.pytorch", reason="spconv is benchmark-only (extra 'bench')")
    grid = random_grid(3000, 12, seed=61)
    x, w = features(grid.num_voxels, 16, 16, 3, seed=61)
    ijk = grid.ijk
    lo = ijk.amin(0)
    ind = torch.cat((torch.zeros_like(ijk[:, :1]), ijk - lo), 1).int()
    t = spconv.SparseConvTensor(x, ind, ((ijk - lo).amax(0) + 1).tolist(), 1)
    m = spconv.SubMConv3d(16, 16, 3, bias=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spconv 2.3.8's CPU build returned wrong sums with 2 threads here (NOTES.md)
    try:
        with torch.no_grad():
            m.weight.copy_(w.permute(4, 0, 1, 2, 3))
            ref = m(t).features
    finally:
        torch.set_num_threads(threads)
    _, y = sparse_conv3d(grid, x, w)
    assert_close(y, ref.double().numpy())


# ----------------------------------------------------------------------------------------- on a device
def test_on_device_matches_brute_force_for_every_width(device):
    """On CUDA: the compiled Triton kernel (forward and input gradient) on every width, bit-identical
    run to run; on the CPU: the torch path."""
    grid = random_grid(2500, 10, seed=71).to(device)
    ijk = grid.ijk.cpu().numpy()
    for c in WIDTHS:
        x, w = features(grid.num_voxels, c, c, 3, seed=c)
        xd, wd = x.to(device).clone().requires_grad_(), w.to(device)
        _, y = sparse_conv3d(grid, xd, wd)
        assert_close(y, brute_force(ijk, x.numpy(), w.numpy()))
        assert torch.equal(y, sparse_conv3d(grid, xd, wd)[1])
        (y * y).sum().backward()  # dL/dx = conv^T(2 y): check against the float64 brute force
        wt = np.flip(w.numpy(), (0, 1, 2)).transpose(0, 1, 2, 4, 3)
        assert_close(xd.grad, brute_force(ijk, 2 * y.detach().cpu().double().numpy(), wt))
    x, w = features(grid.num_voxels, 32, 64, 2, seed=72)
    coarse, yc = sparse_conv3d(grid, x.to(device), w.to(device), stride=2)
    cijk = coarse.ijk.cpu().numpy()
    assert_close(yc, brute_force(ijk, x.numpy(), w.numpy(), out_ijk=cijk, mode="down"))
    fine, yf = sparse_conv3d(coarse, yc, w.transpose(3, 4).contiguous().to(device), stride=2, transposed=True)
    assert fine is grid
    ref = brute_force(cijk, yc.detach().cpu().numpy(), w.transpose(3, 4).numpy(), out_ijk=ijk, mode="up")
    assert_close(yf, ref)


def test_triton_tile_shapes_agree(backend):
    """Every tile shape (with and without skipping the offsets absent from a tile) gives the same sums up
    to rounding; the default shape per width is what ``tile_config`` says."""
    if backend != "triton":
        pytest.skip("Triton kernel only")
    from mapper.kernels import sparse_conv as sc
    from mapper.kernels import triton_sparse_conv as tsc
    from mapper.nn.conv import conv_plan

    grid = random_grid(300, 5, seed=81)
    _, cmap, _ = conv_plan(grid, 3)
    x, w = features(grid.num_voxels, 24, 40, 3, seed=81)
    wf = w.reshape(27, 24, 40)
    ref = brute_force(grid.ijk.numpy(), x.numpy(), w.numpy())
    assert tsc.tile_config(24, 40) == (*tsc.TILES[64][:2], 32, *tsc.TILES[64][3:])
    for cfg in ((16, 16, 16, 1, True), (32, 64, 32, 4, False), (64, 32, 16, 2, True)):
        assert_close(tsc.conv_forward_triton(x, wf, cmap, config=cfg), ref)
    assert_close(sc.conv_forward_torch(x, wf, cmap), ref)

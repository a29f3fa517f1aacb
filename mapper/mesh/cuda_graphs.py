"""CUDA graphs (:mod:`mapper.graphs`) for meshes: a short brick list (an incremental mesh) is launch-bound, so
its marching cubes replays one graph per power-of-two bucket of the list, and a short delta replays one graph
from the changed bricks to the mesh; longer lists (full meshes) run eagerly."""

from __future__ import annotations

import functools

import torch

from .. import graphs
from ..kernels.dispatch import compiled, triton_twin
from ..layers import BrickLayer
from .tables import _tables
from .types import Mesh

GRAPH_MIN_BRICKS = 64  # the smallest bucket
GRAPH_MAX_BRICKS = 2048  # longer lists run eagerly (GPU-bound there; bounds the graphs' memory)
GRAPH_TRI_PER_BRICK = 32  # triangle capacity per bucket brick; a list with more runs eagerly
GRAPH_PAGES = 1024  # pool pages a graph's tables hold (2^24 bricks at 16 k per page); more run eagerly
# deltas: one graph from the changed bricks to the mesh, per bucket of the changed-brick count
GRAPH_MAX_CHANGED = 2048  # more changed bricks: the eager path (a depth frame at 5 cm: 700-1100)
# capacities per changed brick of a bucket (a room's depth frame at 5 cm: ~3 blocks and ~23 triangles per
# changed brick); a delta that does not fit replays the next bucket (twice the capacity)
GRAPH_BLOCKS_PER_CHANGED = 4  # blocks (the 27-neighbourhoods, present and unique)
GRAPH_TRI_PER_CHANGED = 32  # triangles
GRAPH_LEAVES = 1 << 19  # grid leaves the graphs' copy of the grid holds (shared by the buckets)
_BIG = 1 << 62
_SENTINEL = (1 << 63) - 1


def _mc_graph_inputs(key, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A bucket's static inputs, holding an empty list (no cell reads a page)."""
    mb, _with_color = key
    table, count = _tables(dev)
    i64 = torch.int64
    return (
        torch.zeros((mb, 3), dtype=i64, device=dev),
        torch.full((mb, 27), -1, dtype=i64, device=dev),
        torch.zeros(1, dtype=i64, device=dev),
        torch.full((GRAPH_PAGES + 1,), _BIG, dtype=i64, device=dev),
        *(torch.zeros(GRAPH_PAGES, dtype=i64, device=dev) for _ in range(4)),
        torch.ones(1, dtype=torch.float64, device=dev),
        table.to(torch.int32).reshape(-1).contiguous(),
        count.to(torch.int32).contiguous(),
    )


def _mc_graph_fn(key, *inputs):
    mb, with_color = key
    fn = triton_twin("triton_mesh:marching_cubes_static_triton")
    out = fn(*inputs, tri_cap=mb * GRAPH_TRI_PER_BRICK, with_color=with_color)
    return _mesh_outputs(out, inputs[0], torch.zeros(2, dtype=torch.int64, device=inputs[0].device))


MC_GRAPHS = graphs.GraphedOp("marching_cubes", _mc_graph_fn, _mc_graph_inputs, max_graphs=16)


@functools.cache
def _grid_buffers(dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The delta graphs' copy of a layer's grid and slot table (shared by every bucket: replays take turns
    under the op's lock, each filling it first): leaf keys (padded with the largest key: the graph finds
    leaves by a binary search of them, no tile index), slot table."""
    return (
        torch.full((GRAPH_LEAVES,), _SENTINEL, dtype=torch.int64, device=dev),
        torch.full((GRAPH_LEAVES, 8), -1, dtype=torch.int32, device=dev),
    )


def _delta_graph_inputs(key, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A delta bucket's static inputs, holding no changed brick."""
    cb, with_color = key
    return (
        torch.full((cb,), -1, dtype=torch.int64, device=dev),
        *_grid_buffers(dev),
        *_mc_graph_inputs((1, with_color), dev)[3:],
    )


def _delta_graph_fn(key, *inputs):
    cb, with_color = key
    fn = triton_twin("triton_mesh:changed_mesh_static_triton")
    out = fn(
        *inputs,
        m_cap=cb * GRAPH_BLOCKS_PER_CHANGED,
        tri_cap=cb * GRAPH_TRI_PER_CHANGED,
        with_color=with_color,
    )
    return _delta_outputs(out)


def _delta_outputs(out) -> tuple[torch.Tensor, ...]:
    """``changed_mesh_static_triton``'s outputs as :func:`_mesh_outputs`' (inside the graph)."""
    *mc, req, sizes = out
    return _mesh_outputs((*mc, sizes[:5]), req, sizes[5:])


DELTA_GRAPHS = graphs.GraphedOp("mesh_delta", _delta_graph_fn, _delta_graph_inputs, max_graphs=16)


def _graph_buckets(largest: int = GRAPH_MAX_BRICKS) -> list[int]:
    b, out = GRAPH_MIN_BRICKS, []
    while b <= largest:
        out.append(b)
        b *= 2
    return out


def warm_graphs(layer: BrickLayer) -> int:
    """Capture the marching-cubes graphs a TSDF layer's meshes use (every bucket; called by the map's
    warm-up, so no capture happens mid-sequence); returns how many are ready (0 where graphs don't apply)."""
    dev = layer.device
    if not (graphs.enabled(dev) and compiled(dev)):
        return 0
    with_color = "color" in layer.pool.fields and "color_weight" in layer.pool.fields
    n = sum(MC_GRAPHS.warm((mb, with_color), dev) for mb in _graph_buckets())
    return n + sum(DELTA_GRAPHS.warm((cb, with_color), dev) for cb in _graph_buckets(GRAPH_MAX_CHANGED))


def _mesh_graphed(layer, s: float, req: torch.Tensor, nbr: torch.Tensor, with_color: bool, partial: bool):
    """The mesh of ``req`` (as ``_mesh_blocks``) from a graph replay of the marching cubes and the block
    bookkeeping (one read-back: the sizes), or None where graphs do not apply (CPU, interpreter,
    ``MAPPER_CUDA_GRAPHS=0``, a list outside the buckets, too many pages, more triangles than the bucket
    holds, a brick out of the edge-key range): the caller runs the eager op (and raises on the range)."""
    dev = req.device
    m = req.shape[0]
    if not (0 < m <= GRAPH_MAX_BRICKS and graphs.enabled(dev) and compiled(dev)):
        return None
    pool = layer.pool
    if pool.page_start_table().numel() - 1 > GRAPH_PAGES:
        return None
    mb = graphs.bucket(m, GRAPH_MIN_BRICKS)

    def fill(inp):
        inp[0][:m].copy_(req)
        inp[1][:m].copy_(nbr)
        inp[1][m:].fill_(-1)
        inp[2].fill_(m)
        _fill_pool(inp[3:9], pool, s, with_color)

    with MC_GRAPHS.run((mb, with_color), dev, fill) as out:
        return _graph_mesh(out, layer, s, with_color, partial, mb * GRAPH_TRI_PER_BRICK)


def _graph_mesh(out, layer, s: float, with_color: bool, partial: bool, tri_cap: int, since=None, sizes=None):
    """The :class:`Mesh` of a mesh graph's outputs (:func:`_mesh_outputs`: the arrays packed over a bucket,
    then the sizes), copied out of the static buffers in four copies; None when they overflowed (more
    triangles than ``tri_cap``, or more blocks than a delta bucket holds) or a brick is outside the
    edge-key range (the caller runs the eager path, which raises on the range). One read-back: ``sizes``
    (as a list, read here if None). Serves both graphs: the marching cubes over a brick list and the delta
    from changed bricks. The arrays are views of the copies (each contiguous)."""
    i64, pn, col, faces, sizes_t = out
    n_tri, nv, nb, nr, bad, _n_req, over = sizes_t.tolist() if sizes is None else sizes
    if over or bad or n_tri > tri_cap:
        return None
    mb = (i64.numel() - pn.shape[1] - 1) // 7  # blocks 3 mb, offsets mb + 1, removed 3 mb, then the keys
    head = 7 * mb + 1
    ints = i64[: head + nv].clone()
    pn = pn[:, :nv].clone()
    removed = ints[4 * mb + 1 : 4 * mb + 1 + 3 * (nr if partial else 0)].view(-1, 3)
    return Mesh(
        vertices=pn[0],
        faces=faces[:n_tri].clone(),
        normals=pn[1],
        colors=col[:nv].clone() if with_color else None,
        vertex_keys=ints[head:],
        blocks=ints[: 3 * nb].view(nb, 3),
        block_face_offsets=ints[3 * mb : 3 * mb + nb + 1],
        removed_blocks=removed,
        version=layer.version,
        full=not partial,
        since_version=since,
        voxel_size_m=s,
    )


def _mesh_outputs(mc_out, req: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inside a graph: ``marching_cubes_static_triton``'s outputs over the ``[Mb]`` blocks ``req`` packed
    for :func:`_graph_mesh` (few copies out): int64 ``[7 Mb + 1 + K]`` = block coordinates ``[Mb, 3]``
    (rows with faces), face offsets from 0 ``[Mb + 1]``, removed block coordinates ``[Mb, 3]``, edge keys
    ``[K]`` (last: a copy of the first ``7 Mb + 1 + V`` entries holds them all); float32 ``[2, K, 3]``
    positions and normals; uint8 ``[K, 3]`` colours; int32 ``[F, 3]`` faces; int64 ``[7]`` sizes:
    triangles, vertices, blocks, removed blocks, out of the key range, then ``extra`` (int64 ``[2]``: a
    delta's block count and overflow flag; zeros otherwise)."""
    _fc, keys, pos, nrm, col, faces, blocks, offsets, removed, sizes = mc_out
    zero = torch.zeros(1, dtype=torch.int64, device=req.device)
    i64 = torch.cat(
        (
            req.index_select(0, blocks).reshape(-1),
            zero,
            offsets,
            req.index_select(0, removed).reshape(-1),
            keys,
        )
    )
    return i64, torch.stack((pos, nrm)), col, faces.to(torch.int32), torch.cat((sizes, extra))


class _FillCache:
    """What was last written into graph input buffers (by identity), so a replay refills only what
    changed: a pool's page tables change when it grows (new tensors, never written in place), the voxel
    size never; a buffer of leaf keys keeps the padding above the longest grid written so far. Bounded
    (the eager fallback fills fresh buffers each call)."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._d: dict[int, tuple] = {}

    def same(self, buf: torch.Tensor, what: tuple) -> bool:
        """True when ``buf`` last got ``what`` (compared element by element with ``is`` / ``==``)."""
        got = self._d.get(id(buf))
        if got is None or got[0] is not buf or len(got[1]) != len(what):
            return False
        return all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(got[1], what, strict=True)
        )

    def put(self, buf: torch.Tensor, what: tuple) -> None:
        if len(self._d) >= self.limit:
            self._d.clear()
        self._d[id(buf)] = (buf, what)

    def clear(self) -> None:
        self._d.clear()


_FILLED = _FillCache()


def _fill_pool(inp, pool, s: float, with_color: bool) -> None:
    """Write a pool's page-start table (padded), page tables and the voxel size into a graph's inputs,
    unless they hold them already (the pool did not grow since this bucket's last fill)."""
    starts = pool.page_start_table()
    names = ("tsdf", "weight", "color", "color_weight") if with_color else ("tsdf", "weight")
    tables = tuple(pool.page_table(name) for name in names)
    what = (starts, *tables, float(s))
    if _FILLED.same(inp[0], what):
        return
    n_pages = starts.numel() - 1
    inp[0][: n_pages + 1].copy_(starts)
    inp[0][n_pages + 1 :].fill_(_BIG)
    for i, t in enumerate(tables):
        inp[1 + i][:n_pages].copy_(t)
    inp[5].fill_(s)
    _FILLED.put(inp[0], what)


def _mesh_since_graphed(layer, s: float, since: int, changed: torch.Tensor, with_color: bool):
    """``mesh_since`` (no brick removed since ``since``; ``changed``: bool ``[L, 8]``) from one graph replay:
    the changed bricks' neighbourhoods, their lookup, marching cubes and the block bookkeeping. Reads back
    the changed-brick count and, after the replay, the sizes. None where graphs do not apply (see
    :func:`_mesh_graphed`; also more than ``GRAPH_MAX_CHANGED`` changed bricks, more blocks or triangles
    than the bucket holds, a grid over the graphs' copy): the caller runs the eager path."""
    dev = layer.device
    if not (graphs.enabled(dev) and compiled(dev)):
        return None
    n_leaves = layer.grid.num_leaves
    if n_leaves == 0 or n_leaves > GRAPH_LEAVES or layer.pool.page_start_table().numel() - 1 > GRAPH_PAGES:
        return None
    cpos = changed.reshape(-1).nonzero().squeeze(1)  # the changed-brick count: one read-back
    c = cpos.numel()
    if not 0 < c <= GRAPH_MAX_CHANGED:
        return None
    cb = graphs.bucket(c, GRAPH_MIN_BRICKS)
    fill = _delta_fill(layer, s, cpos, with_color)
    while True:
        with DELTA_GRAPHS.run((cb, with_color), dev, fill) as out:
            sizes = out[-1].tolist()  # the one read-back after the replay
            mesh = _graph_mesh(out, layer, s, with_color, True, cb * GRAPH_TRI_PER_CHANGED, since, sizes)
        if mesh is not None or sizes[4] or cb >= GRAPH_MAX_CHANGED:
            return mesh  # None: a brick outside the key range (the eager path raises) or too big
        cb *= 2  # more blocks or triangles than the bucket holds: the next one holds twice as many


def _delta_fill(layer, s: float, cpos: torch.Tensor, with_color: bool):
    """The ``fill`` of a delta graph's inputs: changed bricks (padded with -1), the grid's leaf keys (padded
    with the largest key), its slot table, the pool (:func:`_fill_pool`)."""
    grid, c = layer.grid, cpos.numel()
    n_leaves = grid.num_leaves

    def fill(inp):
        inp[0][:c].copy_(cpos)
        inp[0][c:].fill_(-1)
        keys = inp[1]
        keys[:n_leaves].copy_(grid.leaves.keys)
        prev = _LEAF_FILL.get(id(keys))
        written = keys.numel() if prev is None or prev[0] is not keys else prev[1]
        if written > n_leaves:  # rows a longer grid wrote (or unknown): the padding again
            keys[n_leaves:written].fill_(_SENTINEL)
        if len(_LEAF_FILL) > 16:
            _LEAF_FILL.clear()
        _LEAF_FILL[id(keys)] = (keys, n_leaves)
        inp[2][:n_leaves].copy_(layer.slots)
        _fill_pool(inp[3:9], layer.pool, s, with_color)

    return fill


# a leaf-key buffer's id -> (the buffer, leaves written into it): the rows past them hold the padding
_LEAF_FILL: dict[int, tuple[torch.Tensor, int]] = {}

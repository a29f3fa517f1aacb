"""Triangle meshes of a TSDF layer by marching cubes: sparse, vectorised, incremental by brick.

**Cells.** A cell is the cube between 8 voxel centres ``(i..i+1, j..j+1, k..k+1)``; it belongs to the
*block* (= brick, ``min corner >> 2``) of its min corner and is meshed only when all 8 corners are observed
(weight > 0). A corner is *inside* when ``tsdf <= 0`` (the sign rule of :mod:`mapper.surface`).

**The case table** is generated here, not copied: for each of the 256 inside/outside patterns, every cube
face gets marching-squares segments between its sign-changing edges. A face with two inside corners on a
diagonal is ambiguous; the fixed, face-local rule is to **cut off the face's corners (0, 0) and (1, 1)**
(face-local axes = the two other world axes in increasing order), whatever their sign. Both cells sharing
the face see the same corners, so they make the same choice (no cracks), and the rule does not depend on
the sign, so complementary cases give the same surface with opposite orientation. Each segment is directed
so that the surface normal points to the outside (``tsdf > 0``, free space); the directed segments chain
into closed loops and each loop is triangulated as a fan from the lowest-numbered vertex whose diagonals
do not lie in a cube face.

**Vertices** sit on lattice edges (linear interpolation between the two voxel centres) and are welded by an
int64 *edge key* of (min voxel, axis), so the mesh is watertight where the surface is. Normals are the
TSDF gradient (central differences, one-sided where a neighbour is unobserved) at both voxel centres,
interpolated along the edge and normalised; colours are interpolated the same way when the layer has them.

**Canonical order.** Blocks sorted by block key (brick i, j, k), faces inside a block by cell (in-brick
offset order), then by the table; vertices sorted by edge key. Equal surfaces give equal arrays, which is
what makes ``apply_delta(prev, mesh_since(...))`` checkable against a full :func:`extract_mesh`.

**Incremental.** A cell reads its 8 corners and, for the normals, the 6-neighbours of its edges' end
voxels: up to 2 voxels below and 1 above its min corner on each axis. So a change in brick ``b`` can alter
the cells of the 27 bricks ``b + {-1, 0, 1}^3`` (not only the lower neighbours); :func:`mesh_since`
re-meshes exactly those blocks.

**Key ranges.** An edge key has 64 bits for (i, j, k, axis): i and j get 21 bits, k 20, the axis 2. Meshing
works for voxel coordinates ``-2^20 <= i, j < 2^20 - 4`` (the whole map range) and ``-2^19 <= k < 2^19 - 4``
(z is up in this project's worlds; ``InvalidArgument`` otherwise).

**Files.** ``tables.py`` the generated case table; ``keys.py`` block and edge keys; ``types.py`` the
:class:`Mesh` type; ``build.py`` extraction (:func:`extract_mesh`); ``cuda_graphs.py`` the CUDA-graph replays
of short lists and deltas; ``incremental.py`` :func:`mesh_since`; ``delta.py`` :func:`apply_delta`. This
module re-exports their names (``from mapper.mesh import X`` keeps working).
"""

from __future__ import annotations

from .build import (
    _assemble as _assemble,
)
from .build import (
    _check_key_range as _check_key_range,
)
from .build import (
    _check_layer as _check_layer,
)
from .build import (
    _check_voxel_size as _check_voxel_size,
)
from .build import (
    _mesh_blocks as _mesh_blocks,
)
from .build import (
    extract_mesh,
    neighbour_slots,
)
from .cuda_graphs import (
    _BIG as _BIG,
)
from .cuda_graphs import (
    _SENTINEL as _SENTINEL,
)
from .cuda_graphs import (
    DELTA_GRAPHS,
    GRAPH_BLOCKS_PER_CHANGED,
    GRAPH_LEAVES,
    GRAPH_MAX_BRICKS,
    GRAPH_MAX_CHANGED,
    GRAPH_MIN_BRICKS,
    GRAPH_PAGES,
    GRAPH_TRI_PER_BRICK,
    GRAPH_TRI_PER_CHANGED,
    MC_GRAPHS,
    warm_graphs,
)
from .cuda_graphs import (
    _delta_fill as _delta_fill,
)
from .cuda_graphs import (
    _delta_graph_fn as _delta_graph_fn,
)
from .cuda_graphs import (
    _delta_graph_inputs as _delta_graph_inputs,
)
from .cuda_graphs import (
    _delta_outputs as _delta_outputs,
)
from .cuda_graphs import (
    _fill_pool as _fill_pool,
)
from .cuda_graphs import (
    _graph_buckets as _graph_buckets,
)
from .cuda_graphs import (
    _graph_mesh as _graph_mesh,
)
from .cuda_graphs import (
    _mc_graph_fn as _mc_graph_fn,
)
from .cuda_graphs import (
    _mc_graph_inputs as _mc_graph_inputs,
)
from .cuda_graphs import (
    _mesh_graphed as _mesh_graphed,
)
from .cuda_graphs import (
    _mesh_outputs as _mesh_outputs,
)
from .cuda_graphs import (
    _mesh_since_graphed as _mesh_since_graphed,
)
from .delta import _member as _member
from .delta import _merge_positions as _merge_positions
from .delta import apply_delta
from .incremental import _offsets27 as _offsets27
from .incremental import affected_blocks, mesh_since
from .keys import (
    VOXEL_RANGE_IJ,
    VOXEL_RANGE_K,
    block_keys,
    decode_block_keys,
    decode_edge_keys,
    edge_keys,
)
from .keys import (
    _sorted_unique_blocks as _sorted_unique_blocks,
)
from .tables import CORNER_OFFSETS, EDGE_AXIS, EDGE_CORNERS, EDGE_MIN_OFFSET, case_table
from .tables import _tables as _tables
from .types import ARRAY_FIELDS, Mesh, empty_mesh
from .types import _check_mesh as _check_mesh

__all__ = [
    "ARRAY_FIELDS",
    "CORNER_OFFSETS",
    "DELTA_GRAPHS",
    "EDGE_AXIS",
    "EDGE_CORNERS",
    "EDGE_MIN_OFFSET",
    "GRAPH_BLOCKS_PER_CHANGED",
    "GRAPH_LEAVES",
    "GRAPH_MAX_BRICKS",
    "GRAPH_MAX_CHANGED",
    "GRAPH_MIN_BRICKS",
    "GRAPH_PAGES",
    "GRAPH_TRI_PER_BRICK",
    "GRAPH_TRI_PER_CHANGED",
    "MC_GRAPHS",
    "VOXEL_RANGE_IJ",
    "VOXEL_RANGE_K",
    "Mesh",
    "affected_blocks",
    "apply_delta",
    "block_keys",
    "case_table",
    "decode_block_keys",
    "decode_edge_keys",
    "edge_keys",
    "empty_mesh",
    "extract_mesh",
    "mesh_since",
    "neighbour_slots",
    "warm_graphs",
]

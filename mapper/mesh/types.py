"""The :class:`Mesh` type (a full mesh or a delta), the empty mesh and the argument check of a mesh."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import InvalidArgument, InvalidArgumentType

ARRAY_FIELDS = (
    "vertices",
    "faces",
    "normals",
    "colors",
    "vertex_keys",
    "blocks",
    "block_face_offsets",
    "removed_blocks",
)


@dataclass(eq=False)
class Mesh:
    """A triangle mesh of the TSDF zero level set, or a delta of one (see :func:`mesh_since`).

    Tensors live on the layer's device.

    Attributes:
        vertices: float32 ``[V, 3]`` positions in metres.
        faces: int32 ``[F, 3]`` vertex indices, counter-clockwise seen from free space.
        normals: float32 ``[V, 3]`` unit normals pointing to free space.
        colors: uint8 ``[V, 3]`` RGB, or None when the layer has no colour.
        vertex_keys: int64 ``[V]`` edge key of each vertex (sorted; -1 for meshes read from files).
        blocks: int64 ``[B, 3]`` bricks that own at least one face, sorted by block key.
        block_face_offsets: int64 ``[B + 1]``: the faces of block b are ``faces[off[b]:off[b + 1]]``.
        removed_blocks: int64 ``[R, 3]`` bricks covered by this mesh that have no face (a delta's consumer
            drops what it had there); empty for full meshes.
        version: the layer version the mesh shows.
        full: True when the mesh covers the whole layer (replace, don't patch).
        since_version: for a delta, the version it is relative to; None otherwise.
        voxel_size_m: voxel edge in metres (0.0 when unknown).
    """

    vertices: torch.Tensor
    faces: torch.Tensor
    normals: torch.Tensor
    colors: torch.Tensor | None
    vertex_keys: torch.Tensor
    blocks: torch.Tensor
    block_face_offsets: torch.Tensor
    removed_blocks: torch.Tensor
    version: int = 0
    full: bool = True
    since_version: int | None = None
    voxel_size_m: float = 0.0

    @property
    def num_vertices(self) -> int:
        return int(self.vertices.shape[0])

    @property
    def num_faces(self) -> int:
        return int(self.faces.shape[0])

    @property
    def device(self) -> torch.device:
        return self.vertices.device

    @property
    def has_blocks(self) -> bool:
        """Whether the faces are partitioned into blocks (meshes from files are not)."""
        return int(self.block_face_offsets[-1]) == self.num_faces

    def face_blocks(self) -> torch.Tensor:
        """int64 ``[F]``: the index (into ``blocks``) of each face's block."""
        counts = self.block_face_offsets[1:] - self.block_face_offsets[:-1]
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    def to(self, device: str | torch.device) -> Mesh:
        dev = torch.device(device)
        return replace(
            self, **{k: None if (t := getattr(self, k)) is None else t.to(dev) for k in ARRAY_FIELDS}
        )

    def equals(self, other: Mesh) -> bool:
        """Exact equality of every array (bitwise for floats; ``colors`` None on both or equal) and of the
        version."""
        if not isinstance(other, Mesh) or self.version != other.version:
            return False
        for k in ARRAY_FIELDS:
            a, b = getattr(self, k), getattr(other, k)
            if a is None or b is None:
                if a is not b:
                    return False
            elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b.to(a.device)):
                return False
        return True

    def __repr__(self) -> str:
        kind = "full" if self.full else f"delta since {self.since_version}"
        return (
            f"Mesh(vertices={self.num_vertices}, faces={self.num_faces}, blocks={self.blocks.shape[0]}, "
            f"removed_blocks={self.removed_blocks.shape[0]}, version={self.version}, {kind})"
        )


def empty_mesh(device: torch.device, with_color: bool, version: int = 0, voxel_size_m: float = 0.0) -> Mesh:
    z = torch.zeros
    return Mesh(
        vertices=z((0, 3), dtype=torch.float32, device=device),
        faces=z((0, 3), dtype=torch.int32, device=device),
        normals=z((0, 3), dtype=torch.float32, device=device),
        colors=z((0, 3), dtype=torch.uint8, device=device) if with_color else None,
        vertex_keys=z(0, dtype=torch.int64, device=device),
        blocks=z((0, 3), dtype=torch.int64, device=device),
        block_face_offsets=z(1, dtype=torch.int64, device=device),
        removed_blocks=z((0, 3), dtype=torch.int64, device=device),
        version=version,
        voxel_size_m=voxel_size_m,
    )


def _check_mesh(name: str, m) -> None:
    if not isinstance(m, Mesh):
        raise InvalidArgumentType(f"{name}: expected a Mesh, got {type(m).__name__}")
    if not m.has_blocks:
        raise InvalidArgument(f"{name}: the mesh has no block structure (read from a file?)")

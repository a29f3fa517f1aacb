"""Sharded maps: which shard owns a point, which shards a frame can touch, what a shard keeps.

A sharded map is K ordinary maps ("shards"). Ownership is by the index grid's root tiles (32 voxels on a
side, ``voxel >> 5``), grouped into square columns of ``block_tiles x block_tiles`` tiles in x and y (all
heights): block ``(bx, by) = floor(tile_xy / block_tiles)`` belongs to shard ``mix(bx, by) mod K`` (a fixed
integer hash, below). Each shard integrates the whole of every frame it receives and then keeps only the
bricks within ``halo_m`` of its own blocks (:meth:`ShardSpec.keep_bricks`); ``halo_m`` covers the ESDF
max distance, the TSDF truncation and the query/mesh neighbourhoods, so a shard's answers for points it
owns equal those of one unsharded map fed the same frames (``Map(shard=...)``, tests/test_sharding.py,
tests/test_cluster_ray.py). The cluster's ingress routes frames with :func:`shards_touching` and gathers
reads with :func:`owner_of_points` / :func:`owner_of_bricks`.

Depends only on torch (used by ``mapper.map`` below the API and by ``mapper.cluster`` above it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .errors import InvalidArgument, InvalidArgumentType

TILE_VOXELS = 32  # a root tile of the index grid (mapper.grid: voxel >> 5)
BRICK_VOXELS = 4
_M32 = 0xFFFFFFFF


def mix(bx: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """A fixed 32-bit integer hash of block coordinates (int64 tensors, any shape) -> int64 in [0, 2^32).
    Part of the on-disk meaning of a sharded map: never change it."""
    h = (bx * 0x9E3779B1 + by * 0x85EBCA77) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) & _M32
    return h ^ (h >> 15)


def shard_of_blocks(bx: torch.Tensor, by: torch.Tensor, count: int) -> torch.Tensor:
    """int64 shard of each block ``(bx, by)``."""
    return mix(bx.long(), by.long()) % count


def block_of_points(points_m: torch.Tensor, voxel_size_m: float, block_tiles: int) -> torch.Tensor:
    """int64 ``[N, 2]`` block ``(bx, by)`` of world points ``[N, >=2]`` (metres): the block of the tile of
    the fine voxel that contains them."""
    p = points_m[:, :2].to(torch.float64)
    vox = torch.floor(p / voxel_size_m).long()
    return torch.div(vox, TILE_VOXELS * block_tiles, rounding_mode="floor")


def owner_of_points(points_m, voxel_size_m: float, count: int, block_tiles: int) -> torch.Tensor:
    """int64 ``[N]``: the shard that owns each world point ``[N, 3]`` (metres; torch or numpy)."""
    p = torch.as_tensor(points_m)
    if p.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    b = block_of_points(p.reshape(-1, p.shape[-1]), voxel_size_m, block_tiles)
    return shard_of_blocks(b[:, 0], b[:, 1], count)


def owner_of_bricks(bricks: torch.Tensor, count: int, block_tiles: int) -> torch.Tensor:
    """int64 ``[B]``: the shard that owns each fine-voxel brick ``[B, 3]`` (brick = voxel >> 2; a brick
    lies in one tile, so its voxels share an owner)."""
    vox = bricks[:, :2].long() * BRICK_VOXELS
    b = torch.div(vox, TILE_VOXELS * block_tiles, rounding_mode="floor")
    return shard_of_blocks(b[:, 0], b[:, 1], count)


def shards_touching(lo_m, hi_m, voxel_size_m: float, count: int, block_tiles: int) -> list[int]:
    """The shards owning a block that meets the box ``[lo_m, hi_m]`` (x, y; metres), sorted."""
    block_m = TILE_VOXELS * block_tiles * voxel_size_m
    b0 = [math.floor(float(lo_m[a]) / block_m) for a in range(2)]
    b1 = [math.floor(float(hi_m[a]) / block_m) for a in range(2)]
    nx, ny = b1[0] - b0[0] + 1, b1[1] - b0[1] + 1
    if nx * ny > 4 * count * count + 64:  # a box over many blocks: every shard is in it in practice
        return list(range(count))
    bx = torch.arange(b0[0], b1[0] + 1, dtype=torch.int64)
    by = torch.arange(b0[1], b1[1] + 1, dtype=torch.int64)
    gx, gy = torch.meshgrid(bx, by, indexing="ij")
    return sorted({int(s) for s in shard_of_blocks(gx.reshape(-1), gy.reshape(-1), count).tolist()})


def halo_for(config: dict) -> float:
    """The halo (metres) a shard of a map with this ``Map.config()`` keeps around its own blocks so that its
    answers there are exact: the ESDF max distance (its sites), plus two ESDF bricks (the ESDF's brick
    domain and the trilinear neighbours of a query), plus the TSDF truncation and two voxels (trilinear
    TSDF queries and marching-cubes cells at a block border)."""
    s = float(config["voxel_size_m"])
    h = (float(config.get("truncation_vox", 3.0)) + 2) * s
    if "esdf" in config.get("layers", ()):
        es = float(config.get("esdf_voxel_size_m") or max(s, 0.05))
        h += float(config.get("esdf_max_distance_m", 2.0)) + 2 * BRICK_VOXELS * es
    return h


def default_block_tiles(voxel_size_m: float, halo_m: float) -> int:
    """Tiles per block edge: a block at least 4 halos wide (so that a shard keeps little beyond its own
    blocks: ~(1 + 2 halo / block)^2 of them) and at least 8 m."""
    tile_m = TILE_VOXELS * voxel_size_m
    return max(1, math.ceil(max(4 * halo_m, 8.0) / tile_m))


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a sharded map: the ``shard`` argument of :class:`mapper.Map` (``config()["shard"]``).

    Attributes:
        index: this shard's number, ``0 <= index < count``.
        count: K, the number of shards of the map.
        block_tiles: root tiles per block edge (blocks are the unit of ownership).
        halo_m: the margin (metres, x/y) around its own blocks a shard keeps (:func:`halo_for`).
        map_id, name: the sharded map's id and name (labels the cluster groups shards by).
    """

    index: int
    count: int
    block_tiles: int
    halo_m: float
    map_id: str = ""
    name: str = ""

    @classmethod
    def from_dict(cls, d) -> ShardSpec:
        if isinstance(d, ShardSpec):
            return d
        if not isinstance(d, dict):
            raise InvalidArgumentType(f"shard: expected a dict, got {type(d).__name__}")
        unknown = set(d) - {"index", "count", "block_tiles", "halo_m", "map_id", "name"}
        if unknown:
            raise InvalidArgument(f"shard: unknown keys {sorted(unknown)}")
        try:
            spec = cls(
                index=_int(d, "index"),
                count=_int(d, "count"),
                block_tiles=_int(d, "block_tiles"),
                halo_m=float(d["halo_m"]),
                map_id=str(d.get("map_id", "")),
                name=str(d.get("name", "")),
            )
        except KeyError as e:
            raise InvalidArgument(f"shard: {e.args[0]} is required") from None
        if spec.count < 1 or not 0 <= spec.index < spec.count:
            raise InvalidArgument(f"shard: index {spec.index} is not in 0..count-1 (count {spec.count})")
        if spec.block_tiles < 1:
            raise InvalidArgument(f"shard: block_tiles must be >= 1, got {spec.block_tiles}")
        if not (math.isfinite(spec.halo_m) and spec.halo_m >= 0):
            raise InvalidArgument(f"shard: halo_m must be a finite number >= 0, got {spec.halo_m}")
        return spec

    def to_dict(self) -> dict:
        return asdict(self)

    def keeps(self, points_m: torch.Tensor, voxel_size_m: float, margin_m: float = 0.0) -> torch.Tensor:
        """bool ``[N]``: whether the square ``|x - px|, |y - py| <= halo_m + margin_m`` around each point
        ``[N, >=2]`` meets a block this shard owns (samples closer than a block apart along each axis,
        so every block the square meets is looked at)."""
        h = self.halo_m + margin_m
        block_m = TILE_VOXELS * self.block_tiles * voxel_size_m
        n = math.ceil(2 * h / block_m) + 2
        offs = torch.linspace(-h, h, n, dtype=torch.float64, device=points_m.device)
        p = points_m[:, :2].to(torch.float64)
        keep = torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)
        for dx in offs:
            for dy in offs:
                q = p + torch.stack((dx, dy))
                b = block_of_points(q, voxel_size_m, self.block_tiles)
                keep |= shard_of_blocks(b[:, 0], b[:, 1], self.count) == self.index
        return keep

    def keep_bricks(self, bricks: torch.Tensor, brick_m: float, voxel_size_m: float) -> torch.Tensor:
        """bool ``[B]``: the bricks (``[B, 3]`` brick coordinates of edge ``brick_m``) that meet the halo of
        this shard's blocks (a brick wholly outside is dropped after each frame)."""
        centre = (bricks[:, :2].to(torch.float64) + 0.5) * brick_m
        return self.keeps(centre, voxel_size_m, margin_m=0.5 * brick_m)


def _int(d: dict, key: str) -> int:
    x = d[key]
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidArgumentType(f"shard: {key} must be an int, got {type(x).__name__}")
    return x

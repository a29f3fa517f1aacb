"""API schemas (pydantic), separate from the library's types."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..store import NAME_PATTERN

Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Coord = Annotated[float, Field(strict=True, ge=-1e6, le=1e6, allow_inf_nan=False)]  # metres; +-1000 km
Vec3 = Annotated[list[Coord], Field(min_length=3, max_length=3)]
LayerName = Literal["tsdf", "color", "occupancy", "esdf"]
MapId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class ErrorBody(BaseModel):
    type: str
    detail: str


class OccupancyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    l_hit: Annotated[float, Field(strict=True, gt=0, le=10, allow_inf_nan=False)] | None = None
    l_miss: Annotated[float, Field(strict=True, lt=0, ge=-10, allow_inf_nan=False)] | None = None
    clamp_min: Annotated[float, Field(strict=True, lt=0, ge=-50, allow_inf_nan=False)] | None = None
    clamp_max: Annotated[float, Field(strict=True, gt=0, le=50, allow_inf_nan=False)] | None = None


class RegistrationParams(BaseModel):
    """Tracking of LiDAR frames sent without a pose (``mapper.registration.OdometryConfig``)."""

    model_config = ConfigDict(extra="forbid")
    max_range_m: Annotated[float, Field(strict=True, gt=0, le=1000.0, allow_inf_nan=False)] | None = Field(
        None, description="default: the map's max_range_m"
    )
    min_range_m: Annotated[float, Field(strict=True, ge=0, le=1000.0, allow_inf_nan=False)] | None = None
    voxel_size_m: Annotated[float, Field(strict=True, ge=0.01, le=20.0, allow_inf_nan=False)] | None = Field(
        None, description="local registration map voxel; default max_range_m / 100"
    )
    max_points_per_voxel: Annotated[int, Field(strict=True, ge=1, le=64)] | None = None
    initial_threshold_m: Annotated[float, Field(strict=True, gt=0, le=100.0, allow_inf_nan=False)] | None = (
        None
    )
    max_iterations: Annotated[int, Field(strict=True, ge=1, le=500)] | None = None


class MapCreate(BaseModel):
    """A new map. Unset parameters take the service defaults (``MAPPER_DEFAULT_*``) or the library's."""

    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=NAME_PATTERN)] | None = Field(
        None, description="unique among the service's maps (409 otherwise); default: the id"
    )
    voxel_size_m: Annotated[float, Field(strict=True, ge=0.005, le=10.0, allow_inf_nan=False)] | None = None
    layers: Annotated[list[LayerName], Field(min_length=1, max_length=4)] | None = None
    truncation_vox: Annotated[float, Field(strict=True, ge=1.0, le=32.0, allow_inf_nan=False)] | None = None
    esdf_max_distance_m: Annotated[float, Field(strict=True, gt=0, le=50.0, allow_inf_nan=False)] | None = (
        None
    )
    max_range_m: Annotated[float, Field(strict=True, gt=0, le=1000.0, allow_inf_nan=False)] | None = None
    tsdf_max_weight: Annotated[float, Field(strict=True, gt=0, le=1e4, allow_inf_nan=False)] | None = None
    tsdf_obs_weight: Annotated[float, Field(strict=True, gt=0, le=1e3, allow_inf_nan=False)] | None = None
    esdf_voxel_size_m: Annotated[float, Field(strict=True, ge=0.005, le=10.0, allow_inf_nan=False)] | None = (
        Field(None, description="the ESDF's own voxel (>= voxel_size_m); default max(voxel_size_m, 0.05)")
    )
    occupancy: OccupancyParams | None = None
    registration: RegistrationParams | None = None
    keep_radius_m: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] | None = Field(
        None, description="radius policy: free the bricks wholly farther than this from each frame's sensor"
    )
    memory_budget_bytes: Annotated[int, Field(gt=0, le=1 << 50)] | None = Field(
        None, description="this map's memory budget (507 beyond it); default MAPPER_MAP_MEMORY_BUDGET_BYTES"
    )
    shards: Annotated[int, Field(strict=True, ge=1, le=1024)] | None = Field(
        None,
        description="mapper serve --ray only: split the map over this many map workers by root-tile blocks "
        "(at most the number of workers; README 'Sharded maps'); 1 or unset: an ordinary map",
    )
    shard_block_m: Annotated[float, Field(strict=True, gt=0, le=1e5, allow_inf_nan=False)] | None = Field(
        None,
        description="with shards: the edge of a block of root tiles (the unit of ownership); default "
        "max(4 halos, 8 m)",
    )


class MapSummary(BaseModel):
    id: str
    name: str
    created: str | None = None
    config: dict
    frames_integrated: int
    version: int
    last_seq: int = Field(description="sequence number of the last operation in the write-ahead log")
    queue_depth: int
    memory_bytes: int | None = Field(None, description="bytes the map's layers hold")
    memory_budget_bytes: int | None = Field(None, description="the map's memory budget")


class MapList(BaseModel):
    maps: list[MapSummary]


class SnapshotInfo(BaseModel):
    map_id: str
    seq: int = Field(description="the last write-ahead log sequence number the snapshot contains")
    bytes: int
    version: int | None = None


class MapDetail(MapSummary):
    stats: dict
    snapshot: SnapshotInfo | None = None


class Ack(BaseModel):
    seq: int
    map_version: int
    points_used: int
    points_dropped: int
    integrate_ms: float
    frame_id: str | None = None
    T_world_sensor: list[float] | None = Field(
        None, description="LiDAR frames: the pose used (16 numbers, row-major 4x4), estimated if not sent"
    )
    registration: dict | None = Field(
        None,
        description="LiDAR frames sent without a pose: ICP statistics of the estimate (iterations, "
        "converged, correspondences, fitness, rmse_m)",
    )


class OpResult(BaseModel):
    seq: int
    map_version: int
    bricks_freed: dict = Field(default_factory=dict)


class ClearRequest(BaseModel):
    """Remove voxels in the box ``[aabb_min, aabb_max]``, or outside a sphere, or (no fields) all."""

    model_config = ConfigDict(extra="forbid")
    aabb_min: Vec3 | None = None
    aabb_max: Vec3 | None = None
    keep_center_m: Vec3 | None = Field(None, description="with keep_radius_m: clear everything outside")
    keep_radius_m: Annotated[float, Field(strict=True, gt=0, le=1e7, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.aabb_min is None) != (self.aabb_max is None):
            raise ValueError("aabb_min and aabb_max go together")
        if (self.keep_center_m is None) != (self.keep_radius_m is None):
            raise ValueError("keep_center_m and keep_radius_m go together")
        if self.aabb_min is not None and self.keep_center_m is not None:
            raise ValueError("give a box or a sphere, not both")
        if self.aabb_min is not None and any(
            a > b for a, b in zip(self.aabb_min, self.aabb_max, strict=True)
        ):
            raise ValueError("aabb_min must be <= aabb_max on every axis")
        return self


class DecayRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    factor: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] = 0.5
    threshold: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False, le=1e6)] = 0.05


class BoxRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    aabb_min: Vec3
    aabb_max: Vec3

    @model_validator(mode="after")
    def _check(self):
        if any(a >= b for a, b in zip(self.aabb_min, self.aabb_max, strict=True)):
            raise ValueError("aabb_min must be < aabb_max on every axis")
        return self


POINTS_SCHEMA = {
    "type": "array",
    "items": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3},
    "minItems": 1,
}
QUERY_BODY = {
    "requestBody": {
        "required": True,
        "description": '`{"points": [[x, y, z], ...]}` in JSON, or msgpack with points as a wire array '
        "(float32/float64 [M, 3]). Metres, world frame.",
        "content": {
            "application/json": {
                "schema": {"type": "object", "required": ["points"], "properties": {"points": POINTS_SCHEMA}}
            },
        },
    }
}
FRAME_BODY = {
    "requestBody": {
        "required": True,
        "description": "One frame: msgpack (`application/msgpack`, arrays as {dtype, shape, data}) or JSON "
        "with nested lists. See mapper/wire.py. A LiDAR frame may omit T_world_sensor: the map then "
        "registers the scan and the ack carries the pose it used.",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["kind"],
                    "properties": {
                        "kind": {"type": "string", "enum": ["lidar", "depth"]},
                        "points": {
                            "type": "array",
                            "items": {
                                "type": "array",
                                "items": {"type": "number"},
                                "minItems": 3,
                                "maxItems": 4,
                            },
                        },
                        "T_world_sensor": {
                            "type": "array",
                            "items": {"type": "number"},
                            "minItems": 16,
                            "maxItems": 16,
                        },
                        "timestamp": {"type": "number"},
                        "frame_id": {"type": "string"},
                        "depth": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        "depth_scale": {"type": "number"},
                        "K": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4},
                    },
                }
            },
        },
    }
}
IMPORT_BODY = {
    "requestBody": {
        "required": True,
        "description": "A snapshot file as downloaded from GET /v1/maps/{id}/export (safetensors).",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}

"""Service settings: environment variables with the ``MAPPER_`` prefix (pydantic-settings).

``MAPPER_HOST``, ``MAPPER_PORT``, ``MAPPER_DATA_DIR``, ``MAPPER_STORE`` (``s3://bucket/prefix``: snapshots +
WAL in an object store, ``MAPPER_S3_ENDPOINT_URL`` for MinIO), ``MAPPER_DEVICE`` (``auto`` = CUDA when
available), ``MAPPER_API_TOKENS`` (comma-separated bearer tokens with full access), ``MAPPER_READ_TOKENS``
(read-only tokens), ``MAPPER_METRICS_TOKEN`` (a bearer token for ``/metrics`` only), limits
(``MAPPER_MAX_BODY_BYTES``, ``MAPPER_MAX_POSE_TRANSLATION_M``, ...), the connection edge
(``MAPPER_HEADER_TIMEOUT_S``, ``MAPPER_BODY_TIMEOUT_S``, ``MAPPER_MAX_CONNECTIONS[_PER_CLIENT]``, ...;
``mapper.api.edge``), ``MAPPER_SNAPSHOT_INTERVAL_S``, ``MAPPER_FOXGLOVE_PORT``/``MAPPER_FOXGLOVE_HOST``, the
default map parameters and ``MAPPER_SHUTDOWN_GRACE_S``. ``mapper serve`` reads them; its flags override them.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .errors import InvalidArgument

KiB = 1 << 10
MiB = 1 << 20


def _split_tokens(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    return [str(t).strip() for t in value if str(t).strip()]


class Settings(BaseSettings):
    """Everything the service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="MAPPER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Path("mapper-data")
    device: str = "auto"
    api_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    read_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list)
    metrics_token: str | None = None  # scrapers: /metrics then needs it (or an API/read token)
    log_level: str = "info"

    # limits
    max_body_bytes: int = Field(64 * MiB, gt=0)
    max_import_bytes: int = Field(2048 * MiB, gt=0)
    max_points_per_frame: int = Field(2_000_000, gt=0)
    max_image_pixels: int = Field(4_000_000, gt=0)
    max_query_points: int = Field(1_000_000, gt=0)
    max_slice_cells: int = Field(4_000_000, gt=0)
    max_box_voxels: int = Field(8_000_000, gt=0)
    max_maps: int = Field(64, gt=0)
    queue_depth: int = Field(64, gt=0)
    max_batch: int = Field(16, gt=0)
    ws_max_in_flight: int = Field(256, gt=0)
    # permessage-deflate on WebSocket streams (off: LiDAR frames of float32 points shrink by ~8 % for a
    # zlib inflate of every frame on the event loop, ~10 ms per 1.4 MB frame; NOTES.md issue 13)
    ws_compression: bool = False
    # the connection edge (mapper.api.edge, `mapper serve`): a request's headers must be complete within
    # header_timeout_s of its first byte (of the connection for a new one); its body may pause at most
    # body_timeout_s between reads and must average min_body_bytes_per_s after a first body_timeout_s
    # (a slow-loris trickle is closed); connections beyond the caps are refused at once (per client IP:
    # 429, in total: 503; 0 = no cap). Behind a proxy every client has the proxy's address: raise the cap.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    min_body_bytes_per_s: int = Field(16 * KiB, ge=0)  # 0 = no rate floor (the pause limit alone)
    max_connections: int = Field(1024, ge=0)  # also at most half the process's file descriptor limit
    max_connections_per_client: int = Field(64, ge=0)
    max_pose_translation_m: float = Field(1e6, gt=0)  # per axis; also bounded by each map's key range
    # memory (bytes); unset = sized to the machine when the service starts (mapper/budget.py): all maps
    # together 50 % of RAM (60 % of GPU memory with CUDA), one map the same, one read RAM / 32
    memory_budget_bytes: int | None = Field(None, gt=0)
    map_memory_budget_bytes: int | None = Field(None, gt=0)
    max_request_bytes: int | None = Field(None, gt=0)
    # working memory of the heavy operations in flight together (reads, writer batches with their ESDF
    # update); one that does not fit waits (mapper.api.memory.WorkBudget); unset = RAM / 8 (GPU memory / 8
    # with CUDA)
    work_memory_bytes: int | None = Field(None, gt=0)

    # durability
    # where snapshots + WAL live: unset = data_dir (a local or shared filesystem); s3://bucket/prefix = an
    # S3-compatible object store (mapper.objstore; credentials from the usual AWS environment variables)
    store: str | None = None
    s3_endpoint_url: str | None = None  # MinIO or another S3-compatible server; unset = AWS S3
    store_owner: str | None = None  # set by the cluster's map workers (w<i>): the maps they own in the store
    fsync: bool = True
    snapshot_interval_s: float = Field(300.0, ge=0)  # 0 = only on request and at shutdown
    snapshot_wal_bytes: int = Field(1024 * MiB, gt=0)  # also snapshot once the log grows past this
    snapshots_kept: int = Field(2, ge=1)

    # behaviour
    esdf_update: Literal["eager", "lazy"] = "eager"  # eager: before each ack; lazy: on the next query
    query_threads: int = Field(4, gt=0)
    # map writers run this many nice steps below reads (Linux, per thread): reads first when cores are short
    writer_nice: int = Field(5, ge=0, le=19)
    # map writers integrating at once; maps take turns round-robin, one batch each (0 = auto: 2 on a GPU,
    # so that one map's host work overlaps another's kernels on its own stream; cores / 2 on the CPU)
    writer_slots: int = Field(0, ge=0, le=64)
    # threads decoding and validating incoming frames (all maps; 0 = auto: half the cores, 2 to 8), apart
    # from the threads reads use, so that a burst of frames never queues a read's request parsing
    decode_threads: int = Field(0, ge=0, le=64)
    # SIGTERM: streams ack what they took and close within this (then uvicorn waits as long for the
    # HTTP requests still running, then every map is snapshotted); see mapper.api.shutdown
    shutdown_grace_s: float = Field(20.0, gt=0)
    # native heap (glibc): cap the malloc arenas, give free pages back every N s (mapper.api.memory)
    malloc_arena_max: int = Field(2, ge=0)  # 0 = glibc's default (8 per core)
    malloc_trim_s: float = Field(10.0, ge=0)  # 0 = never
    # blocks >= this are mmapped (unmapped at free); 0 = glibc's dynamic threshold. 128 KiB: the request
    # temporaries of 128 KiB-1 MiB left fragmented free space in the arenas at 1 MiB (NOTES #10)
    malloc_mmap_threshold: int = Field(128 * KiB, ge=0, le=32 * MiB)

    # compile the Triton kernels of the default map configuration and of every restored map before
    # /readyz is ready; the Triton cache lives under data_dir/triton-cache unless TRITON_CACHE_DIR is set
    warmup: bool = True

    # outputs: a Foxglove WebSocket server (mapper serve --foxglove-port; mapper.api.routes.viewer) on
    # foxglove_host:foxglove_port (0 = an ephemeral port); unset or empty = none
    foxglove_port: int | None = Field(None, ge=0, le=65535)
    foxglove_host: str = "127.0.0.1"

    # defaults of POST /v1/maps
    default_voxel_size_m: float = Field(0.1, gt=0)
    default_layers: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["tsdf", "esdf"])
    default_max_range_m: float = Field(100.0, gt=0)

    @field_validator("foxglove_port", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("api_tokens", "read_tokens", "default_layers", mode="before")
    @classmethod
    def _comma_list(cls, value):
        return _split_tokens(value)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_tokens or self.read_tokens)

    def check_bind(self) -> None:
        """Refuse to serve a non-loopback address without a token (raises ``InvalidArgument``)."""
        if self.auth_enabled or is_loopback(self.host):
            return
        raise InvalidArgument(
            f"host: refusing to bind {self.host!r} (not loopback) with no MAPPER_API_TOKENS configured"
        )


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

"""Where the durable store of the maps lives: the one interface its backends implement, and the factory
that picks one from the settings.

- the filesystem (default): ``MAPPER_DATA_DIR/maps/<id>/`` (``mapper.persistence``: WAL segments appended
  and fsync'd, snapshots renamed into place);
- an S3-compatible object store: ``MAPPER_STORE=s3://bucket/prefix`` (+ ``MAPPER_S3_ENDPOINT_URL`` for
  MinIO), ``mapper.objstore``: one WAL object per group commit, snapshots published by a manifest.

The service (``mapper.api.service``), recovery (``mapper.store.recover_map``) and the cluster workers only
use the calls below.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from .errors import InvalidArgument
from .objstore import ObjectDataDir
from .persistence import DataDir, Snapshot


class WalLog(Protocol):
    """The open WAL of a map (its writer thread only)."""

    size: int

    def append(self, seq: int, payload: bytes) -> None:
        """Add one record (not yet durable)."""

    def sync(self) -> None:
        """Make every appended record durable; the service acknowledges a batch after this returns."""

    def close(self) -> None:
        """``sync`` and release."""

    def cut(self, size: int, first_seq: int) -> WalLog:
        """After a failed sync: drop what was appended since the log held ``size`` bytes; returns the
        writer to append with from ``first_seq`` on."""


class MapFiles(Protocol):
    """The durable state of one map: ``info``, snapshots, the WAL, quarantined records."""

    root: Path  # a local folder named after the map id (the map itself on the filesystem; a cache on S3)

    @property
    def id(self) -> str: ...

    def write_info(self, info: dict) -> None: ...

    def read_info(self) -> dict: ...

    def snapshots(self) -> list[int]: ...

    def latest_snapshot(self) -> Snapshot | None:
        """The newest published snapshot that can be read; its ``path`` is a local file."""

    def write_snapshot(self, seq: int, tensors: dict[str, torch.Tensor], meta: dict) -> Snapshot:
        """Write and publish a snapshot covering the WAL records ``<= seq``."""

    def prune(self, covered_seq: int, keep: int) -> None:
        """Delete the WAL the snapshot at ``covered_seq`` covers and all but ``keep`` snapshots."""

    def open_wal(self, first_seq: int) -> WalLog: ...

    def replay(self, after_seq: int) -> Iterator[tuple[int, bytes]]:
        """``(seq, payload)`` of the WAL records after ``after_seq``, in order."""

    def quarantine(self, seq: int, payload: bytes, error: str): ...

    def quarantined(self) -> list[dict]: ...

    def wal_bytes(self) -> int: ...

    def remove(self) -> None: ...


class MapStore(Protocol):
    """All maps of one service (``MapService.data``)."""

    def map_dir(self, map_id: str) -> MapFiles: ...

    def map_ids(self) -> list[str]:
        """The maps this service recovers at start."""

    def claim(self, map_id: str, source: str | None = None) -> None:
        """Make ``map_id`` this service's before it is recovered here (a cluster move or adoption)."""


def is_object_store(store: str | None) -> bool:
    return bool(store) and str(store).startswith("s3://")


def open_store(settings, owner: str | None = None) -> MapStore:
    """The store of ``settings``: ``DataDir(settings.data_dir)`` unless ``settings.store`` names an
    object store (checked now: bucket, credentials, endpoint; ``InvalidArgument`` says what is wrong).
    ``owner`` (default ``settings.store_owner``): the cluster worker this service is."""
    store = getattr(settings, "store", None)
    if not store:
        return DataDir(settings.data_dir, fsync=settings.fsync)
    if not is_object_store(store):
        raise InvalidArgument(
            f"store: {str(store)[:200]!r} is not an s3://bucket/prefix URL (unset: the data directory "
            "MAPPER_DATA_DIR)"
        )
    return ObjectDataDir(
        store,
        Path(settings.data_dir) / "store-cache",
        endpoint_url=settings.s3_endpoint_url or None,
        owner=owner if owner is not None else settings.store_owner,
    )

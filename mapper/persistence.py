"""Durable maps: a snapshot (safetensors + JSON metadata) plus a write-ahead log of accepted operations.

Layout of one map under the data directory::

    maps/<id>/info.json                     id, name, created, config (atomic write)
    maps/<id>/snapshot-<seq>.safetensors    tensors of Map.state_dict(); header metadata = the JSON below
    maps/<id>/snapshot-<seq>.json           {"seq", "meta", ...}: written last, it commits the snapshot
    maps/<id>/wal-<first seq>.log           records seq > the snapshot's, appended and fsync'd before acks
    maps/<id>/quarantine/<seq>.msgpack      a record that failed on replay, kept aside (+ <seq>.json: error)

A WAL record is ``MAGIC | length u32 | seq u64 | crc32 u32 | payload`` (little-endian; the CRC covers seq
and payload); the payload is a msgpack operation (``{"op": "frame", "frame": <wire frame>}``, ``clear``,
``decay``, ``clear_outside``). A LiDAR frame sent without a pose is logged with the pose the map estimated
for it and ``"pose_estimated": true`` (the writer registers it before logging), so replay integrates it at
that pose and restores the tracking state exactly, without registering again. A torn last record (a crash
mid-append) fails the length or CRC check and is truncated on recovery. Snapshots are written to a
temporary name, fsync'd, renamed, then committed by the JSON file (also temp + fsync + rename + directory
fsync): a crash at any point leaves the previous snapshot and the log that covers it intact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InvalidArgument

log = logging.getLogger("mapper.persistence")

MAGIC = b"MWAL"
HEADER = struct.Struct("<4sIQI")  # magic, payload length, seq, crc32(seq bytes + payload)
MAX_RECORD = 1 << 31
META_KEY = "mapper"
FORMAT_VERSION = 1
_SNAP_RE = re.compile(r"^snapshot-(\d{16})\.json$")
_WAL_RE = re.compile(r"^wal-(\d{16})\.log$")


# ------------------------------------------------------------------------------------ file helpers
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename (then fsync the directory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def _crc(seq: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<Q", seq)))


def pack_record(seq: int, payload: bytes) -> bytes:
    """One WAL record (header + payload), as every backend stores it."""
    if len(payload) >= MAX_RECORD:
        raise InvalidArgument(f"record: {len(payload)} bytes exceed the log's record limit")
    return HEADER.pack(MAGIC, len(payload), seq, _crc(seq, payload)) + payload


def iter_records(data: bytes, on_bad=None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(seq, payload)`` of the intact records at the start of ``data``; at the first torn or
    corrupt record stop and call ``on_bad(byte offset, reason)``."""
    pos = 0
    n = len(data)
    while pos < n:
        bad = None
        if n - pos < HEADER.size:
            bad = "truncated header"
        else:
            magic, length, seq, crc = HEADER.unpack_from(data, pos)
            end = pos + HEADER.size + length
            if magic != MAGIC:
                bad = "bad magic"
            elif end > n:
                bad = "truncated payload"
            else:
                payload = bytes(data[pos + HEADER.size : end])
                if _crc(seq, payload) != crc:
                    bad = "CRC mismatch"
        if bad:
            if on_bad is not None:
                on_bad(pos, bad)
            return
        yield seq, payload
        pos = end


# ---------------------------------------------------------------------------------------------- WAL
class WalWriter:
    """Append-only log segment. ``append`` buffers, ``sync`` makes everything appended durable."""

    def __init__(self, path: Path, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        new = not path.exists()
        self._f = open(path, "ab")
        if new and fsync:
            os.fsync(self._f.fileno())
            fsync_dir(path.parent)
        self.size = self._f.tell()

    def append(self, seq: int, payload: bytes) -> None:
        rec = pack_record(seq, payload)
        self._f.write(rec)
        self.size += len(rec)

    def sync(self) -> None:
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
            self._f.close()

    def cut(self, size: int, first_seq: int) -> WalWriter:
        """After a failed append or sync: the segment truncated back to ``size`` bytes (what was durable
        before the batch) and a writer that appends after it (``first_seq`` is the next record's seq)."""
        with contextlib.suppress(Exception):
            self.close()
        with contextlib.suppress(Exception):  # close() stops at a failed flush: close the file anyway
            self._f.close()  # (else its buffer could reach the file after the cut)
        with open(self.path, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        return WalWriter(self.path, self.fsync)


def read_wal(path: Path, repair: bool = False) -> Iterator[tuple[int, bytes]]:
    """Yield ``(seq, payload)`` of the intact records of a segment. At the first torn or corrupt record
    reading stops; with ``repair`` the file is truncated there (a crash mid-append leaves such a tail)."""
    with open(path, "rb") as f:
        data = f.read()

    def bad(pos: int, reason: str) -> None:
        log.warning(
            "%s: %s at byte %d of %d; %s", path, reason, pos, len(data), "truncating" if repair else "stop"
        )
        if repair:
            with open(path, "r+b") as f:
                f.truncate(pos)
                f.flush()
                os.fsync(f.fileno())

    yield from iter_records(data, bad)


# ----------------------------------------------------------------------------------------- snapshots
@dataclass
class Snapshot:
    seq: int  # last WAL sequence number the snapshot contains
    path: Path  # the .safetensors file
    meta: dict  # Map.state_dict() metadata (+ "info")


def load_snapshot_file(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a snapshot / export file. Raises ``InvalidArgument`` if it is not one."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InvalidArgument(f"snapshot: not a readable safetensors file ({e})") from None
    return tensors, _parse_meta(header)


def load_snapshot_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
        header_len = struct.unpack_from("<Q", data, 0)[0]
        header = json.loads(data[8 : 8 + header_len]).get("__metadata__", {}) or {}
    except (SafetensorError, ValueError, struct.error, json.JSONDecodeError) as e:
        raise InvalidArgument(f"snapshot: not a readable safetensors file ({e})") from None
    return tensors, _parse_meta(header)


def _parse_meta(header: dict) -> dict:
    raw = header.get(META_KEY)
    if raw is None:
        raise InvalidArgument("snapshot: no mapper metadata in the safetensors header")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"snapshot: metadata is not JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise InvalidArgument("snapshot: metadata lacks the map config")
    return meta


class MapDir:
    """The files of one map. Not thread-safe by itself: the map's writer owns the WAL; snapshot files
    are written by one snapshot job at a time."""

    def __init__(self, root: Path, fsync: bool = True):
        self.root = Path(root)
        self.fsync = fsync

    @property
    def id(self) -> str:
        return self.root.name

    # info
    def write_info(self, info: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.root / "info.json", json.dumps(info, indent=1).encode(), self.fsync)
        if self.fsync:
            fsync_dir(self.root.parent)

    def read_info(self) -> dict:
        return json.loads((self.root / "info.json").read_text())

    # snapshots
    def snapshots(self) -> list[int]:
        seqs = []
        for p in self.root.iterdir():
            m = _SNAP_RE.match(p.name)
            if m and (self.root / f"snapshot-{m.group(1)}.safetensors").exists():
                seqs.append(int(m.group(1)))
        return sorted(seqs)

    def snapshot_path(self, seq: int) -> Path:
        return self.root / f"snapshot-{seq:016d}.safetensors"

    def latest_snapshot(self) -> Snapshot | None:
        """The newest committed snapshot that parses (older ones are fallbacks)."""
        for seq in reversed(self.snapshots()):
            try:
                meta = json.loads((self.root / f"snapshot-{seq:016d}.json").read_text())["meta"]
                return Snapshot(seq, self.snapshot_path(seq), meta)
            except (OSError, ValueError, KeyError) as e:
                log.error("%s: snapshot %d unreadable (%s); trying an older one", self.root, seq, e)
        return None

    def write_snapshot(self, seq: int, tensors: dict[str, torch.Tensor], meta: dict) -> Snapshot:
        """Write and commit a snapshot covering WAL records ``<= seq``."""
        from safetensors.torch import save_file

        meta = {**meta, "wal_seq": seq, "format": FORMAT_VERSION}
        path = self.snapshot_path(seq)
        tmp = path.with_name(f".{path.name}.tmp")
        tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
        if self.fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        marker = {"seq": seq, "meta": meta, "bytes": path.stat().st_size}
        atomic_write(self.root / f"snapshot-{seq:016d}.json", json.dumps(marker).encode(), self.fsync)
        return Snapshot(seq, path, meta)

    def prune(self, covered_seq: int, keep: int) -> None:
        """Delete WAL segments entirely covered by the snapshot at ``covered_seq`` and all but the newest
        ``keep`` snapshots."""
        segs = self.wal_segments()
        for i, (_, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt <= covered_seq + 1:
                path.unlink(missing_ok=True)
        for seq in self.snapshots()[:-keep]:
            (self.root / f"snapshot-{seq:016d}.json").unlink(missing_ok=True)
            self.snapshot_path(seq).unlink(missing_ok=True)
        for p in self.root.glob(".*.tmp"):
            p.unlink(missing_ok=True)

    # WAL
    def wal_segments(self) -> list[tuple[int, Path]]:
        segs = []
        for p in self.root.iterdir():
            m = _WAL_RE.match(p.name)
            if m:
                segs.append((int(m.group(1)), p))
        return sorted(segs)

    def open_wal(self, first_seq: int) -> WalWriter:
        return WalWriter(self.root / f"wal-{first_seq:016d}.log", self.fsync)

    def replay(self, after_seq: int) -> Iterator[tuple[int, bytes]]:
        """WAL records with ``seq > after_seq`` in order; torn tails are truncated."""
        last = after_seq
        for _, path in self.wal_segments():
            for seq, payload in read_wal(path, repair=True):
                if seq <= last:
                    continue
                yield seq, payload
                last = seq

    # quarantine: WAL records that failed on replay, kept aside (the map replays past them)
    def quarantine(self, seq: int, payload: bytes, error: str) -> Path:
        """Keep a record that failed on replay: ``quarantine/<seq>.msgpack`` + ``<seq>.json`` (its error)."""
        qdir = self.root / "quarantine"
        qdir.mkdir(exist_ok=True)
        atomic_write(qdir / f"{seq:016d}.msgpack", payload, self.fsync)
        note = {"seq": seq, "error": error, "bytes": len(payload)}
        atomic_write(qdir / f"{seq:016d}.json", json.dumps(note).encode(), self.fsync)
        return qdir / f"{seq:016d}.msgpack"

    def quarantined(self) -> list[dict]:
        """The notes (``{"seq", "error", "bytes"}``) of the quarantined records, oldest first."""
        qdir = self.root / "quarantine"
        if not qdir.is_dir():
            return []
        notes = []
        for p in sorted(qdir.glob("*.json")):
            try:
                notes.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                notes.append({"seq": p.stem, "error": "unreadable note"})
        return notes

    def wal_bytes(self) -> int:
        return sum(p.stat().st_size for _, p in self.wal_segments())

    def remove(self) -> None:
        """Delete the map's files: rename first (atomic), then remove the tree."""
        gone = self.root.with_name(f".deleted-{self.root.name}")
        os.replace(self.root, gone)
        if self.fsync:
            fsync_dir(self.root.parent)
        shutil.rmtree(gone, ignore_errors=True)


class DataDir:
    """``MAPPER_DATA_DIR``: one folder per map under ``maps/``."""

    def __init__(self, root: Path, fsync: bool = True):
        self.root = Path(root)
        self.fsync = fsync
        (self.root / "maps").mkdir(parents=True, exist_ok=True)
        for p in (self.root / "maps").glob(".deleted-*"):
            shutil.rmtree(p, ignore_errors=True)

    def map_dir(self, map_id: str) -> MapDir:
        return MapDir(self.root / "maps" / map_id, self.fsync)

    def map_ids(self) -> list[str]:
        return sorted(
            p.name
            for p in (self.root / "maps").iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / "info.json").exists()
        )

    def claim(self, map_id: str, source: str | None = None) -> None:
        """Make ``map_id`` one of this directory's maps before it is recovered here (a cluster move or
        adoption): rename ``source`` (another worker's map directory on the same filesystem; atomic) into
        place unless it is already here."""
        target = self.map_dir(map_id).root
        if source is not None and Path(source).exists() and not target.exists():
            os.replace(source, target)

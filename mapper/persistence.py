"""Durable maps: a snapshot (safetensors + JSON metadata) plus a write-ahead log of accepted operations.

Layout of one map under the data directory::

    maps/<id>/info.json                     id, name, created, config (atomic write)
    maps/<id>/snapshot-<seq>.safetensors    tensors of Map.state_dict(); header metadata = the JSON below
    maps/<id>/snapshot-<seq>.json           {"seq", "meta", "bytes", "crc32", "check"}: written last, it
                                            commits the snapshot (crc32: of the .safetensors file, header
                                            metadata and tensor data; check: CRC32 of the manifest itself)
    maps/<id>/wal-<first seq>.log           records seq > the snapshot's, appended and fsync'd before acks
    maps/<id>/quarantine/<seq>.msgpack      a record that failed on replay, kept aside (+ <seq>.json: error)
    maps/<id>/quarantine/wal-<first>-<offset>.bin   damaged WAL bytes cut out of replay (+ .json: note)
    maps/<id>/quarantine/snapshot-<seq>.*   a damaged snapshot moved aside (+ .note.json: why)

A WAL record is ``MAGIC | length u32 | seq u64 | crc32 u32 | payload`` (little-endian; the CRC covers seq
and payload); the payload is a msgpack operation (``{"op": "frame", "frame": <wire frame>}``, ``clear``,
``decay``, ``clear_outside``). A LiDAR frame sent without a pose is logged with the pose the map estimated
for it and ``"pose_estimated": true`` (the writer registers it before logging), so replay integrates it at
that pose and restores the tracking state exactly, without registering again.

Damage (``iter_records``): a record whose magic, length or CRC is wrong, with an intact record after it, is
*damage in the middle*: its bytes are copied to ``quarantine/`` and reported, and reading resumes at the
next intact record (found by scanning for the magic and checking header, length and CRC). Damage with no
intact record after it at the end of the newest segment is a *torn tail* (a crash mid-append) and is
truncated; a complete record with a bad CRC there is quarantined before the cut. Snapshots are written to a
temporary name, fsync'd, read back (CRC32, header), renamed, then committed by the JSON file (also temp +
fsync + rename + directory fsync): a crash at any point leaves the previous snapshot and the log that covers
it intact. The log is kept from the *previous* snapshot on (``prune``), so a snapshot found damaged on
recovery (``open_snapshot``: size, CRC32, manifest check) is quarantined and the map is rebuilt from the
snapshot before it plus the log.
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


TORN = ("truncated header", "truncated payload")  # what a crash mid-append leaves at a log's end


def _record_at(data, pos: int):
    """``(seq, payload, end)`` of the intact record at byte ``pos`` of ``data``, or the reason it is not."""
    n = len(data)
    if n - pos < HEADER.size:
        return "truncated header"
    magic, length, seq, crc = HEADER.unpack_from(data, pos)
    if magic != MAGIC:
        return "bad magic"
    end = pos + HEADER.size + length
    if length >= MAX_RECORD or end > n:
        return "truncated payload"
    payload = bytes(data[pos + HEADER.size : end])
    if _crc(seq, payload) != crc:
        return "CRC mismatch"
    return seq, payload, end


def _resync(data, start: int) -> int | None:
    """Byte offset of the first intact record at or after ``start`` (magic, length and CRC check), or None."""
    p = data.find(MAGIC, start)
    while p != -1:
        if not isinstance(_record_at(data, p), str):
            return p
        p = data.find(MAGIC, p + 1)
    return None


def iter_records(data: bytes, on_damage=None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(seq, payload)`` of every intact record of ``data``, in order. A record that is not intact
    (bad magic, length or CRC) is skipped up to the next intact record (``_resync``) and reported as
    ``on_damage(start, end, reason, tail)``: bytes ``[start, end)`` are lost; ``tail`` is True when no
    intact record follows (``end == len(data)``: the caller decides whether that is a torn tail)."""
    pos = 0
    n = len(data)
    while pos < n:
        rec = _record_at(data, pos)
        if isinstance(rec, str):
            nxt = _resync(data, pos + 1)
            if on_damage is not None:
                on_damage(pos, n if nxt is None else nxt, rec, nxt is None)
            if nxt is None:
                return
            pos = nxt
            continue
        seq, payload, pos = rec
        yield seq, payload


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


def read_wal(path: Path, repair: bool = False, on_damage=None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(seq, payload)`` of the intact records of a segment (``iter_records``: damage in the middle
    is skipped). ``on_damage(start, end, reason, tail, data)`` hears of every damaged range. With ``repair``
    (the newest segment, where a crash mid-append leaves a torn tail) the file is truncated at damage that
    no intact record follows."""
    with open(path, "rb") as f:
        data = f.read()

    def bad(start: int, end: int, reason: str, tail: bool) -> None:
        cut = tail and repair
        log.warning(
            "%s: %s at bytes %d-%d of %d; %s",
            path,
            reason,
            start,
            end,
            len(data),
            "truncating (torn tail)" if cut else "skipped to the next intact record" if not tail else "stop",
        )
        if on_damage is not None:
            on_damage(start, end, reason, tail, data)
        if cut:
            with open(path, "r+b") as f:
                f.truncate(start)
                f.flush()
                os.fsync(f.fileno())

    yield from iter_records(data, bad)


# ----------------------------------------------------------------------------------------- snapshots
@dataclass
class Snapshot:
    seq: int  # last WAL sequence number the snapshot contains
    path: Path  # the .safetensors file
    meta: dict  # Map.state_dict() metadata (+ "info")


class SnapshotDamaged(ValueError):
    """A committed snapshot that cannot be used: its data file is missing, its size or CRC32 differs from
    its manifest's, the manifest does not check, or the file does not load. Recovery quarantines it and
    falls back to the snapshot before it (plus the log)."""


def file_crc32(path: Path) -> int:
    """CRC32 of a file (a snapshot: header metadata and tensor data), read in 4 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest_bytes(seq: int, meta: dict, size: int, crc32: int) -> bytes:
    """The JSON manifest that commits snapshot ``seq``: ``check`` is the CRC32 of the manifest itself (its
    other fields as sorted JSON), so a damaged manifest is told from a valid one."""
    body = {"seq": seq, "meta": meta, "bytes": size, "crc32": crc32}
    check = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    return json.dumps({**body, "check": check}).encode()


def parse_manifest(data: bytes | None, seq: int) -> dict:
    """A snapshot manifest checked (JSON, ``seq``, ``check`` when present); raises ``SnapshotDamaged``.
    Manifests written before checksums (no ``crc32``/``check``) are accepted as they are."""
    if data is None:
        raise SnapshotDamaged("manifest missing")
    try:
        marker = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotDamaged(f"manifest is not JSON ({e})") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("meta"), dict):
        raise SnapshotDamaged("manifest is not a snapshot manifest")
    if "check" in marker:
        body = {k: v for k, v in marker.items() if k != "check"}
        if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != marker["check"]:
            raise SnapshotDamaged("manifest checksum mismatch")
    if marker.get("seq") != seq:
        raise SnapshotDamaged(f"manifest names seq {marker.get('seq')!r}, not {seq}")
    return marker


def verify_snapshot_file(path: Path, marker: dict) -> None:
    """The data file of a snapshot against its manifest (size, CRC32); raises ``SnapshotDamaged``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise SnapshotDamaged(f"{path.name} is missing") from None
    if "bytes" in marker and size != marker["bytes"]:
        raise SnapshotDamaged(f"{path.name}: {size} bytes, the manifest says {marker['bytes']}")
    if "crc32" in marker and file_crc32(path) != marker["crc32"]:
        raise SnapshotDamaged(f"{path.name}: CRC32 differs from the manifest's")


def write_snapshot_data(path: Path, tensors: dict[str, torch.Tensor], meta: dict, fsync: bool) -> tuple:
    """Write a snapshot file (temp name, fsync, read back: header and CRC32, rename); returns its
    ``(size, crc32)``. The read-back is the verification the log's pruning waits for."""
    # lazy: safetensors loads only when a snapshot is written or read
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    try:
        with safe_open(str(tmp), "pt") as f:
            back, names = _parse_meta(f.metadata() or {}), set(f.keys())
    except (SafetensorError, InvalidArgument) as e:
        raise OSError(f"{tmp}: the snapshot just written does not read back ({e})") from None
    if back.get("wal_seq") != meta.get("wal_seq") or names != set(tensors):
        raise OSError(f"{tmp}: the snapshot just written reads back different")
    size, crc = tmp.stat().st_size, file_crc32(tmp)
    os.replace(tmp, path)
    return size, crc


def load_snapshot_file(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a snapshot / export file. Raises ``InvalidArgument`` if it is not one."""
    # lazy: safetensors loads only when a snapshot is written or read
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
    # lazy: safetensors loads only when a snapshot is written or read
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
        """Seqs of the committed snapshots (a manifest exists; its data file may still prove damaged)."""
        seqs = []
        for p in self.root.iterdir():
            m = _SNAP_RE.match(p.name)
            if m:
                seqs.append(int(m.group(1)))
        return sorted(seqs)

    def snapshot_path(self, seq: int) -> Path:
        return self.root / f"snapshot-{seq:016d}.safetensors"

    def manifest(self, seq: int) -> dict:
        """The checked manifest of snapshot ``seq`` (``parse_manifest``); raises ``SnapshotDamaged``."""
        try:
            data = (self.root / f"snapshot-{seq:016d}.json").read_bytes()
        except FileNotFoundError:
            data = None
        return parse_manifest(data, seq)

    def open_snapshot(self, seq: int) -> Snapshot:
        """Committed snapshot ``seq``, verified (manifest check, data size and CRC32). Raises
        ``SnapshotDamaged``; other ``OSError`` (the disk failing to read) propagates."""
        marker = self.manifest(seq)
        path = self.snapshot_path(seq)
        verify_snapshot_file(path, marker)
        return Snapshot(seq, path, marker["meta"])

    def latest_snapshot(self) -> Snapshot | None:
        """The newest committed snapshot that verifies (older ones are fallbacks)."""
        for seq in reversed(self.snapshots()):
            try:
                return self.open_snapshot(seq)
            except SnapshotDamaged as e:
                log.error("%s: snapshot %d damaged (%s); trying an older one", self.root, seq, e)
        return None

    def write_snapshot(self, seq: int, tensors: dict[str, torch.Tensor], meta: dict) -> Snapshot:
        """Write, verify and commit a snapshot covering WAL records ``<= seq``."""
        meta = {**meta, "wal_seq": seq, "format": FORMAT_VERSION}
        path = self.snapshot_path(seq)
        size, crc = write_snapshot_data(path, tensors, meta, self.fsync)
        atomic_write(
            self.root / f"snapshot-{seq:016d}.json", manifest_bytes(seq, meta, size, crc), self.fsync
        )
        return Snapshot(seq, path, meta)

    def quarantine_snapshot(self, seq: int, reason: str) -> dict:
        """Move a damaged snapshot aside: ``quarantine/snapshot-<seq>.safetensors`` and ``.manifest`` (what
        is left of them) + ``snapshot-<seq>.note.json``; returns the note."""
        qdir = self.root / "quarantine"
        qdir.mkdir(exist_ok=True)
        name = f"snapshot-{seq:016d}"
        for src, dst in ((".safetensors", ".safetensors"), (".json", ".manifest")):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.root / (name + src), qdir / (name + dst))
        note = {"kind": "snapshot", "seq": seq, "error": reason}
        atomic_write(qdir / f"{name}.note.json", json.dumps(note).encode(), self.fsync)
        if self.fsync:
            fsync_dir(self.root)
        return note

    def prune(self, covered_seq: int, keep: int) -> None:
        """After the snapshot at ``covered_seq`` was written and verified: keep it and the one before it
        (at least 2 snapshots, else ``keep``) and the WAL from that previous snapshot on, so that a damaged
        newest snapshot can be replaced by the previous one plus the log; delete older snapshots and the
        WAL segments they alone cover."""
        snaps = [s for s in self.snapshots() if s <= covered_seq]
        base = snaps[-2] if len(snaps) >= 2 else 0  # the fallback's seq (0: the map as created)
        segs = self.wal_segments()
        for i, (_, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt <= base + 1:
                path.unlink(missing_ok=True)
        for seq in self.snapshots()[: -max(keep, 2)]:
            (self.root / f"snapshot-{seq:016d}.json").unlink(missing_ok=True)
            self.snapshot_path(seq).unlink(missing_ok=True)
        for p in self.root.glob(".*.tmp"):
            if p.is_file():
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

    def replay(self, after_seq: int, damage: list | None = None) -> Iterator[tuple[int, bytes]]:
        """WAL records with ``seq > after_seq`` in order (segments wholly before ``after_seq`` are not read).
        Damage in a segment is skipped to the next intact record; its bytes are copied to ``quarantine/``
        and its note (``quarantine_bytes``) appended to ``damage``. At the end of the newest segment a torn
        tail (a crash mid-append: a short header or payload) is truncated, a complete damaged record there
        is quarantined first."""
        last = after_seq
        segs = self.wal_segments()
        for i, (first, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt <= after_seq + 1:
                continue  # every record in it is <= after_seq
            newest = nxt is None
            prev = [last]

            def on_damage(start, end, reason, tail, data, path=path, first=first, newest=newest, prev=prev):
                if tail and newest and reason in TORN:
                    return  # a torn tail: read_wal cuts it
                note = self.quarantine_bytes(path.name, first, start, bytes(data[start:end]), reason, prev[0])
                if damage is not None:
                    damage.append(note)

            for seq, payload in read_wal(path, repair=newest, on_damage=on_damage):
                prev[0] = max(prev[0], seq)
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

    def quarantine_bytes(
        self, segment: str, first: int, offset: int, data: bytes, reason: str, after_seq: int = 0
    ) -> dict:
        """Keep damaged WAL bytes (``segment``'s bytes from ``offset``, after record ``after_seq``):
        ``quarantine/wal-<first>-<offset>.bin`` + ``.json`` (the note, returned). The same damage found
        again keeps one copy."""
        qdir = self.root / "quarantine"
        qdir.mkdir(exist_ok=True)
        name = f"wal-{first:016d}-{offset:012d}"
        note = {
            "kind": "wal",
            "segment": segment,
            "offset": offset,
            "bytes": len(data),
            "after_seq": after_seq,
            "error": reason,
        }
        atomic_write(qdir / f"{name}.bin", data, self.fsync)
        atomic_write(qdir / f"{name}.json", json.dumps(note).encode(), self.fsync)
        return note

    def quarantined(self) -> list[dict]:
        """The notes of what was kept aside, oldest first: records that failed on replay (``{"seq",
        "error", "bytes"}``), damaged WAL bytes (``"kind": "wal"``) and snapshots (``"kind": "snapshot"``)."""
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

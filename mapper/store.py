"""The durable store of a map below the service: what goes into the write-ahead log, how a logged operation
enters the map, and how a map is rebuilt from its directory (snapshot + WAL). The file formats (WAL
records, snapshots, the data directory layout) are in ``mapper.persistence``; the service (``mapper.api``)
decides *when* to log, sync and snapshot.

One way in: ``wire.parse_frame`` validates a frame once and yields a typed frame; ``encode_record`` builds
its log record once; ``apply`` is the one call that enters the map, live and on replay.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from datetime import UTC, datetime
from typing import Any

import torch

from . import wire
from .errors import InvalidArgument, InvalidArgumentType, NotFound
from .map import Map
from .persistence import DataDir, MapDir, Snapshot, SnapshotDamaged, load_snapshot_file

log = logging.getLogger("mapper.store")

DURABLE_OPS = ("frame", "clear", "decay", "clear_outside")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
UNLIMITED = wire.Limits(1 << 62, 1 << 62, 1 << 62, math.inf)  # replay: the log holds what was accepted


def apply(m: Map, kind: str, args, track: bool = True, admit=None) -> dict:
    """Apply one logged operation to a map: the one place where an operation enters the map (the live
    writer and WAL replay share it). A frame enters once: ``Map.integrate_lidar`` (tracking included unless
    ``track=False``) or ``Map.integrate_depth``. A LiDAR frame without a pose is tracked and integrated in
    this one call; the writer then logs it with the pose used (``res["T_world_sensor"]``), which replay
    reads back as ``pose_estimated``.

    Args:
        m: the map (its writer thread only).
        kind: one of ``DURABLE_OPS``.
        args: a ``wire.LidarFrame`` / ``wire.DepthFrame`` (validated by ``wire.parse_frame``) or the
            operation's dict (``clear``: ``aabb_min``/``aabb_max``, ``decay``: ``factor``/``threshold``,
            ``clear_outside``: ``center_m``/``radius_m``).
        admit: LiDAR frames: passed to ``Map.integrate_lidar`` (called with the pose after tracking, before
            any layer changes; raising refuses the frame).
    Returns: the map method's result dict."""
    if kind == "frame":
        f = args
        if isinstance(f, wire.LidarFrame):
            return m.integrate_lidar(
                f.points, f.T_world_sensor, estimated=f.pose_estimated, track=track, admit=admit
            )
        return m.integrate_depth(f.depth_m, f.K, f.T_world_sensor, color=f.color)
    if kind == "clear":
        return m.clear(args.get("aabb_min"), args.get("aabb_max"))
    if kind == "decay":
        return m.decay(args["factor"], args["threshold"])
    if kind == "clear_outside":
        return m.clear_outside(args["center_m"], args["radius_m"])
    raise InvalidArgument(f"op: unknown operation {kind!r}")


def encode_record(kind: str, args) -> bytes:
    """The WAL payload of an operation (msgpack; format in ``mapper.persistence``). Built once per
    operation: before queueing for a posed frame; for a LiDAR frame without a pose, after ``apply`` tracked
    and integrated it (the frame then carries the pose used, ``pose_estimated``)."""
    if kind == "frame":
        rec = {"op": "frame", "frame": wire.frame_to_wire(args)}
        if getattr(args, "pose_estimated", False):
            rec["pose_estimated"] = True  # the map's own estimate: replay reproduces the tracking state
        return wire.packb(rec)
    return wire.packb({"op": kind, **args})


def decode_record(payload: bytes, limits: wire.Limits) -> tuple[str, Any]:
    """A WAL payload -> ``(kind, frame or args)``, the frame validated by ``wire.parse_frame``."""
    rec = wire.unpackb(payload)
    kind = rec.pop("op")
    if kind == "frame":
        frame = wire.parse_frame(rec["frame"], limits)
        if isinstance(frame, wire.LidarFrame) and frame.T_world_sensor is not None:
            frame.pose_estimated = bool(rec.get("pose_estimated", False))
        return kind, frame
    return kind, rec


class RecoveryError(RuntimeError):
    """A map that cannot be rebuilt without a hole: acknowledged records are missing and no damage
    explains it (a WAL segment deleted, a damaged snapshot whose log was already pruned). The map is left
    on disk, reported, and not served."""


def _damaged(mdir: MapDir, seq: int, e: Exception) -> str:
    reason = f"{type(e).__name__}: {e}"[:500]
    log.error("map %s: snapshot %d damaged (%s); trying the one before it", mdir.id, seq, reason)
    return reason


def _load_base(mdir: MapDir, info: dict, device, damaged: list) -> tuple[Map, Snapshot | None]:
    """The newest snapshot that verifies and loads (``MapDir.open_snapshot``, ``Map.from_state_dict``);
    each damaged one on the way is appended to ``damaged`` as ``(seq, reason)``. None: the map as created
    (empty), allowed only when the map began empty (not imported) and no snapshot at seq 0 says
    otherwise."""
    for seq in reversed(mdir.snapshots()):
        try:
            snap = mdir.open_snapshot(seq)
            tensors, meta = load_snapshot_file(snap.path)
            if meta.get("wal_seq", seq) != seq:
                raise SnapshotDamaged(f"metadata wal_seq {meta.get('wal_seq')!r} is not {seq}")
            return Map.from_state_dict(tensors, meta, device=device), snap
        except torch.OutOfMemoryError:
            raise  # the device, not the snapshot: the map fails this time and is not touched
        except RuntimeError as e:
            if "CUDA" in str(e) or "out of memory" in str(e):
                raise  # likewise
            damaged.append((seq, _damaged(mdir, seq, e)))
        except (ValueError, KeyError, TypeError) as e:  # SnapshotDamaged, InvalidArgument, a bad layout
            damaged.append((seq, _damaged(mdir, seq, e)))
    if info.get("imported"):
        raise RecoveryError("every snapshot is damaged and the map was imported: no base to rebuild it on")
    for seq, _ in damaged:
        if seq == 0:
            try:
                base = mdir.manifest(0)["meta"]
            except Exception:
                base = None
            if base is None or base.get("version", 0) != 0:
                raise RecoveryError("snapshot 0 (the map's base) is damaged: no base to rebuild it on")
    return Map(**info["config"], device=device), None


def recover_map(
    mdir: MapDir, device, quarantined: list | None = None, damage: list | None = None
) -> tuple[Map, dict, Snapshot | None, int, int]:
    """Load a map from its directory: the newest snapshot that verifies, then the WAL records after it.

    - A damaged snapshot (``MapDir.open_snapshot``: size, CRC32, manifest; or metadata out of range) is
      quarantined (``MapDir.quarantine_snapshot``) and the snapshot before it is used with the log after
      it (the log is kept from the previous snapshot on); when none is left, the map as created.
    - Damaged WAL bytes in the middle of a segment are quarantined and replay resumes at the next intact
      record (``MapDir.replay``); a torn tail is truncated.
    - A record that fails (any exception) is quarantined (``MapDir.quarantine``: kept aside with its error,
      appended to ``quarantined`` as ``(seq, error)``) and replay goes on.
    - Every damaged range and snapshot is appended to ``damage`` (its quarantine note).
    - A hole in the sequence numbers that no damage explains raises ``RecoveryError`` (nothing is served
      with a silent gap).

    Returns (map, info, snapshot or None, last seq, records replayed)."""
    info = check_info(mdir.read_info(), mdir.id)
    damaged: list = []
    m, snap = _load_base(mdir, info, device, damaged)
    last = snap.seq if snap is not None else 0
    replayed = 0
    wal_damage: list = []
    seen = 0
    for seq, payload in mdir.replay(last, wal_damage):
        if seq != last + 1 and len(wal_damage) == seen:
            raise RecoveryError(
                f"records {last + 1}..{seq - 1} are missing from the write-ahead log after "
                f"{f'snapshot {snap.seq}' if snap else 'the start'} and no damage was found there"
            )
        seen = len(wal_damage)
        try:
            kind, args = decode_record(payload, UNLIMITED)
            apply(m, kind, args)
        except Exception as e:  # the record stays a no-op; kept aside for inspection
            error = f"{type(e).__name__}: {e}"[:2000]
            log.warning("map %s: record %d failed on replay (%s); quarantined", mdir.id, seq, error)
            try:
                mdir.quarantine(seq, payload, error)
            except OSError:
                log.exception("map %s: could not quarantine record %d", mdir.id, seq)
            if quarantined is not None:
                quarantined.append((seq, error))
        last = seq
        replayed += 1
    notes = [mdir.quarantine_snapshot(seq, reason) for seq, reason in damaged]
    for note in wal_damage:
        log.error(
            "map %s: damaged write-ahead log bytes (%s, %d bytes at %d of %s, after record %d); quarantined,"
            " replay resumed at the next intact record",
            mdir.id,
            note["error"],
            note["bytes"],
            note["offset"],
            note["segment"],
            note["after_seq"],
        )
    if damage is not None:
        damage.extend(notes + wal_damage)
    log.info(
        "map %s: snapshot %s + %d WAL records (last seq %d)",
        mdir.id,
        snap.seq if snap else None,
        replayed,
        last,
    )
    return m, info, snap, last, replayed


def check_name(name, what: str = "name") -> str:
    """A map name as ``POST /v1/maps`` accepts it (``NAME_PATTERN``); raises ``InvalidArgument``."""
    if not isinstance(name, str):
        raise InvalidArgumentType(f"{what}: expected a string, got {type(name).__name__}")
    if not re.fullmatch(NAME_PATTERN, name):
        raise InvalidArgument(f"{what}: {name[:80]!r} does not match {NAME_PATTERN}")
    return name


def check_info(info, map_id: str) -> dict:
    """A map's ``info.json`` as the service wrote it (id of its directory, a valid name, a config dict)."""
    if not isinstance(info, dict):
        raise InvalidArgument("info.json: not an object")
    if info.get("id") != map_id:
        raise InvalidArgument(f"info.json: id {info.get('id')!r} is not the directory's {map_id!r}")
    check_name(info.get("name"), "info.json: name")
    if not isinstance(info.get("config"), dict):
        raise InvalidArgument("info.json: config is not an object")
    return info


def new_map_id() -> str:
    return "m" + secrets.token_urlsafe(9).replace("-", "x").replace("_", "y")


def save_new_map(data: DataDir, m: Map, name: str | None = None) -> dict:
    """Write a map built offline into a data directory (snapshot, then info), as the service would store it;
    ``mapper serve`` with that ``MAPPER_DATA_DIR`` serves it. Returns its info. ``name`` must match
    ``NAME_PATTERN`` (``InvalidArgument`` otherwise)."""
    if name is not None:
        check_name(name)
    map_id = new_map_id()
    info = {
        "id": map_id,
        "name": name or map_id,
        "created": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "config": m.config(),
        "imported": True,  # built offline: snapshot 0 is its base (recovery never rebuilds it empty)
    }
    mdir = data.map_dir(map_id)
    mdir.root.mkdir(parents=True, exist_ok=True)
    tensors, meta = m.state_dict()
    mdir.write_snapshot(0, tensors, {**meta, "info": info})
    mdir.write_info(info)
    return info


def find_map_dir(data: DataDir, id_or_name: str) -> MapDir:
    """The directory of a map by id or name (raises ``NotFound``)."""
    for map_id in data.map_ids():
        mdir = data.map_dir(map_id)
        if map_id == id_or_name:
            return mdir
        try:
            if mdir.read_info().get("name") == id_or_name:
                return mdir
        except (OSError, ValueError):
            continue
    raise NotFound(f"map {id_or_name!r} not found in {data.root}")

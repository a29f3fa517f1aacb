"""Snapshots + WAL in an S3-compatible object store (AWS S3, MinIO): ``MAPPER_STORE=s3://bucket/prefix``.

The same interface as the filesystem backend (``mapper.persistence.DataDir`` / ``MapDir`` / ``WalWriter``,
described by ``mapper.store_backends``), so the service, recovery and the cluster use either unchanged.
Layout of one map under ``<prefix>/maps/<id>/``::

    info.json                        id, name, created, config (written last when a map is created)
    owner                            the cluster worker serving the map (``w<i>``); absent: any server
    snapshot-<seq>.safetensors       the snapshot (uploaded first)
    snapshot-<seq>.json              its manifest ``{"seq", "meta", "bytes", "crc32", "check"}``, written
                                     after the data object: it publishes the snapshot (one PUT: an atomic
                                     switch); ``check`` is the manifest's own CRC32
    wal-<first seq>-<last seq>.log   one object per group commit: the batch's records, in the WAL
                                     record format of ``mapper.persistence`` (length, seq, CRC32)
    quarantine/<seq>.msgpack|.json   a record that failed on replay, kept aside
    quarantine/wal-...-<offset>.bin  damaged bytes of a WAL object (+ .json), skipped on replay
    quarantine/snapshot-<seq>.*      a damaged snapshot moved aside (+ .note.json)

S3 has no append and no fsync: ``ObjectWal.sync`` PUTs the records appended since the last sync as one
object, and the service acknowledges the batch only after that PUT returned (= durable in the store). A
failed PUT fails the batch and drops its records (they were not acknowledged; a later batch never carries
them). Recovery = newest manifest that verifies -> its snapshot -> the WAL objects after it, in sequence
order (``mapper.store.recover_map``; damage is handled as on the filesystem: a damaged record is skipped to
the next intact one and its bytes quarantined, a damaged snapshot is quarantined and the one before it used).
After a snapshot is published, the WAL objects the *previous* snapshot covers and all but the newest
``max(keep, 2)`` snapshots are deleted.
A map moves between cluster workers by rewriting its ``owner`` object (nothing is copied or renamed).

Snapshots also stay in a local cache (``<MAPPER_DATA_DIR>/store-cache/<id>/``): the service exports and
loads them from there (a cache miss downloads the object); the store is the only durable copy.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .errors import InvalidArgument
from .persistence import (
    FORMAT_VERSION,
    Snapshot,
    SnapshotDamaged,
    file_crc32,
    iter_records,
    manifest_bytes,
    pack_record,
    parse_manifest,
    write_snapshot_data,
)

log = logging.getLogger("mapper.objstore")

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SNAP_RE = re.compile(r"snapshot-(\d{16})\.json$")
_WAL_RE = re.compile(r"wal-(\d{16})-(\d{16})\.log$")
_OWNER_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
REPLAY_PREFETCH = 16  # WAL objects fetched ahead on recovery


class StoreError(OSError):
    """A request to the object store failed (network, permissions, a vanished object). An ``OSError`` like
    the filesystem backend's failures: a batch whose WAL PUT fails is refused, nothing is acknowledged."""


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix)`` with the prefix empty or ending in ``/``. Raises
    ``InvalidArgument`` naming what is wrong."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidArgument(f"store: {str(url)[:200]!r} is not an s3://bucket/prefix URL")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidArgument(
            f"store: {bucket[:80]!r} in {url[:200]!r} is not a bucket name (3-63 characters of a-z, 0-9, "
            "'.', '-')"
        )
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise InvalidArgument(f"store: the prefix {prefix[:200]!r} has an empty, '.' or '..' part")
    return bucket, (prefix + "/" if prefix else "")


def connect(url: str, endpoint_url: str | None = None):
    """An S3 client for ``url``, checked: the bucket must exist and the credentials (the usual AWS
    environment: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance role) must reach
    it. Returns ``(client, bucket, prefix)``; raises ``InvalidArgument`` with the reason otherwise."""
    bucket, prefix = parse_url(url)
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise InvalidArgument("store: an s3:// store needs boto3: pip install 'mapper[s3]'") from None
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    where = endpoint_url or "AWS S3"
    config = Config(
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        max_pool_connections=32,  # the maps' writers, snapshot uploads and replay prefetch share it
        # no default checksum trailers on PUT (some S3-compatible servers refuse them): WAL records carry
        # their own CRC32, a snapshot's is in its manifest
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    try:
        client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise InvalidArgument(
            f"store: no credentials for {url} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or an AWS "
            "profile)"
        ) from None
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchBucket") or status == 404:
            raise InvalidArgument(f"store: bucket {bucket!r} does not exist at {where}") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            raise InvalidArgument(
                f"store: access to bucket {bucket!r} at {where} denied ({code or status}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy"
            ) from None
        raise InvalidArgument(f"store: bucket {bucket!r} at {where}: {code or status} ({e})") from None
    except (BotoCoreError, ValueError) as e:  # no connection, a malformed endpoint URL, ...
        raise InvalidArgument(
            f"store: cannot reach {where} (MAPPER_S3_ENDPOINT_URL): {type(e).__name__}: {e}"
        ) from None
    return client, bucket, prefix


class _Objects:
    """The calls to one bucket, every failure raised as ``StoreError``."""

    def __init__(self, client, bucket: str):
        self.client = client
        self.bucket = bucket

    def _fail(self, what: str, key: str, e: Exception) -> StoreError:
        return StoreError(f"store: {what} s3://{self.bucket}/{key} failed: {type(e).__name__}: {e}")

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        except Exception as e:
            raise self._fail("PUT", key, e) from None

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as e:
            if _missing(e):
                return None
            raise self._fail("GET", key, e) from None

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:
            if _missing(e):
                return False
            raise self._fail("HEAD", key, e) from None

    def upload(self, path: Path, key: str) -> None:
        try:
            self.client.upload_file(str(path), self.bucket, key)
        except Exception as e:
            raise self._fail("upload of", key, e) from None

    def download(self, key: str, path: Path) -> bool:
        """Download to ``path`` (via a temporary name); False when the object does not exist."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            self.client.download_file(self.bucket, key, str(tmp))
        except Exception as e:
            tmp.unlink(missing_ok=True)
            if _missing(e):
                return False
            raise self._fail("download of", key, e) from None
        os.replace(tmp, path)
        return True

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy (multipart for large objects)."""
        try:
            self.client.copy({"Bucket": self.bucket, "Key": src}, self.bucket, dst)
        except Exception as e:
            raise self._fail("COPY to", dst, e) from None

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``, in key order."""
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                out += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
        except Exception as e:
            raise self._fail("LIST", prefix, e) from None
        return sorted(out)

    def folders(self, prefix: str) -> list[str]:
        """The names of the 'folders' directly under ``prefix`` (common prefixes, delimiter ``/``)."""
        out = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                out += [p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
        except Exception as e:
            raise self._fail("LIST", prefix, e) from None
        return sorted(out)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            try:
                r = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
                )
            except Exception as e:
                raise self._fail("DELETE", chunk[0], e) from None
            if r.get("Errors"):
                err = r["Errors"][0]
                raise StoreError(
                    f"store: DELETE s3://{self.bucket}/{err.get('Key')} failed: {err.get('Message')}"
                )


def _missing(e: Exception) -> bool:
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict):
        return False
    code = str(resp.get("Error", {}).get("Code", ""))
    return (
        code in ("404", "NoSuchKey", "NotFound")
        or resp.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404
    )


# ---------------------------------------------------------------------------------------------- WAL
class ObjectWal:
    """The WAL of one map in the store: ``append`` buffers records, ``sync`` PUTs them as one object
    ``wal-<first>-<last>.log`` (one per group commit). Same calls as ``persistence.WalWriter``."""

    def __init__(self, objects: _Objects, prefix: str):
        self.objects = objects
        self.prefix = prefix
        self.path = prefix + "wal-"  # where its objects go (the filesystem writer's path)
        self.size = 0  # bytes PUT by this writer
        self._buf = bytearray()
        self._first: int | None = None
        self._last = 0

    def append(self, seq: int, payload: bytes) -> None:
        self._buf += pack_record(seq, payload)
        if self._first is None:
            self._first = seq
        self._last = seq

    def sync(self) -> None:
        """PUT the records appended since the last sync; when it returns they are durable. On failure they
        are dropped (not acknowledged) and the error is raised."""
        if self._first is None:
            return
        key = f"{self.prefix}wal-{self._first:016d}-{self._last:016d}.log"
        data = bytes(self._buf)
        self._buf.clear()
        self._first = None
        self.objects.put(key, data)
        self.size += len(data)

    def close(self) -> None:
        self.sync()

    def cut(self, size: int, first_seq: int) -> ObjectWal:
        """After a failed sync: its PUT already dropped the batch's records (``size`` is not needed: nothing
        of the batch reached the store); a writer whose next object starts at ``first_seq``."""
        self._buf.clear()
        self._first = None
        return self


# -------------------------------------------------------------------------------------------- a map
class ObjectMapDir:
    """The objects of one map (same calls as ``persistence.MapDir``). ``root`` is the map's local cache
    folder (its name is the map id)."""

    def __init__(self, store: ObjectDataDir, map_id: str):
        self.store = store
        self.objects = store.objects
        self.prefix = f"{store.prefix}maps/{map_id}/"
        self.root = store.cache / map_id
        self.fsync = False

    @property
    def id(self) -> str:
        return self.root.name

    def url(self, name: str = "") -> str:
        return f"s3://{self.objects.bucket}/{self.prefix}{name}"

    # info
    def write_info(self, info: dict) -> None:
        if self.store.owner is not None:  # owner first: info.json makes the prefix a map
            self.objects.put(self.prefix + "owner", self.store.owner.encode())
        self.objects.put(self.prefix + "info.json", json.dumps(info, indent=1).encode())

    def read_info(self) -> dict:
        data = self.objects.get(self.prefix + "info.json")
        if data is None:
            raise FileNotFoundError(f"{self.url('info.json')} does not exist")
        return json.loads(data)

    def owner(self) -> str | None:
        data = self.objects.get(self.prefix + "owner")
        return None if data is None else data.decode(errors="replace").strip()

    # snapshots
    def _keys(self, sub: str = "") -> list[tuple[str, int]]:
        return self.objects.list(self.prefix + sub)

    def snapshots(self) -> list[int]:
        """Seqs of the published snapshots (a manifest exists; its data object may still prove damaged)."""
        seqs = []
        for k, _ in self._keys("snapshot-"):
            m = _SNAP_RE.fullmatch(k[len(self.prefix) :])
            if m:
                seqs.append(int(m.group(1)))
        return sorted(seqs)

    def snapshot_path(self, seq: int) -> Path:
        """The snapshot's file in the local cache."""
        return self.root / f"snapshot-{seq:016d}.safetensors"

    def manifest(self, seq: int) -> dict:
        """The checked manifest of snapshot ``seq`` (``persistence.parse_manifest``)."""
        return parse_manifest(self.objects.get(self.prefix + f"snapshot-{seq:016d}.json"), seq)

    def open_snapshot(self, seq: int) -> Snapshot:
        """Published snapshot ``seq`` in the local cache, verified (manifest check; downloaded unless the
        cached file has the manifest's size and CRC32; a download must have them). Raises
        ``SnapshotDamaged``; a failing store (``StoreError``) propagates."""
        marker = self.manifest(seq)
        path = self.snapshot_path(seq)
        if "bytes" not in marker or "crc32" not in marker:
            raise SnapshotDamaged("manifest lacks the snapshot's size and CRC32")
        if path.exists() and path.stat().st_size == marker["bytes"] and file_crc32(path) == marker["crc32"]:
            return Snapshot(seq, path, marker["meta"])
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.objects.download(self.prefix + path.name, path):
            raise SnapshotDamaged(f"{self.url(path.name)} is missing")
        if file_crc32(path) != marker["crc32"] or path.stat().st_size != marker["bytes"]:
            path.unlink(missing_ok=True)
            raise SnapshotDamaged(f"{self.url(path.name)}: CRC32 differs from its manifest's")
        return Snapshot(seq, path, marker["meta"])

    def latest_snapshot(self) -> Snapshot | None:
        """The newest published snapshot that verifies (older ones are fallbacks), in the local cache."""
        for seq in reversed(self.snapshots()):
            try:
                return self.open_snapshot(seq)
            except SnapshotDamaged as e:
                log.error("%s: snapshot %d damaged (%s); trying an older one", self.url(), seq, e)
        return None

    def write_snapshot(self, seq: int, tensors: dict[str, torch.Tensor], meta: dict) -> Snapshot:
        """Write the snapshot to the cache (read back: header, CRC32), upload it, then publish it with its
        manifest."""
        meta = {**meta, "wal_seq": seq, "format": FORMAT_VERSION}
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.snapshot_path(seq)
        size, crc = write_snapshot_data(path, tensors, meta, fsync=False)
        self.objects.upload(path, self.prefix + path.name)
        self.objects.put(self.prefix + f"snapshot-{seq:016d}.json", manifest_bytes(seq, meta, size, crc))
        return Snapshot(seq, path, meta)

    def quarantine_snapshot(self, seq: int, reason: str) -> dict:
        """Move a damaged snapshot aside under ``quarantine/`` (server-side copies, then the originals are
        deleted, manifest first); returns the note."""
        name = f"snapshot-{seq:016d}"
        q = self.prefix + "quarantine/"
        for src, dst in ((".safetensors", ".safetensors"), (".json", ".manifest")):
            if self.objects.exists(self.prefix + name + src):
                self.objects.copy(self.prefix + name + src, q + name + dst)
        note = {"kind": "snapshot", "seq": seq, "error": reason}
        self.objects.put(q + f"{name}.note.json", json.dumps(note).encode())
        self.objects.delete([self.prefix + name + ".json"])
        self.objects.delete([self.prefix + name + ".safetensors"])
        self.snapshot_path(seq).unlink(missing_ok=True)
        return note

    def prune(self, covered_seq: int, keep: int) -> None:
        """After the snapshot at ``covered_seq`` was published: keep it, the one before it (at least 2
        snapshots, else ``keep``) and the WAL objects after that previous one (a damaged newest snapshot is
        replaced by the previous one plus the log); delete older snapshots (manifest first: a manifest never
        names a missing object) and the WAL they alone cover, in the store and the cache."""
        snaps = [s for s in self.snapshots() if s <= covered_seq]
        base = snaps[-2] if len(snaps) >= 2 else 0
        covered = [k for k, _ in self._keys("wal-") if (m := _WAL_RE.search(k)) and int(m.group(2)) <= base]
        self.objects.delete(covered)
        old = self.snapshots()[: -max(keep, 2)]
        self.objects.delete([self.prefix + f"snapshot-{s:016d}.json" for s in old])
        self.objects.delete([self.prefix + f"snapshot-{s:016d}.safetensors" for s in old])
        kept = {self.snapshot_path(s).name for s in self.snapshots()}
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name not in kept and p.is_file():
                    p.unlink(missing_ok=True)

    # WAL
    def wal_segments(self) -> list[tuple[int, str]]:
        """``(first seq, key)`` of the WAL objects in order."""
        out = []
        for k, _ in self._keys("wal-"):
            m = _WAL_RE.search(k)
            if m:
                out.append((int(m.group(1)), k))
        return sorted(out)

    def open_wal(self, first_seq: int) -> ObjectWal:
        return ObjectWal(self.objects, self.prefix)

    def replay(self, after_seq: int, damage: list | None = None) -> Iterator[tuple[int, bytes]]:
        """WAL records with ``seq > after_seq`` in order. An object cannot be torn (a PUT is all or
        nothing): any damaged range in one (bad magic, length or CRC) is damage, skipped to the next intact
        record, its bytes copied to ``quarantine/`` and its note appended to ``damage``."""
        keys = []
        for k, _ in self._keys("wal-"):
            m = _WAL_RE.search(k)
            if m and int(m.group(2)) > after_seq:
                keys.append(k)
        last = after_seq
        for key, data in self._fetched(keys):
            if data is None:
                raise StoreError(f"store: s3://{self.objects.bucket}/{key} vanished during replay")
            name = key[len(self.prefix) :]
            prev = [last]

            def bad(start: int, end: int, reason: str, tail: bool, name=name, data=data, prev=prev) -> None:
                log.warning(
                    "%s: %s at bytes %d-%d of %d; skipped", self.url(name), reason, start, end, len(data)
                )
                note = self.quarantine_bytes(name, start, bytes(data[start:end]), reason, prev[0])
                if damage is not None:
                    damage.append(note)

            for seq, payload in iter_records(data, bad):
                prev[0] = max(prev[0], seq)
                if seq <= last:
                    continue
                yield seq, payload
                last = seq

    def _fetched(self, keys: list[str]) -> Iterator[tuple[str, bytes | None]]:
        """``(key, bytes)`` in order, ``REPLAY_PREFETCH`` GETs in flight (one object per group commit: a
        replay is bound by request latency, not bandwidth)."""
        with ThreadPoolExecutor(REPLAY_PREFETCH, thread_name_prefix="wal-get") as pool:
            ahead: collections.deque = collections.deque()
            for k in keys:
                ahead.append((k, pool.submit(self.objects.get, k)))
                if len(ahead) >= REPLAY_PREFETCH:
                    key, fut = ahead.popleft()
                    yield key, fut.result()
            while ahead:
                key, fut = ahead.popleft()
                yield key, fut.result()

    # quarantine
    def quarantine(self, seq: int, payload: bytes, error: str) -> str:
        key = self.prefix + f"quarantine/{seq:016d}"
        self.objects.put(key + ".msgpack", payload)
        self.objects.put(
            key + ".json", json.dumps({"seq": seq, "error": error, "bytes": len(payload)}).encode()
        )
        return f"s3://{self.objects.bucket}/{key}.msgpack"

    def quarantine_bytes(self, name: str, offset: int, data: bytes, reason: str, after_seq: int = 0) -> dict:
        """Keep damaged bytes of WAL object ``name`` (from ``offset``): ``quarantine/<name>-<offset>.bin``
        + ``.json`` (the note, returned)."""
        key = self.prefix + f"quarantine/{name.removesuffix('.log')}-{offset:012d}"
        note = {
            "kind": "wal",
            "segment": name,
            "offset": offset,
            "bytes": len(data),
            "after_seq": after_seq,
            "error": reason,
        }
        self.objects.put(key + ".bin", data)
        self.objects.put(key + ".json", json.dumps(note).encode())
        return note

    def quarantined(self) -> list[dict]:
        notes = []
        for k, _ in self._keys("quarantine/"):
            if not k.endswith(".json"):
                continue
            try:
                notes.append(json.loads(self.objects.get(k) or b""))
            except (OSError, ValueError):
                notes.append({"seq": k.rsplit("/", 1)[-1][:-5], "error": "unreadable note"})
        return notes

    def wal_bytes(self) -> int:
        return sum(size for k, size in self._keys("wal-") if _WAL_RE.search(k))

    def remove(self) -> None:
        """Delete the map: ``info.json`` first (the prefix stops being a map at once), then the rest."""
        self.objects.delete([self.prefix + "info.json"])
        self.objects.delete([k for k, _ in self._keys()])
        shutil.rmtree(self.root, ignore_errors=True)


class ObjectDataDir:
    """``MAPPER_STORE=s3://bucket/prefix``: one prefix per map under ``<prefix>/maps/`` (same calls as
    ``persistence.DataDir``).

    Args:
        url: ``s3://bucket[/prefix]``.
        cache: the local folder for snapshot copies (``<MAPPER_DATA_DIR>/store-cache``).
        endpoint_url: an S3-compatible server (MinIO: ``http://host:9000``); None: AWS S3.
        owner: the cluster worker this service is (``w<i>``): it serves the maps whose ``owner`` object
            names it and marks the maps it creates or claims; None (``mapper serve``): every map.
    """

    def __init__(self, url: str, cache: Path, endpoint_url: str | None = None, owner: str | None = None):
        if owner is not None and not _OWNER_RE.match(owner):
            raise InvalidArgument(f"store: owner {owner[:80]!r} is not a worker name")
        client, bucket, self.prefix = connect(url, endpoint_url)
        self.objects = _Objects(client, bucket)
        self.root = f"s3://{bucket}/{self.prefix}"
        self.cache = Path(cache)
        self.owner = owner
        self.fsync = False
        self.cache.mkdir(parents=True, exist_ok=True)

    def map_dir(self, map_id: str) -> ObjectMapDir:
        return ObjectMapDir(self, map_id)

    def owners(self) -> dict[str, str | None]:
        """Every map in the store (a prefix with ``info.json``) -> its owner (None: no owner object)."""
        out = {}
        for map_id in self.objects.folders(self.prefix + "maps/"):
            if not _ID_RE.match(map_id):  # not written by mapper (ids: store.new_map_id)
                continue
            mdir = self.map_dir(map_id)
            if not self.objects.exists(mdir.prefix + "info.json"):
                continue
            out[map_id] = mdir.owner()
        return out

    def map_ids(self) -> list[str]:
        """The maps this service serves: all of them, or those its ``owner`` owns."""
        return sorted(m for m, o in self.owners().items() if self.owner is None or o == self.owner)

    def claim(self, map_id: str, source: str | None = None) -> None:
        """Make this worker the map's owner (a move or an adoption): one PUT, nothing moves. ``source``
        (the previous owner's cache folder) is not needed."""
        if self.owner is not None:
            self.objects.put(self.map_dir(map_id).prefix + "owner", self.owner.encode())

"""Sharded maps in the cluster: one map spread over K workers (``POST /v1/maps`` with ``"shards": K``).

Each shard is an ordinary map on its own worker whose config carries ``shard`` (``mapper.sharding.ShardSpec``:
its index, K, the block size and the halo). The ingress keeps ``ShardedMap`` routes (found again from the
workers' map lists after a restart: the shard configs name their map) and:

- **frames**: decoded once here (to bound their footprint), sent as they came to every shard whose kept
  region the footprint can reach (``frame_shards``), concurrently, and their pose alone to shard 0 when
  it is not one of them (``pose_only_message``: shard 0 holds the trajectory); acked once every one of
  them has acked (each ack means: in that shard's WAL). Exactly once per shard: a 429 (queue full) is sent
  again, a worker that died with the frame is asked for its last seq once Ray restarted it
  (``_send_frame``); any other refusal is returned as it is (the other shards may hold the frame).
- **queries**: points routed to their owner (``owner_of_points``), answers gathered in the request's order.
- **slices / boxes**: every involved shard computes the same lattice; each cell is taken from its owner;
  a slice without bounds covers the union of the shards' ESDF extents.
- **mesh** (and the viewer's blocks): each shard's mesh or delta reduced to the blocks (bricks) it owns,
  vertices welded by edge key; versions are cursors (``MeshCursors``).
- **status / occupied / trajectory**: summed or united over the shards / owned voxels in one map's order /
  shard 0's.
- **export / import**: a tar of the shards' snapshots (``export_manifest``, ``read_export``).
- **summary / stats**: per layer voxels, bricks and bytes summed; ``shards`` lists the parts.

The functions at the top are pure (numpy / torch, no I/O) and tested without Ray (tests/test_sharding.py).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import secrets
import tarfile
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import io as mapper_io
from .. import sharding, wire
from ..errors import Conflict, InvalidArgument, MapperError
from ..grid import IndexGrid
from ..mesh import Mesh, block_keys, empty_mesh

log = logging.getLogger("mapper.cluster.shards")

BUSY_RETRY_S = 120.0  # a shard's full queue: the frame is retried this long before its 429 is returned


# ------------------------------------------------------------------------------------------ pure parts
def frame_footprint(frame, config: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """The box (x, y, z min / max, metres) that a posed frame can change in a map with this config: the
    sensor origin and every valid return (as the map filters them: finite, in range), widened by the
    longest TSDF band beyond a return (4 truncations at grazing incidence) and one brick of the coarsest
    layer. None when the frame has no valid return (it changes no voxel)."""
    T = np.asarray(frame.T_world_sensor, dtype=np.float64)
    max_range = float(config.get("max_range_m", 100.0))
    if isinstance(frame, wire.LidarFrame):
        p = np.asarray(frame.points, dtype=np.float64)[:, :3]
        r = np.linalg.norm(p, axis=1)
        ok = np.isfinite(p).all(axis=1) & (r > 1e-6) & (r <= max_range)
        if not ok.any():
            return None
        world = p[ok] @ T[:3, :3].T + T[:3, 3]
    else:
        depth = frame.depth_m
        K = np.asarray(frame.K, dtype=np.float64).reshape(-1)
        fx, fy, cx, cy = (K[0], K[4], K[2], K[5]) if K.size == 9 else K[:4]
        d = depth.reshape(-1).astype(np.float64)
        ok = np.isfinite(d) & (d > 0) & (d <= max_range)
        if not ok.any():
            return None
        idx = np.nonzero(ok)[0]
        h, w = depth.shape
        u, v = (idx % w).astype(np.float64), (idx // w).astype(np.float64)
        cam = np.stack(((u - cx) / fx * d[idx], (v - cy) / fy * d[idx], d[idx]), 1)
        world = cam @ T[:3, :3].T + T[:3, 3]
    lo = np.minimum(world.min(axis=0), T[:3, 3])
    hi = np.maximum(world.max(axis=0), T[:3, 3])
    s = float(config["voxel_size_m"])
    es = float(config.get("esdf_voxel_size_m") or s)
    margin = 4 * float(config.get("truncation_vox", 3.0)) * s + 4 * max(s, es)
    return lo - margin, hi + margin


def frame_shards(frame, config: dict) -> list[int]:
    """The shards a frame must go to: those whose kept region (own blocks + halo + a brick) meets the
    frame's footprint. Empty when the frame changes no voxel (it then goes to shard 0 alone, for its ack)."""
    spec = sharding.ShardSpec.from_dict(config["shard"])
    box = frame_footprint(frame, config)
    if box is None:
        return []
    s = float(config["voxel_size_m"])
    es = float(config.get("esdf_voxel_size_m") or s)
    grow = spec.halo_m + 4 * max(s, es)
    lo, hi = box[0][:2] - grow, box[1][:2] + grow
    return sharding.shards_touching(lo, hi, s, spec.count, spec.block_tiles)


def decode_arrays(msg: dict) -> dict:
    """A msgpack reply of a worker: every wire array ({dtype, shape, data}) -> numpy; other values as they
    are."""
    out = {}
    for k, v in msg.items():
        if isinstance(v, dict) and {"dtype", "shape", "data"} <= set(v):
            out[k] = np.frombuffer(v["data"], dtype=np.dtype(v["dtype"]).newbyteorder("<")).reshape(
                v["shape"]
            )
        else:
            out[k] = v
    return out


def gather_rows(parts: list[tuple[np.ndarray, dict]], n: int) -> dict:
    """Per-point answers of several shards -> one answer in the request's order. ``parts``: (the request
    rows the shard answered, its decoded reply); arrays are placed at those rows, scalars taken from the
    first part (``map_version`` becomes the sum over the parts, which grows whenever any part does)."""
    out: dict = {}
    version = 0
    for rows, reply in parts:
        for k, v in reply.items():
            if k == "map_version":
                version += int(v)
            elif isinstance(v, np.ndarray):
                if k not in out:
                    out[k] = np.zeros((n, *v.shape[1:]), dtype=v.dtype)
                out[k][rows] = v
            else:
                out.setdefault(k, v)
    out["map_version"] = version
    return out


def gather_cells(parts: dict[int, dict], owner: np.ndarray, keys: tuple[str, ...]) -> dict:
    """Lattice answers (slice or box) computed by several shards on the same lattice -> each cell from
    its owner (``owner``: the shard of every cell, shaped like the lattice)."""
    first = next(iter(parts.values()))
    out = dict(first)
    version = 0
    for k in keys:
        v = np.array(first[k], copy=True)
        for s, reply in parts.items():
            sel = owner == s
            v[sel] = np.asarray(reply[k])[sel]
        out[k] = v
    for reply in parts.values():
        version += int(reply.get("map_version", 0))
    out["map_version"] = version
    return out


def lattice_centres(origin, resolution_m: float, shape: tuple[int, ...]) -> np.ndarray:
    """Centres ``[*shape, len(origin)]`` of a lattice ``origin + (i + 0.5) * resolution_m`` (the samples of
    ``Map.esdf_slice`` / ``Map.esdf_box``)."""
    axes = [
        origin[a] + (np.arange(shape[a], dtype=np.float64) + 0.5) * resolution_m for a in range(len(shape))
    ]
    return np.stack(np.meshgrid(*axes, indexing="ij"), -1)


def gather_mesh(meshes: dict[int, object], count: int, block_tiles: int, version: int | None = None):
    """Shard meshes (``mapper.mesh.Mesh``: all full, or all deltas) -> the sharded map's mesh: from each
    shard the faces of the blocks (bricks) it owns, vertices welded by their edge key (the same key and
    position in every shard: the halo gives a border brick's neighbours). Blocks sorted by key as in one
    map's mesh. Deltas give a delta (``full=False``; the owned ``removed_blocks`` of every shard) that
    :func:`mapper.mesh.apply_delta` merges into the gathered mesh it was made since, with the same result
    as gathering the full meshes. ``version``: the gathered version (default: the sum of the shards')."""
    fulls = {bool(m.full) for m in meshes.values()}
    if len(fulls) != 1:
        raise InvalidArgument("meshes: mix of full meshes and deltas (ask every shard for the whole mesh)")
    full = fulls.pop()
    verts, norms, cols, vkeys, faces, blocks, counts, removed = [], [], [], [], [], [], [], []
    total, voxel, base = 0, 0.0, 0
    with_color = any(m.colors is not None for m in meshes.values())
    for s, m in meshes.items():
        total += int(m.version)
        voxel = voxel or m.voxel_size_m
        if m.removed_blocks.shape[0]:
            r = m.removed_blocks.cpu()
            removed.append(r[sharding.owner_of_bricks(r, count, block_tiles) == s])
        if m.blocks.shape[0] == 0:
            continue
        own = sharding.owner_of_bricks(m.blocks.cpu(), count, block_tiles) == s
        fb = m.face_blocks().cpu()
        keep = own[fb]
        f = m.faces.cpu().long()[keep]
        used, inv = torch.unique(f.reshape(-1), return_inverse=True)
        verts.append(m.vertices.cpu()[used])
        norms.append(m.normals.cpu()[used])
        if with_color:
            cols.append(m.colors.cpu()[used])
        vkeys.append(m.vertex_keys.cpu()[used])
        faces.append(inv.reshape(-1, 3) + base)
        base += int(used.numel())
        c = (m.block_face_offsets[1:] - m.block_face_offsets[:-1]).cpu()
        blocks.append(m.blocks.cpu()[own])
        counts.append(c[own])
    version = total if version is None else int(version)
    since = None if full else min(int(m.since_version or 0) for m in meshes.values())
    gone = torch.cat(removed) if removed else torch.zeros((0, 3), dtype=torch.int64)
    gone = gone[torch.argsort(block_keys(gone), stable=True)] if gone.shape[0] else gone
    if not faces:
        out = empty_mesh(torch.device("cpu"), with_color, version, voxel)
        out.full, out.since_version, out.removed_blocks = full, since, gone
        return out
    v, n, k = torch.cat(verts), torch.cat(norms), torch.cat(vkeys)
    f = torch.cat(faces)
    ukeys, inv = torch.unique(k, return_inverse=True)  # sorted keys, as one map's mesh has them
    first = torch.full((ukeys.numel(),), k.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(k.numel()), reduce="amin")
    # faces of each shard are in its block order; re-sort the blocks of all shards by key
    b, c = torch.cat(blocks), torch.cat(counts)
    face_block = torch.repeat_interleave(torch.arange(b.shape[0]), c)
    order = torch.argsort(block_keys(b), stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    face_order = torch.argsort(rank[face_block], stable=True)
    offsets = torch.zeros(b.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(c[order], 0)
    return Mesh(
        vertices=v[first],
        faces=inv[f][face_order].to(torch.int32),
        normals=n[first],
        colors=torch.cat(cols)[first] if with_color else None,
        vertex_keys=ukeys,
        blocks=b[order],
        block_face_offsets=offsets,
        removed_blocks=gone,
        version=version,
        full=full,
        since_version=since,
        voxel_size_m=voxel,
    )


class MeshCursors:
    """The mesh versions of a sharded map: one int per gathered mesh (the sum of its shards' TSDF versions,
    so it grows whenever a shard's does and two gathers with the same sum show the same shard versions),
    remembered with the shards' versions so that ``since_version=<cursor>`` asks each shard for its own
    delta. A cursor not remembered (an ingress restart, older than the last ``keep``) or one a shard
    refuses (its versions went back after a restart) gives the whole mesh: as one map does when its change
    log no longer reaches back."""

    def __init__(self, keep: int = 4096):
        self.keep = keep
        self.table: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def issue(self, versions) -> int:
        """The cursor of a mesh gathered from shards at ``versions`` (one int per shard)."""
        versions = tuple(int(v) for v in versions)
        cursor = sum(versions)
        self.table[cursor] = versions
        self.table.move_to_end(cursor)
        while len(self.table) > self.keep:
            self.table.popitem(last=False)
        return cursor

    def lookup(self, cursor: int) -> tuple[int, ...] | None:
        return self.table.get(int(cursor))


def gather_occupied(parts: dict[int, dict], count: int, block_tiles: int, max_voxels: int) -> dict:
    """Occupied-voxel answers of the shards (``Map.occupied_voxels`` replies: ``centers`` float32 ``[N, 3]``,
    ``voxel_size_m``) -> one map's answer: each shard's owned voxels, in the voxel order of one map's grid
    (leaf by leaf), ``max_voxels`` of them evenly strided as ``Map.occupied_voxels`` picks them. Exact
    while no shard capped its reply (``capped`` is then also set when the union exceeds ``max_voxels``)."""
    first = next(iter(parts.values()))
    s = float(first["voxel_size_m"])
    ijk, shard_capped = [], False
    for i, reply in parts.items():
        c = torch.from_numpy(np.array(reply["centers"], dtype=np.float32)).reshape(-1, 3)
        shard_capped |= bool(reply.get("capped"))
        v = torch.floor(c.double() / s).long()
        mine = sharding.owner_of_points((v.double() + 0.5) * s, s, count, block_tiles) == i
        ijk.append(v[mine])
    v = torch.cat(ijk) if ijk else torch.zeros((0, 3), dtype=torch.int64)
    if v.shape[0]:
        order = torch.argsort(IndexGrid.from_ijk(v.int(), device="cpu").ijk_to_index(v.int()))
        v = v[order]
    total = int(v.shape[0])
    idx = torch.arange(total)
    if total > max_voxels:
        idx = idx[torch.linspace(0, total - 1, max_voxels).long()]
    centres = ((v[idx].to(torch.float32) + 0.5) * s).numpy()
    return {
        "centers": centres,
        "total": total,
        "capped": total > centres.shape[0] or shard_capped,
        "voxel_size_m": s,
        "map_version": sum(int(r.get("map_version", 0)) for r in parts.values()),
    }


def pose_only_message(frame) -> dict:
    """A LiDAR frame with the pose (and timestamp, frame id) of ``frame`` and no valid return: it records
    the pose in a shard's trajectory and changes no voxel (its one point is at the sensor origin, which
    every map drops). Shard 0 gets it for each frame that does not reach it, so its trajectory is the
    sharded map's."""
    return wire.lidar_message(
        np.zeros((1, 3), np.float32), frame.T_world_sensor, frame.timestamp, frame.frame_id
    )


def sum_layers(stats: list[dict]) -> dict:
    """Per-layer numbers (voxels, bricks, bytes, ...) of several shards' ``stats()["layers"]`` summed; a
    nested dict is summed key by key (numbers only)."""
    out: dict = {}
    for st in stats:
        for name, d in (st or {}).items():
            acc = out.setdefault(name, {})
            for k, v in d.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    acc[k] = acc.get(k, 0) + v
    return out


def check_shards(body: dict, workers: int) -> int | None:
    """The ``shards`` of a create request (None: an ordinary map). Raises ``InvalidArgument`` (422) naming
    the problem: not an int, < 1, more than the workers, or options a sharded map cannot keep exact."""
    k = body.get("shards")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int):
        raise InvalidArgument(f"shards: expected an integer >= 1, got {k!r}")
    if k < 1:
        raise InvalidArgument(f"shards: expected an integer >= 1, got {k}")
    if k > workers:
        raise InvalidArgument(f"shards: {k} shards need {k} map workers; this cluster has {workers}")
    if k > 1 and body.get("keep_radius_m") is not None:
        raise InvalidArgument("keep_radius_m: not available on a sharded map (a shard skips most frames)")
    if k > 1 and body.get("registration") is not None:
        raise InvalidArgument("registration: a sharded map needs posed frames (T_world_sensor)")
    return k


# ----------------------------------------------------------------------------------------- routes
@dataclass
class ShardedMap:
    """A sharded map as the ingress routes it: shard i is map ``ids[i]`` on worker ``workers[i]``."""

    id: str
    name: str
    config: dict  # shard 0's Map.config() (the shard entry says K, blocks and halo)
    workers: list[int]
    ids: list[str]
    created: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # frames: one order for every shard
    gate: object = field(default_factory=lambda: _gate())  # closed while a shard moves
    cursors: MeshCursors = field(default_factory=MeshCursors)
    seqs: dict[int, int] = field(default_factory=dict)  # shard -> its last logged seq, as last seen

    @property
    def spec(self) -> sharding.ShardSpec:
        return sharding.ShardSpec.from_dict(self.config["shard"])

    @property
    def count(self) -> int:
        return len(self.ids)


def _gate():
    # lazy: ingress imports this module at import time (the loop of issue #28)
    from .ingress import Route

    return Route(-1, "")


def group_shards(found: dict[str, tuple[int, dict]]) -> tuple[dict[str, ShardedMap], set[str]]:
    """Worker map summaries (``{shard map id: (worker, summary)}``, ordinary maps included) -> the
    sharded maps whose K shards are all present, and the ids of every shard map seen."""
    parts: dict[str, dict[int, tuple[int, dict]]] = {}
    seen = set()
    for mid, (w, summ) in found.items():
        sh = (summ.get("config") or {}).get("shard")
        if not isinstance(sh, dict):
            continue
        seen.add(mid)
        parts.setdefault(sh.get("map_id", ""), {})[int(sh["index"])] = (w, summ)
    out = {}
    for map_id, by_index in parts.items():
        first = next(iter(by_index.values()))[1]
        k = int(first["config"]["shard"]["count"])
        if sorted(by_index) != list(range(k)):
            continue  # a shard missing (its worker is not answering): the map is not served
        ordered = [by_index[i] for i in range(k)]
        out[map_id] = ShardedMap(
            id=map_id,
            name=first["config"]["shard"].get("name") or map_id,
            config=by_index[0][1]["config"],
            workers=[w for w, _ in ordered],
            ids=[s["id"] for _, s in ordered],
            created=by_index[0][1].get("created"),
        )
    return out, seen


def new_sharded_id() -> str:
    return "s" + secrets.token_hex(8)


def summary(sm: ShardedMap, parts: list[dict]) -> dict:
    """The sharded map's ``GET /v1/maps`` entry from its shards' summaries."""
    cfg = {k: v for k, v in sm.config.items() if k != "shard"}
    spec = sm.spec
    return {
        "id": sm.id,
        "name": sm.name,
        "created": sm.created,
        "config": {
            **cfg,
            "shards": sm.count,
            "shard_block_tiles": spec.block_tiles,
            "shard_halo_m": spec.halo_m,
        },
        "frames_integrated": max(int(p.get("frames_integrated", 0)) for p in parts),
        "version": sum(int(p.get("version", 0)) for p in parts),
        "last_seq": sum(int(p.get("last_seq", 0)) for p in parts),
        "queue_depth": sum(int(p.get("queue_depth", 0)) for p in parts),
        "memory_bytes": sum(int(p.get("memory_bytes") or 0) for p in parts),
        "memory_budget_bytes": sum(int(p.get("memory_budget_bytes") or 0) for p in parts),
        "shards": [
            {"index": i, "worker": sm.workers[i], "map_id": sm.ids[i], "memory_bytes": p.get("memory_bytes")}
            for i, p in enumerate(parts)
        ],
    }


def parse_json_or_msgpack(body: bytes, content_type: str):
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in wire.MSGPACK_TYPES:
        return wire.unpackb(body)
    try:
        return json.loads(body)
    except ValueError as e:
        raise wire.MalformedMessage(f"body: not valid JSON ({e})") from None


def slice_lattice(
    params: dict, resolution_default: float
) -> tuple[tuple[float, float], tuple[int, int], float]:
    """``(origin_xy, (h, w), resolution)`` of ``Map.esdf_slice`` for explicit bounds."""
    res = float(params.get("resolution_m") or resolution_default)
    x0, y0 = float(params["x_min"]), float(params["y_min"])
    w = max(1, math.ceil((float(params["x_max"]) - x0) / res))
    h = max(1, math.ceil((float(params["y_max"]) - y0) / res))
    return (x0, y0), (h, w), res


# ------------------------------------------------------------------------------ export format (pure)
EXPORT_FORMAT = "mapper-sharded-export/1"
EXPORT_MEDIA_TYPE = "application/x-tar"


def export_manifest(sm: ShardedMap, sizes: list[int]) -> dict:
    """The ``manifest.json`` of a sharded export: the format, the map's id, name and config (shard 0's,
    without its ``shard`` entry), K, the block size and halo, and each shard file's name and size."""
    spec = sm.spec
    return {
        "format": EXPORT_FORMAT,
        "id": sm.id,
        "name": sm.name,
        "shards": sm.count,
        "block_tiles": spec.block_tiles,
        "halo_m": spec.halo_m,
        "config": {k: v for k, v in sm.config.items() if k != "shard"},
        "files": [{"name": f"shard{i}.safetensors", "bytes": int(n)} for i, n in enumerate(sizes)],
    }


def tar_header(name: str, size: int) -> bytes:
    """The 512-byte (GNU, any size) tar header of a regular file: a sharded export is a tar written as it
    streams (``manifest.json``, then ``shard<i>.safetensors``, each an exported snapshot)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = int(size), 0o644, 0
    return info.tobuf(tarfile.GNU_FORMAT)


def tar_padding(size: int) -> bytes:
    return b"\0" * (-int(size) % 512)


TAR_END = b"\0" * 1024


def is_sharded_export(data: bytes) -> bool:
    """Whether an import body is a tar (a sharded export) rather than a snapshot file."""
    return len(data) >= 512 and data[257:262] == b"ustar"


def read_export(data: bytes) -> tuple[dict, list[bytes]]:
    """A sharded export -> (its manifest, the K shard snapshot files in shard order). Raises
    ``InvalidArgument`` naming what is missing or malformed."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            if "manifest.json" not in members:
                raise InvalidArgument("import: a tar without manifest.json is not a sharded export")
            man = json.loads(tar.extractfile(members["manifest.json"]).read())
            if not isinstance(man, dict) or man.get("format") != EXPORT_FORMAT:
                got = man.get("format") if isinstance(man, dict) else None
                raise InvalidArgument(f"import: manifest.json format {got!r} is not {EXPORT_FORMAT!r}")
            k, files = man.get("shards"), man.get("files")
            if (
                isinstance(k, bool)
                or not isinstance(k, int)
                or k < 2
                or not isinstance(files, list)
                or len(files) != k
            ):
                raise InvalidArgument(
                    "import: manifest.json needs shards (an int >= 2) and one file per shard"
                )
            out = []
            for i, f in enumerate(files):
                name = f.get("name") if isinstance(f, dict) else None
                if name != f"shard{i}.safetensors" or name not in members:
                    raise InvalidArgument(f"import: shard {i}'s file shard{i}.safetensors is missing")
                out.append(tar.extractfile(members[name]).read())
    except (tarfile.TarError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, InvalidArgument):
            raise
        raise InvalidArgument(f"import: not a readable sharded export ({type(e).__name__}: {e})") from None
    for key in ("block_tiles", "halo_m", "config"):
        if key not in man:
            raise InvalidArgument(f"import: manifest.json has no {key}")
    return man, out


# ------------------------------------------------------------------------------------- the ingress side
MSGPACK_HEADERS = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}


async def _json_reply(router, index: int, method: str, path: str, **kw):
    """One request to a worker, read whole: (status, body bytes, headers)."""
    resp = await router.json(index, method, path, **kw)
    return resp.status_code, resp.content, resp.headers


def _error_response(status: int, content: bytes, headers):
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import Response

    keep = {k: v for k, v in headers.items() if k.lower() in ("content-type",)}
    return Response(content, status_code=status, headers=keep)


async def create(router, body: dict, k: int, headers: dict):
    """Create a sharded map: the config is validated and completed by a worker (an ordinary create of the
    same body, deleted again), then one shard map per worker, on the K least loaded workers."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import JSONResponse

    plain = {key: v for key, v in body.items() if key not in ("shards", "shard_block_m", "name")}
    block_m = body.get("shard_block_m")
    if block_m is not None and (
        isinstance(block_m, bool) or not isinstance(block_m, (int, float)) or not 0 < block_m <= 1e5
    ):
        raise InvalidArgument(f"shard_block_m: expected a number in (0, 1e5] metres, got {block_m!r}")
    name = body.get("name")
    if name is not None and any(getattr(x, "name", None) == name for x in _all_maps(router)):
        raise Conflict(f"name: a map named {name!r} exists")
    order = await router.ranked()
    probe_worker = order[0]
    status, content, hdrs = await _json_reply(
        router,
        probe_worker,
        "POST",
        "/v1/maps",
        headers={"content-type": "application/json"},
        content=json.dumps(plain).encode(),
    )
    if status != 201:
        return _error_response(status, content, hdrs)
    probe = json.loads(content)
    await _json_reply(router, probe_worker, "DELETE", f"/v1/maps/{probe['id']}")
    config = probe["config"]
    halo = sharding.halo_for(config)
    tile_m = sharding.TILE_VOXELS * float(config["voxel_size_m"])
    tiles = (
        max(1, round(float(block_m) / tile_m))
        if block_m is not None
        else sharding.default_block_tiles(config["voxel_size_m"], halo)
    )
    map_id = new_sharded_id()
    name = name or map_id
    workers = order[:k]
    budget = body.get("memory_budget_bytes")
    ids = []
    try:
        for i, w in enumerate(workers):
            spec = sharding.ShardSpec(i, k, tiles, halo, map_id, name)
            cfg = {**config, "shard": spec.to_dict()}
            summ = await asyncio.wait_for(
                _await(router.workers[w].actor.create_map.remote(f"{map_id}.s{i}", cfg, budget)), 300
            )
            ids.append(summ["id"])
    except Exception:
        for i, mid in enumerate(ids):  # all or nothing
            await _json_reply(router, workers[i], "DELETE", f"/v1/maps/{mid}")
        raise
    sm = ShardedMap(
        map_id,
        name,
        {**config, "shard": sharding.ShardSpec(0, k, tiles, halo, map_id, name).to_dict()},
        list(workers),
        ids,
    )
    router.sharded[map_id] = sm
    parts = await asyncio.gather(*(_summary_of(router, sm, i) for i in range(k)))
    sm.created = parts[0].get("created")
    return JSONResponse(summary(sm, parts), status_code=201)


def _all_maps(router):
    return list(router.routes.values()) + list(router.sharded.values())


async def _await(ref):
    return await ref


async def _actor(ref, timeout_s: float):
    """An actor call's result; the library error it raised (``InvalidArgument``...) raised here as itself,
    so the client gets its 4xx, not a 500."""
    try:
        return await asyncio.wait_for(_await(ref), timeout_s)
    except Exception as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, MapperError):
            raise cause from None
        raise


async def _summary_of(router, sm: ShardedMap, i: int, detail: bool = False) -> dict:
    status, content, _ = await _json_reply(router, sm.workers[i], "GET", f"/v1/maps/{sm.ids[i]}")
    if status != 200:
        # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
        from ..api.errors import Unavailable

        raise Unavailable(f"shard {i} of map {sm.id!r} answered {status}; retry")
    out = json.loads(content)
    if not detail:
        out.pop("stats", None)
        out.pop("snapshot", None)
    return out


async def get_map(router, sm: ShardedMap):
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import JSONResponse

    parts = await asyncio.gather(*(_summary_of(router, sm, i, True) for i in range(sm.count)))
    out = summary(sm, parts)
    stats = [p.get("stats") or {} for p in parts]
    out["stats"] = {
        "voxel_size_m": sm.config["voxel_size_m"],
        "device": ",".join(sorted({str(s.get("device")) for s in stats})),
        "frames_integrated": out["frames_integrated"],
        "version": out["version"],
        "layers": sum_layers([s.get("layers") for s in stats]),
        "shards": [s.get("layers") for s in stats],
    }
    out["snapshot"] = None
    return JSONResponse(out, headers={"X-Map-Version": str(out["version"])})


async def delete(router, sm: ShardedMap):
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import Response

    for i in range(sm.count):
        status, content, hdrs = await _json_reply(router, sm.workers[i], "DELETE", f"/v1/maps/{sm.ids[i]}")
        if status not in (204, 404):
            return _error_response(status, content, hdrs)
    router.sharded.pop(sm.id, None)
    return Response(status_code=204)


async def integrate(router, sm: ShardedMap, body: bytes, content_type: str, settings) -> tuple[int, dict]:
    """One frame into a sharded map: (status, ack or error body). The frame is parsed here (its footprint
    picks the shards) and sent as it came to each of them; 200 once every one has acked it (in its WAL)."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from ..api.errors import error_body, status_of

    try:
        msg = await asyncio.to_thread(parse_json_or_msgpack, body, content_type)
        limits = wire.Limits(
            settings.max_points_per_frame,
            settings.max_image_pixels,
            settings.max_query_points,
            settings.max_pose_translation_m,
        )
        frame = await asyncio.to_thread(wire.parse_frame, msg, limits)
        if frame.T_world_sensor is None:
            raise InvalidArgument("T_world_sensor: required on a sharded map (its shards do not track)")
        targets = await asyncio.to_thread(frame_shards, frame, sm.config) or [0]
    except MapperError as e:
        return status_of(e), error_body(e)
    ctype = "application/json" if not content_type else content_type
    real = targets or [0]  # a frame that changes no voxel still goes to one shard, for its ack
    pose = None if 0 in real else wire.packb(pose_only_message(frame))
    sends = [(i, body, ctype) for i in real] + ([(0, pose, wire.MSGPACK)] if pose is not None else [])
    async with sm.lock:  # one frame order for every shard (callers hold sm.gate)
        results = await asyncio.gather(*(_send_frame(router, sm, i, b, t) for i, b, t in sends))
    for status, out in results:
        if status != 200:
            out = dict(out)
            out["detail"] = f"{out.get('detail', '')} (shards {real}; the others may hold the frame)"
            return status, out
    replies = [r for (_, b, _), (_, r) in zip(sends, results, strict=True) if b is not pose]
    ack = dict(next((r for r in replies if not r.get("recovered")), replies[0]))
    ack.pop("recovered", None)
    if frame.frame_id is not None:
        ack.setdefault("frame_id", frame.frame_id)
    ack["shards"] = {
        str(i): {
            "seq": r["seq"],
            "map_version": r["map_version"],
            **({"pose_only": True} if b is pose else {}),
        }
        for (i, b, _), (_, r) in zip(sends, results, strict=True)
    }
    return 200, ack


RECOVER_S = 150.0  # a shard's worker died with a frame: how long to wait for it to answer again


async def _send_frame(router, sm: ShardedMap, i: int, body: bytes, ctype: str) -> tuple[int, dict]:
    """One frame to shard ``i`` (under ``sm.lock``): (status, its ack or error). Exactly once: a 429 (not
    logged) is sent again; when the worker dies with the frame (``WorkerLost``), the shard's last seq after
    Ray restarted it says whether the frame reached its WAL (then the recovered map holds it: acked) or
    not (sent again). So every shard a frame goes to holds it once, and an unacked frame is in none."""
    # lazy: ingress imports this module at import time (the loop of issue #28)
    from .ingress import WorkerLost

    loop = asyncio.get_running_loop()
    if i not in sm.seqs:
        sm.seqs[i] = int((await _summary_of(router, sm, i))["last_seq"])
    before = sm.seqs[i]
    busy_until = loop.time() + BUSY_RETRY_S
    while True:
        try:
            resp = await router.json(
                sm.workers[i],
                "POST",
                f"/v1/maps/{sm.ids[i]}/frames",
                headers={"content-type": ctype, "accept": "application/json"},
                content=body,
            )
        except WorkerLost:
            summ = await _summary_after_restart(router, sm, i)
            if int(summ["last_seq"]) > before:  # logged before the worker died: recovered from its WAL
                sm.seqs[i] = int(summ["last_seq"])
                log.warning("map %s: shard %d's worker died with a frame; it was in its WAL", sm.id, i)
                return 200, {"seq": sm.seqs[i], "map_version": summ["version"], "recovered": True}
            log.warning("map %s: shard %d's worker died with a frame before logging it; sent again", sm.id, i)
            continue  # never logged: safe to send again
        if resp.status_code == 429 and loop.time() < busy_until:
            await asyncio.sleep(0.05)  # not logged there: safe to send again
            continue
        out = resp.json()
        if resp.status_code == 200:
            sm.seqs[i] = int(out["seq"])
        return resp.status_code, out


async def _summary_after_restart(router, sm: ShardedMap, i: int) -> dict:
    """Shard ``i``'s summary once its worker answers again (Ray restarts a dead actor; its maps recover)."""
    # lazy: ingress imports this module at import time (the loop of issue #28)
    from .ingress import WorkerLost

    deadline = asyncio.get_running_loop().time() + RECOVER_S
    while True:
        try:
            return await _summary_of(router, sm, i)
        except (WorkerLost, MapperError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def query(router, sm: ShardedMap, kind: str, body: bytes, content_type: str, settings) -> dict:
    """Per-point query: each point to its owner; the answers in the request's order."""
    msg = await asyncio.to_thread(parse_json_or_msgpack, body, content_type)
    if not isinstance(msg, dict):
        raise wire.MalformedMessage(f"body: expected an object, got {type(msg).__name__}")
    pts = await asyncio.to_thread(
        wire.check_points, msg.get("points"), "points", settings.max_query_points, False
    )
    spec = sm.spec
    owner = sharding.owner_of_points(pts, sm.config["voxel_size_m"], spec.count, spec.block_tiles).numpy()

    async def one(i: int):
        rows = np.nonzero(owner == i)[0]
        resp = await router.json(
            sm.workers[i],
            "POST",
            f"/v1/maps/{sm.ids[i]}/query/{kind}",
            headers=MSGPACK_HEADERS,
            content=wire.packb({"points": wire.encode_array(pts[rows])}),
        )
        return rows, resp

    parts = await asyncio.gather(*(one(i) for i in sorted(set(owner.tolist()))))
    for _, resp in parts:
        if resp.status_code != 200:
            raise _Upstream(resp)
    return gather_rows([(rows, decode_arrays(wire.unpackb(resp.content))) for rows, resp in parts], len(pts))


class _Upstream(Exception):
    """A shard's error reply, returned to the client as it is."""

    def __init__(self, resp):
        super().__init__(resp.status_code)
        self.resp = resp


async def slice_(router, sm: ShardedMap, params: dict) -> dict:
    """A horizontal ESDF slice over explicit bounds: every shard owning a cell computes the lattice, each
    cell taken from its owner."""
    keys = ("x_min", "y_min", "x_max", "y_max")
    given = [params.get(k) is not None for k in keys]
    if any(given) and not all(given):
        raise InvalidArgument("x_min, y_min, x_max, y_max: give all four or none")
    if not any(given):  # one map's default: the ESDF's extent
        lo, hi = await esdf_bounds(router, sm)
        params = {
            **params,
            "x_min": repr(lo[0]),
            "y_min": repr(lo[1]),
            "x_max": repr(hi[0]),
            "y_max": repr(hi[1]),
        }
    es = float(sm.config.get("esdf_voxel_size_m") or sm.config["voxel_size_m"])
    origin, shape, res = slice_lattice(params, es)
    centres = lattice_centres(origin, res, shape[::-1])  # [w, h, 2] (x, y)
    spec = sm.spec
    owner = (
        sharding.owner_of_points(
            torch.from_numpy(centres.reshape(-1, 2)), sm.config["voxel_size_m"], spec.count, spec.block_tiles
        )
        .numpy()
        .reshape(shape[1], shape[0])
        .T
    )  # [h, w] as the slice
    q = {**params, "format": "msgpack"}
    involved = sorted(set(owner.reshape(-1).tolist()))
    resps = await asyncio.gather(
        *(router.json(sm.workers[i], "GET", f"/v1/maps/{sm.ids[i]}/esdf/slice", params=q) for i in involved)
    )
    for resp in resps:
        if resp.status_code != 200:
            raise _Upstream(resp)
    parts = {i: decode_arrays(wire.unpackb(r.content)) for i, r in zip(involved, resps, strict=True)}
    return gather_cells(parts, owner, ("distance",))


async def box(router, sm: ShardedMap, body: bytes, content_type: str) -> dict:
    msg = await asyncio.to_thread(parse_json_or_msgpack, body, content_type)
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from pydantic import ValidationError

    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from ..api.schemas import BoxRequest

    try:
        req = BoxRequest.model_validate(msg)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise InvalidArgument(
            f"body.{loc}: {first.get('msg')}" if loc else f"body: {first.get('msg')}"
        ) from None
    es = float(sm.config.get("esdf_voxel_size_m") or sm.config["voxel_size_m"])
    shape = tuple(max(1, math.ceil((b - a) / es)) for a, b in zip(req.aabb_min, req.aabb_max, strict=True))
    centres = lattice_centres(req.aabb_min, es, shape)
    spec = sm.spec
    owner = (
        sharding.owner_of_points(
            torch.from_numpy(centres.reshape(-1, 3)), sm.config["voxel_size_m"], spec.count, spec.block_tiles
        )
        .numpy()
        .reshape(shape)
    )
    involved = sorted(set(owner.reshape(-1).tolist()))
    resps = await asyncio.gather(
        *(
            router.json(
                sm.workers[i],
                "POST",
                f"/v1/maps/{sm.ids[i]}/esdf/box",
                headers={"content-type": "application/json", "accept": wire.MSGPACK},
                content=json.dumps(req.model_dump()).encode(),
            )
            for i in involved
        )
    )
    for resp in resps:
        if resp.status_code != 200:
            raise _Upstream(resp)
    parts = {i: decode_arrays(wire.unpackb(r.content)) for i, r in zip(involved, resps, strict=True)}
    return gather_cells(parts, owner, ("distance", "gradient", "observed"))


async def mesh(router, sm: ShardedMap, since: int | None = None):
    """The sharded map's mesh (``mapper.mesh.Mesh``, its ``version`` a cursor of ``sm.cursors``) and the
    sum of the shards' map versions. With ``since`` (a cursor handed out before) each shard is asked for its
    delta since its own version then, and the gathered delta is relative to ``since``; an unknown cursor,
    or a shard that no longer reaches back, gives the whole mesh."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from ..api.deps import VERSION_HEADER

    vec = sm.cursors.lookup(since) if since is not None else None
    if vec is not None and len(vec) != sm.count:
        vec = None

    async def fetch(i: int, v: int | None):
        params = {"format": "msgpack"} if v is None else {"format": "msgpack", "since_version": v}
        return await router.json(sm.workers[i], "GET", f"/v1/maps/{sm.ids[i]}/mesh", params=params)

    resps = await asyncio.gather(*(fetch(i, None if vec is None else vec[i]) for i in range(sm.count)))
    if vec is not None and any(r.status_code == 422 for r in resps):  # a shard's versions went back
        vec = None
        resps = await asyncio.gather(*(fetch(i, None) for i in range(sm.count)))
    for resp in resps:
        if resp.status_code != 200:
            raise _Upstream(resp)
    meshes = {i: mapper_io.mesh_from_msgpack(r.content) for i, r in enumerate(resps)}
    if len({m.full for m in meshes.values()}) > 1:  # one shard's change log did not reach back: all whole
        again = [i for i, m in meshes.items() if not m.full]
        for i, r in zip(again, await asyncio.gather(*(fetch(i, None) for i in again)), strict=True):
            if r.status_code != 200:
                raise _Upstream(r)
            meshes[i] = mapper_io.mesh_from_msgpack(r.content)
            resps[i] = r
    map_version = sum(int(r.headers.get(VERSION_HEADER, 0)) for r in resps)
    spec = sm.spec
    cursor = sm.cursors.issue([meshes[i].version for i in range(sm.count)])
    out = await asyncio.to_thread(gather_mesh, meshes, spec.count, spec.block_tiles, cursor)
    if not out.full:
        out.since_version = since
    return out, map_version


async def status(router, sm: ShardedMap) -> dict:
    """The viewer's live numbers (``GET .../status``) of a sharded map: frames, trajectory length and
    config from shard 0 (it records every frame's pose), versions summed (the mesh version is a cursor),
    voxels / bricks / bytes summed over the shards (what they hold: halo copies included), the extent of
    each layer as the union of the shards' (equal to one map's: a shard holds only bricks one map has)."""
    resps = await asyncio.gather(
        *(router.json(sm.workers[i], "GET", f"/v1/maps/{sm.ids[i]}/status") for i in range(sm.count))
    )
    for resp in resps:
        if resp.status_code != 200:
            raise _Upstream(resp)
    parts = [r.json() for r in resps]
    p0 = parts[0]
    mesh_versions = [p.get("mesh_version") for p in parts]
    bounds: dict = {}
    for p in parts:
        for name, b in (p.get("bounds") or {}).items():
            if name not in bounds:
                bounds[name] = {"min": list(b["min"]), "max": list(b["max"])}
            else:
                bounds[name]["min"] = [min(a, c) for a, c in zip(bounds[name]["min"], b["min"], strict=True)]
                bounds[name]["max"] = [max(a, c) for a, c in zip(bounds[name]["max"], b["max"], strict=True)]
    acks = [p["ack_ms"] for p in parts if p.get("ack_ms") is not None]
    return {
        **p0,
        "id": sm.id,
        "name": sm.name,
        "queue_depth": sum(int(p.get("queue_depth") or 0) for p in parts),
        "ack_ms": max(acks) if acks else None,
        "version": sum(int(p.get("version") or 0) for p in parts),
        "mesh_version": None if None in mesh_versions else sm.cursors.issue(mesh_versions),
        "layers": sum_layers([p.get("layers") for p in parts]),
        "bounds": bounds,
    }


async def occupied(router, sm: ShardedMap, max_voxels: int) -> dict:
    """``GET .../occupied`` of a sharded map: every shard's occupied voxels (up to the route's cap), the
    owned ones in one map's order (``gather_occupied``)."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from ..api.routes.viewer import MAX_OCCUPIED

    resps = await asyncio.gather(
        *(
            router.json(
                sm.workers[i],
                "GET",
                f"/v1/maps/{sm.ids[i]}/occupied",
                params={"max_voxels": MAX_OCCUPIED},
                headers={"accept": wire.MSGPACK},
            )
            for i in range(sm.count)
        )
    )
    for resp in resps:
        if resp.status_code != 200:
            raise _Upstream(resp)
    parts = {i: decode_arrays(wire.unpackb(r.content)) for i, r in enumerate(resps)}
    spec = sm.spec
    return await asyncio.to_thread(gather_occupied, parts, spec.count, spec.block_tiles, max_voxels)


async def esdf_bounds(router, sm: ShardedMap) -> tuple[list[float], list[float]]:
    """The extent (x, y, z min / max, metres) of the sharded map's ESDF: the union of its shards' (what
    one map's slice defaults to). ``InvalidArgument`` when no shard has an ESDF yet."""
    got = await asyncio.gather(
        *(
            asyncio.wait_for(_await(router.workers[w].actor.esdf_bounds.remote(mid)), 120)
            for w, mid in zip(sm.workers, sm.ids, strict=True)
        )
    )
    got = [b for b in got if b is not None]
    if not got:
        raise InvalidArgument("the map has no ESDF yet: pass explicit bounds")
    lo = [min(b[0][a] for b in got) for a in range(3)]
    hi = [max(b[1][a] for b in got) for a in range(3)]
    return lo, hi


async def fan_out(router, sm: ShardedMap, method: str, path: str, body: bytes, headers: dict):
    """An edit every shard applies the same way (clear, decay, snapshot): sent to all; the first reply
    with the others' under ``shards``."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import JSONResponse

    async with sm.lock:
        sm.seqs.clear()  # the edit is logged too: frames read each shard's last seq again
        resps = await asyncio.gather(
            *(
                router.json(
                    sm.workers[i], method, f"/v1/maps/{sm.ids[i]}/{path}", headers=headers, content=body
                )
                for i in range(sm.count)
            )
        )
    for resp in resps:
        if resp.status_code >= 300:
            raise _Upstream(resp)
    out = dict(resps[0].json())
    out["shards"] = [r.json() for r in resps]
    return JSONResponse(out, status_code=resps[0].status_code)


async def export(router, sm: ShardedMap):
    """``GET .../export`` of a sharded map: a tar streamed as it is read (``manifest.json``, then every
    shard's exported snapshot). Each shard's export is opened under the map's frame lock, so all of them
    show the same frames (each worker snapshots and opens its file before it answers)."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import StreamingResponse

    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from ..api.deps import attachment

    resps = []
    try:
        async with sm.lock:
            for i in range(sm.count):
                resp = await router.send(sm.workers[i], "GET", f"/v1/maps/{sm.ids[i]}/export")
                resps.append(resp)
                if resp.status_code != 200:
                    await resp.aread()
                    raise _Upstream(resp)
        sizes = [int(r.headers["content-length"]) for r in resps]
    except BaseException:
        for r in resps:
            await r.aclose()
        raise
    man = json.dumps(export_manifest(sm, sizes)).encode()

    async def chunks():
        try:
            yield tar_header("manifest.json", len(man)) + man + tar_padding(len(man))
            for i, (resp, size) in enumerate(zip(resps, sizes, strict=True)):
                yield tar_header(f"shard{i}.safetensors", size)
                n = 0
                async for b in resp.aiter_raw():
                    n += len(b)
                    yield b
                if n != size:  # cut: end the stream without the tar's end (the client sees it broken)
                    raise RuntimeError(f"shard {i}: export cut after {n} of {size} bytes")
                yield tar_padding(size)
            yield TAR_END
        finally:
            for r in resps:
                await r.aclose()

    return StreamingResponse(
        chunks(),
        media_type=EXPORT_MEDIA_TYPE,
        headers={"Content-Disposition": attachment(f"{sm.name}.sharded.tar")},
    )


async def import_export(router, data: bytes, name: str | None):
    """``POST /v1/maps/import`` of a sharded export: a new sharded map (a new id; the stored name unless
    ``name`` is given or the stored one is taken) with K shards on the K least loaded workers, each shard
    loaded by its worker from its snapshot file (sent through Ray's object store: no shared filesystem
    needed). All or nothing. Caller holds ``router.lock``."""
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    from fastapi.responses import JSONResponse

    man, files = await asyncio.to_thread(read_export, data)
    k = check_shards({"shards": man["shards"]}, len(router.workers))
    taken = {x.name for x in _all_maps(router)}
    if name is not None and name in taken:
        raise Conflict(f"name: a map named {name!r} exists")
    stored = man.get("name") if isinstance(man.get("name"), str) else None
    map_id = new_sharded_id()
    name = name or (stored if stored not in taken else None) or map_id
    if len(router.routes) + len(router.sharded) >= router.settings.max_maps:
        raise Conflict(f"map limit reached ({router.settings.max_maps} maps; MAPPER_MAX_MAPS)")
    specs = [
        sharding.ShardSpec.from_dict(
            {"index": i, "count": k, "block_tiles": man["block_tiles"], "halo_m": man["halo_m"]}
        )
        for i in range(k)
    ]
    workers = (await router.ranked())[:k]
    ids: list[str] = []
    try:
        for i, (w, blob) in enumerate(zip(workers, files, strict=True)):
            spec = {**specs[i].to_dict(), "map_id": map_id, "name": name}
            summ = await _actor(
                router.workers[w].actor.import_shard.remote(f"{map_id}.s{i}", blob, spec), 300
            )
            ids.append(summ["id"])
            if i == 0:
                config = summ["config"]
    except Exception:
        for i, mid in enumerate(ids):  # all or nothing
            await _json_reply(router, workers[i], "DELETE", f"/v1/maps/{mid}")
        raise
    sm = ShardedMap(map_id, name, config, list(workers), ids)
    router.sharded[map_id] = sm
    parts = await asyncio.gather(*(_summary_of(router, sm, i) for i in range(k)))
    sm.created = parts[0].get("created")
    return JSONResponse(summary(sm, parts), status_code=201)

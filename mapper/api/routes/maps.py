"""Maps: create, list, inspect, delete; clear, decay, snapshot, export, import."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from ...errors import InvalidArgument, NotFound
from ...formats import nanovdb, vdb
from ..deps import EntryDep, ReadAuth, ServiceDep, SettingsDep, WriteAuth, attachment, version_header
from ..schemas import (
    IMPORT_BODY,
    NAME_PATTERN,
    ClearRequest,
    DecayRequest,
    ErrorBody,
    MapCreate,
    MapDetail,
    MapList,
    MapSummary,
    OpResult,
    SnapshotInfo,
)

ERRORS = {c: {"model": ErrorBody} for c in (400, 401, 403, 404, 409, 413, 422, 429, 503, 507)}
router = APIRouter(prefix="/v1/maps", tags=["maps"], dependencies=[ReadAuth], responses=ERRORS)


def _config(body: MapCreate, settings) -> dict:
    cfg = {
        "voxel_size_m": body.voxel_size_m or settings.default_voxel_size_m,
        "layers": list(body.layers or settings.default_layers),
        "max_range_m": body.max_range_m or settings.default_max_range_m,
    }
    for k in (
        "truncation_vox",
        "esdf_max_distance_m",
        "esdf_voxel_size_m",
        "tsdf_max_weight",
        "tsdf_obs_weight",
        "keep_radius_m",
    ):
        if getattr(body, k) is not None:
            cfg[k] = getattr(body, k)
    if body.occupancy is not None:
        cfg["occupancy"] = body.occupancy.model_dump(exclude_none=True)
    if body.registration is not None:
        cfg["registration"] = body.registration.model_dump(exclude_none=True)
    return cfg


@router.post("", status_code=201, response_model=MapSummary, dependencies=[WriteAuth])
async def create_map(body: MapCreate, service: ServiceDep, settings: SettingsDep) -> MapSummary:
    """Create an empty map; returns its server-generated id."""
    if (body.shards or 1) > 1:
        raise InvalidArgument("shards: a sharded map needs the cluster (mapper serve --ray)")
    entry = await service.create(body.name, _config(body, settings), body.memory_budget_bytes)
    return MapSummary(**entry.summary())


@router.get("", response_model=MapList)
async def list_maps(service: ServiceDep) -> MapList:
    return MapList(maps=[MapSummary(**e.summary()) for e in service.list()])


@router.get("/{map_id}", response_model=MapDetail)
async def get_map(entry: EntryDep, response: Response) -> MapDetail:
    """The map's config and ``stats()`` (voxels and bytes per layer, frames, last stage timings) of its last
    published version (``version``, also in the ``X-Map-Version`` header)."""
    seen = []

    def run(m):
        seen.append(m.version)
        return m.stats()

    stats = await entry.read(run)
    response.headers.update(version_header(seen[0]))
    snap = entry.last_snapshot
    info = None
    if snap is not None:
        info = SnapshotInfo(
            map_id=entry.id, seq=snap.seq, bytes=_size(snap.path), version=snap.meta.get("version")
        )
    summary = {**entry.summary(), "version": seen[0], "frames_integrated": stats["frames_integrated"]}
    return MapDetail(**summary, stats=stats, snapshot=info)


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@router.delete("/{map_id}", status_code=204, dependencies=[WriteAuth])
async def delete_map(map_id: str, entry: EntryDep, service: ServiceDep) -> Response:
    await service.delete(entry.id)
    return Response(status_code=204)


@router.post("/{map_id}/clear", response_model=OpResult, dependencies=[WriteAuth])
async def clear_map(entry: EntryDep, body: ClearRequest | None = None) -> OpResult:
    """Remove the voxels in a box (``aabb_min``/``aabb_max``), outside a sphere, or everything."""
    body = body or ClearRequest()
    if body.keep_center_m is not None:
        fut = await entry.maintain(
            "clear_outside", {"center_m": body.keep_center_m, "radius_m": body.keep_radius_m}
        )
    else:
        fut = await entry.maintain("clear", {"aabb_min": body.aabb_min, "aabb_max": body.aabb_max})
    return OpResult(**await fut)


@router.post("/{map_id}/decay", response_model=OpResult, dependencies=[WriteAuth])
async def decay_map(entry: EntryDep, body: DecayRequest | None = None) -> OpResult:
    """Fade observations: weights x ``factor``; voxels below ``threshold`` become unknown."""
    body = body or DecayRequest()
    fut = await entry.maintain("decay", {"factor": body.factor, "threshold": body.threshold})
    return OpResult(**await fut)


@router.post("/{map_id}/snapshot", response_model=SnapshotInfo, dependencies=[WriteAuth])
async def snapshot_map(entry: EntryDep) -> SnapshotInfo:
    """Write a snapshot now (safetensors + JSON), truncating the write-ahead log it covers."""
    snap = await entry.snapshot()
    if snap is None:
        snap = await entry.snapshot(force=True)
    return SnapshotInfo(
        map_id=entry.id, seq=snap.seq, bytes=_size(snap.path), version=snap.meta.get("version")
    )


@router.get(
    "/{map_id}/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "the snapshot file, or (format=vdb / nvdb) one layer as an OpenVDB / NanoVDB grid",
        }
    },
)
async def export_map(
    entry: EntryDep,
    format: Annotated[
        Literal["snapshot", "vdb", "nvdb"],
        Query(description="snapshot (safetensors, for import), vdb (OpenVDB) or nvdb (NanoVDB)"),
    ] = "snapshot",
    layer: Annotated[Literal["tsdf", "esdf"], Query(description="the layer of a vdb / nvdb export")] = "tsdf",
) -> Response:
    """Download the map as a snapshot file (safetensors; the header metadata holds the config);
    ``POST /v1/maps/import`` takes it back. ``format=vdb`` / ``nvdb``: the observed voxels of ``layer``
    (TSDF or ESDF, metres) as an OpenVDB ``FloatGrid`` / a NanoVDB float grid (``mapper.formats.vdb``,
    ``mapper.formats.nanovdb``) with the voxel-size transform."""
    if format != "snapshot":
        if layer not in entry.map.layers:
            raise InvalidArgument(
                f"layer: the map has no {layer!r} layer (it has {', '.join(entry.map.layers)})"
            )
        grid = await entry.read(lambda m: vdb.map_layer_grid(m, layer), esdf=layer == "esdf")
        body = await asyncio.to_thread(grid_file_bytes, grid, format)
        return Response(
            body,
            media_type="application/octet-stream",
            headers={"Content-Disposition": attachment(f"{entry.name}-{layer}.{format}")},
        )
    snap = await entry.snapshot()
    if snap is None:
        snap = await entry.snapshot(force=True)
    try:
        f = await asyncio.to_thread(open, snap.path, "rb")  # open now: a later snapshot may prune the file
    except OSError:
        raise NotFound(f"map {entry.id!r}: snapshot file vanished; retry") from None
    size = _size(snap.path)

    async def chunks():
        try:
            while True:
                b = await asyncio.to_thread(f.read, 1 << 20)
                if not b:
                    break
                yield b
        finally:
            f.close()

    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={
            "Content-Disposition": attachment(f"{entry.name}-{snap.seq}.safetensors"),
            "Content-Length": str(size),
            "X-Mapper-Seq": str(snap.seq),
        },
    )


@router.post(
    "/import", status_code=201, response_model=MapSummary, dependencies=[WriteAuth], openapi_extra=IMPORT_BODY
)
async def import_map(
    request: Request,
    service: ServiceDep,
    name: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
) -> MapSummary:
    """Create a map from an exported snapshot file (a new id; the stored name unless ``name`` is given
    or taken)."""
    data = await request.body()
    entry = await service.import_map(data, name)
    return MapSummary(**entry.summary())


def grid_file_bytes(grid, format: str) -> bytes:
    """A layer's grid as a ``.vdb`` or ``.nvdb`` file."""
    return vdb.vdb_bytes([grid]) if format == "vdb" else nanovdb.nvdb_bytes([grid])

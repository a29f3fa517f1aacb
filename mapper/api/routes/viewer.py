"""The browser viewer: its page (``GET /viewer``, ``GET /`` redirects there) and the read-only /v1 routes
it polls: block meshes (incremental), the sensor trajectory, occupied voxels and a cheap live status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from typing import Annotated

import numpy as np
import torch
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from ... import viewer
from ...foxglove import FoxgloveBridge
from ...mesh import apply_delta, empty_mesh
from ..deps import VERSION_HEADER, EntryDep, ReadAuth, reply
from ..foxglove_gate import FoxgloveGate
from ..schemas import ErrorBody

log = logging.getLogger("mapper.api")


@contextlib.asynccontextmanager
async def foxglove_lifespan(app):
    """With ``Settings.foxglove_port`` (``mapper serve --foxglove-port``, ``MAPPER_FOXGLOVE_PORT``), a
    Foxglove WebSocket server on ``Settings.foxglove_host`` (``MAPPER_FOXGLOVE_HOST``) publishes the maps
    (mapper.foxglove): the SDK's server on an ephemeral loopback port behind ``FoxgloveGate`` (tokens,
    both subprotocol names) on the public one.
    Runs inside the app's lifespan, after the map service started."""
    settings = app.state.settings
    port = settings.foxglove_port
    if port is None:
        yield
        return
    host = settings.foxglove_host
    bridge = FoxgloveBridge(app.state.service, host="127.0.0.1", port=0)  # reached through the gate only
    try:
        gate = await FoxgloveGate(settings, bridge.port).start(host, port)
    except BaseException:
        bridge.stop()
        raise
    log.info("Foxglove WebSocket server on ws://%s:%d", host, gate.port)
    app.state.foxglove = bridge
    task = asyncio.get_running_loop().create_task(bridge.run(), name="foxglove")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gate.close()
        bridge.stop()


ERRORS = {c: {"model": ErrorBody} for c in (400, 401, 403, 404, 422, 429, 503)}
router = APIRouter(prefix="/v1/maps", tags=["viewer"], dependencies=[ReadAuth], responses=ERRORS)
pages = APIRouter(include_in_schema=False, lifespan=foxglove_lifespan)

MAX_OCCUPIED = 1_000_000  # cap of ?max_voxels (instanced cubes in a browser)


@pages.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/viewer", status_code=307)


@pages.get("/viewer")
async def viewer_page() -> FileResponse:
    """The single-page viewer (static; it asks for a token itself when the service needs one)."""
    return FileResponse(viewer.STATIC_DIR / "index.html", media_type="text/html")


@router.get(
    "/{map_id}/mesh/blocks",
    responses={
        200: {
            "description": "the mesh (or, with since_version, the changed blocks) in the block format of "
            "mapper.viewer: per block its own vertices (float32 positions, int8 normals, uint8 colours) "
            "and uint16 faces",
            "content": {viewer.MEDIA_TYPE: {}},
        }
    },
)
async def mesh_blocks(
    request: Request,
    entry: EntryDep,
    since_version: Annotated[int | None, Query(ge=0, le=2**62)] = None,
) -> Response:
    """The TSDF mesh split into self-contained blocks, for viewers: with ``since_version`` (a previous
    reply's version) only the blocks changed since then and the removed ones (a full mesh, flag bit 0,
    when the change log no longer reaches back). The reply's ``ETag`` names the mesh version it brings
    the client to; a request whose ``If-None-Match`` names the current one gets ``304 Not Modified``
    without a body (a viewer polling an idle map)."""
    current = entry.view.mesh_version
    if current is not None and _etag(current) in _if_none_match(request):
        headers = {"ETag": _etag(current), "X-Mapper-Mesh-Version": str(current), "Cache-Control": "no-cache"}
        return Response(status_code=304, headers={**headers, VERSION_HEADER: str(entry.view.version)})

    def run(m):
        t = time.perf_counter()
        mesh = m.mesh(since_version=since_version)
        entry.metrics.stage.labels("mesh").observe(time.perf_counter() - t)
        return mesh, m.version

    def run_full(m):
        """The whole mesh: the cached one brought up to date with a delta (equal to a full extraction,
        see mapper.mesh.apply_delta), or a full extraction the first time."""
        t = time.perf_counter()
        cached = _FULL.get(entry)
        if cached is not None and cached[0].version == m.mesh_version:
            return cached[0], cached[1], m.version
        if cached is None:
            mesh = m.mesh()
        else:
            mesh = apply_delta(cached[0], m.mesh(since_version=cached[0].version))
        entry.metrics.stage.labels("mesh").observe(time.perf_counter() - t)
        return mesh, None, m.version

    t = time.perf_counter()
    m = entry.view  # the last published version (what the reads below see, or a newer one)
    body = None
    if since_version is None:
        mesh, body, map_version = await entry.read(run_full)
    elif since_version == m.mesh_version:
        # nothing changed (the common poll of an idle map): an empty delta, without taking the map's lock
        mesh = empty_mesh(torch.device("cpu"), "color" in m.layers, since_version, m.voxel_size_m)
        mesh.full, mesh.since_version = False, since_version
        map_version = m.version
    else:
        mesh, map_version = await entry.read(run)
    if body is None:
        body = await asyncio.to_thread(viewer.mesh_to_blocks_bytes, mesh)
        if since_version is None:
            _FULL[entry] = (mesh, body)
    entry.metrics.query.labels("mesh_blocks").observe(time.perf_counter() - t)
    headers = {"X-Mapper-Mesh-Version": str(mesh.version), VERSION_HEADER: str(map_version)}
    headers |= {"ETag": _etag(mesh.version), "Cache-Control": "no-cache"}
    return Response(body, media_type=viewer.MEDIA_TYPE, headers=headers)


def _etag(mesh_version: int) -> str:
    return f'"mesh-{mesh_version}"'


def _if_none_match(request: Request) -> set[str]:
    """The entity tags of an ``If-None-Match`` header (weak ones compared by their opaque part)."""
    raw = request.headers.get("if-none-match", "")
    return {t.strip().removeprefix("W/") for t in raw.split(",") if t.strip()}


# the last whole mesh served per map and its encoding: opening a viewer on a map that did not change costs
# no extraction, and after changes only a delta; dropped with the map entry (deleted map, service stop)
_FULL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@router.get("/{map_id}/trajectory", responses={200: {"content": {"application/json": {}}}})
async def trajectory(
    request: Request,
    entry: EntryDep,
    start: Annotated[int, Query(ge=0, le=2**62, description="first frame index to return")] = 0,
):
    """The sensor pose of every integrated frame from frame index ``start`` on: ``T_world_sensor``
    ``[N, 4, 4]`` (sensor to world), ``positions`` ``[N, 3]``, the map ``versions`` after each frame,
    ``start`` (index of the first pose returned) and ``count`` (poses recorded so far)."""

    def run(m):
        T, versions, first = m.trajectory(start)
        T = T.numpy()
        return {
            "start": first,
            "count": first + int(T.shape[0]),
            "T_world_sensor": T.astype(np.float64),
            "positions": T[:, :3, 3].astype(np.float64),
            "versions": versions.numpy().astype(np.int64).tolist(),
        }

    return reply(request, await entry.read(run))


@router.get("/{map_id}/occupied", responses={200: {"content": {"application/json": {}}}})
async def occupied(
    request: Request,
    entry: EntryDep,
    max_voxels: Annotated[int, Query(ge=1, le=MAX_OCCUPIED)] = 200_000,
):
    """Centres of the occupied voxels (occupancy log-odds > 0, or the TSDF surface voxels of a map without
    occupancy), at most ``max_voxels`` (an evenly strided subset; ``capped`` says so)."""

    def run(m):
        c, total = m.occupied_voxels(max_voxels)
        return {
            "centers": c.cpu().numpy().astype(np.float32),
            "total": total,
            "capped": total > c.shape[0],
            "voxel_size_m": m.voxel_size_m,
            "map_version": m.version,
        }

    return reply(request, await entry.read(run))


@router.get("/{map_id}/status")
async def status(entry: EntryDep) -> dict:
    """Cheap live numbers for dashboards: frames integrated, map and mesh versions, voxels and bytes per
    layer, extent per layer, trajectory length, the last ack latency and the queue depth."""

    def run(m):
        out = m.layer_sizes()
        out["bounds"] = {k: {"min": lo, "max": hi} for k, (lo, hi) in m.bounds().items()}
        return out

    out = await entry.read(run)
    ack_ms = getattr(entry, "ack_ms", None)
    cfg = entry.info["config"]
    return {
        "id": entry.id,
        "name": entry.name,
        "layer_names": list(cfg.get("layers", [])),
        "voxel_size_m": cfg.get("voxel_size_m"),
        "esdf_max_distance_m": entry.map.esdf_max_distance_m,
        "queue_depth": entry.queue.qsize(),
        "ack_ms": ack_ms,
        **out,
    }

"""Queries on a consistent epoch of the map: distances, occupancy, TSDF, ESDF slices and boxes, meshes."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Annotated, Literal

import numpy as np
import torch
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ... import budget, io, render, wire
from ...errors import InvalidArgument, RequestTooLarge
from ..deps import EntryDep, ReadAuth, attachment, read_message, reply, version_header, wants_msgpack
from ..schemas import QUERY_BODY, BoxRequest, ErrorBody
from ..service import MapEntry

ERRORS = {c: {"model": ErrorBody} for c in (400, 401, 403, 404, 413, 422, 429, 503)}
router = APIRouter(prefix="/v1/maps", tags=["queries"], dependencies=[ReadAuth], responses=ERRORS)
ARRAY_RESPONSE = {
    200: {
        "description": "JSON (arrays as nested lists, NaN as null) or msgpack "
        "(`Accept: application/msgpack`, "
        "arrays as {dtype, shape, data})",
        "content": {"application/json": {}, "application/msgpack": {}},
    }
}


def np_(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _bound(entry: MapEntry, what: str, count: int, unit: str, per_item: int) -> None:
    """Refuse (413, naming the numbers) a read whose output and encoding would exceed
    ``MAPPER_MAX_REQUEST_BYTES``, before anything is allocated."""
    try:
        budget.check_read(
            what, count, unit, per_item, entry.service.request_bytes, "MAPPER_MAX_REQUEST_BYTES"
        )
    except RequestTooLarge:
        entry.metrics.budget_refusals.labels(entry.id, "request").inc()
        raise


def _fmt(request: Request) -> str:
    return "msgpack" if wants_msgpack(request) else "json"


async def _points(request: Request, entry: MapEntry) -> np.ndarray:
    msg = await read_message(request)
    limit = entry.service.limits.max_query_points
    pts = await asyncio.to_thread(wire.check_points, msg.get("points"), "points", limit, False)
    _bound(entry, "query", int(pts.shape[0]), "points", budget.QUERY_POINT_BYTES[_fmt(request)])
    return pts


async def _timed(entry: MapEntry, kind: str, fn, **kw):
    """``fn(view)`` on the map's last published version: (its result, the headers naming that version)."""
    t = time.perf_counter()
    seen = []

    def run(m):
        seen.append(m.version)
        return fn(m)

    out = await entry.read(run, **kw)
    dt = time.perf_counter() - t
    entry.metrics.query.labels(kind).observe(dt)
    entry.metrics.map_query.labels(entry.id, kind).observe(dt)
    return out, version_header(seen[0])


@router.post("/{map_id}/query/distance", openapi_extra=QUERY_BODY, responses=ARRAY_RESPONSE)
async def query_distance(request: Request, entry: EntryDep):
    """Signed distance (m), its gradient and an observed flag at world points (trilinear in the ESDF)."""
    pts = await _points(request, entry)

    def run(m):
        d, g, obs = m.query_distance(pts)
        return {
            "distance": np_(d).astype(np.float32),
            "gradient": np_(g).astype(np.float32),
            "observed": np_(obs).astype(np.uint8),
            "map_version": m.version,
        }

    out, headers = await _timed(entry, "distance", run, esdf=True)
    return reply(request, out, headers=headers)


@router.post("/{map_id}/query/occupancy", openapi_extra=QUERY_BODY, responses=ARRAY_RESPONSE)
async def query_occupancy(request: Request, entry: EntryDep):
    """Occupancy state (-1 unknown, 0 free, 1 occupied) and probability at world points."""
    pts = await _points(request, entry)

    def run(m):
        state, p = m.query_occupancy(pts)
        return {
            "state": np_(state).astype(np.int32),
            "probability": np_(p).astype(np.float32),
            "map_version": m.version,
        }

    out, headers = await _timed(entry, "occupancy", run)
    return reply(request, out, headers=headers)


@router.post("/{map_id}/query/tsdf", openapi_extra=QUERY_BODY, responses=ARRAY_RESPONSE)
async def query_tsdf(request: Request, entry: EntryDep):
    """Truncated signed distance (m) and weight at world points (weight 0 = unobserved)."""
    pts = await _points(request, entry)

    def run(m):
        t, w = m.query_tsdf(pts)
        return {
            "tsdf": np_(t).astype(np.float32),
            "weight": np_(w).astype(np.float32),
            "map_version": m.version,
        }

    out, headers = await _timed(entry, "tsdf", run)
    return reply(request, out, headers=headers)


Finite = Annotated[float, Query(allow_inf_nan=False)]


@router.get(
    "/{map_id}/esdf/slice",
    responses={
        200: {
            "description": "PNG (colour-mapped distances) or msgpack/JSON {distance, origin_xy, "
            "resolution_m}",
            "content": {"image/png": {}, "application/msgpack": {}, "application/json": {}},
        }
    },
)
async def esdf_slice(
    request: Request,
    entry: EntryDep,
    z: Annotated[float, Query(allow_inf_nan=False, ge=-1e6, le=1e6, description="height of the slice (m)")],
    format: Literal["png", "msgpack", "json"] = "png",
    x_min: Annotated[float | None, Query(allow_inf_nan=False, ge=-1e6, le=1e6)] = None,
    y_min: Annotated[float | None, Query(allow_inf_nan=False, ge=-1e6, le=1e6)] = None,
    x_max: Annotated[float | None, Query(allow_inf_nan=False, ge=-1e6, le=1e6)] = None,
    y_max: Annotated[float | None, Query(allow_inf_nan=False, ge=-1e6, le=1e6)] = None,
    resolution_m: Annotated[float | None, Query(gt=0, le=100, allow_inf_nan=False)] = None,
):
    """A horizontal ESDF slice at height ``z`` (NaN = unknown); bounds default to the map's extent.
    413 when its cells exceed ``MAPPER_MAX_SLICE_CELLS`` or their memory ``MAPPER_MAX_REQUEST_BYTES``."""
    per_cell = budget.SLICE_CELL_BYTES[format]
    max_cells = min(
        entry.settings.max_slice_cells,
        max(1, (entry.service.request_bytes - budget.READ_WORKING_BYTES) // per_cell),
    )
    bounds = (x_min, y_min, x_max, y_max)
    if any(b is None for b in bounds) and any(b is not None for b in bounds):
        raise InvalidArgument("x_min, y_min, x_max, y_max: give all four or none")
    lo = hi = None
    if bounds[0] is not None:
        lo, hi = (x_min, y_min), (x_max, y_max)
        if x_min >= x_max or y_min >= y_max:
            raise InvalidArgument("x_min/y_min must be < x_max/y_max")
        res = resolution_m or entry.map.voxel_size_m
        cells = math.ceil((x_max - x_min) / res) * math.ceil((y_max - y_min) / res)
        if cells > entry.settings.max_slice_cells:
            entry.metrics.budget_refusals.labels(entry.id, "request").inc()
            raise RequestTooLarge(
                f"slice: {cells} cells exceed MAPPER_MAX_SLICE_CELLS={entry.settings.max_slice_cells}"
            )
        _bound(entry, f"slice ({format})", cells, "cells", per_cell)

    def run(m):
        s = m.esdf_slice(
            z,
            aabb_min_xy=lo,
            aabb_max_xy=hi,
            resolution_m=resolution_m,
            max_pixels=max_cells,
        )
        if format == "png":
            return render.slice_to_png(s, max_distance_m=m.esdf_max_distance_m)
        return {
            "distance": np_(s.distance).astype(np.float32),
            "origin_xy": [float(v) for v in s.origin_xy],
            "resolution_m": float(s.resolution_m),
            "z_m": z,
            "map_version": m.version,
        }

    out, headers = await _timed(entry, "slice", run, esdf=True)
    if format == "png":
        return Response(out, media_type="image/png", headers=headers)
    if format == "msgpack":
        return Response(wire.packb(out), media_type=wire.MSGPACK, headers=headers)
    return reply(request, out, headers=headers)


@router.post("/{map_id}/esdf/box", responses=ARRAY_RESPONSE)
async def esdf_box(request: Request, entry: EntryDep, body: BoxRequest):
    """The ESDF on the voxel lattice inside a box: distance [X, Y, Z], gradient [X, Y, Z, 3], observed."""
    s = entry.map.voxel_size_m
    n = math.prod(max(1, math.ceil((b - a) / s)) for a, b in zip(body.aabb_min, body.aabb_max, strict=True))
    if n > entry.settings.max_box_voxels:
        entry.metrics.budget_refusals.labels(entry.id, "request").inc()
        raise RequestTooLarge(f"box: {n} voxels exceed MAPPER_MAX_BOX_VOXELS={entry.settings.max_box_voxels}")
    _bound(entry, "box", n, "voxels", budget.BOX_VOXEL_BYTES[_fmt(request)])

    def run(m):
        b = m.esdf_box(body.aabb_min, body.aabb_max, max_voxels=entry.settings.max_box_voxels)
        return {
            "distance": np_(b.distance).astype(np.float32),
            "gradient": np_(b.gradient).astype(np.float32),
            "observed": np_(b.observed).astype(np.uint8),
            "origin": [float(v) for v in np_(b.origin).reshape(-1)],
            "resolution_m": float(b.resolution_m),
            "map_version": m.version,
        }

    out, headers = await _timed(entry, "box", run, esdf=True)
    return reply(request, out, headers=headers)


@router.get(
    "/{map_id}/mesh",
    responses={
        200: {
            "description": "binary PLY, or msgpack {vertices, faces, colors?, normals, version, "
            "removed_blocks, ...}",
            "content": {"application/octet-stream": {}, "application/msgpack": {}},
        }
    },
)
async def get_mesh(
    entry: EntryDep,
    format: Literal["ply", "msgpack"] = "ply",
    since_version: Annotated[int | None, Query(ge=0, le=2**62)] = None,
):
    """The TSDF zero-crossing mesh; with ``since_version`` only the blocks changed since then (plus the
    removed blocks), for incremental viewers. 413 when the TSDF is too large to mesh within
    ``MAPPER_MAX_REQUEST_BYTES``."""
    tsdf_voxels = entry.view.bricks.get("tsdf", 0) * 64
    _bound(entry, "mesh", tsdf_voxels, "voxels", budget.MESH_VOXEL_BYTES)

    def run(m):
        t = time.perf_counter()
        mesh = m.mesh(since_version=since_version)
        entry.metrics.stage.labels("mesh").observe(time.perf_counter() - t)
        if format == "ply":
            return io.mesh_to_ply_bytes(mesh)
        return wire.packb(io.mesh_to_msgpack_dict(mesh))

    out, headers = await _timed(entry, "mesh", run)
    if format == "ply":
        return Response(
            out,
            media_type="application/octet-stream",
            headers={"Content-Disposition": attachment(f"{entry.name}.ply"), **headers},
        )
    return Response(out, media_type=wire.MSGPACK, headers=headers)

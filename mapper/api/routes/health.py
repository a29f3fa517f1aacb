"""Liveness and readiness (no token: probes call these) and Prometheus metrics (a token once any is set)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..auth import bearer
from ..deps import MetricsAuth, MetricsDep, ServiceDep, SettingsDep, check_token

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    """The process serves requests."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "restoring maps or stopping"}, 401: {"description": "invalid token"}},
)
async def readyz(request: Request, service: ServiceDep, settings: SettingsDep):
    """Maps are restored and the service accepts work (503 while restoring or stopping). Once tokens are
    set, a request without one (a probe) gets only ``{"status": "ready"}``; with an API/read token (an
    invalid one: 401), or with no tokens configured, also ``failed``: maps left on disk that could not be
    restored (id -> error), ``degraded``: served maps whose snapshots fail (id -> error; retried) and
    ``quarantined``: per map, the WAL records that failed on replay and were kept aside
    (``maps/<id>/quarantine/``; the map is served without them)."""
    if service.stopping or not service.ready.is_set():
        state = "stopping" if service.stopping else "restoring"
        return JSONResponse({"type": "unavailable", "detail": state}, status_code=503)
    if settings.auth_enabled:  # map ids and error texts only for a token holder
        token = bearer(request.scope)
        if token is None:
            return {"status": "ready"}
        check_token(settings, token, write=False)
    return {
        "status": "ready",
        "maps": len(service.maps),
        "failed": service.failed,
        "degraded": service.degraded(),
        "quarantined": service.quarantine_report(),
        "device": str(service.device),
    }


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, 401: {"description": "token required"}},
    dependencies=[MetricsAuth],
)
async def metrics(m: MetricsDep, service: ServiceDep) -> Response:
    """Prometheus text format. Needs no token when none is configured; otherwise ``MAPPER_METRICS_TOKEN``
    or an API/read token (``Authorization: Bearer``): the series name maps."""
    for e in list(service.maps.values()):
        m.queue_depth.labels(e.id).set(e.queue.qsize())
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

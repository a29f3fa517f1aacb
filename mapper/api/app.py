"""``create_app(settings)``: the FastAPI application; its lifespan owns the map service."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote

import fastapi_offline
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import (
    ClientDisconnect,
    Request,  # module level: the docs routes' annotations resolve here
)
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..errors import MapperError
from ..settings import Settings
from ..viewer import STATIC_DIR
from . import access_log, errors
from .auth import AuthGate
from .metrics import Metrics
from .routes import frames, health, maps, queries, viewer
from .service import MapService
from .shutdown import DrainOnSignal

log = logging.getLogger("mapper.api")


class BodyLimit:
    """Refuse request bodies over the limit (413): by Content-Length up front, else while streaming."""

    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit = self.settings.max_import_bytes if path.endswith("/import") else self.settings.max_body_bytes
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n > limit or n < 0:
                    exc = errors.PayloadTooLarge(
                        f"body: {v.decode(errors='replace')} bytes exceed the limit of {limit}"
                    )
                    if n < 0:
                        exc = errors.UnsupportedMediaType("content-length: not a valid length")
                    response = await errors.mapper_error_handler(None, exc)  # type: ignore[arg-type]
                    return await response(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise errors.PayloadTooLarge(f"body: more than {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


class HttpMetrics:
    """Request latency by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t = time.perf_counter()
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
            self.metrics.http.labels(scope["method"], path, str(status)).observe(time.perf_counter() - t)


DOCS_STATIC = "/docs-static"


def _token_query(request: Request) -> str:
    """``?token=...`` when the page was opened with one (a browser cannot send a bearer header): the page
    then loads ``/openapi.json`` with it (the docs need a read token once tokens are set, ``AuthGate``)."""
    token = request.query_params.get("token")
    return f"?token={quote(token, safe='')}" if token else ""


def _offline_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` with their scripts and styles served by the app itself from
    the assets packaged in ``fastapi-offline``, so the pages work without internet access."""
    static = Path(fastapi_offline.__file__).parent / "static"
    app.mount(DOCS_STATIC, StaticFiles(directory=static), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request):
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}{_token_query(request)}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
            swagger_js_url=f"{root}{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect():
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}{_token_query(request)}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
            with_google_fonts=False,
        )


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service for ``settings`` (default: from the environment). Nothing heavy happens before the
    lifespan starts: the map service (maps restored from ``MAPPER_DATA_DIR``) lives inside it."""
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.check_bind()  # also when served by a plain `uvicorn --factory` with MAPPER_HOST set
        access_log.install()  # the viewer's polls are no access-log lines (uvicorn configured its loggers)
        service = MapService(settings, metrics)
        app.state.service = service
        await service.start()
        hook = DrainOnSignal(service, settings.shutdown_grace_s).install()  # acks before uvicorn's 1012
        try:
            yield
        finally:
            hook.uninstall()
            await service.stop()

    app = FastAPI(
        title="mapper",
        version=__version__,
        description="Real-time 3D mapping: msgpack/JSON frame ingest over HTTP and WebSocket, distance, "
        "occupancy and TSDF queries, ESDF slices, meshes, durable maps. Errors are {type, detail}.",
        lifespan=lifespan,
        docs_url=None,  # served below from packaged assets: no CDN (robots and air-gapped labs)
        redoc_url=None,
    )
    _offline_docs(app)
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_exception_handler(MapperError, errors.mapper_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(ClientDisconnect, errors.client_disconnect_handler)
    app.add_exception_handler(OSError, errors.os_error_handler)
    app.add_exception_handler(Exception, errors.internal_error_handler)
    for r in (maps.router, frames.router, queries.router, health.router):
        app.include_router(r)
    app.include_router(viewer.router)
    app.include_router(viewer.pages)
    app.mount("/viewer/static", StaticFiles(directory=STATIC_DIR), name="viewer-static")
    app.add_middleware(BodyLimit, settings=settings)
    app.add_middleware(AuthGate, settings=settings)  # outside BodyLimit: 401 before any body is read
    app.add_middleware(HttpMetrics, metrics=metrics)
    return app

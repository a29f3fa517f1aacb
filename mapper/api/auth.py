"""Authentication before anything reads the request: an ASGI middleware in front of the routes.

FastAPI parses a route's JSON body before it runs the route's dependencies, so a malformed body got 422
before a missing token got 401. ``AuthGate`` answers first: it matches the request to its route, reads the
route's auth level from its dependencies (``deps.ReadAuth`` / ``WriteAuth`` / ``MetricsAuth``) and checks
the bearer token from the headers alone. The dependencies still run (and document the scheme in OpenAPI);
a route the table misses is still protected by them, only later.

It also keeps the "no tokens -> loopback only" rule when the bind address is not known to the app (a plain
``uvicorn --factory mapper.api:create_app --host 0.0.0.0``: ``--host`` never reaches the settings): with
no ``MAPPER_API_TOKENS``/``MAPPER_READ_TOKENS``, a connection from a non-loopback client address is
refused (403; WebSocket: closed before accept). NOTES.md explains the choice.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import parse_qs

from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import MapperError
from ..settings import Settings, is_loopback
from . import deps, errors

_LEVELS = {deps._write_auth: "write", deps._read_auth: "read", deps._metrics_auth: "metrics"}


def auth_level(route) -> str | None:
    """``"write"``, ``"read"``, ``"metrics"`` or None: the strictest auth dependency of a route."""
    dependant = getattr(route, "dependant", None)
    found: set[str] = set()
    stack = [dependant] if dependant is not None else []
    while stack:
        d = stack.pop()
        level = _LEVELS.get(d.call)
        if level:
            found.add(level)
        stack.extend(d.dependencies)
    for level in ("write", "read", "metrics"):
        if level in found:
            return level
    return None


def remote_client(scope: Scope) -> str | None:
    """The client address when it is an IP address that is not loopback (else None: loopback, a Unix
    socket, or a test client without an address)."""
    client = scope.get("client")
    if not client:
        return None
    host = str(client[0])
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if is_loopback(host) else host


# the API description and its pages: a read token once tokens are set (header, or ?token= for a browser)
DOCS_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def query_token(scope: Scope) -> str | None:
    """The ``?token=`` query parameter (WebSocket clients and browsers cannot always send a header)."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0] if values else None


def bearer(scope: Scope) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            value = v.decode("latin-1")
            return value[7:].strip() if value.lower().startswith("bearer ") else None
    return None


def app_path(scope: Scope) -> str:
    """The request path inside the app (without its ``root_path``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class AuthGate:
    """Refuse unauthenticated requests before any body is read (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.settings = settings
        self._table: list[tuple] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        try:
            self._check(scope)
        except MapperError as exc:
            if scope["type"] == "websocket":
                await receive()  # websocket.connect
                return await send({"type": "websocket.close", "code": 1008, "reason": str(exc)[:120]})
            response = await errors.mapper_error_handler(None, exc)  # type: ignore[arg-type]
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> None:
        s = self.settings
        if not s.auth_enabled:
            host = remote_client(scope)
            if host is not None:
                raise errors.Forbidden(
                    f"no MAPPER_API_TOKENS configured: only loopback clients are served (client {host})"
                )
        if scope["type"] != "http":
            return  # the WebSocket route checks its token (header or ?token=) before accepting
        if app_path(scope) in DOCS_PATHS:
            deps.check_token(s, bearer(scope) or query_token(scope), write=False)
            return
        level = self._level(scope)
        if level == "metrics":
            deps.check_metrics_token(s, bearer(scope))
        elif level is not None:
            deps.check_token(s, bearer(scope), write=level == "write")

    def _level(self, scope: Scope) -> str | None:
        if self._table is None:  # built at the first request: every route is registered by then
            self._table = route_table(scope["app"].router.routes)
        path, method = app_path(scope), scope.get("method", "")
        for regex, methods, level in self._table:
            if regex.match(path) and (not methods or method in methods):
                return level
        return None


def route_table(routes) -> list[tuple]:
    """``(path regex, methods, auth level)`` of every HTTP API route, walking included routers (FastAPI
    keeps them as nested routers from 0.12x on, as flat routes before)."""
    table = []
    for r in routes:
        inner = getattr(r, "original_router", None)
        if inner is not None:
            table.extend(route_table(inner.routes))
        elif isinstance(r, APIRoute):
            table.append((r.path_regex, r.methods, auth_level(r)))
    return table

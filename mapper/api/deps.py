"""Dependencies (as ``Annotated`` aliases): settings, the service, a map by id, auth, body codecs."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Annotated
from urllib.parse import quote

from fastapi import Depends, Path, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from .. import wire
from ..settings import Settings
from .errors import Forbidden, Unauthorized, UnsupportedMediaType
from .metrics import Metrics
from .service import MapEntry, MapService

_bearer = HTTPBearer(auto_error=False, description="MAPPER_API_TOKENS (full) or MAPPER_READ_TOKENS (read)")


def get_settings(conn: HTTPConnection) -> Settings:
    return conn.app.state.settings


def get_service(conn: HTTPConnection) -> MapService:
    return conn.app.state.service


def get_metrics(conn: HTTPConnection) -> Metrics:
    return conn.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[MapService, Depends(get_service)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


def check_token(settings: Settings, token: str | None, write: bool) -> None:
    """Raise ``Unauthorized`` (no / unknown token) or ``Forbidden`` (read-only token on a write)."""
    if not settings.auth_enabled:
        return
    if not token:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    tok = token.encode()
    if any(hmac.compare_digest(tok, t.encode()) for t in settings.api_tokens):
        return
    if any(hmac.compare_digest(tok, t.encode()) for t in settings.read_tokens):
        if write:
            raise Forbidden("this token is read-only")
        return
    raise Unauthorized("invalid bearer token")


def _read_auth(
    settings: SettingsDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
):
    check_token(settings, creds.credentials if creds else None, write=False)


def _write_auth(
    settings: SettingsDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
):
    check_token(settings, creds.credentials if creds else None, write=True)


def check_metrics_token(settings: Settings, token: str | None) -> None:
    """``/metrics``: open when no token of any kind is configured; else ``MAPPER_METRICS_TOKEN`` or an
    API/read token (``Unauthorized`` otherwise)."""
    if settings.metrics_token is None and not settings.auth_enabled:
        return
    if (
        token
        and settings.metrics_token
        and hmac.compare_digest(token.encode(), settings.metrics_token.encode())
    ):
        return
    if not settings.auth_enabled:
        raise Unauthorized("missing or invalid bearer token (MAPPER_METRICS_TOKEN)")
    check_token(settings, token, write=False)


def _metrics_auth(
    settings: SettingsDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
):
    check_metrics_token(settings, creds.credentials if creds else None)


ReadAuth = Depends(_read_auth)
WriteAuth = Depends(_write_auth)
MetricsAuth = Depends(_metrics_auth)


def _map_entry(
    service: ServiceDep, map_id: Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
) -> MapEntry:
    return service.get(map_id)


EntryDep = Annotated[MapEntry, Depends(_map_entry)]


def wants_msgpack(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return any(t in accept for t in wire.MSGPACK_TYPES)


def is_msgpack_body(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return ctype in wire.MSGPACK_TYPES


async def read_message(request: Request) -> dict:
    """The request body as a dict: msgpack (Content-Type application/msgpack) or JSON (otherwise)."""
    body = await request.body()
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in wire.MSGPACK_TYPES:
        msg = await (
            asyncio.to_thread(wire.unpackb, body) if len(body) > 65536 else _sync(wire.unpackb, body)
        )
    elif ctype in ("", "application/json", "text/json") or ctype.endswith("+json"):
        msg = await (asyncio.to_thread(_json, body) if len(body) > 65536 else _sync(_json, body))
    else:
        raise UnsupportedMediaType(
            f"content-type: expected application/msgpack or application/json, got {ctype!r}"
        )
    if not isinstance(msg, dict):
        raise wire.MalformedMessage(f"body: expected a map/object, got {type(msg).__name__}")
    return msg


async def _sync(fn, *args):
    return fn(*args)


def _json(body: bytes):
    if not body:
        raise wire.MalformedMessage("body: empty")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise wire.MalformedMessage(f"body: malformed JSON ({e})") from None


def attachment(filename: str) -> str:
    """A ``Content-Disposition`` value safe for any file name (stored map names come from old data dirs and
    imports too): an ASCII fallback with everything outside ``[A-Za-z0-9._-]`` replaced, plus the exact
    name percent-encoded (RFC 6266 / 5987). Never contains quotes, CR or LF."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", filename)[:200] or "download"
    return f"attachment; filename=\"{safe}\"; filename*=UTF-8''{quote(filename, safe='')}"


def reply(request: Request, obj, status_code: int = 200, headers: dict | None = None):
    """``obj`` as msgpack when the client accepts it, JSON otherwise (arrays -> nested lists)."""
    if wants_msgpack(request):
        return Response(wire.packb(obj), status_code=status_code, media_type=wire.MSGPACK, headers=headers)
    return JSONResponse(wire.to_jsonable(obj), status_code=status_code, headers=headers)


VERSION_HEADER = "X-Map-Version"


def version_header(version: int) -> dict[str, str]:
    """The header every read reply carries: the ``map_version`` it read (README "Versions")."""
    return {VERSION_HEADER: str(int(version))}

"""Service errors (subclasses of the library's hierarchy) and the one handler mapping them to HTTP.

Every error body is ``{"type": <snake_case name>, "detail": <message>}``.
"""

from __future__ import annotations

import errno
import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    CapacityExceeded,
    Conflict,
    InsufficientStorage,
    InvalidArgument,
    InvalidArgumentType,
    MapperError,
    NotFound,
    OutOfDeviceMemory,
    Unavailable,
)
from ..wire import MalformedMessage, TooLarge

log = logging.getLogger("mapper.api")


class Unauthorized(MapperError):
    """No bearer token, or an unknown one (HTTP 401)."""


class Forbidden(MapperError):
    """A valid token without the right for this operation (HTTP 403)."""


class PayloadTooLarge(TooLarge):
    """The request body exceeds ``MAPPER_MAX_BODY_BYTES`` (HTTP 413)."""


class Busy(CapacityExceeded):
    """The map's queue is full; retry later (HTTP 429)."""


class UnsupportedMediaType(InvalidArgument):
    """The body's Content-Type is neither msgpack nor JSON (HTTP 415 is not in the contract: 400)."""


# most specific first
STATUS: list[tuple[type[BaseException], int]] = [
    (Unauthorized, 401),
    (Forbidden, 403),
    (MalformedMessage, 400),
    (UnsupportedMediaType, 400),
    (NotFound, 404),
    (Conflict, 409),
    (Busy, 429),
    (InsufficientStorage, 507),
    (TooLarge, 413),
    (CapacityExceeded, 413),
    (Unavailable, 503),
    (OutOfDeviceMemory, 503),
    (InvalidArgumentType, 422),
    (InvalidArgument, 422),
    (MapperError, 400),
]


def error_type(exc: BaseException) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()


def status_of(exc: BaseException) -> int:
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return 500


def error_body(exc: BaseException) -> dict:
    return {"type": error_type(exc), "detail": str(exc)}


async def mapper_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """The one handler: library and service errors -> ``{"type", "detail"}`` with their status."""
    code = status_of(exc)
    headers = {}
    if code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif code in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(exc), status_code=code, headers=headers)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    parts = []
    for e in errors[:10]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return JSONResponse({"type": "validation_error", "detail": "; ".join(parts)}, status_code=422)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kinds = {404: "not_found", 405: "method_not_allowed", 400: "bad_request", 413: "payload_too_large"}
    return JSONResponse(
        {"type": kinds.get(exc.status_code, "http_error"), "detail": str(exc.detail)},
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


# a request whose client went away before its body was read: nginx's 499 in the metrics (never a 5xx)
CLIENT_CLOSED = 499
# the scope key the connection edge (mapper.api.edge) sets when it closed a request's connection itself
EDGE_CLOSED = "mapper.edge_closed"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


async def client_disconnect_handler(request: Request, exc: Exception) -> Response:
    """Starlette's ``ClientDisconnect`` (the connection closed while the body was being read): one log
    line, no traceback, and status 499 for the metrics (408 when the server closed it for a read timeout,
    ``mapper.api.edge``). The response itself goes nowhere: the connection is gone."""
    why = request.scope.get(EDGE_CLOSED)
    code = 408 if why else CLIENT_CLOSED
    log.info(
        "%s %s: %s (%d)",
        request.method,
        request.url.path,
        f"closed by the server: {why}" if why else "the client disconnected before its body was read",
        code,
    )
    return Response(status_code=code)


async def os_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A full disk (ENOSPC/EDQUOT, e.g. while writing a snapshot) is 507 ``insufficient_storage`` with one
    log line; any other ``OSError`` is an internal error."""
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        log.warning("%s %s: disk full (%s)", request.method, request.url.path, exc)
        detail = f"disk full: {exc.strerror or exc}; free space in the data directory and retry"
        return JSONResponse({"type": "insufficient_storage", "detail": detail}, status_code=507)
    return await internal_error_handler(request, exc)


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"type": "internal_error", "detail": "internal server error"}, status_code=500)

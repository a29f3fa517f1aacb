"""The connection edge of ``mapper serve``: read timeouts and connection caps below the ASGI app.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no header or body read
timeout: a client that sends half a request line, or a body one byte at a time, holds its connection (and
a file descriptor) forever, and enough of them exhaust the descriptors for everyone. An ASGI middleware
cannot help (the app is only called once the headers are complete), so the edge lives in the HTTP
protocol: :func:`http_protocol` subclasses uvicorn's httptools protocol (its parser callbacks say when the
headers are complete and when body bytes arrive) and :class:`EdgeGuard` counts the open connections.

* **Caps**: a new connection beyond ``MAPPER_MAX_CONNECTIONS_PER_CLIENT`` from one IP address is answered
  429, beyond ``MAPPER_MAX_CONNECTIONS`` in total 503 (``Retry-After: 1``, ``Connection: close``), before
  any byte of its request is parsed; it lingers half a second for its request so that the client reads
  the answer (no reset), then closes. WebSocket connections count until they close.
* **Headers**: complete within ``MAPPER_HEADER_TIMEOUT_S`` of the connection (a later request on a
  keep-alive connection: of its first byte), else 408 and close.
* **Body**: no pause longer than ``MAPPER_BODY_TIMEOUT_S``, and after a first ``MAPPER_BODY_TIMEOUT_S`` at
  least ``MAPPER_MIN_BODY_BYTES_PER_S`` on average (Apache's ``mod_reqtimeout`` rule), else the
  connection is closed; the route sees a disconnect and answers 408 in the metrics (``errors.EDGE_CLOSED``).
  Time while the server itself stopped reading (uvicorn's flow control: the app is behind) never counts.

Counted in ``mapper_connections`` and ``mapper_connections_closed_total{reason}``; one log line each.
Served another way (``uvicorn --factory mapper.api:create_app``) the app runs without the edge.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
from http import HTTPStatus

from ..settings import Settings
from .errors import EDGE_CLOSED

log = logging.getLogger("mapper.api.edge")

REFUSED_LINGER_S = 0.5  # a refused connection waits this long for its request before it is closed
MAX_LINGERING = 64  # beyond this many refused connections waiting at once, refuse and close at once


class EdgeGuard:
    """Open connections, in total and per client IP address (the socket's peer, not a forwarded header)."""

    def __init__(self, settings: Settings, metrics=None):
        self.header_timeout_s = settings.header_timeout_s
        self.body_timeout_s = settings.body_timeout_s
        self.min_rate = settings.min_body_bytes_per_s
        self.max_total = settings.max_connections
        self.max_per_client = settings.max_connections_per_client
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.max_total and self.max_total > soft // 2:
            log.info(
                "MAPPER_MAX_CONNECTIONS=%d lowered to %d: half of the file descriptor limit (ulimit -n %d)",
                self.max_total,
                soft // 2,
                soft,
            )
            self.max_total = max(1, soft // 2)
        self.metrics = metrics
        self.open: dict[asyncio.BaseTransport, str] = {}
        self.per_client: collections.Counter[str] = collections.Counter()
        # connections handed to the WebSocket protocol: their end is not reported here, so they are
        # released when found closed (at each admission)
        self.upgraded: set[asyncio.BaseTransport] = set()
        self.lingering = 0  # refused connections waiting for their request

    def admit(self, transport: asyncio.BaseTransport, host: str) -> tuple[int, str, str] | None:
        """Count a new connection, or return ``(status, reason, detail)`` when a cap refuses it."""
        for t in [t for t in self.upgraded if t.is_closing()]:
            self.upgraded.discard(t)
            self.release(t)
        if self._full(host):
            self._sweep()
        if self.max_total and len(self.open) >= self.max_total:
            return 503, "total", f"the server holds {len(self.open)} connections (MAPPER_MAX_CONNECTIONS)"
        if self.max_per_client and self.per_client[host] >= self.max_per_client:
            return (
                429,
                "per_client",
                f"client {host} holds {self.per_client[host]} connections "
                "(MAPPER_MAX_CONNECTIONS_PER_CLIENT)",
            )
        self.open[transport] = host
        self.per_client[host] += 1
        self._gauge()
        return None

    def release(self, transport: asyncio.BaseTransport) -> None:
        host = self.open.pop(transport, None)
        if host is None:
            return
        self.per_client[host] -= 1
        if self.per_client[host] <= 0:
            del self.per_client[host]
        self._gauge()

    def closed(self, reason: str) -> None:
        if self.metrics is not None and hasattr(self.metrics, "edge_closed"):
            self.metrics.edge_closed.labels(reason).inc()

    def _full(self, host: str) -> bool:
        total = self.max_total and len(self.open) >= self.max_total
        return bool(total or (self.max_per_client and self.per_client[host] >= self.max_per_client))

    def _sweep(self) -> None:
        for t in [t for t in self.open if t.is_closing()]:
            self.upgraded.discard(t)
            self.release(t)

    def _gauge(self) -> None:
        if self.metrics is not None and hasattr(self.metrics, "connections"):
            self.metrics.connections.set(len(self.open))


def _raw_response(status: int, error_type: str, detail: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"type": error_type, "detail": detail}).encode()
    phrase = HTTPStatus(status).phrase.encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n%s\r\n" % (status, phrase, len(body), extra)
    ) + body


def http_protocol(guard: EdgeGuard):
    """uvicorn's httptools protocol with the edge of ``guard`` (pass as ``uvicorn.run(http=...)``), or
    None when httptools is not installed (uvicorn then runs its h11 protocol without the edge)."""
    try:
        # lazy: httptools (uvicorn[standard]) may be absent; the except below falls back
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        log.warning("httptools is not installed: serving without read timeouts and connection caps")
        return None

    class EdgeHttpProtocol(HttpToolsProtocol):
        edge = guard

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._edge_timer: asyncio.TimerHandle | None = None
            self._edge_refused = False
            self._edge_body: list[float] | None = None  # [start, bytes since start, last read]
            refusal = self.edge.admit(transport, self.client[0] if self.client else "")
            if refusal is not None:
                self._edge_refuse(*refusal)
                return
            self._edge_arm(self.edge.header_timeout_s, self._edge_headers_late)

        def connection_lost(self, exc) -> None:
            self._edge_cancel()
            self.edge.release(self.transport)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._edge_refused:
                return  # the refusal is sent; the request is not parsed
            super().data_received(data)

        # parser callbacks
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._edge_timer is None:  # a later request on a keep-alive connection
                self._edge_arm(self.edge.header_timeout_s, self._edge_headers_late)

        def on_headers_complete(self) -> None:
            self._edge_cancel()
            super().on_headers_complete()
            if self.parser.should_upgrade() and getattr(self, "_should_upgrade", lambda: True)():
                self.edge.upgraded.add(self.transport)  # a WebSocket: its protocol takes the connection
                return
            now = self.loop.time()
            self._edge_body = [now, 0, now]
            self._edge_arm(self.edge.body_timeout_s, self._edge_body_check)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            if self._edge_body is not None:
                self._edge_body[1] += len(body)
                self._edge_body[2] = self.loop.time()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._edge_cancel()
            self._edge_body = None

        # the edge
        def _edge_arm(self, delay: float, callback) -> None:
            self._edge_cancel()
            self._edge_timer = self.loop.call_later(delay, callback)

        def _edge_cancel(self) -> None:
            if getattr(self, "_edge_timer", None) is not None:
                self._edge_timer.cancel()
                self._edge_timer = None

        def _edge_refuse(self, status: int, reason: str, detail: str) -> None:
            self._edge_refused = True
            self.edge.closed(reason)
            log.warning("refused a connection from %s: %s", self.client[0] if self.client else "?", detail)
            self.transport.write(_raw_response(status, "too_many_connections", detail, b"retry-after: 1\r\n"))
            if self.edge.lingering >= MAX_LINGERING:  # a flood: no descriptor held for it
                self.transport.close()
                return
            self.edge.lingering += 1

            def close() -> None:
                self.edge.lingering -= 1
                self.transport.close()

            self.loop.call_later(REFUSED_LINGER_S, close)

        def _edge_headers_late(self) -> None:
            self._edge_timer = None
            if self.transport.is_closing():
                return
            s = self.edge.header_timeout_s
            self.edge.closed("header_timeout")
            log.info("closed a connection from %s: request headers not complete after %g s", self._who(), s)
            detail = f"request headers not complete within {s:g} s (MAPPER_HEADER_TIMEOUT_S)"
            self.transport.write(_raw_response(408, "request_timeout", detail))
            self.transport.close()

        def _edge_body_check(self) -> None:
            self._edge_timer = None
            b = self._edge_body
            if b is None or self.transport.is_closing():
                return
            now = self.loop.time()
            if self.flow is not None and self.flow.read_paused:  # the app is behind, not the client
                b[0], b[1], b[2] = now, 0, now
                self._edge_arm(self.edge.body_timeout_s, self._edge_body_check)
                return
            t = self.edge.body_timeout_s
            deadline = b[2] + t  # the longest pause
            if self.edge.min_rate:
                deadline = min(deadline, b[0] + t + b[1] / self.edge.min_rate)  # the average rate
            if now < deadline:
                self._edge_arm(deadline - now, self._edge_body_check)
                return
            why = (
                f"request body read timeout: {b[1]} bytes in {now - b[0]:.1f} s (MAPPER_BODY_TIMEOUT_S "
                f"{t:g} s, MAPPER_MIN_BODY_BYTES_PER_S {self.edge.min_rate})"
            )
            self.edge.closed("body_timeout")
            if self.cycle is not None and not self.cycle.response_complete:
                self.scope[EDGE_CLOSED] = why  # the route's disconnect handler logs it (408)
            else:
                log.info("closed a connection from %s: %s", self._who(), why)
            self.transport.close()

        def _who(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    return EdgeHttpProtocol

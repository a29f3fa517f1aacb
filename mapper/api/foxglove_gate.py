"""The public Foxglove port: a WebSocket gate in front of the foxglove-sdk server (``mapper.foxglove``).

The SDK's server has no authentication hook and speaks only the subprotocol ``foxglove.sdk.v1``, while
Lichtblick before December 2025 and tools built on ``@foxglove/ws-protocol`` ask for its older name
``foxglove.websocket.v1`` (the same protocol: serverInfo / advertise / subscribe ops and binary message
frames) and get HTTP 400. So the SDK server listens on an ephemeral loopback port and :class:`FoxgloveGate`
serves the public one:

* the handshake must carry a valid API or read token once tokens are set (``Authorization: Bearer`` or
  ``?token=``, as on the service's own WebSocket; checked by ``deps.check_token``): else HTTP 401 (403
  for a token the service does not accept), before any map name is sent; with no token configured only
  loopback clients are served (``auth.AuthGate``'s rule);
* it accepts either subprotocol name, answering with the one the client offered first, and speaks
  ``foxglove.sdk.v1`` to the SDK server; messages are relayed unchanged both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from ..errors import MapperError
from ..settings import Settings, is_loopback
from .deps import check_token
from .errors import status_of

log = logging.getLogger("mapper.foxglove")

SUBPROTOCOLS = ("foxglove.sdk.v1", "foxglove.websocket.v1")  # the SDK's name first: what upstream speaks
UPSTREAM_SUBPROTOCOL = "foxglove.sdk.v1"
MAX_CLIENT_MESSAGE = 1 << 20  # client -> server messages are small JSON ops (subscribe, ...)


def _offered(request) -> list[str]:
    raw = ",".join(request.headers.get_all("Sec-WebSocket-Protocol"))
    return [p.strip() for p in raw.split(",") if p.strip()]


def _token(request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


class FoxgloveGate:
    """The public Foxglove WebSocket server: token check, both subprotocol names, relay to ``upstream``."""

    def __init__(self, settings: Settings, upstream_port: int):
        self.settings = settings
        self.upstream = f"ws://127.0.0.1:{upstream_port}"
        self.server = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> FoxgloveGate:
        self.server = await serve(
            self._relay,
            host,
            port,
            process_request=self._check,
            select_subprotocol=self._select,
            subprotocols=list(SUBPROTOCOLS),
            max_size=MAX_CLIENT_MESSAGE,
            compression=None,
        )
        self.port = next(iter(self.server.sockets)).getsockname()[1]
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)

    # the handshake
    def _check(self, connection, request):
        s = self.settings
        try:
            if not s.auth_enabled:
                host = str(connection.remote_address[0]) if connection.remote_address else ""
                if not _loopback(host):
                    return self._refuse(
                        connection,
                        403,
                        f"no MAPPER_API_TOKENS configured: only loopback clients are served (client {host})",
                    )
            check_token(s, _token(request), write=False)
        except MapperError as e:
            return self._refuse(connection, status_of(e), str(e))
        if not any(p in SUBPROTOCOLS for p in _offered(request)):
            return self._refuse(
                connection, 400, f"Sec-WebSocket-Protocol: expected one of {', '.join(SUBPROTOCOLS)}"
            )
        return None

    @staticmethod
    def _refuse(connection, status: int, detail: str):
        log.info("foxglove: refused a connection (%d): %s", status, detail)
        response = connection.respond(status, detail + "\n")
        if status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @staticmethod
    def _select(connection, offered):
        for p in offered:  # the client's preference
            if p in SUBPROTOCOLS:
                return p
        return None

    # the relay
    async def _relay(self, client) -> None:
        try:
            async with connect(
                self.upstream, subprotocols=[UPSTREAM_SUBPROTOCOL], max_size=None, compression=None
            ) as upstream:

                async def pump(src, dst):
                    with contextlib.suppress(ConnectionClosed):
                        async for msg in src:
                            await dst.send(msg)

                pairs = ((client, upstream), (upstream, client))
                tasks = {asyncio.create_task(pump(a, b)) for a, b in pairs}
                _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in pending:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                        await t
        except (OSError, ConnectionClosed) as e:  # the SDK server went away (shutdown)
            log.info("foxglove: relay ended: %s", e)


def _loopback(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == ""  # not an IP address (a Unix socket): local
    return is_loopback(host)

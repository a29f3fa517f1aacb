"""Graceful shutdown that keeps the ack promise: drain the service *before* the server closes connections.

On SIGTERM (or SIGINT) uvicorn stops accepting, then at once closes every WebSocket with 1012, waits for
the HTTP requests in progress (up to ``timeout_graceful_shutdown``) and only then runs the lifespan
shutdown. The acks of frames a stream had already handed to a map's writer would be lost, and a client that
resends unacknowledged frames would integrate them twice. So the lifespan puts this hook in front of the
server's signal handlers: the first signal starts :meth:`MapService.drain` (new requests and streams get
503, streams stop reading, send the acks of the frames they took and close with 1012 and a reason), and
only when that is done, or ``MAPPER_SHUTDOWN_GRACE_S`` ran out, is the signal passed on to the server's own
handler. A second signal passes on at once. This works for ``mapper serve`` and for ``uvicorn --factory``
alike (uvicorn installs its handlers before the lifespan starts); without a main-thread event loop (a
``TestClient``) nothing is installed and the lifespan shutdown drains the streams instead.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

log = logging.getLogger("mapper.api.shutdown")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainOnSignal:
    """Runs ``service.drain(grace_s)`` on the first SIGTERM/SIGINT, then re-raises the signal for the
    handler installed before (uvicorn's, which then shuts the server down)."""

    def __init__(self, service, grace_s: float):
        self.service = service
        self.grace_s = grace_s
        self.previous: dict[int, object] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None

    def install(self) -> DrainOnSignal:
        """Install the handlers (only from the main thread, where signal handlers live)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        self.loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            prev = signal.getsignal(sig)
            if prev in (signal.SIG_IGN, None):
                continue
            self.previous[sig] = prev
            signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back where ours are still installed."""
        for sig, prev in self.previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev)
        self.previous = {}

    def _on_signal(self, sig: int, frame) -> None:
        if self.task is not None or self.loop is None:  # a second signal: do not wait any longer
            self._pass_on(sig)
            return
        self.loop.call_soon_threadsafe(self._start, sig)

    def _start(self, sig: int) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._drain(sig), name="drain")

    async def _drain(self, sig: int) -> None:
        t = time.monotonic()
        log.info("%s: draining (grace %.0f s)", signal.Signals(sig).name, self.grace_s)
        try:
            done = await self.service.drain(self.grace_s)
            log.info("drained in %.2f s%s", time.monotonic() - t, "" if done else " (grace exceeded)")
        except Exception:
            log.exception("drain failed; shutting down anyway")
        finally:
            self._pass_on(sig)

    def _pass_on(self, sig: int) -> None:
        """Restore the previous handlers and raise the signal again for them."""
        if sig not in self.previous:
            return
        self.uninstall()
        signal.raise_signal(sig)

"""Ingest: one frame per POST, or a WebSocket stream of frames with in-order acks and backpressure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from ... import wire
from ...errors import MapperError
from ..deps import EntryDep, ReadAuth, WriteAuth, check_token, is_msgpack_body, read_message, reply
from ..errors import PayloadTooLarge, error_body, status_of
from ..schemas import FRAME_BODY, Ack, ErrorBody
from ..service import MapEntry

log = logging.getLogger("mapper.api.frames")
ERRORS = {c: {"model": ErrorBody} for c in (400, 401, 403, 404, 413, 422, 429, 503, 507)}
router = APIRouter(prefix="/v1/maps", tags=["frames"])
WS_DECODE_AHEAD = 4  # frames of one stream decoded at once
SHUTDOWN_REASON = "service restarting: every frame taken is acknowledged; resend the rest elsewhere or later"


@router.post(
    "/{map_id}/frames",
    response_model=Ack,
    dependencies=[ReadAuth, WriteAuth],
    responses=ERRORS,
    openapi_extra=FRAME_BODY,
)
async def post_frame(request: Request, entry: EntryDep):
    """Integrate one frame. The ack comes after the frame is in the write-ahead log (fsync'd) and in the
    map: a query sent after the ack sees it. 429 when the map's queue is full (retry)."""
    t0 = time.perf_counter()
    body = await (request.body() if is_msgpack_body(request) else read_message(request))
    frame = await entry.decode(body)  # validated once, on a decode thread (off the loop and the writer)
    ack = await (await entry.submit(frame, wait=False))  # WAL (fsync'd) -> map -> published version
    dt = time.perf_counter() - t0
    entry.metrics.ack.labels("http").observe(dt)
    entry.metrics.map_ack.labels(entry.id, "http").observe(dt)
    return reply(request, ack)


async def _deny(ws: WebSocket, exc: MapperError) -> None:
    """Refuse a WebSocket before accepting it (an HTTP error response where the server supports it)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(error_body(exc), status_code=status_of(exc)))
    else:
        await ws.close(code=1008, reason=str(exc)[:120])


def _settle_quietly(fut: asyncio.Future) -> asyncio.Future:
    """Mark ``fut``'s exception as seen once it is set: a frame's error reaches the client in its ack, or
    nowhere when the client left before it (then asyncio would log a traceback per frame at collection:
    "Future exception was never retrieved")."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


@router.websocket("/{map_id}/stream")
async def stream_frames(ws: WebSocket, map_id: str):
    """Binary msgpack frames in, msgpack acks out in the same order. When the map's queue is full the
    server stops reading (backpressure); an accepted frame is never dropped. A bad frame gets an error
    message ``{"type", "detail", "frame_id"?}`` in its place and the stream goes on. Auth: the
    ``Authorization: Bearer`` header, or ``?token=`` for clients that cannot set headers.

    On shutdown (SIGTERM) the server stops reading, sends the acks of every frame it took, then closes
    with 1012 (service restart): frames without an ack were not taken and are safe to resend."""
    settings = ws.app.state.settings
    try:
        auth = ws.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ws.query_params.get("token")
        check_token(settings, token, write=True)
        entry: MapEntry = ws.app.state.service.get(map_id)
    except MapperError as e:
        await _deny(ws, e)
        return
    await ws.accept()
    await FrameStream(ws, entry, settings).run()


class FrameStream:
    """One accepted WebSocket stream of frames into ``entry``: a reader (this task) decodes each message
    on a thread as soon as it is read, a submitter hands the decoded frames to the map's writer in arrival
    order, and a sender sends their acks in the same order. Two bounded queues between them give the
    backpressure: ``decoded`` (``WS_DECODE_AHEAD`` frames being decoded) and ``pending``
    (``ws_max_in_flight`` acks outstanding); the map's full queue stops the submitter, hence the reader."""

    def __init__(self, ws: WebSocket, entry: MapEntry, settings) -> None:
        self.ws, self.entry, self.settings = ws, entry, settings
        self.metrics = entry.metrics
        self.metrics.ws_connections.inc()
        self.loop = asyncio.get_running_loop()
        # acks to send, in order: (future of the ack, t0, frame_id), None = the end
        self.pending: asyncio.Queue = asyncio.Queue(settings.ws_max_in_flight)
        # decoded frames in arrival order: each decode runs in a thread as soon as its message is read, so
        # a stream decodes several frames at once (as several HTTP clients would); the submitter takes
        # them in order, so the acks keep the frames' order
        self.decoded: asyncio.Queue = asyncio.Queue(min(WS_DECODE_AHEAD, settings.ws_max_in_flight))

    async def run(self) -> None:
        """Serve the stream until the client leaves, a task fails or the service drains; then acknowledge
        every frame read and close."""
        self.sender = self.loop.create_task(self._send_acks())
        self.submitter = self.loop.create_task(self._submit_frames())
        service = self.entry.service
        service.streams += 1
        draining = self.loop.create_task(service.draining.wait())
        self.recv: asyncio.Task | None = None
        try:
            await self._read(draining)
        except WebSocketDisconnect:
            pass
        finally:
            for t in (self.recv, draining):
                if t is not None:
                    t.cancel()
            self.metrics.ws_connections.dec()
            await self._finish()
            await self._close()
            service.streams -= 1

    async def _read(self, draining: asyncio.Task) -> None:
        """Read messages into ``decoded`` until the client leaves, the sender or submitter stops, or the
        service drains (then no more frames are taken)."""
        service = self.entry.service
        while not service.draining.is_set():
            self.recv = self.recv or self.loop.create_task(self.ws.receive())
            await asyncio.wait((self.recv, draining), return_when=asyncio.FIRST_COMPLETED)
            if not self.recv.done():
                return  # shutting down: take no more frames, ack those taken (run's finally)
            message, self.recv = self.recv.result(), None
            if message["type"] == "websocket.disconnect":
                return
            t0 = time.perf_counter()
            try:
                task = self._take(message.get("bytes"))
            except MapperError as e:
                task = _settle_quietly(self.loop.create_future())
                task.set_exception(e)
            await self.decoded.put((task, t0))  # waits while WS_DECODE_AHEAD frames are being decoded
            if self.sender.done() or self.submitter.done():
                return

    def _take(self, data) -> asyncio.Future:
        """Start decoding one message's bytes on a thread (raises on a text or oversized message)."""
        if data is None:
            raise wire.MalformedMessage("stream: send frames as binary msgpack messages")
        if len(data) > self.settings.max_body_bytes:
            raise PayloadTooLarge(f"frame: {len(data)} bytes exceed MAPPER_MAX_BODY_BYTES")
        return _settle_quietly(self.loop.create_task(self.entry.decode(data)))

    async def _submit_frames(self) -> None:
        """Hand the decoded frames to the map's writer in order; a bad frame's error takes its place."""
        while True:
            item = await self.decoded.get()
            if item is None:
                await self.pending.put(None)
                return
            task, t0 = item
            fid = None
            try:
                frame = await task
                fid = frame.frame.frame_id
                fut = await self.entry.submit(frame, wait=True)  # waits while the map's queue is full
            except Exception as e:  # a bad frame: its error takes its place in the acks
                fut = self.loop.create_future()
                fut.set_exception(e)
            _settle_quietly(fut)
            await self.pending.put((fut, t0, fid))  # waits while too many acks are outstanding

    async def _send_acks(self) -> None:
        """Send each frame's ack (or its error message) in the frames' order."""
        while True:
            item = await self.pending.get()
            if item is None:
                return
            await self.ws.send_bytes(wire.packb(await self._ack_message(*item)))

    async def _ack_message(self, fut: asyncio.Future, t0: float, fid) -> dict:
        """The message answering one frame: its ack (timed into the metrics) or its error."""
        entry = self.entry
        try:
            msg = await fut
            dt = time.perf_counter() - t0
            self.metrics.ack.labels("ws").observe(dt)
            self.metrics.map_ack.labels(entry.id, "ws").observe(dt)
        except MapperError as e:
            msg = {**error_body(e), "status": status_of(e)}
            if fid is not None:
                msg["frame_id"] = fid
            log.info("stream %s: frame %s refused (%d): %s", entry.id, fid, msg["status"], e)
        except Exception as e:  # an internal error: report it, keep the stream
            log.exception("stream %s: frame failed", entry.id)
            msg = {"type": "internal_error", "detail": type(e).__name__, "status": 500}
        return msg

    async def _finish(self) -> None:
        """Submit and acknowledge every frame read (at most 60 s), unless the client is gone."""
        if self.sender.done():  # the client is gone: nothing more can be acknowledged
            self.submitter.cancel()
        elif not self.submitter.done():

            async def finish():  # every frame read is submitted and acknowledged, then the end marker
                await self.decoded.put(None)
                await self.submitter
                await self.sender

            try:
                await asyncio.wait_for(finish(), timeout=60)
            except Exception:
                self.submitter.cancel()
                self.sender.cancel()
        else:
            self.sender.cancel()

    async def _close(self) -> None:
        """Close the socket: 1012 when the service drains (every frame taken is acknowledged; the rest was
        not read), else a normal close."""
        with contextlib.suppress(Exception):
            if self.entry.service.draining.is_set():
                await self.ws.close(code=1012, reason=SHUTDOWN_REASON)
            else:
                await self.ws.close()

"""One exception hierarchy for the library; the service maps it to HTTP in one handler."""

from __future__ import annotations


class MapperError(Exception):
    """Base class of every error mapper raises on purpose."""


class InvalidArgument(MapperError, ValueError):
    """An argument has the wrong shape, range, device or content (HTTP 422)."""


class InvalidArgumentType(MapperError, TypeError):
    """An argument has the wrong type or dtype (HTTP 422)."""


class NotFound(MapperError, KeyError):
    """A named thing (map, layer) does not exist (HTTP 404)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class Conflict(MapperError):
    """The request conflicts with the current state (HTTP 409)."""


class CapacityExceeded(MapperError):
    """A size limit would be exceeded (HTTP 413 / 429)."""


class RequestTooLarge(CapacityExceeded, InvalidArgument):
    """One request (a slice, box, query, mesh, or a map's ESDF reach) would need more memory than a
    single request may use (HTTP 413); the message names the numbers."""


class InsufficientStorage(CapacityExceeded):
    """A map's or the process's memory budget would be exceeded (HTTP 507); nothing was changed."""


class OutOfDeviceMemory(MapperError):
    """The device ran out of memory during an operation (HTTP 503); the map is unchanged or holds the
    operation's partial update, and keeps serving."""


class Unavailable(MapperError):
    """The service is starting or stopping, or a map is restoring (HTTP 503)."""

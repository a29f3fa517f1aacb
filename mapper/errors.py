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

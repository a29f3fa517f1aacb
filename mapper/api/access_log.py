"""Keep uvicorn's access log readable: the viewer's and dashboards' polls are not access-log lines.

An open viewer tab polls ``GET /v1/maps/{id}/mesh/blocks`` up to ten times a second, and the status, the
trajectory and ``/metrics`` every second or so, also on a map that does not change. :class:`PollFilter`
drops the successful (2xx/304) answers to these read polls from the ``uvicorn.access`` logger; errors
(4xx/5xx) on them stay, as does every other request. Their counts and latencies stay in ``/metrics``
(``mapper_http_request_duration_seconds``).
"""

from __future__ import annotations

import logging
import re

ACCESS_LOGGER = "uvicorn.access"

# GET paths of high-rate read polls (the query string is ignored)
POLL_PATHS = re.compile(
    r"^/(?:v1/maps/[^/?]+/(?:mesh/blocks|status|trajectory|occupied|esdf/slice)|metrics|healthz|readyz|livez)$"
)


class PollFilter(logging.Filter):
    """Drops uvicorn access records of successful GET polls (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client_addr, method, full_path, http_version, status_code)
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _, method, full_path, _, status = args
        try:
            status = int(status)
        except (TypeError, ValueError):
            return True
        if method not in ("GET", "HEAD") or not (200 <= status < 300 or status == 304):
            return True
        return not POLL_PATHS.match(str(full_path).split("?", 1)[0])


def install(logger_name: str = ACCESS_LOGGER) -> PollFilter:
    """Add one :class:`PollFilter` to ``logger_name`` (idempotent) and return it."""
    logger = logging.getLogger(logger_name)
    for f in logger.filters:
        if isinstance(f, PollFilter):
            return f
    f = PollFilter()
    logger.addFilter(f)
    return f

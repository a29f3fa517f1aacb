"""The HTTP/WebSocket mapping service: ``create_app(settings)``."""

from .app import create_app

__all__ = ["create_app"]

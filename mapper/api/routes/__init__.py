"""One router per resource: maps, frames (HTTP + WebSocket ingest), queries, health."""

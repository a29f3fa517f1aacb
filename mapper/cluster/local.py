"""Run the cluster in a program: its ingress app served from a thread of this process, and a wait until a
cluster (this one, or ``mapper serve --ray`` elsewhere) is ready.

    from mapper.cluster.ingress import create_cluster_app
    from mapper.cluster.local import serve_in_thread

    with serve_in_thread(create_cluster_app(settings, workers=2)) as url:
        ...  # MapperClient(url)

Used by tests/test_cluster_ray.py and benchmarks/bench_cluster.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

START_TIMEOUT_S = 600.0


@contextlib.contextmanager
def serve_in_thread(
    app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = START_TIMEOUT_S
) -> Iterator[str]:
    """Serve ``app`` (uvicorn) on ``host:port`` (0: a free port) from a daemon thread; yields its base URL
    once the app's lifespan has started (for the cluster app: Ray joined, the map workers up and their
    maps recovered). On exit the server stops (the lifespan's shutdown: every map snapshotted).

    Raises:
        RuntimeError: the server stopped or did not start within ``timeout_s`` seconds.
    """
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    t = threading.Thread(target=server.run, name="mapper-serve", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not t.is_alive():
            raise RuntimeError("the app stopped while starting (see its log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the app did not start within {timeout_s:g} s")
        time.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        t.join(timeout_s)


def wait_ready(
    url: str, timeout_s: float = 180.0, workers: int | None = None, alive: Callable[[], bool] | None = None
) -> dict:
    """Poll ``GET {url}/readyz`` until it answers 200 (with ``workers``: and reports that many map workers);
    returns its body. ``alive``: checked on every poll (e.g. that the server process still runs).

    Raises:
        RuntimeError: ``alive()`` turned false, or not ready within ``timeout_s`` seconds.
    """
    # lazy: the service stack (fastapi, pydantic, uvicorn, httpx, websockets) loads only where it is used
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"{url}: the server stopped before it was ready ({last})")
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            last = f"{r.status_code} {r.text[:200]}"
            if r.status_code == 200:
                body = r.json()
                if workers is None or body.get("workers") == workers:
                    return body
        except httpx.HTTPError as e:
            last = type(e).__name__
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not ready within {timeout_s:g} s (last: {last})")
        time.sleep(0.5)

"""The scaffolding of the SIGKILL tests (``tests/test_service_crash.py``, ``tests/test_objstore.py``,
``tests/test_cluster_ray.py``): a client streaming frames from a thread while the test kills the process
under it, the checks of a map recovered after the kill, and the TSDF comparison against a map rebuilt here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from test_service_helpers import scan

from mapper import Map
from mapper.client import MapperClient
from mapper.persistence import load_snapshot_file


class StreamThread:
    """Frames ``frame(i)`` (``(points_sensor, T_world_sensor)``), ``i = 0 .. n - 1``, streamed into ``map_id``
    over one WebSocket (``MapperClient.stream``, at most ``window`` in flight) from a daemon thread, with
    frame ids ``f"{prefix}{i}"`` (and timestamps ``float(i)`` with ``timestamps``). ``acks`` grows as acks
    arrive; ``errors`` holds what ended the stream early (a kill cuts it). ``before_send(i)`` runs before
    frame ``i`` is sent (to hold the stream at a point)."""

    def __init__(
        self,
        url: str,
        map_id: str,
        n: int,
        *,
        frame: Callable[[int], tuple] = scan,
        window: int = 4,
        token: str | None = None,
        prefix: str = "f",
        timestamps: bool = False,
        before_send: Callable[[int], None] | None = None,
    ):
        self.url, self.map_id, self.n, self.frame, self.window = url, map_id, n, frame, window
        self.token, self.prefix, self.timestamps, self.before_send = token, prefix, timestamps, before_send
        self.acks: list[dict] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="stream", daemon=True)

    def _run(self) -> None:
        try:
            with MapperClient(self.url, token=self.token) as c, c.stream(self.map_id, self.window) as s:
                for i in range(self.n):
                    if self.before_send is not None:
                        self.before_send(i)
                    ts = float(i) if self.timestamps else None
                    self.acks.extend(s.send_lidar(*self.frame(i), timestamp=ts, frame_id=f"{self.prefix}{i}"))
                self.acks.extend(s.flush())
        except BaseException as e:  # the kill cuts the stream
            self.errors.append(e)

    def start(self) -> StreamThread:
        self.thread.start()
        return self

    def wait_acks(self, n: int, timeout_s: float = 120.0) -> int:
        """Wait until ``n`` frames are acked (or the stream ended, or ``timeout_s`` passed); returns how many
        are acked now."""
        deadline = time.monotonic() + timeout_s
        while len(self.acks) < n and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(self.acks)

    def kill_after(self, n_acks: int, kill: Callable[[], None], join_s: float = 60.0) -> float:
        """Once ``n_acks`` frames are acked, ``kill()`` (the process under the stream, SIGKILL); waits for
        the stream to end and asserts that the kill cut it. Returns ``time.monotonic()`` at the kill."""
        self.wait_acks(n_acks)
        kill()
        killed = time.monotonic()
        self.join(join_s)
        assert self.errors, "the stream should have been cut by the kill"
        return killed

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the stream still runs {timeout_s:g} s later"

    def frame_ids(self) -> list[str]:
        return [a["frame_id"] for a in self.acks]


def wait_until(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``cond`` until it holds or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not (ok := cond()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return ok


def answer_within(call: Callable, since: float, timeout_s: float = 60.0, errors: tuple = (Exception,)):
    """``call()``'s answer once it stops raising ``errors`` (a killed worker, restarted, answers again);
    asserts that it answered within ``timeout_s`` of ``since`` (``time.monotonic()`` at the kill)."""
    while True:
        try:
            out = call()
            break
        except errors:
            assert time.monotonic() - since < timeout_s, f"no answer within {timeout_s:g} s of the kill"
            time.sleep(0.5)
    assert time.monotonic() - since < timeout_s, f"no answer within {timeout_s:g} s of the kill"
    return out


def check_recovered(c: MapperClient, map_id: str, n_acked: int, window: int, export: Path) -> tuple[int, Map]:
    """A map restarted after a kill: it holds every acknowledged frame and at most the ``window`` (+ 1)
    frames that were in flight (durable without their ack), ``frames_integrated`` agrees, and it keeps
    ingesting (the next frame takes the next seq). Returns the recovered seq and the map as served (its
    export, loaded here)."""
    m = c.get_map(map_id)
    recovered = m["last_seq"]
    assert n_acked <= recovered <= n_acked + window + 1
    assert m["frames_integrated"] == recovered
    served = served_map(c, map_id, export)
    assert c.send_lidar(map_id, *scan(99))["seq"] == recovered + 1
    return recovered, served


def served_map(c: MapperClient, map_id: str, path: Path) -> Map:
    """The map ``map_id`` as served: exported to ``path`` and loaded on the CPU."""
    c.export(map_id, path)
    tensors, meta = load_snapshot_file(path)
    return Map.from_state_dict(tensors, meta, device="cpu")


def rebuilt(config: dict, n: int, frame: Callable[[int], tuple] = scan) -> Map:
    """A CPU map of ``config`` fed ``frame(0 .. n - 1)`` here: the reference of a served map."""
    m = Map(**config, device="cpu")
    for i in range(n):
        m.integrate_lidar(*frame(i))
    return m


def assert_same_tsdf(a: Map, b: Map, atol: float = 1e-3) -> None:
    """Same TSDF voxels (exactly), weights and distances (within ``atol``)."""
    g1, x = a.layer("tsdf")
    g2, y = b.layer("tsdf")
    assert torch.equal(g1.ijk, g2.ijk)
    torch.testing.assert_close(x["weight"], y["weight"], rtol=0, atol=atol)
    torch.testing.assert_close(x["tsdf"], y["tsdf"], rtol=0, atol=atol)

"""SIGKILL while a client streams: after a restart every acknowledged frame is in the map, and the map
equals one rebuilt here from exactly the frames the server recovered (a prefix of the stream that holds
every acknowledged frame: frames in flight at the kill may be durable without their ack)."""

from __future__ import annotations

import threading
import time

import torch
from test_service_helpers import Server, scan

from mapper import Map
from mapper.client import MapperClient
from mapper.persistence import load_snapshot_file

N_FRAMES = 40
WINDOW = 4


def test_sigkill_loses_no_acknowledged_frame(tmp_path):
    data = tmp_path / "data"
    # snapshots every ~0.5 s during the stream: recovery = snapshot + WAL replay, not WAL alone
    server = Server(data, tmp_path / "a.log", MAPPER_SNAPSHOT_INTERVAL_S="0.5").start()
    acks: list[dict] = []
    try:
        with MapperClient(server.url) as c:
            mid = c.create_map(name="crash", voxel_size_m=0.25, layers=["tsdf"])["id"]
            config = c.get_map(mid)["config"]
        stream_error: list[BaseException] = []

        def stream():
            try:
                with MapperClient(server.url) as c2, c2.stream(mid, window=WINDOW) as s:
                    for i in range(N_FRAMES):
                        acks.extend(s.send_lidar(*scan(i), timestamp=float(i), frame_id=f"f{i}"))
                    acks.extend(s.flush())
            except BaseException as e:  # the kill cuts the stream
                stream_error.append(e)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 120
        while len(acks) < 12 and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.01)
        server.kill()  # SIGKILL, mid-stream
        t.join(60)
        assert stream_error, "the stream should have been cut by the kill"
    finally:
        server.stop()
    n_acked = len(acks)
    assert 12 <= n_acked < N_FRAMES
    assert [a["frame_id"] for a in acks] == [f"f{i}" for i in range(n_acked)]
    assert [a["seq"] for a in acks] == list(range(1, n_acked + 1))

    with Server(data, tmp_path / "b.log") as s2, MapperClient(s2.url) as c:
        m = c.get_map(mid)
        recovered = m["last_seq"]
        assert n_acked <= recovered <= n_acked + WINDOW + 1
        assert m["frames_integrated"] == recovered
        c.export(mid, tmp_path / "after.safetensors")
        ack = c.send_lidar(mid, *scan(99))  # and it keeps ingesting after the crash
        assert ack["seq"] == recovered + 1

    tensors, meta = load_snapshot_file(tmp_path / "after.safetensors")
    served = Map.from_state_dict(tensors, meta, device="cpu")
    rebuilt = Map(**config, device="cpu")
    for i in range(recovered):
        rebuilt.integrate_lidar(*scan(i))
    g1, a = served.layer("tsdf")
    g2, b = rebuilt.layer("tsdf")
    assert torch.equal(g1.ijk, g2.ijk)
    torch.testing.assert_close(a["weight"], b["weight"], rtol=0, atol=1e-3)
    torch.testing.assert_close(a["tsdf"], b["tsdf"], rtol=0, atol=1e-3)
    assert served.frames_integrated == rebuilt.frames_integrated == recovered

"""SIGKILL while a client streams: after a restart every acknowledged frame is in the map, and the map
equals one rebuilt here from exactly the frames the server recovered (a prefix of the stream that holds
every acknowledged frame: frames in flight at the kill may be durable without their ack)."""

from __future__ import annotations

from crash_helpers import StreamThread, assert_same_tsdf, check_recovered, rebuilt
from test_service_helpers import Server

from mapper.client import MapperClient

N_FRAMES = 40
WINDOW = 4


def test_sigkill_loses_no_acknowledged_frame(tmp_path):
    data = tmp_path / "data"
    # snapshots every ~0.5 s during the stream: recovery = snapshot + WAL replay, not WAL alone
    server = Server(data, tmp_path / "a.log", MAPPER_SNAPSHOT_INTERVAL_S="0.5").start()
    try:
        with MapperClient(server.url) as c:
            mid = c.create_map(name="crash", voxel_size_m=0.25, layers=["tsdf"])["id"]
            config = c.get_map(mid)["config"]
        stream = StreamThread(server.url, mid, N_FRAMES, window=WINDOW, timestamps=True).start()
        stream.kill_after(12, server.kill)  # SIGKILL, mid-stream
    finally:
        server.stop()
    n_acked = len(stream.acks)
    assert 12 <= n_acked < N_FRAMES
    assert stream.frame_ids() == [f"f{i}" for i in range(n_acked)]
    assert [a["seq"] for a in stream.acks] == list(range(1, n_acked + 1))

    with Server(data, tmp_path / "b.log") as s2, MapperClient(s2.url) as c:
        recovered, served = check_recovered(c, mid, n_acked, WINDOW, tmp_path / "after.safetensors")
    ref = rebuilt(config, recovered)
    assert_same_tsdf(served, ref)
    assert served.frames_integrated == ref.frames_integrated == recovered

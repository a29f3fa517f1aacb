"""Host syncs of a steady-state frame on the GPU (issue 12): counted as CUDA reports them
(``torch.cuda.set_sync_debug_mode("warn")``), per frame after a warm-up, inputs as the service passes them
(points / depth on the device, pose and intrinsics on the host). The bound per case is what the frame path
needs now (NOTES.md, "Frame path"); a change that adds a sync fails here, naming its line."""

from __future__ import annotations

import pytest
import torch
from sync_count import cuda_syncs

from mapper import Map, sim

pytestmark = pytest.mark.gpu

# LiDAR TSDF: the points filter, the coarse pass's sizes, the frame's brick count, the allocation's sizes;
# occupancy: + the ESDF queue's occasional compaction (a unique of the queued bricks once they pass 2^18
# rows: occupancy frames queue ~10^5 bricks; the ray chunking's row count is gone: the coarse pass's own size
# read decides whether to cut the rays); depth TSDF: the grow's brick count (triton_depth), the allocation's
# sizes, the valid pixels (read after the frame's work is queued)
MAX_SYNCS = {"lidar_tsdf": 4, "occupancy": 5, "depth_tsdf": 3}


def _frames(kind: str, dev: torch.device, n: int):
    if kind == "depth_tsdf":
        cam = sim.PinholeCamera(320, 240, 260.0, 260.0, 160.0, 120.0)
        return [(d, K.cpu(), T.cpu()) for d, K, T in sim.depth_sequence(n, cam, device=dev, max_range_m=8.0)]
    lidar = sim.SpinningLidar(n_beams=32, n_azimuth=1024)
    return [(p, T.cpu()) for p, T in sim.lidar_sequence(n, device=dev, lidar=lidar)]


@pytest.mark.parametrize("kind", sorted(MAX_SYNCS))
def test_steady_state_frame_host_syncs(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    frames = _frames(kind, dev, 6)
    if kind == "depth_tsdf":
        m = Map(0.02, layers=("tsdf",), device=dev, max_range_m=8.0)
    else:
        m = Map(
            0.1 if kind == "lidar_tsdf" else 0.05,
            layers=("tsdf",) if kind == "lidar_tsdf" else ("occupancy",),
            device=dev,
        )
    counts = []
    for i, f in enumerate(frames):
        with cuda_syncs() as sites:
            if kind == "depth_tsdf":
                m.integrate_depth(*f)
            else:
                m.integrate_lidar(*f, track=False)
        if i >= 3:  # steady state: kernels compiled, pools grown for the first frames
            counts.append((sum(sites.values()), dict(sites)))
    worst = max(counts, key=lambda c: c[0])
    assert worst[0] <= MAX_SYNCS[kind], f"{kind}: {worst[0]} host syncs in a frame: {worst[1]}"
    assert worst[0] >= 1  # the counter works (the allocation reads its sizes)

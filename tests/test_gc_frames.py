"""No frame pays a full garbage collection (mapper.gc_policy, issue 12).

1. The frame path leaves no reference cycles: frames of every kind (LiDAR TSDF + ESDF update + distance
   query, occupancy + ESDF, depth TSDF + colour + incremental mesh, pose-less LiDAR, a read view) run with
   the collector off, then ``gc.collect()`` must find nothing unreachable (the ESDF's recursive closure was
   one cycle of ~80 objects, 35 of them tensors, per update).
2. After ``gc_policy.settle()`` (what the warm-up does), a steady sequence of frames starts no generation-2
   collection (``gc.callbacks``), and the objects the collector still tracks grow by a few per frame (what
   a full collection would walk), time-bounded.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import time
import weakref

import pytest
import torch
from test_service_helpers import scan

from mapper import Map, gc_policy, sim


@pytest.fixture
def collector():
    """The collector as a test found it, whatever the test did (disable, debug flags, freeze)."""
    enabled = gc.isenabled()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
        if enabled:
            gc.enable()


def _cycles_of(step, frames: int) -> tuple[int, collections.Counter]:
    """Run ``step(i)`` for ``frames`` frames with the collector off; (unreachable objects, their types)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds, to name it
    for i in range(frames):
        step(i)
    found = gc.collect()
    types = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    gc.garbage.clear()
    gc.set_debug(0)
    gc.enable()
    return found, types


@contextlib.contextmanager
def _triton_compiles():
    """The names of the Triton kernels compiled inside the block (none without Triton)."""
    names: list[str] = []
    try:
        import triton

        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):
        yield names
        return
    prev = knobs.jit_post_compile_hook

    def hook(*args, **kwargs):
        names.append(str(getattr(kwargs.get("fn"), "name", kwargs.get("fn"))))
        return prev(*args, **kwargs) if prev is not None else False

    knobs.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.jit_post_compile_hook = prev


def _depth(i: int, device: torch.device):
    cam = sim.PinholeCamera(width=64, height=48, fx=50.0, fy=50.0, cx=31.5, cy=23.5)
    return next(iter(sim.depth_sequence(1, cam, device=device, seed=i, max_range_m=6.0)))


def test_frames_leave_no_reference_cycles(collector, device):
    kw = {"device": device, "warmup": False}  # on CUDA the first frames compile (outside the check)
    lidar_esdf = Map(0.25, layers=("tsdf", "esdf"), max_range_m=10.0, **kw)
    occ_esdf = Map(0.25, layers=("occupancy", "esdf"), max_range_m=10.0, **kw)
    depth = Map(0.1, layers=("tsdf", "color"), max_range_m=6.0, **kw)
    posless = Map(0.25, layers=("tsdf",), max_range_m=10.0, **kw)
    q = torch.tensor([[1.0, 0.5, 0.2], [3.0, -1.0, 0.0]], device=device)

    def lidar_step(i):
        pts, T = scan(i, 1500)
        lidar_esdf.integrate_lidar(pts, T)
        lidar_esdf.update_esdf()
        lidar_esdf.query_distance(q)
        occ_esdf.integrate_lidar(pts, T)
        occ_esdf.update_esdf()
        posless.integrate_lidar(pts)  # tracked: the odometry's state changes every frame
        lidar_esdf.read_view().query_tsdf(q)

    version = [None]

    def depth_step(i):
        d, K, T = _depth(i, device)
        color = torch.full((*d.shape, 3), 100 + i, dtype=torch.uint8, device=device)
        depth.integrate_depth(d, K, T, color=color)
        mesh = depth.mesh(since_version=version[0]) if version[0] is not None else depth.mesh()
        version[0] = mesh.version

    for step in (lidar_step, depth_step):  # first frames outside: caches, lazily built tables
        step(0)
    frame = 1
    for step in (lidar_step, depth_step):
        # Triton's compiler leaves cycles (thousands of objects per kernel variant; not a frame's work, and
        # the warm-up does it before the first frame): windows in which something compiled do not count
        for _ in range(5):
            with _triton_compiles() as compiled:
                found, types = _cycles_of(lambda i, s=step, f=frame: s(f + i), 3)
            frame += 3
            if not compiled:
                break
        assert not compiled, f"{step.__name__}: Triton still compiled {len(compiled)} kernels: {compiled[:4]}"
        assert found == 0, f"{step.__name__}: {found} objects in reference cycles: {types.most_common(8)}"


def test_a_dropped_map_leaves_no_reference_cycles(collector, device):
    """Maps are freed by reference counting (so a map frozen by ``settle()`` is still freed when dropped):
    every kind of map, after frames, ESDF, queries, a read view, meshes and a snapshot."""
    kw = {"device": device, "warmup": False}
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)

    def use_and_drop(layers):
        m = Map(0.25, layers=layers, max_range_m=10.0, **kw)
        for i in range(2):
            pts, T = scan(i, 1500)
            m.integrate_lidar(pts, T if i else None)
        if m._esdf is not None:
            m.update_esdf()
            m.esdf_slice(0.5)
        view = m.read_view()
        view.stats()
        if m._tsdf is not None:
            m.mesh()
        m.state_dict()
        del m, view

    for layers in (("tsdf", "esdf"), ("occupancy", "esdf"), ("tsdf", "color", "occupancy")):
        # on CUDA the first map of a kind compiles its kernels, and Triton's compiler leaves cycles of its
        # own: a round in which something compiled does not count (as in the frames test above)
        for _ in range(3):
            gc.set_debug(0)  # free what an earlier round saved, then save again
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            with _triton_compiles() as compiled:
                use_and_drop(layers)
                found = gc.collect()
            types = collections.Counter(type(o).__qualname__ for o in gc.garbage)
            gc.garbage.clear()
            if not compiled:
                break
        assert not compiled, f"{layers}: Triton still compiled {len(compiled)} kernels: {compiled[:4]}"
        assert found == 0, f"{layers}: {found} objects in reference cycles: {types.most_common(8)}"


def test_a_cycle_is_found(collector):
    """The check above can fail: a frame step that leaves one cycle is caught."""

    def leaky(i):
        a = {"i": i}
        a["self"] = a

    found, types = _cycles_of(leaky, 2)
    assert found == 2 and types["dict"] == 2


def test_settled_frames_start_no_full_collection(collector, device):
    m = Map(0.25, layers=("tsdf", "esdf"), device=device, max_range_m=10.0, warmup=False)
    for i in range(2):
        pts, T = scan(i, 1500)
        m.integrate_lidar(pts, T)
        m.update_esdf()
    full = []

    def cb(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    assert gc_policy.settle() >= 0.0
    assert gc.get_freeze_count() > 1000  # torch, numpy, pytest: the heap the warm-up leaves
    tracked0 = len(gc.get_objects())
    assert tracked0 < gc.get_freeze_count() // 10  # what a full collection walks now: not the frozen heap
    gc.callbacks.append(cb)
    frames, t0 = 0, time.perf_counter()
    try:
        while frames < 12 and time.perf_counter() - t0 < 30.0:
            pts, T = scan(frames, 1500)
            m.integrate_lidar(pts, T)
            m.update_esdf()
            frames += 1
    finally:
        gc.callbacks.remove(cb)
    assert frames >= 3
    assert full == [], f"{len(full)} full collections in {frames} frames"
    grown = len(gc.get_objects()) - tracked0
    assert grown <= 64 + 8 * frames, f"{grown} more tracked objects after {frames} frames"


def test_settle_thaws_what_it_froze(collector):
    """Frozen objects are never collected as cycles (the hazard of ``gc.freeze()``: the service settles
    again when it deletes a map); the next ``settle()`` thaws them first and collects them."""

    class Node:
        pass

    a = Node()
    a.self = a  # a cycle: only the cyclic collector frees it
    ref = weakref.ref(a)
    gc_policy.settle()
    del a
    gc.collect()
    assert ref() is not None  # frozen: invisible to the collector
    gc_policy.settle()
    assert ref() is None


def test_a_deleted_map_frozen_by_the_warm_up_is_freed(tmp_path, collector):
    """A map alive at the warm-up's ``gc.freeze()`` is still freed, with its tensors, when the service
    deletes it: its entry and the map hold no reference cycles (a frozen cycle would never be collected)."""
    from test_service_helpers import client, frame_bytes

    from mapper import wire

    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        r = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 200, r.text
        entry = c.app.state.service.maps[mid]
        refs = weakref.ref(entry), weakref.ref(entry.map)
        del entry
        gc_policy.settle()  # what the warm-up does: the map and its entry are frozen now
        assert gc.get_freeze_count() > 0
        assert c.delete(f"/v1/maps/{mid}").status_code == 204
        deadline = time.monotonic() + 10.0
        while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [ref() is None for ref in refs] == [True, True]

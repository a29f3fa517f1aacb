"""The native-heap hygiene of the service (mapper.api.memory): malloc_trim gives freed heap pages back, a
fixed mmap threshold returns large blocks at free, and the work budget bounds the memory of concurrent
heavy operations (waiting, never failing)."""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mapper.api import memory


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not memory.available(), reason="needs glibc malloc")
def test_trim_returns_freed_heap_pages():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    n, size = 60_000, 4000  # 240 MB of small blocks: from the heap, never mmapped
    blocks = [libc.malloc(size) for _ in range(n)]
    assert all(blocks)
    for b in blocks:
        libc.memset(b, 1, size)
    touched = rss_bytes()
    for b in blocks[:-1]:  # the last block pins the top of the heap: glibc keeps the pages below it
        libc.free(b)
    freed = rss_bytes()
    assert freed > touched - 100e6  # free() alone gave (almost) nothing back
    assert memory.trim()
    trimmed = rss_bytes()
    libc.free(blocks[-1])
    assert trimmed < freed - 150e6, (touched, freed, trimmed)


def test_limit_arenas_zero_keeps_the_default():
    assert memory.limit_arenas(0) is False


# the subprocesses' start: mapper.api.memory loaded alone (no torch import) and libc's malloc/free/memset
LIBC_PROBE = r"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("memory", sys.argv[2])  # alone: no torch import
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
"""


# ------------------------------------------------------------------------------------- heap probes
@pytest.mark.skipif(memory.heap_info() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_mmap_threshold_returns_large_blocks_at_free():
    """With a fixed threshold a freed large block leaves the process at once (mmapped, unmapped on free),
    while glibc's dynamic threshold keeps such blocks in the arena after the first one was freed. In a
    subprocess: the setting is process-wide and cannot be undone."""
    code = (
        LIBC_PROBE
        + r"""
if sys.argv[1] == "fixed":
    assert memory.set_mmap_threshold(1 << 20)
n = 8 << 20
libc.free(libc.malloc(n))  # the dynamic threshold rises to 8 MiB here
before = memory.rss_bytes()
b = libc.malloc(n); libc.memset(b, 1, n)
live = memory.heap_info()
libc.free(b)
print(before, memory.rss_bytes(), live["mmap"], live["in_use"])
"""
    )
    out = {}
    for mode in ("dynamic", "fixed"):
        cmd = [sys.executable, "-c", code, mode, memory.__file__]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[mode] = [int(x) for x in r.stdout.split()]
    before, after, mmap, _ = out["fixed"]
    assert mmap >= 8 << 20  # served by mmap ...
    assert after - before < 2 << 20  # ... and gone at free
    before, after, mmap, in_use = out["dynamic"]
    assert mmap < 8 << 20 and in_use >= 8 << 20  # from the arena ...
    assert after - before > 6 << 20  # ... and still resident after free


FRAGMENT = (
    LIBC_PROBE
    + r"""
assert memory.set_mmap_threshold(int(sys.argv[1]))
size, n = 256 << 10, 200  # 50 MiB of request temporaries, each followed by a small block that stays
before = memory.rss_bytes()
temps, small = [], []
for _ in range(n):
    temps.append(libc.malloc(size)); libc.memset(temps[-1], 1, size)
    small.append(libc.malloc(512)); libc.memset(small[-1], 1, 512)
live = memory.heap_info()
for b in temps:
    libc.free(b)
free = sum(a["free"] for a in memory.malloc_arenas())
print(before, memory.rss_bytes(), live["mmap"], free)
"""
)


@pytest.mark.skipif(memory.heap_info() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_default_mmap_threshold_keeps_request_temporaries_out_of_the_arenas():
    """The service's default threshold (128 KiB) serves temporaries of 256 KiB with their own mmaps, so
    freeing them between small blocks that stay live (as a request's arrays between the objects it leaves
    behind) returns their memory at once; at the former 1 MiB they come from the arena and their freed
    space stays there, resident, pinned between the small blocks. In subprocesses (the setting is
    process-wide)."""
    from mapper.settings import Settings

    default = Settings.model_fields["malloc_mmap_threshold"].default
    assert default == 128 << 10
    out = {}
    for threshold in (default, 1 << 20):
        cmd = [sys.executable, "-c", FRAGMENT, str(threshold), memory.__file__]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[threshold] = [int(x) for x in r.stdout.split()]
    temps = 200 * (256 << 10)
    before, after, mmap, free = out[default]
    assert mmap >= temps  # every temporary mmapped ...
    assert free < 4 << 20 and after - before < 8 << 20, out  # ... and gone at free: the arena stays small
    before, after, mmap, free = out[1 << 20]
    assert mmap < 4 << 20  # from the arena ...
    assert free >= temps - (4 << 20) and after - before > temps - (8 << 20), out  # ... freed, still resident


@pytest.mark.skipif(memory.heap_info() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_malloc_arenas_add_up_to_mallinfo2():
    """The per-arena probe (malloc_info XML) against glibc's totals (mallinfo2), with a live 64 MiB of small
    blocks and 16 MiB of them freed so that both numbers are large."""
    blocks = [np.ones(2000) for _ in range(4000)]  # 16 kB arrays: from an arena
    del blocks[::4]
    arenas = memory.malloc_arenas()
    libc = ctypes.CDLL("libc.so.6")

    class MallInfo2(ctypes.Structure):
        _fields_ = [  # noqa: RUF012
            (n, ctypes.c_size_t)
            for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        ]

    libc.mallinfo2.restype = MallInfo2
    mi = libc.mallinfo2()
    assert arenas and len(arenas) >= 1
    assert all(a["system"] >= a["free"] >= 0 for a in arenas)
    tol = 1 << 20  # the Python objects made between the two calls
    assert abs(sum(a["system"] for a in arenas) - mi.arena) < tol, (arenas, mi.arena)
    assert abs(sum(a["free"] for a in arenas) - mi.fordblks) < tol, (arenas, mi.fordblks)
    assert sum(a["free"] for a in arenas) >= 1000 * 16000 - tol
    del blocks


def test_mmap_threshold_zero_keeps_the_default():
    assert memory.set_mmap_threshold(0) is False


# ------------------------------------------------------------------------------------- work budget
def test_work_budget_refuses_a_non_positive_capacity():
    with pytest.raises(ValueError, match="work memory budget"):
        memory.WorkBudget(0)


def test_work_budget_waits_in_order_and_never_exceeds_the_capacity():
    """Reservations over the capacity wait (none fails), first come first served, the total held never
    exceeds the capacity, and a reservation larger than the capacity runs alone."""
    log: list[tuple[str, str, int]] = []

    async def main():
        wb = memory.WorkBudget(100)
        gates = {name: asyncio.Event() for name in "ABCDE"}

        async def op(name, n):
            async with wb.hold(n):
                log.append(("start", name, wb.reserved))
                assert wb.reserved <= wb.capacity
                await gates[name].wait()
            log.append(("end", name, wb.reserved))

        tasks = {}
        for name, n in (("A", 60), ("B", 30), ("C", 50), ("D", 10), ("E", 500)):
            tasks[name] = asyncio.create_task(op(name, n))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        # A (60) and B (30) run; C (50) does not fit; D (10) would, but waits behind C (first come)
        assert [x[1] for x in log if x[0] == "start"] == ["A", "B"]
        assert (wb.running, wb.waiting, wb.reserved) == (2, 3, 90)
        gates["A"].set()
        await asyncio.sleep(0.01)
        assert [x[1] for x in log if x[0] == "start"] == ["A", "B", "C", "D"]  # 30 + 50 + 10
        for k in "BCD":
            gates[k].set()
        await asyncio.sleep(0.01)
        assert log[-1] == ("start", "E", 100)  # clamped to the capacity, alone
        gates["E"].set()
        await asyncio.gather(*tasks.values())
        assert (wb.reserved, wb.running, wb.waiting, wb.waits, wb.peak) == (0, 0, 0, 3, 100)

    asyncio.run(main())


def test_work_budget_cancelled_waiter_lets_the_others_run():
    async def main():
        wb = memory.WorkBudget(100)
        first = asyncio.Event()
        held = await wb.acquire(80)
        big = asyncio.create_task(wb.acquire(90))  # waits; blocks the small one behind it
        small = asyncio.create_task(wb.acquire(10))
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done()
        big.cancel()
        await asyncio.sleep(0.01)
        assert small.done() and wb.reserved == 90 and wb.waiting == 0
        first.set()
        wb.release(held)
        wb.release(small.result())
        assert (wb.reserved, wb.running) == (0, 0)

    asyncio.run(main())


@pytest.mark.skipif(memory.heap_info() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_work_budget_bounds_the_live_memory_of_concurrent_work():
    """Eight threads that each hold 32 MiB for a while: through a 100 MiB budget at most three run at once
    and the live native heap grows by at most ~96 MiB; without it by ~256 MiB."""
    size = 32 << 20

    def work():
        a = np.ones(size // 8)  # 32 MiB, touched
        time.sleep(0.15)
        return float(a[-1])

    def live():
        h = memory.heap_info()
        return h["in_use"] + h["mmap"]

    async def run(wb, pool):
        loop = asyncio.get_running_loop()

        async def one():
            if wb is None:
                return await loop.run_in_executor(pool, work)
            async with wb.hold(size):
                return await loop.run_in_executor(pool, work)

        base, peak, done = live(), 0, False

        async def watch():
            nonlocal peak
            while not done:
                peak = max(peak, live() - base)
                await asyncio.sleep(0.005)

        w = asyncio.create_task(watch())
        assert await asyncio.gather(*(one() for _ in range(8))) == [1.0] * 8
        done = True
        await w
        return peak

    with ThreadPoolExecutor(8) as pool:
        bounded = asyncio.run(run(memory.WorkBudget(100 << 20), pool))
        free = asyncio.run(run(None, pool))
    assert bounded <= 3 * size + (8 << 20), bounded / 2**20
    assert free >= 6 * size, free / 2**20


def test_concurrent_reads_over_the_work_budget_wait_and_succeed(tmp_path):
    """Black box: with a work budget that fits one read (64 MiB each) eight concurrent slices and queries
    all answer 200 (they waited, none failed), and the bytes reserved at once never passed the budget."""
    from test_api_limits import auth, metric, new_map
    from test_service_helpers import client, frame_bytes

    from mapper import wire

    cap = 100 << 20
    with client(tmp_path, api_tokens=["test-token-123"], work_memory_bytes=cap) as c:
        mid = new_map(c)
        for i in range(2):
            r = c.post(
                f"/v1/maps/{mid}/frames",
                content=frame_bytes(i),
                headers={**auth(), "content-type": wire.MSGPACK},
            )
            assert r.status_code == 200, r.text
        pts = wire.packb({"points": np.random.default_rng(0).uniform(-5, 5, (20_000, 3)).astype(np.float32)})
        barrier = threading.Barrier(8)

        def one(k):
            barrier.wait()
            if k % 2:
                return c.get(
                    f"/v1/maps/{mid}/esdf/slice", params={"z": 0.5, "format": "msgpack"}, headers=auth()
                )
            return c.post(
                f"/v1/maps/{mid}/query/distance",
                content=pts,
                headers={**auth(), "content-type": wire.MSGPACK},
            )

        with ThreadPoolExecutor(8) as pool:
            codes = [r.status_code for r in pool.map(one, range(8))]
        assert codes == [200] * 8
        text = c.get("/metrics", headers=auth()).text
        assert metric(text, "mapper_work_memory_budget_bytes") == cap
        assert 64 << 20 <= metric(text, "mapper_work_peak_bytes") <= cap
        assert metric(text, "mapper_work_waits_total") >= 1
        assert metric(text, "mapper_work_reserved_bytes") == 0 and metric(text, "mapper_work_running") == 0


def test_esdf_update_estimate_follows_the_last_update():
    from test_service_helpers import scan

    from mapper import budget
    from mapper.map import Map

    assert budget.esdf_update_bytes(Map(voxel_size_m=0.3, layers=["tsdf"], max_range_m=10.0)) == 0
    m = Map(voxel_size_m=0.3, layers=["tsdf", "esdf"], max_range_m=10.0)
    assert budget.esdf_update_bytes(m) == 0  # no update yet
    m.integrate_lidar(*scan(0, 1500))
    res = m.update_esdf()
    assert res["computed_voxels"] > 0
    assert budget.esdf_update_bytes(m) == budget.ESDF_UPDATE_BYTES_PER_VOXEL * res["computed_voxels"]


def test_work_budget_cancel_after_a_release_passed_over_the_waiter():
    """A waiter cancelled, then skipped by a release before it resumes: no error, nothing leaks."""

    async def main():
        wb = memory.WorkBudget(100)
        held = await wb.acquire(100)
        w = asyncio.create_task(wb.acquire(50))
        await asyncio.sleep(0.01)
        w.cancel()  # its future is cancelled now; the task resumes later
        wb.release(held)  # _wake pops the cancelled entry
        with pytest.raises(asyncio.CancelledError):
            await w
        assert (wb.reserved, wb.running, wb.waiting) == (0, 0, 0)
        assert await wb.acquire(100) == 100

    asyncio.run(main())


@pytest.mark.skipif(memory.malloc_arenas() is None, reason="needs glibc malloc_info")
def test_memory_collector_exports_every_arena():
    """/metrics gets one `system` and one `free` sample per arena, the free never above the held bytes."""
    fams = {f.name: f for f in memory.MemoryCollector().collect()}
    samples = fams["mapper_malloc_arena_bytes"].samples
    by_arena: dict[str, dict[str, float]] = {}
    for s in samples:
        by_arena.setdefault(s.labels["arena"], {})[s.labels["kind"]] = s.value
    assert len(by_arena) == len(memory.malloc_arenas()) >= 1
    assert all(set(v) == {"system", "free"} and v["system"] >= v["free"] >= 0 for v in by_arena.values())
    assert sorted(by_arena, key=int) == [str(i) for i in range(len(by_arena))]  # main arena is "0"

"""Test configuration.

* Without CUDA, Triton kernels run on CPU tensors through the interpreter: ``TRITON_INTERPRET=1`` must be
  set before ``triton.jit`` decorates anything, hence here, at import time.
* ``MAPPER_TRITON_SM90=1`` (no CUDA): instead of the plain interpreter, every Triton launch is compiled for
  sm_90 first and then interpreted (``tests/triton_sm90.py``), so CI catches kernels that only the
  interpreter accepts. ``tests/test_triton_sm90.py`` runs the Triton tests that way in a subprocess.
* ``backend`` runs a test with the torch reference and with the Triton kernels (``MAPPER_KERNELS``).
* ``device`` runs a test on the CPU and, where CUDA exists, on the GPU (those cases carry the ``gpu`` mark).
* ``local_ray``: one local Ray for every test of the ``ray`` mark (``tests/test_cluster_ray.py``, the Ray case
  of ``tests/test_objstore.py``). Those tests run one after another (moved next to the first of them), Ray
  starts with the first and stops after the last: one start of Ray per session instead of one per file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
SM90_CHECK = not HAS_CUDA and os.environ.get("MAPPER_TRITON_SM90") == "1"
if SM90_CHECK:
    os.environ.pop("TRITON_INTERPRET", None)
    from triton_sm90 import install as _install_sm90

    _install_sm90()
elif not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A service created in-process (TestClient) fixes glibc's mmap threshold for the whole pytest process
# (MAPPER_MALLOC_MMAP_THRESHOLD, default 128 KiB): every later test would pay an mmap and fresh page faults
# per block >= 128 KiB (CPU +44-87 % on meshing / TSDF frames, benchmarks/results/mmap_threshold_tsdf_cpu.md).
# Keep glibc's dynamic threshold in tests; tests/test_service_memory.py tests the thresholds explicitly.
os.environ.setdefault("MAPPER_MALLOC_MMAP_THRESHOLD", "0")

SHARED_DATA = Path(
    os.environ.get("MAPPER_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)


_BACKGROUND: list = []  # the sm_90 check's runner, when started early


def pytest_sessionfinish(session, exitstatus):
    _stop_ray()  # a run that stopped inside the Ray tests (-x, Ctrl-C)
    for bg in _BACKGROUND:  # a run that stopped before the check (-x, Ctrl-C) must not leave it running
        if bg.proc is not None and bg.proc.poll() is None:
            bg.proc.kill()
    report = os.environ.get("MAPPER_TRITON_SM90_REPORT")
    if SM90_CHECK and report:
        from triton_sm90 import compiled

        Path(report).write_text("\n".join(sorted(set(compiled))))


def pytest_collection_finish(session):
    """Start the sm_90 compile check's subprocess now, beside the suite, when that test is selected."""
    for item in session.items:
        if item.name == "test_every_triton_kernel_compiles_for_sm90":
            mod = item.module
            if mod.should_start_early():
                mod.Background.start()
                _BACKGROUND.append(mod.Background)
            break


def pytest_collection_modifyitems(config, items):
    # the Ray tests share one local Ray (``local_ray``): run them together, where the first of them stands
    on_ray = [i for i in items if i.get_closest_marker("ray")]
    if on_ray:
        first = items.index(on_ray[0])
        rest = [i for i in items if not i.get_closest_marker("ray")]
        items[:] = rest[:first] + on_ray + rest[first:]
    # the sm_90 compile check runs in a background subprocess from the end of collection: wait for it last
    last = [i for i in items if i.name == "test_every_triton_kernel_compiles_for_sm90"]
    if last:
        items[:] = [i for i in items if i not in last] + last
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def _triton_ok() -> bool:
    from mapper.kernels.dispatch import triton_available

    return triton_available()


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton" and not _triton_ok():
        pytest.skip("triton not installed")
    if request.param == "triton" and not (os.environ.get("TRITON_INTERPRET") == "1" or SM90_CHECK):
        dev = request.getfixturevalue("device") if "device" in request.fixturenames else torch.device("cpu")
        if dev.type != "cuda":
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set when there is no CUDA)")
    monkeypatch.setenv("MAPPER_KERNELS", request.param)
    return request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return torch.device(request.param)


_RAY: list = []  # the ray module while the tests' local Ray runs


def _start_ray():
    if _RAY:
        return _RAY[0]
    ray = pytest.importorskip(
        "ray", reason="ray is not installed (pip install 'mapper[ray]'): Ray tests skip"
    )
    assert not ray.is_initialized(), "Ray already runs in this process: the tests need their own local Ray"
    from test_service_helpers import S3_TEST_ENV

    from mapper.cluster.ray_cluster import start_local_ray

    # Ray's processes keep the environment of its start: map workers on the S3 store (test_objstore.py)
    # sign their requests to moto with its test credentials, set here (the tests' process keeps its own)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_TEST_ENV.items():
            mp.setenv(k, v)
        start_local_ray(num_cpus=2, namespace="mapper-test")
    _RAY.append(ray)
    return ray


def _stop_ray() -> None:
    while _RAY:
        _RAY.pop().shutdown()


@pytest.fixture(scope="module")
def local_ray():
    """The tests' local Ray (2 CPUs, a 200 MiB object store, no dashboard) for tests of the ``ray`` mark:
    started by the first of them, stopped after the last (they run one after another). A module's tests
    start their cluster apps on it once the map workers of the previous module's apps are gone
    (``mapper-w<i>`` actors are reused by name while they live)."""
    ray = _start_ray()
    deadline = time.monotonic() + 60
    while workers := [a for a in ray.util.list_named_actors(True) if a["name"].startswith("mapper-w")]:
        assert time.monotonic() < deadline, f"map workers of an earlier module still live: {workers}"
        time.sleep(0.2)
    return ray


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # the last test of the ray mark is done (its module's fixtures too, when the next test is elsewhere)
    if (
        _RAY
        and item.get_closest_marker("ray")
        and (nextitem is None or not nextitem.get_closest_marker("ray"))
    ):
        _stop_ray()


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA

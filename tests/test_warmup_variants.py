"""Frames after the warm-up compile nothing (issue 12: the first frame of a new map <= 50 ms once warmed).

Triton compiles one variant of a kernel per specialisation key (constexprs, dtypes, alignment, integer
kinds and residues; see ``tests/triton_variants.py``). ``warm_up`` must launch every variant a map
configuration's frames will launch:

* CPU (interpreter): specialisation keys of the launches (a key only the frames have would be a
  compilation mid-stream on a GPU), for the kernels whose sizes Triton specialises: the warm-up launches
  each class. (The whole frame path in the interpreter takes minutes on the CI machine: that check is the
  GPU test's.)
* GPU: the same through ``triton.knobs.runtime.jit_post_compile_hook`` (a compile, or a load from the disk
  cache, of any kernel during the frames fails).
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_variants import VariantRecorder

from mapper import Map, sim, warmup


def _frames(n_beams: int, n_az: int, n: int, dev):
    lidar = sim.SpinningLidar(n_beams=n_beams, n_azimuth=n_az, dropout_prob=0.2)
    return list(sim.lidar_sequence(n, device=dev, lidar=lidar, extent_m=60.0))


def _run_frames(m: Map, frames) -> None:
    version = None
    for i, (p, T) in enumerate(frames):
        m.integrate_lidar(p[: p.shape[0] - 7 * i], T, track=False)  # sizes the warm-up never saw
        if m._esdf is not None:
            m.update_esdf()
            m.query_distance(p[:5].to(torch.float32))
        mesh = m.mesh(since_version=version) if version is not None else m.mesh()
        version = mesh.version


def _fmt(keys) -> str:
    return "\n".join(f"{name}: {[a for a in spec if a[1] == 'c' or a[2] is not None]}" for name, spec in keys)


def _interpreter_only():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU-side check runs the kernels in the Triton interpreter")


def _envelope_problem(n_lines: int, length: int, offset: int = 0):
    g = torch.Generator().manual_seed(n_lines * 31 + length)
    f = torch.rand(offset + n_lines * length, generator=g) * 4
    f[torch.rand(f.shape[0], generator=g) < 0.3] = float("inf")
    start = offset + torch.arange(n_lines, dtype=torch.int64) * length
    return f, start, torch.full((n_lines,), length, dtype=torch.int64)


def test_recorder_tells_specialised_sizes_apart(monkeypatch):
    """The recorder itself: a specialised integer (the envelope's line count) gives one key per class
    (``== 1``, ``% 16 == 0``, neither), an unspecialised one (the normal fit's count) a single key."""
    _interpreter_only()
    monkeypatch.setenv("MAPPER_KERNELS", "triton")
    from mapper.kernels.envelope import lower_envelope
    from mapper.kernels.normals import ray_band_params, ray_bands, scan_normals

    with VariantRecorder() as rec:
        for n in (1, 2, 3, 16, 32):
            lower_envelope(*_envelope_problem(n, 5))
    env = [k for k in rec.keys if k[0] == "_envelope_kernel"]
    assert len(env) == 5 and len(set(env)) == 3
    g = torch.Generator().manual_seed(0)
    with VariantRecorder() as rec:
        for n in (1, 16, 37):
            p = torch.rand((n, 3), generator=g, dtype=torch.float64) * 2
            nrm, sup = scan_normals(torch.zeros(3, dtype=torch.float64), p, 0.5, (1,))
            ray_bands(p, nrm, sup, ray_band_params(p.device, 0.3, 1.2, 0.075, 1.0, 1.0))
    for name in ("_cell_normals_kernel", "_cell_moments_kernel", "_ray_bands_kernel"):
        nk = [k for k in rec.keys if k[0] == name]
        assert len(nk) == 3 and len(set(nk)) == 1, name


def test_warm_up_launches_every_envelope_variant(monkeypatch):
    """The ESDF's envelope kernel specialises its line count: the warm-up launches each class, so an ESDF
    update of any size finds its variant compiled (on the H200 these compiled in frames 1 and 3)."""
    _interpreter_only()
    monkeypatch.setenv("MAPPER_KERNELS", "triton")
    from mapper.kernels.envelope import lower_envelope, lower_envelope_torch

    with VariantRecorder() as warm:
        warmup._envelope_variants(torch.device("cpu"))
    assert len(set(warm.keys)) == len(warmup.ENVELOPE_LINES)
    with VariantRecorder() as frames:
        for n, length in ((1, 9), (2, 3), (48, 4), (33, 7), (5, 1)):
            f, start, length_t = _envelope_problem(n, length)
            torch.testing.assert_close(
                lower_envelope(f, start, length_t), lower_envelope_torch(f, start, length_t)
            )
    new = sorted(set(frames.keys) - set(warm.keys))
    assert not new, "variants the warm-up did not launch (they would compile mid-stream):\n" + _fmt(new)


@pytest.mark.gpu
def test_frames_after_warm_up_compile_nothing_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    triton = pytest.importorskip("triton")
    dev = torch.device("cuda")
    frames = _frames(64, 1875, 4, dev)  # ~120 k returns per scan
    cfg = Map(0.1, layers=("tsdf", "esdf"), device=dev, max_range_m=60.0, warmup=False).config()
    warmup.warm_up(cfg, dev)
    names = []
    prev = triton.knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        names.append(str(kwargs.get("repr", kwargs.get("fn"))))

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        m = Map(**cfg, device=dev)  # warmed already: no second warm-up
        _run_frames(m, frames)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = prev
    assert m.bricks["tsdf"] > 0
    assert not names, "kernels compiled after the warm-up:\n" + "\n".join(names)

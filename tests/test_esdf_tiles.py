"""Bounded working memory of the ESDF update: a change larger than ``tile_bricks`` (incremental) and a cold
rebuild of a large map run tile by tile, and the CUDA path's chunked line passes (the Triton line kernel);
every form gives the one-pass layer bit for bit (the one-pass layer is checked against brute force in
``test_esdf.py`` / ``test_esdf_coarse.py``)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from test_esdf import (
    VOX,
    assert_same_layer,
    block_bricks,
    box_sdf,
    source_scene,
    sphere_sdf,
)

from mapper.integrators import esdf as esdf_mod
from mapper.integrators.esdf import EsdfIntegrator


@pytest.mark.parametrize(("source", "esdf_voxel"), [("tsdf", VOX), ("occupancy", VOX), ("tsdf", 2 * VOX)])
def test_tiled_update_and_cold_equal_one_pass(monkeypatch, caplog, source, esdf_voxel):
    monkeypatch.setattr(esdf_mod, "TILE_SHIFT", 2)  # tiles of 4^3 bricks: several in a small scene
    write, args = source_scene(source)
    one = EsdfIntegrator(esdf_voxel, 0.45, "cpu", source_voxel_size_m=VOX)
    tiled = EsdfIntegrator(esdf_voxel, 0.45, "cpu", source_voxel_size_m=VOX)
    tiled.tile_bricks = 48
    b1 = write(block_bricks([-0.9] * 3, [0.9] * 3), sphere_sdf([0, 0, 0], 0.5))
    with caplog.at_level(logging.INFO, logger="mapper.integrators.esdf"):
        one.update(*args, [b1])
        tiled.update(*args, [b1])
    assert tiled.last["tiles"] > 1 and "tile group" in caplog.text
    assert_same_layer(one, tiled)
    b2 = write(block_bricks([1.0, -0.5, -0.5], [2.6, 0.5, 0.5]), box_sdf([1.8, 0, 0], [0.4, 0.2, 0.3]))
    one.update(*args, [b2])
    tiled.update(*args, [b2])
    assert_same_layer(one, tiled)
    assert one.layer.num_bricks > 0
    # cold, tile by tile, onto a fresh layer and onto a stale one (bricks to free)
    for start in ("fresh", "stale"):
        cold = EsdfIntegrator(esdf_voxel, 0.45, "cpu", source_voxel_size_m=VOX)
        cold.tile_bricks = 96
        if start == "stale":
            cold.update(*args, [torch.as_tensor(block_bricks([3.0] * 3, [3.5] * 3))])
            far = torch.tensor([[40, 40, 40]])
            cold.layer.allocate(far)  # a stored brick no source explains: the rebuild frees it
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mapper.integrators.esdf"):
            res = cold.recompute(*args)
        assert res["tiles"] > 1 and "tile group" in caplog.text
        assert_same_layer(one, cold)


def test_gpu_choices_chunked_triton_line_pass_equals_cpu_path(monkeypatch):
    """The CUDA path's choices (``_cuda_path``) with the line passes in chunks of a few runs
    (``CUDA_ROWS``) through the Triton line kernel (interpreted) give the CPU path's layer bit for bit.
    On CPU tensors the kernel needs the interpreter (CI, no CUDA); on a GPU machine the CUDA tests of
    tests/test_linemin.py cover the compiled kernel."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set when there is no CUDA)")
    from mapper.kernels.triton_linemin import line_min_triton

    write, args = source_scene("tsdf")
    cpu, cuda = EsdfIntegrator(VOX, 0.25, "cpu"), EsdfIntegrator(VOX, 0.25, "cpu")
    b1 = write(block_bricks([-0.5] * 3, [0.5] * 3), sphere_sdf([0, 0, 0], 0.3))
    cpu.update(*args, [b1])
    with monkeypatch.context() as mp:
        mp.setattr(esdf_mod, "_cuda_path", lambda device: True)
        mp.setattr(esdf_mod, "CUDA_ROWS", 512)
        calls = []

        def kernel(*a):
            calls.append(a[0].numel())
            return line_min_triton(*a)

        mp.setattr(esdf_mod, "_line_min", kernel)
        cuda.update(*args, [b1])
    assert len(calls) > 3 and max(calls) <= 4 * 512  # chunked: whole runs of about CUDA_ROWS slots
    assert_same_layer(cpu, cuda)

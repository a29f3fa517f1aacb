#!/usr/bin/env bash
# H200 run of branch s2-mc (the coordinator's GPU procedure; <= 150 s): the marching-cubes kernel tests on
# the GPU, then benchmarks/bench_mesh.py (full mesh of ~1 M triangles at 5 cm; incremental mesh after each
# frame of a simulated 640x480 depth sequence and of a 120 k-point LiDAR sequence, 5 cm).
# From the repository root, with $OUT set; writes $OUT/s2-mc/.
set -u
O="${OUT:-/tmp/out}/s2-mc"
mkdir -p "$O"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$O/gpu.txt" 2>&1
git rev-parse HEAD >> "$O/gpu.txt" 2>/dev/null
timeout 55 python3 -m pytest -q -p no:cacheprovider tests/test_mesh_kernel.py 2>&1 | tee "$O/tests.log" | tail -6
timeout 55 python3 benchmarks/bench_mesh.py --device cuda --parts full incremental --sensor depth \
  --frames 40 --reps 30 --profile --out "$O/mesh_h200.md" 2>&1 | tee "$O/bench.log" | tail -40
timeout 35 python3 benchmarks/bench_mesh.py --device cuda --parts incremental --sensor lidar \
  --frames 25 --out "$O/mesh_lidar_h200.md" 2>&1 | tee "$O/bench_lidar.log" | tail -8

#!/usr/bin/env bash
# GPU checks of branch s2-grazing (LiDAR TSDF at grazing incidence; warm-up before the first frame), run by
# the coordinator on the H200 from the repository root with $OUT set; <= 150 s. Outputs: $OUT/s2-grazing/.
set -u
D="${OUT:-/tmp/out}/s2-grazing"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
# the grazing / projected-walk / warm-up tests on CUDA (~25 s on the H200)
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_tsdf_grazing.py tests/test_warmup.py \
  -k "cuda or gpu" -rA --durations=8 > "$D/pytest_grazing.txt" 2>&1
echo "rc=$?" >> "$D/pytest_grazing.txt"
# first frame of a new map: cold, after the warm-up, after a restart (cache on disk); one process each
timeout 62 python3 benchmarks/bench_warmup.py --device cuda --voxel 0.1 --frames 3 --out "$D" > "$D/bench_warmup.txt" 2>&1
echo "rc=$?" >> "$D/bench_warmup.txt"
# the LiDAR TSDF (now with normals) against its reference and the Triton walk against torch, on CUDA
timeout 22 python3 -m pytest -q -p no:cacheprovider tests/test_segments.py -k "cuda and (lidar or walk)" \
  --durations=5 > "$D/pytest_segments.txt" 2>&1
echo "rc=$?" >> "$D/pytest_segments.txt"
# cost of the projected LiDAR TSDF vs along the ray (normals included), per frame
timeout 14 python3 benchmarks/bench_lidar_normals.py --device cuda --frames 4 --out "$D/lidar_normals.md" > "$D/lidar_normals.txt" 2>&1
echo "rc=$?" >> "$D/lidar_normals.txt"
for f in bench_warmup pytest_grazing pytest_segments lidar_normals; do tail -n 4 "$D/$f.txt"; done

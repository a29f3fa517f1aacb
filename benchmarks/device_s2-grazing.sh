#!/usr/bin/env bash
# GPU checks of branch s2-grazing (LiDAR TSDF at grazing incidence; warm-up before the first frame), run by
# the coordinator on the H200 from the repository root with $OUT set; <= 150 s. Outputs: $OUT/s2-grazing/.
set -u
D="${OUT:-/tmp/out}/s2-grazing"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
# the grazing / projected-walk / warm-up tests on CUDA, and the LiDAR TSDF equality with its reference
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_tsdf_grazing.py tests/test_warmup.py \
  tests/test_segments.py -k "(cuda or gpu) and not occupancy" --durations=8 > "$D/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$D/pytest.txt"
# first frame of a new map: cold, after the warm-up, after a restart (cache on disk)
timeout 75 python3 benchmarks/bench_warmup.py --device cuda --voxel 0.1 --frames 4 --out "$D" > "$D/bench_warmup.txt" 2>&1
echo "bench rc=$?" >> "$D/bench_warmup.txt"
tail -3 "$D/pytest.txt" "$D/bench_warmup.txt"

#!/usr/bin/env bash
# GPU run of branch s2-frame (issue 12, frame path), <= 150 s on one H200. From the repository root, with
# $OUT set and PYTHONPATH pointing at the tree: the frame benchmark (200 LiDAR frames, 300 depth frames,
# six cases, stage profile) and the GPU tests of the code the branch touches. Outputs under $OUT/s2-frame/.
set -u
OUT=${OUT:-/tmp/out}
D="$OUT/s2-frame"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
timeout 100 python3 benchmarks/bench_frame.py --device cuda --lidar-frames 200 --depth-frames 300 \
  --out "$D/frame_h200.md" --json "$D/frame_h200.json" > "$D/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - start )) s" >> "$D/gpu.txt"
left=$(( 145 - ($(date +%s) - start) ))
if [ "$left" -gt 10 ]; then
  timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_map_frame.py tests/test_project_update.py tests/test_paged_pool.py \
    tests/test_segments.py tests/test_grid_oracle.py -k "cuda or gpu or triton" > "$D/tests.log" 2>&1
  echo "tests rc=$? after $(( $(date +%s) - start )) s" >> "$D/gpu.txt"
fi

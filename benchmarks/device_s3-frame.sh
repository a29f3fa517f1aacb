#!/usr/bin/env bash
# H200 run of branch s3-frame (issue 12: LiDAR normal fit as a Triton kernel, warm-up of every kernel
# variant, frame path), <= 150 s on one H200. From the repository root with $OUT set and PYTHONPATH at the
# tree + the service wheels; writes $OUT/s3-frame/. Each step is time-boxed and writes as it goes.
set -u
D="${OUT:-/tmp/out}/s3-frame"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
# 1. GPU tests of the new kernels (normal fit vs reference vs oracle, distance query) and the warm-up hooks,
#    verbose so a timeout still names each result (~15 s). The slower GPU tests of the branch
#    (test_warmup_variants.py's GPU twin, test_tsdf_grazing.py) run in the coordinator's GPU suite.
timeout 25 python3 -m pytest -v -p no:cacheprovider tests/test_normals_kernel.py tests/test_query_kernel.py \
  tests/test_warmup.py -k "cuda or gpu" -rfE --tb=short --durations=5 > "$D/tests.log" 2>&1
el tests $?
# 2. the normal fit on the GPU: integrate_lidar projected vs along the ray, scan_normals alone (~10 s)
timeout 10 python3 benchmarks/bench_lidar_normals.py --device cuda --frames 4 --out "$D/lidar_normals_h200.md" \
  > "$D/lidar_normals.log" 2>&1
el lidar_normals $?
# 3. frame path: 500 LiDAR frames (~120 k points) x 3 cases, 200 depth frames 640x480 x 3 cases, stage profile
timeout 42 python3 benchmarks/bench_frame.py --device cuda --lidar-frames 500 --depth-frames 200 \
  --out "$D/frame_h200.md" --json "$D/frame_h200.json" > "$D/frame.log" 2>&1
el frame $?
# 4. first frame of a new map after the warm-up (fresh processes: warm, restart), kernels compiled per frame;
#    the warm case compiles every kernel cold (> 34 s on the H200): the rest of the budget
left=$(( 147 - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/bench_warmup.py --device cuda --voxel 0.1 --frames 3 --skip-cold --out "$D" \
  > "$D/warmup.log" 2>&1
el warmup $?
tail -n 3 "$D"/*.log

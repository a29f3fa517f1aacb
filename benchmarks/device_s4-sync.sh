#!/usr/bin/env bash
# H200 run of branch s4-sync (issue 12: steady-state frames with few host syncs: the allocation's one size
# read, the depth grow without compaction, pinned pose/intrinsics copies), <= 150 s on one H200. From the
# repository root with $OUT set and PYTHONPATH at the tree + the service wheels; writes $OUT/s4-sync/.
# Each step is time-boxed and writes as it goes.
set -u
D="${OUT:-/tmp/out}/s4-sync"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
# 1. the host-sync bound per steady-state frame (LiDAR TSDF, occupancy, depth TSDF), verbose: a failure names
#    the sync sites (~15 s with compiles)
timeout 35 python3 -m pytest -v -p no:cacheprovider tests/test_frame_syncs.py -rfE --tb=short \
  > "$D/tests_syncs.log" 2>&1
el tests_syncs $?
# 2. frame path: 150 LiDAR frames (~120 k points) x 3 cases, 150 depth frames 640x480 x 3 cases, with the
#    stage profile (launches, host syncs with their lines, GPU busy) (~30 s)
timeout 65 python3 benchmarks/bench_frame.py --device cuda --lidar-frames 150 --depth-frames 150 \
  --out "$D/frame_h200_s4sync.md" --json "$D/frame_h200_s4sync.json" > "$D/frame.log" 2>&1
el frame $?
# 3. GPU tests of the changed code (compiled Triton), the rest of the budget on 4 workers: allocation, depth
#    grow, integrators, segments, paged pool, projective update, layer kinds, read views (the coordinator's
#    GPU suite runs them all)
left=$(( 147 - ($(date +%s) - start) ))
timeout "$left" python3 -m pytest -v -p no:cacheprovider -n 4 tests/test_map_frame.py tests/test_integrators.py \
  tests/test_segments.py tests/test_paged_pool.py tests/test_project_update.py tests/test_layer_kinds.py \
  tests/test_read_views.py -k "cuda or gpu" -rfE --tb=short > "$D/tests.log" 2>&1
el tests $?
tail -n 4 "$D/tests.log" >> "$D/gpu.txt"
tail -n 3 "$D"/*.log

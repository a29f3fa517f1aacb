#!/usr/bin/env bash
# H200 run of branch s5-alloc (issue 12: the allocation / grid merge of every frame in few launches), <= 70 s
# on one H200. From the repository root with $OUT set and PYTHONPATH at the tree + the service wheels; writes
# $OUT/s5-alloc/. Each step is time-boxed and writes as it goes.
set -u
D="${OUT:-/tmp/out}/s5-alloc"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/tests:$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
# 1. the GPU tests of the allocation (compiled Triton kernels against the torch references, whole sequences
#    against the dict reference, one size read per call) and of the pool's fill / gather / scatter
timeout 25 python3 -m pytest -q -p no:cacheprovider tests/test_layers_alloc.py tests/test_paged_pool.py \
  tests/test_map_frame.py -k "cuda and (alloc or allocate or fill or gather or empty)" -rfE --tb=short \
  > "$D/tests.log" 2>&1
el tests $?
# 2. the allocation alone, this branch vs 04bf0e6, interleaved in one process (ops, GPU activities, syncs)
timeout 15 python3 benchmarks/bench_allocate.py --device cuda --frames 40 --bricks 40000 \
  --out "$D/allocate_h200.md" > "$D/allocate.log" 2>&1
el allocate $?
# 3. frames: stage `merge` after, then before (04bf0e6's allocate_kept patched in), one after the other in this
#    call (after first: it compiles what both use, if an earlier script of the call has not)
FR="--device cuda --cases depth_tsdf_2cm lidar_tsdf_10cm --lidar-frames 100 --depth-frames 150 --profile-frames 1"
left=$(( 69 - ($(date +%s) - start) ))
timeout "$(( left * 55 / 100 ))" python3 benchmarks/bench_frame.py $FR --out "$D/frame_after.md" \
  > "$D/frame_after.log" 2>&1
el frame_after $?
left=$(( 69 - ($(date +%s) - start) ))
timeout "$left" python3 -c 'import sys, bench_allocate as ba, bench_frame as bf
from mapper.layers import BrickLayer
BrickLayer.allocate_kept = ba.previous_allocate_kept
bf.main(sys.argv[1:])' $FR --out "$D/frame_before.md" > "$D/frame_before.log" 2>&1
el frame_before $?
grep -h "merge" "$D"/frame_*.md | head -8
tail -n 3 "$D"/*.log

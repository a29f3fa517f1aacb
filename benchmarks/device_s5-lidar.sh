#!/usr/bin/env bash
# H200 run of branch s5-lidar (issue 12: the LiDAR TSDF frame in fewer launches: the normal fit's moments
# and normals of every scale in two Triton kernels), <= 70 s on one H200. From the repository root with $OUT
# set and PYTHONPATH at the tree + the service wheels; writes $OUT/s5-lidar/. Old vs new in one call: the
# base tree is this tree with benchmarks/device_s5-lidar.base.patch reversed (`git apply -R`, no .git needed;
# skipped when it no longer applies, e.g. on a merged main).
set -u
D="${OUT:-/tmp/out}/s5-lidar"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
ROOT=$PWD
PP="${PYTHONPATH:-}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
# 1. the normal-fit kernels against their references, compiled, and the projected walk on the GPU (~15 s;
#    the frame's host syncs are in the bench's stage profile)
PYTHONPATH="$ROOT/tests:$ROOT${PP:+:$PP}" timeout 25 python3 -m pytest -q -p no:cacheprovider \
  tests/test_normals_kernel.py tests/test_tsdf_grazing.py -k cuda -rfE --tb=short > "$D/tests.log" 2>&1
el tests $?
# 2. the base tree (this branch's LiDAR files as on main 04bf0e6)
B=/tmp/s5-lidar-base
rm -rf "$B" && mkdir -p "$B" && cp -r "$ROOT/mapper" "$ROOT/benchmarks" "$B/" && \
  (cd "$B" && git apply -R "$ROOT/benchmarks/device_s5-lidar.base.patch") > "$D/base.txt" 2>&1
have_base=$?
el base_tree $have_base
# 3. 100 LiDAR frames (~120 k points) with the stage profile, per case this branch then the base (each a
#    process with its share of the time left; bench_frame writes its report after every case)
left() { echo $(( 68 - ($(date +%s) - start) )); }
run_bench() {  # tree tag case seconds
  PYTHONPATH="$1${PP:+:$PP}" timeout "$4" python3 "$1/benchmarks/bench_frame.py" --device cuda \
    --cases "$3" --lidar-frames 100 --profile-frames 1 \
    --out "$D/frame_h200_$2_$3.md" --json "$D/frame_h200_$2_$3.json" > "$D/frame_$2_$3.log" 2>&1
  el "frame_$2_$3" $?
}
run_bench "$ROOT" s5lidar lidar_tsdf_10cm $(( $(left) / 4 + 4 ))
[ "$have_base" = 0 ] && run_bench "$B" base lidar_tsdf_10cm $(( $(left) / 3 + 2 ))
run_bench "$ROOT" s5lidar lidar_tsdf_5cm $(( $(left) / 2 ))
[ "$have_base" = 0 ] && run_bench "$B" base lidar_tsdf_5cm $(( $(left) - 1 ))
grep -h "^| lidar" "$D"/frame_h200_*.md > "$D/summary.txt" 2>/dev/null
tail -n 3 "$D"/*.log

#!/usr/bin/env bash
# H200 run of branch s5-depth (issue 12: the depth TSDF frame's grow stage in one Triton kernel,
# mapper/kernels/triton_depth.py), <= 70 s on one H200, from the repository root with $OUT set
# (PYTHONPATH: the tree + the service wheels):   bash benchmarks/device_s5-depth.sh
# 1. bench_depth_ab.py (<= 55 s): depth TSDF 2 cm / 1 cm / 5 mm, 100 frames each, the new grow and the
#    previous one (MAPPER_DEPTH_GROW=keyed) in ONE process (the map's kernels compile once: one cold
#    bench_frame.py process per path spent its 16 s slots compiling in the first run, 02:55 UTC), per frame /
#    per stage median, p99, max, kernels, launch calls, syncs; then the 1000-frame 2 cm sequence (new path);
#    the report is rewritten after each run, so the time limit keeps what finished;
# 2. GPU tests with the time left: tests/test_depth_grow.py (kernel == reference == brute force, overflow
#    retry, one host read) and test_project_update on CUDA (the coordinator's GPU suite runs the rest).
# Frames are generated on the device. Outputs: $OUT/s5-depth/{gpu.txt,depth_ab.md,depth_ab.json,*.log}.
set -u
D="${OUT:-/tmp/out}/s5-depth"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
timeout "$(left 55)" python3 benchmarks/bench_depth_ab.py --frames 100 --long 1000 \
  --out "$D/depth_ab.md" --json "$D/depth_ab.json" > "$D/depth_ab.log" 2>&1
el depth_ab $?
timeout "$(left 69)" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/test_depth_grow.py tests/test_project_update.py -k "cuda and not points_used" > "$D/tests.log" 2>&1
el tests $?
tail -n 3 "$D"/*.log

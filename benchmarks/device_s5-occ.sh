#!/usr/bin/env bash
# H200 run of branch s5-occ (issue 12, occupancy 5 cm LiDAR frame: the log-odds update as one Triton launch,
# no separate row-estimate sync), <= 70 s on one H200. From the repository root with $OUT set and PYTHONPATH
# at the tree + the service wheels; writes $OUT/s5-occ/. Each step is time-boxed and writes as it goes.
set -u
D="${OUT:-/tmp/out}/s5-occ"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
# 1. occupancy 5 cm, 100 LiDAR frames (~120 k rays), stage profile: this branch, then the previous path
#    restored by patches (benchmarks/bench_occ_ab.py), one process, the same frames
timeout 52 python3 benchmarks/bench_occ_ab.py --variants new old -- --device cuda --cases occupancy_5cm \
  --lidar-frames 100 --out "$D/frame_occ_h200_{variant}.md" --json "$D/frame_occ_h200_{variant}.json" \
  > "$D/frame.log" 2>&1
el frame $?
# 2. GPU tests of the changed code (the GPU suite of the final run has them all), verbose
left=$(( 69 - ($(date +%s) - start) ))
timeout "$left" python3 -m pytest -v -p no:cacheprovider tests/test_logodds.py tests/test_occupancy_frame.py \
  tests/test_frame_syncs.py -k "cuda or occupancy" -rfE --tb=short > "$D/tests.log" 2>&1
el tests $?
tail -n 4 "$D"/*.log

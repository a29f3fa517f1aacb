#!/usr/bin/env bash
# H200 run of branch s5-depth (issue 12: the depth TSDF frame's grow stage in one Triton kernel,
# mapper/kernels/triton_depth.py), <= 70 s on one H200, from the repository root with $OUT set
# (PYTHONPATH: the tree + the service wheels):   bash benchmarks/device_s5-depth.sh
# 1. GPU tests: tests/test_depth_grow.py (kernel == reference == brute force, overflow retry, one host read),
#    the depth cases of test_map_frame / test_project_update, the depth frame's sync bound (test_frame_syncs);
# 2. bench_frame.py depth TSDF 2 cm / 1 cm / 5 mm, 150 frames each, new path, then the previous grow path
#    (MAPPER_DEPTH_GROW=keyed) in the same call: per frame / per stage median, p99, max, launches, syncs;
# 3. the 1000-frame 640x480 depth TSDF 2 cm sequence (new path) with what time is left.
# Frames are generated on the device. Outputs: $OUT/s5-depth/{gpu.txt,tests.log,frame_new.*,frame_old.*,
# frame_1000.*,*.log}.
set -u
D="${OUT:-/tmp/out}/s5-depth"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
timeout "$(left 22)" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/test_depth_grow.py tests/test_frame_syncs.py tests/test_map_frame.py tests/test_project_update.py \
  -k "(test_depth_grow and cuda) or depth_tsdf or (depth and cuda) or (project and cuda)" > "$D/tests.log" 2>&1
el tests $?
CASES="depth_tsdf_2cm depth_tsdf_1cm depth_tsdf_5mm"
timeout "$(left 38)" python3 benchmarks/bench_frame.py --device cuda --cases $CASES --depth-frames 150 \
  --out "$D/frame_new.md" --json "$D/frame_new.json" > "$D/frame_new.log" 2>&1
el frame_new $?
MAPPER_DEPTH_GROW=keyed timeout "$(left 54)" python3 benchmarks/bench_frame.py --device cuda --cases $CASES \
  --depth-frames 150 --out "$D/frame_old.md" --json "$D/frame_old.json" > "$D/frame_old.log" 2>&1
el frame_old $?
timeout "$(left 69)" python3 benchmarks/bench_frame.py --device cuda --cases depth_tsdf_2cm --depth-frames 1000 \
  --profile-frames 1 --out "$D/frame_1000.md" --json "$D/frame_1000.json" > "$D/frame_1000.log" 2>&1
el frame_1000 $?
tail -n 3 "$D"/*.log

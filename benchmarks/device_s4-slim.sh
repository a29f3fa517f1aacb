#!/usr/bin/env bash
# H200 run of branch s4-slim (issue 12: no frame pays a full GC; the 1000-frame depth sequence; the first
# frame of a new map after the warm-up), <= 150 s on one H200, from the repository root with $OUT set
# (PYTHONPATH: the tree + the service wheels):   bash benchmarks/device_s4-slim.sh
# 1. bench_frame.py (<= 70 s): the 500-frame LiDAR TSDF 10 cm sequence (~120 k points per frame) and a
#    1000-frame 640x480 depth TSDF 2 cm sequence, every frame of a fresh map kept, GC policy "settle"
#    (mapper.gc_policy: full collection + gc.freeze() after the warm-up): per frame and per stage median /
#    p99 / max, GC ms per frame, gen-2 collections, one full collection's cost before the settle and after
#    the sequence, launches / syncs / GPU busy per frame;
# 2. bench_warmup.py (the rest, ~70 s): first frames of a new map after the warm-up in a fresh process
#    (every kernel compiled cold during the warm-up) and after a restart (Triton cache on disk);
# 3. tests/test_gc_frames.py on the GPU (frames leave no reference cycles on the Triton path; settled frames
#    start no gen-2 collection) with what time is left (the coordinator's GPU suite runs it too).
# Frames are generated on the device. Outputs: $OUT/s4-slim/{gpu.txt,frame_h200.md,frame_h200.json,
# warmup.md,warmup.json,tests.log,*.log}.
set -u
D="${OUT:-/tmp/out}/s4-slim"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git log -1 --format='%H %s' >> "$D/gpu.txt" 2>&1
timeout 70 python3 benchmarks/bench_frame.py --device cuda --cases lidar_tsdf_10cm depth_tsdf_2cm \
  --lidar-frames 500 --depth-frames 1000 --out "$D/frame_h200.md" --json "$D/frame_h200.json" > "$D/frame.log" 2>&1
el frame $?
left=$(( 132 - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/bench_warmup.py --device cuda --voxel 0.1 --frames 3 --skip-cold --out "$D" \
  > "$D/warmup.log" 2>&1
el warmup $?
left=$(( 147 - ($(date +%s) - start) ))
if [ "$left" -gt 5 ]; then
  timeout "$left" python3 -m pytest -v -p no:cacheprovider tests/test_gc_frames.py -k cuda -rfE --tb=short \
    > "$D/tests.log" 2>&1
  el tests $?
fi
tail -n 4 "$D"/*.log

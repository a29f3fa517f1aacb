#!/usr/bin/env bash
# Issue 12's "done when" 2 on one H200 (<= 150 s, from the repository root, $OUT set, PYTHONPATH = the tree + the
# service wheels): bench_frame.py over the sequence lengths for every case, every frame of a fresh map kept
# (growth included), pose and K on the host as the service passes them: LiDAR TSDF 10 / 5 cm and occupancy 5 cm
# over 500 frames of ~120 k points (64 x 1875 rays), depth TSDF 2 cm / 1 cm / 5 mm over 1000 640x480 frames; per
# frame and per stage median / p99 / max, launches / syncs / GPU busy per frame. Frames are generated on the device.
#   OUT=/tmp/out bash benchmarks/device_s5-frame.sh     -> $OUT/s5-frame/{frame_h200.md,frame_h200.json,log}
set -u
D="${OUT:-/tmp/out}/s5-frame"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout "${FRAME_S:-140}" python3 benchmarks/bench_frame.py --device cuda --lidar-frames 500 --depth-frames 1000 \
  --out "$D/frame_h200.md" --json "$D/frame_h200.json" > "$D/frame.log" 2>&1
echo "frame rc=$?" | tee -a "$D/frame.log"

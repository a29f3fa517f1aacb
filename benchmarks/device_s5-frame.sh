#!/usr/bin/env bash
# Issue 12's "done when" 2 on one H200 (<= 150 s, from the repository root, $OUT set, PYTHONPATH = the tree + the
# service wheels): bench_frame.py over the sequence lengths for every case, every frame of a fresh map kept
# (growth included), pose and K on the host as the service passes them: LiDAR TSDF 10 / 5 cm and occupancy 5 cm
# over 500 frames of ~120 k points (64 x 1875 rays), depth TSDF 2 cm / 1 cm / 5 mm over 1000 640x480 frames; per
# frame and per stage median / p99 / max, launches / syncs / GPU busy per frame. Frames are generated on the device.
#   OUT=/tmp/out bash benchmarks/device_s5-frame.sh     -> $OUT/s5-frame/frame_{lidar,depth}_h200.{md,json}
set -u
D="${OUT:-/tmp/out}/s5-frame"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# two processes (LiDAR cases, depth cases), each writing its own report, so a cut second half keeps the first
timeout "${LIDAR_S:-75}" python3 benchmarks/bench_frame.py --device cuda --lidar-frames 500 \
  --cases lidar_tsdf_10cm lidar_tsdf_5cm occupancy_5cm \
  --out "$D/frame_lidar_h200.md" --json "$D/frame_lidar_h200.json" > "$D/frame_lidar.log" 2>&1
echo "lidar rc=$?" | tee -a "$D/frame_lidar.log"
timeout "${DEPTH_S:-75}" python3 benchmarks/bench_frame.py --device cuda --depth-frames 1000 \
  --cases depth_tsdf_2cm depth_tsdf_1cm depth_tsdf_5mm \
  --out "$D/frame_depth_h200.md" --json "$D/frame_depth_h200.json" > "$D/frame_depth.log" 2>&1
echo "depth rc=$?" | tee -a "$D/frame_depth.log"

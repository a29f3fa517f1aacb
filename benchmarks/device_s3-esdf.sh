#!/usr/bin/env bash
# H200 run of branch s3-esdf (issue 11: ESDF launches/syncs, per-frame cost, long-sequence memory), <= 150 s,
# from the repository root with $OUT set (PYTHONPATH: the tree + the service wheels):
#   bash benchmarks/device_s3-esdf.sh
# 1. the ESDF / envelope GPU tests (<= 40 s: xdist start-up and collection take ~10 s);
# 2. bench_esdf.py per frame (<= 45 s; ~40 s on 2026-12-01): depth 640x480 at TSDF 2 / 1 / 0.5 cm + ESDF
#    5 cm, LiDAR 120 k at TSDF 10 / 5 cm + ESDF 10 cm: median / p99 / max ms of TSDF + ESDF, launches and
#    syncs per ESDF update, ESDF voxels, peak GPU memory;
# 3. the room sequence (TSDF 2 cm + ESDF 5 cm, TSDF and ESDF every frame) up to 1000 frames, cut at 48 s of
#    frames (<= 60 s): peak GPU memory every 100 frames (the trend, when 1000 do not fit).
# Frames are generated on the device. Outputs: $OUT/s3-esdf/{gpu.txt,tests.log,esdf_h200.md,room_h200.md,*.log}.
set -u
D="${OUT:-/tmp/out}/s3-esdf"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
git log -1 --format='%H %s' >> "$D/gpu.txt" 2>&1
XDIST=""
python3 -c 'import xdist' 2>/dev/null && XDIST="-n 4"
timeout 40 python3 -m pytest -q -p no:cacheprovider $XDIST -k "cuda or gpu" \
  tests/test_envelope.py tests/test_esdf.py tests/test_esdf_coarse.py > "$D/tests.log" 2>&1
echo "tests rc=$?" >> "$D/tests.log"
tail -3 "$D/tests.log"
timeout 45 python3 benchmarks/bench_esdf.py --device cuda --parts depth lidar \
  --depth-frames 8 --lidar-frames 5 --warmup 3 --count-frames 2 \
  --out "$D/esdf_h200.md" > "$D/bench.log" 2>&1
echo "bench rc=$?" >> "$D/bench.log"
cat "$D/esdf_h200.md"
timeout 60 python3 benchmarks/bench_esdf.py --device cuda --parts room --room-frames 1000 --room-seconds 48 \
  --room-every 100 --warmup 3 --out "$D/room_h200.md" > "$D/room.log" 2>&1
echo "room rc=$?" >> "$D/room.log"
cat "$D/room_h200.md"

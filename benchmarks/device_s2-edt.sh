#!/usr/bin/env bash
# H200 run of branch s2-edt (issue 11: ESDF cost), <= 150 s, from the repository root with $OUT set:
#   bash benchmarks/device_s2-edt.sh
# 1. the ESDF / envelope GPU tests (Triton kernel compiled for the real device);
# 2. bench_esdf.py: depth 640x480 at TSDF 2 / 1 / 0.5 cm + ESDF 5 cm, LiDAR 120 k at TSDF 10 / 5 cm + ESDF
#    10 cm, max distance 0.5 -> 4 m, the transform alone for M = 10..80, and the room sequence (up to 1000 frames, cut at 25 s) for peak memory.
# Frames are generated on the device. Outputs: $OUT/s2-edt/{gpu.txt,tests.log,esdf_h200.md,bench.log}.
set -u
D="${OUT:-/tmp/out}/s2-edt"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
git log -1 --format='%H %s' >> "$D/gpu.txt" 2>&1
XDIST=""
python3 -c 'import xdist' 2>/dev/null && XDIST="-n 4"
timeout 45 python3 -m pytest -q -x -p no:cacheprovider $XDIST -k "cuda or gpu" \
  tests/test_envelope.py tests/test_esdf.py tests/test_esdf_coarse.py > "$D/tests.log" 2>&1
echo "tests rc=$?" >> "$D/tests.log"
timeout 95 python3 benchmarks/bench_esdf.py --device cuda --parts depth lidar maxd kernel room \
  --depth-frames 20 --lidar-frames 10 --maxd-frames 15 --room-frames 1000 --room-seconds 25 --profile 3 \
  --out "$D/esdf_h200.md" > "$D/bench.log" 2>&1
echo "bench rc=$?" >> "$D/bench.log"
tail -3 "$D/tests.log"
cat "$D/esdf_h200.md"

#!/usr/bin/env bash
# H200 run of branch h25b (issue 25: the ESDF update's working memory and speed), <= ~300 s on one H200,
# from the repository root with $OUT set:  bash benchmarks/tools/device_h25b-esdf.sh
# 1. bench_esdf.py, new tree: depth 640x480 (TSDF 2 / 0.5 cm, ESDF 5 cm), LiDAR 120 k (TSDF 10 / 5 cm,
#    ESDF 10 cm), LiDAR TSDF + occupancy + ESDF 5 cm, each with its peak without the ESDF; the cold ESDF of
#    a 600 m street map (300 scans);
# 2. the line kernel's GPU tests (bit-exact vs brute force on the H200);
# 3. base tree (main d6761e6's esdf.py, base_esdf.py beside this script when present): LiDAR 10 cm rows.
# Every step has a timeout; outputs: $OUT/h25b/{gpu.txt,esdf_new.md,esdf_base.md,*.log}.
set -u
D="${OUT:-/tmp/out}/h25b"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
timeout 170 python benchmarks/bench_esdf.py --device cuda --parts ${PARTS:-lidar lidar-occ depth city} \
  --lidar-frames 15 --depth-frames 15 --warmup 2 --count-frames 1 --depth-voxels 0.02 0.005 \
  --city-scans ${CITY_SCANS:-300} --city-extent ${CITY_EXTENT:-1200} --out "$D/esdf_new.md" > "$D/new.log" 2>&1
el bench-new $?
timeout 40 python -m pytest -q -p no:cacheprovider tests/test_linemin.py -k cuda > "$D/tests.log" 2>&1
el tests-linemin $?
if [ -f base_esdf.py ]; then
  rm -rf /tmp/h25b-base && mkdir -p /tmp/h25b-base && cp -r mapper /tmp/h25b-base/ \
    && cp base_esdf.py /tmp/h25b-base/mapper/integrators/esdf.py
  PYTHONPATH="/tmp/h25b-base:$PYTHONPATH" timeout ${BASE_TIMEOUT:-70} python benchmarks/bench_esdf.py --device cuda \
    --parts ${BASE_PARTS:-lidar} --lidar-voxels ${BASE_VOXELS:-0.1} --lidar-frames 15 --warmup 2 --count-frames 1 --no-baseline \
    --out "$D/esdf_base.md" > "$D/base.log" 2>&1
  el bench-base $?
fi

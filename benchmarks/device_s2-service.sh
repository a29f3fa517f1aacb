#!/usr/bin/env bash
# H200 run of the s2-service work (issue 13), <= 150 s, from the repository root with $OUT set:
#   bash benchmarks/device_s2-service.sh
# 1. the copy-on-write read views on CUDA (Triton paged scatter + the TSDF projection kernel's prepare_write),
#    and a service read during an open batch on CUDA (readers on their own streams)
# 2. the cost of publishing a version per frame (120 k-point LiDAR, 10 cm, tsdf+esdf)
# 3. reads under ingest: distance-query latency (10 k points) idle, then with 4 WebSocket writers on the map
set -u
OUT=${OUT:-/tmp/out}/s2-service
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_read_views.py tests/test_service_realtime.py -k cuda 2>&1 | tail -15 > "$OUT/tests.log"
timeout 30 python3 benchmarks/bench_read_views.py --device cuda --voxel 0.1 --frames 30 \
  --out "$OUT/read_views_h200.md" > "$OUT/read_views.log" 2>&1
timeout 65 python3 benchmarks/bench_service.py --device cuda --cases query --voxel 0.1 --query-writers 4 \
  --warmup 5 --duration 15 --idle-duration 5 --out "$OUT/service_query_h200.md" > "$OUT/service_query.log" 2>&1
tail -n 5 "$OUT"/*.log

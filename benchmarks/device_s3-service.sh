#!/usr/bin/env bash
# H200 run of the s3-service work (issue 13), <= 150 s, from the repository root with $OUT set:
#   bash benchmarks/device_s3-service.sh
# (the CUDA tests of this work run in the GPU suite: tests/test_service_fairness.py, test_service_realtime.py)
# 1. bench_service, CUDA, 10 cm tsdf+esdf (ESDF fresh in every ack's batch), WebSocket window 4: 4 robots,
#    then 4 robots + distance queries (10 k points) + ESDF slices (1000 x 1000) back to back (<= 40 s);
#    16 robots (<= 30 s)
# 2. WebSocket (window 1: the same closed loop as HTTP) vs HTTP on the host's CPU (device cpu, 20 k-point
#    frames, 20 cm tsdf) (<= 26 s)
# 3. 4 robots at 10 cm with tsdf+occupancy+esdf (<= 28 s)
# 4. MAPPER_WRITER_NICE=3 on 2 pinned cores of the host (device cpu): distance-query p99 under 2 writers vs
#    the idle p50, and the ingest rate meanwhile (<= 24 s)
# Each case prints its line to the .log as it ends (a case cut by its timeout loses only itself).
set -u
OUT=${OUT:-/tmp/out}/s3-service
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# one Triton cache for every server started here: kernels compile once, not per server
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/s3-service-triton}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
B="python3 benchmarks/bench_service.py --distinct-frames 4"
timeout 40 $B --device cuda --cases ingest --voxel 0.1 --layers tsdf,esdf --clients 4 --transports ws \
  --window 4 --query-clients 4 --slice-cells 1000 --warmup 3 --duration 5 \
  --out "$OUT/service_h200.md" > "$OUT/service.log" 2>&1
timeout 30 $B --device cuda --cases ingest --voxel 0.1 --layers tsdf,esdf --clients 16 --transports ws \
  --window 4 --warmup 3 --duration 5 --no-query-case --out "$OUT/service16_h200.md" > "$OUT/service16.log" 2>&1
timeout 26 $B --device cpu --cases ingest --voxel 0.2 --layers tsdf --points 20000 --clients 4 \
  --transports http,ws --window 1 --warmup 2 --duration 4 \
  --out "$OUT/service_ws_http_cpu.md" > "$OUT/ws_http.log" 2>&1
timeout 28 $B --device cuda --cases ingest --voxel 0.1 --layers tsdf,occupancy,esdf --clients 4 \
  --transports ws --window 4 --warmup 3 --duration 5 --no-query-case \
  --out "$OUT/service_occ_h200.md" > "$OUT/service_occ.log" 2>&1
PIN=""
command -v taskset > /dev/null && PIN="taskset -c 0,1"
OMP_NUM_THREADS=2 timeout 24 $PIN $B --device cpu --cases query --voxel 0.2 --layers tsdf,esdf --points 20000 \
  --query-writers 2 --window 4 --idle-duration 3 --warmup 2 --duration 7 --env MAPPER_WRITER_NICE=3 \
  --out "$OUT/service_query_nice3_cpu2.md" > "$OUT/nice3.log" 2>&1
tail -n 6 "$OUT"/*.log

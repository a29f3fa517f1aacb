#!/usr/bin/env bash
# The GPU benchmarks, one step per benchmark, on the device machine (repository root as cwd, $OUT collected):
#   OUT=/tmp/out bash benchmarks/device_bench.sh STEP [STEP...]
# Each step writes $OUT/<step>.md (the report; .json where the benchmark has one) and $OUT/<step>.log, and has
# its own time limit (STEP_S seconds, default per step below); a failing or cut step does not stop the next.
# Extra arguments for a step's benchmark: ARGS="..." (appended, so they override the defaults below).
# benchmarks/device_final.sh runs these after the GPU suite (Triton's cache then holds most kernels: run cold,
# a step can spend its whole slot compiling).
#
#   frame       bench_frame.py: every case, 500 LiDAR frames (~120 k points), 200 depth frames 640x480
#   lidar       bench_frame.py LiDAR TSDF 10/5 cm + occupancy 5 cm, 500 frames; bench_lidar_normals.py
#   depth       bench_frame.py depth TSDF 2 cm / 1 cm / 5 mm, 1000 frames
#   occ         bench_frame.py occupancy 5 cm, 100 frames
#   mesh        bench_mesh.py: incremental after each depth frame at 5 cm (stage profile), full mesh
#   esdf        bench_esdf.py: issue 25's rows (LiDAR 10/10, 5/10, TSDF+occ+ESDF 5 cm, depth 2/1/0.5 cm + ESDF 5 cm,
#               peak memory with/without the ESDF, the cold 2.2 km street map)
#   room        bench_esdf.py: the 1000-frame room sequence (peak memory every 100 frames)
#   service     bench_service.py, CUDA server, 10 cm tsdf+esdf over WebSocket: 4 robots + queries + ESDF
#               slices, then 16 robots
#   warmup      bench_warmup.py: first frames of a new map after the warm-up (warm, restart)
#   alloc       bench_allocate.py: the per-frame allocation alone
#   topology    bench_topology.py: the grid operators at 1e6 .. 5e8 voxels (topology-small: up to 1e8)
#   integrators bench_integrators.py;  outputs bench_outputs.py;  fps bench_fps.py;  voxelize bench_voxelize.py;
#   registration bench_registration.py
#   gputests    the GPU-marked tests (PYTEST_K, default "cuda or gpu")
#   profile     tools/profile_ops.py (torch.profiler of dilate/prune/merge);  profint tools/profile_integrators.py
#   probe       tools/device_probe.py (Triton on this device at all)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__)' >> "$OUT/gpu.txt" 2>&1
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null
ARGS=${ARGS:-}
# run STEP DEFAULT_SECONDS COMMAND...: time-boxed, the log to $OUT/STEP.log, its tail to stdout
run() {
  local step=$1 t=${STEP_S:-$2}; shift 2
  local s=$(date +%s)
  timeout "$t" "$@" $ARGS > "$OUT/$step.log" 2>&1
  echo "[$step] rc=$? in $(( $(date +%s) - s )) s" | tee -a "$OUT/$step.log" >> "$OUT/gpu.txt"
  tail -n 15 "$OUT/$step.log"
}
B=benchmarks
for step in "$@"; do
  M="$OUT/$step.md" J="$OUT/$step.json"
  case "$step" in
    frame) run frame 120 python3 $B/bench_frame.py --device cuda --lidar-frames 500 --depth-frames 200 \
        --out "$M" --json "$J" ;;
    lidar)
      run lidar 110 python3 $B/bench_frame.py --device cuda --lidar-frames 500 \
        --cases lidar_tsdf_10cm lidar_tsdf_5cm occupancy_5cm --out "$M" --json "$J"
      run lidar-normals 20 python3 $B/bench_lidar_normals.py --device cuda --frames 4 --out "$OUT/lidar-normals.md" ;;
    depth) run depth 110 python3 $B/bench_frame.py --device cuda --depth-frames 1000 \
        --cases depth_tsdf_2cm depth_tsdf_1cm depth_tsdf_5mm --out "$M" --json "$J" ;;
    occ) run occ 60 python3 $B/bench_frame.py --device cuda --lidar-frames 100 --cases occupancy_5cm \
        --out "$M" --json "$J" ;;
    mesh)
      run mesh 40 python3 $B/bench_mesh.py --device cuda --parts incremental --sensor depth --frames 16 --reps 10 \
        --profile --out "$M"
      run mesh-full 30 python3 $B/bench_mesh.py --device cuda --parts full --reps 10 --out "$OUT/mesh-full.md" ;;
    esdf) run esdf 230 python3 $B/bench_esdf.py --device cuda --parts lidar lidar-occ depth city \
        --lidar-frames 20 --depth-frames 20 --warmup 3 --count-frames 1 --depth-voxels 0.02 0.01 0.005 \
        --city-scans ${CITY_SCANS:-1100} --city-extent ${CITY_EXTENT:-2200} --out "$M" ;;
    room) run room 120 python3 $B/bench_esdf.py --device cuda --parts room --room-frames 1000 --room-every 100 \
        --warmup 3 --out "$M" ;;
    service)
      # one Triton cache for every server started here: kernels compile once, not per server
      export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
      S="python3 $B/bench_service.py --device cuda --distinct-frames 4 --cases ingest --voxel 0.1 --layers tsdf,esdf"
      run service 60 $S --clients 4 --transports ws --window 4 --query-clients 4 --slice-cells 1000 --warmup 3 \
        --duration 5 --out "$M"
      run service16 40 $S --clients 16 --transports ws --window 4 --warmup 3 --duration 5 --no-query-case \
        --out "$OUT/service16.md" ;;
    warmup) run warmup 120 python3 $B/bench_warmup.py --device cuda --voxel 0.1 --frames 3 --skip-cold --out "$OUT" ;;
    alloc) run alloc 40 python3 $B/bench_allocate.py --device cuda --frames 40 --bricks 40000 --out "$M" ;;
    topology) run topology 560 python3 $B/bench_topology.py --device cuda --sizes 1e6 1e7 1e8 5e8 --out "$M" ;;
    topology-small) run topology-small 300 python3 $B/bench_topology.py --device cuda --sizes 1e6 1e7 1e8 --out "$M" ;;
    integrators) run integrators 300 python3 $B/bench_integrators.py --device cuda --out "$M" ;;
    outputs) run outputs 300 python3 $B/bench_outputs.py --device cuda --mesh-sizes 1e6 1e7 1e8 --out "$M" ;;
    fps) run fps 300 python3 $B/bench_fps.py --device cuda --sizes 65536:4096 1048576:16384 --out "$M" ;;
    voxelize) run voxelize 200 python3 $B/bench_voxelize.py --device cuda --sizes 25e3 50e3 130e3 250e3 500e3 1e6 \
        --out "$M" ;;
    registration) run registration 300 python3 $B/bench_registration.py --device cuda --out "$M" ;;
    gputests) run gputests 400 python3 -m pytest -q -p no:cacheprovider tests -k "${PYTEST_K:-cuda or gpu}" -rfE ;;
    profile) run profile 300 python3 $B/tools/profile_ops.py --sizes 1e8 5e8 --ops dilate prune merge ;;
    profint) run profint 240 python3 $B/tools/profile_integrators.py ;;
    probe) run probe 120 python3 $B/tools/device_probe.py ;;
    *) echo "unknown step $step (see the list at the top of $0)" | tee -a "$OUT/gpu.txt" ;;
  esac
done

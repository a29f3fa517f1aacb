#!/usr/bin/env bash
# H200 run of branch s4-graph (issue 12: CUDA graphs, mapper/graphs.py; the incremental mesh's marching cubes
# replayed per bucket), <= 150 s on one H200. From the repository root with $OUT set and PYTHONPATH at the
# tree + the service wheels; writes $OUT/s4-graph/. Each step is time-boxed and writes as it goes.
set -u
D="${OUT:-/tmp/out}/s4-graph"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
# 1. GPU tests: graphs (capture/replay == eager, late captures counted, no capture after warm-up, the
#    fixed-shape op == eager op == torch reference), the mesh kernels (incremental == full, now replayed from
#    graphs), the warm-up. The first map's warm-up compiles every kernel cold (~35 s).
timeout 62 python3 -m pytest -v -p no:cacheprovider tests/test_graphs.py tests/test_mesh_kernel.py \
  tests/test_warmup.py -k "cuda or gpu or graph" -rfE --tb=short --durations=8 > "$D/tests.log" 2>&1
el tests $?
# 2. incremental mesh after each 640x480 depth frame at 5 cm, graphs on, then off (stage profile each)
timeout 22 python3 benchmarks/bench_mesh.py --device cuda --parts incremental --sensor depth --frames 30 \
  --reps 20 --profile --out "$D/mesh_incr_graphs_on.md" > "$D/mesh_on.log" 2>&1
el mesh_on $?
MAPPER_CUDA_GRAPHS=0 timeout 22 python3 benchmarks/bench_mesh.py --device cuda --parts incremental \
  --sensor depth --frames 30 --reps 20 --profile --out "$D/mesh_incr_graphs_off.md" > "$D/mesh_off.log" 2>&1
el mesh_off $?
# 3. full mesh of ~1 M faces (over the largest bucket: eager by design; checks it did not regress)
timeout 15 python3 benchmarks/bench_mesh.py --device cuda --parts graphs full --reps 20 --out "$D/mesh_full.md" \
  > "$D/mesh_full.log" 2>&1
el mesh_full $?
# 4. distance query (10 k points) and ESDF slice (1000 x 1000): time and launches per call (not graphed:
#    this says whether a graph would pay)
left=$(( 147 - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/bench_graph_queries.py --device cuda --out "$D/queries.md" \
  > "$D/queries.log" 2>&1
el queries $?
tail -n 3 "$D"/*.log

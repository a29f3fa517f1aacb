#!/usr/bin/env bash
# H200 run of branch s4-graph (issue 12: CUDA graphs, mapper/graphs.py; the incremental mesh replayed from
# one graph per bucket of changed bricks), <= 150 s on one H200. From the repository root with $OUT set and
# PYTHONPATH at the tree + the service wheels; writes $OUT/s4-graph/. Each step is time-boxed, writes as it
# goes, and the last ones get what is left.
set -u
D="${OUT:-/tmp/out}/s4-graph"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
left() { echo $(( 147 - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
# 0. compile every kernel of the three configurations below once (Triton's on-disk cache serves the later
#    processes) and time each warm-up (graph captures included)
timeout 55 python3 - > "$D/compile.log" 2>&1 <<'PY'
import time, torch
from mapper import Map, graphs
for layers in (("tsdf", "color"), ("tsdf",), ("tsdf", "esdf")):
    t = time.perf_counter()
    Map(0.05, layers=layers, device="cuda")
    torch.cuda.synchronize()
    print(layers, f"warm-up {time.perf_counter() - t:.1f} s", graphs.stats(), flush=True)
PY
el compile $?
# 1. GPU tests of graphs: capture/replay == eager, late captures counted, no capture after the warm-up,
#    fixed-shape ops == eager ops == torch reference, graphed incremental == eager == full
timeout 30 python3 -m pytest -v -p no:cacheprovider tests/test_graphs.py -rfE --tb=short --durations=8 \
  > "$D/tests.log" 2>&1
el tests $?
# 2. incremental mesh after each 640x480 depth frame at 5 cm, graphs on, then off (stage profile each)
timeout 20 python3 benchmarks/bench_mesh.py --device cuda --parts incremental --sensor depth --frames 24 \
  --reps 20 --profile --out "$D/mesh_incr_graphs_on.md" > "$D/mesh_on.log" 2>&1
el mesh_on $?
MAPPER_CUDA_GRAPHS=0 timeout 20 python3 benchmarks/bench_mesh.py --device cuda --parts incremental \
  --sensor depth --frames 24 --reps 20 --profile --out "$D/mesh_incr_graphs_off.md" > "$D/mesh_off.log" 2>&1
el mesh_off $?
# 3. capture cost and memory of the graphs; full mesh of ~1 M faces (over the largest bucket: eager)
timeout 16 python3 benchmarks/bench_mesh.py --device cuda --parts graphs full --reps 20 \
  --out "$D/mesh_full.md" > "$D/mesh_full.log" 2>&1
el mesh_full $?
# 4. distance query (10 k points) and ESDF slice (1000 x 1000): time and launches per call (not graphed)
timeout "$(left)" python3 benchmarks/bench_graph_queries.py --device cuda --out "$D/queries.md" \
  > "$D/queries.log" 2>&1
el queries $?
# 5. if time is left: the mesh kernel tests on the GPU (now through the graphs)
l=$(left); if [ "$l" -gt 8 ]; then
  timeout "$l" python3 -m pytest -v -p no:cacheprovider tests/test_mesh_kernel.py -k cuda -rfE --tb=short \
    > "$D/tests_mesh_kernel.log" 2>&1
  el tests_mesh_kernel $?
fi
tail -n 3 "$D"/*.log

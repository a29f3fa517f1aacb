#!/usr/bin/env bash
# H200 run of branch s5-mesh (issue 12: incremental mesh <= 1 ms at 5 cm; one Mesh builder for both graph
# paths), <= 70 s on one H200. From the repository root with $OUT set and PYTHONPATH at the tree + the
# service wheels; writes $OUT/s5-mesh/. Each step is time-boxed and writes as it goes.
# Before/after inside this call: where git and the base commit are at hand, the same bench_mesh.py runs on
# the base tree (04bf0e6) too; otherwise the graphs-off (eager) run is the in-call reference.
set -u
D="${OUT:-/tmp/out}/s5-mesh"
mkdir -p "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
left() { echo $(( 68 - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
git rev-parse HEAD >> "$D/gpu.txt" 2>/dev/null
# 0. compile the kernels of a colour TSDF map and capture its graphs once (Triton's on-disk cache serves
#    the later processes; the first run of 2026-12-02 02:53 spent its whole 68 s compiling in each step)
timeout 30 python3 - > "$D/compile.log" 2>&1 <<'PY'
import time, torch
from mapper import Map, graphs
for layers in (("tsdf", "color"), ("tsdf",)):
    t = time.perf_counter()
    Map(0.05, layers=layers, device="cuda")
    torch.cuda.synchronize()
    print(layers, f"warm-up {time.perf_counter() - t:.1f} s", graphs.stats(), flush=True)
PY
el compile $?
# 1. GPU tests: graph replays == eager == torch reference, incremental == full, the leaf-search kernels ==
#    their references, no capture after the warm-up
timeout 25 python3 -m pytest -v -p no:cacheprovider tests/test_graphs.py tests/test_mesh_kernel.py \
  tests/test_mesh.py -k "cuda or gpu" -rfE --tb=short --durations=6 > "$D/tests.log" 2>&1
el tests $?
# 2. incremental mesh after each 640x480 depth frame at 5 cm, graphs on (stage profile, op counts)
B="--device cuda --parts incremental --sensor depth --frames 16 --reps 10 --profile"
timeout 12 python3 benchmarks/bench_mesh.py $B --out "$D/mesh_incr_graphs_on.md" > "$D/mesh_on.log" 2>&1
el mesh_on $?
# 3. the same on the base tree (before), when git can extract it
BASE=/tmp/s5-mesh-base
rm -rf "$BASE" && mkdir -p "$BASE"
if git archive 04bf0e6 mapper 2>/dev/null | tar -x -C "$BASE" 2>/dev/null && [ -f "$BASE/mapper/mesh.py" ]; then
  PYTHONPATH="$BASE${PYTHONPATH:+:$PYTHONPATH}" timeout 14 python3 benchmarks/bench_mesh.py $B \
    --out "$D/mesh_incr_base_04bf0e6.md" > "$D/mesh_base.log" 2>&1
  el mesh_base $?
else
  echo "no git base tree here: graphs off is the in-call reference" | tee -a "$D/gpu.txt"
  l=$(left); if [ "$l" -gt 14 ]; then
    MAPPER_CUDA_GRAPHS=0 timeout $(( l - 8 )) python3 benchmarks/bench_mesh.py $B \
      --out "$D/mesh_incr_graphs_off.md" > "$D/mesh_off.log" 2>&1
    el mesh_off $?
  fi
fi
# 4. full mesh of ~1 M faces
l=$(left); if [ "$l" -gt 6 ]; then
  timeout "$l" python3 benchmarks/bench_mesh.py --device cuda --parts full --reps 10 \
    --out "$D/mesh_full.md" > "$D/mesh_full.log" 2>&1
  el mesh_full $?
fi
tail -n 3 "$D"/*.log

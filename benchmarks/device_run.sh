#!/usr/bin/env bash
# Run on the GPU machine through the `device` tool (repo root as cwd, $OUT collected):
#   bash benchmarks/device_run.sh <step>...
# steps: gputests, profile, profint, integrators, outputs, fps, voxelize, service, registration, probe,
# topology-small, topology (see the case list below).
# Each step writes its log to $OUT/<step>.log and its report to $OUT/<step>.md; a failing step does not
# stop the next one.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/gpu.txt"
for step in "$@"; do
  case "$step" in
    gputests)
      timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests -k "${PYTEST_K:-cuda or gpu}" 2>&1 | tee "$OUT/gputests.log" | tail -25 ;;
    profile)
      (cd benchmarks && timeout 300 python3 profile_ops.py --sizes 1e8 5e8 --ops dilate prune merge) 2>&1 | tee "$OUT/profile.log" | grep -E "===|Self CUDA time total|_kernel|aten::(sort|unique|searchsorted|cumsum|index|nonzero)" ;;
    integrators)
      timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_integrators.py --device cuda ${BENCH_ARGS:-} \
        --out "$OUT/integrators.md" 2>&1 | tee "$OUT/integrators.log" | tail -25 ;;
    outputs)
      timeout 300 python3 benchmarks/bench_outputs.py --device cuda --mesh-sizes 1e6 1e7 1e8 \
        --out "$OUT/outputs.md" 2>&1 | tee "$OUT/outputs.log" | tail -15 ;;
    fps)
      timeout 300 python3 benchmarks/bench_fps.py --device cuda --sizes 65536:4096 1048576:16384 \
        --out "$OUT/fps.md" 2>&1 | tee "$OUT/fps.log" | tail -12 ;;
    voxelize)
      timeout 200 python3 benchmarks/bench_voxelize.py --device cuda --sizes 25e3 50e3 130e3 250e3 500e3 1e6 \
        --out "$OUT/voxelize.md" 2>&1 | tee "$OUT/voxelize.log" | tail -12 ;;
    service)
      timeout 400 python3 benchmarks/bench_service.py --device cuda ${SERVICE_ARGS:-} --out "$OUT/service.md" 2>&1 \
        | tee "$OUT/service.log" | tail -12 ;;
    profint)
      timeout 240 python3 benchmarks/profile_integrators.py ${PROF_ARGS:-} 2>&1 | tee "$OUT/profint.log" \
        | grep -E "===|per frame|generated|Self CUDA time total|triton|_kernel|aten::" | head -120 ;;
    registration)
      timeout 300 python3 benchmarks/bench_registration.py --device cuda ${REG_ARGS:-} --out "$OUT/registration.md" \
        2>&1 | tee "$OUT/registration.log" | tail -15 ;;
    probe)
      timeout 120 python3 benchmarks/device_probe.py 2>&1 | tee "$OUT/probe.log" ;;
    topology-small)
      timeout 300 python3 benchmarks/bench_topology.py --device cuda --sizes 1e6 1e7 1e8 \
        --out "$OUT/topology_small.md" 2>&1 | tee "$OUT/topology_small.log" | tail -8 ;;
    topology)
      timeout 560 python3 benchmarks/bench_topology.py --device cuda --sizes 1e6 1e7 1e8 5e8 \
        --out "$OUT/topology.md" 2>&1 | tee "$OUT/topology.log" | tail -12 ;;
    *) echo "unknown step $step" ;;
  esac
done

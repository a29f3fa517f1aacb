#!/usr/bin/env bash
# The coordinator's H200 run of branch s2-ray (<= 150 s, from the repository root, $OUT set): the cluster
# benchmark with 1, 2 and 4 map workers (Ray actors) sharing the one GPU. Skips, saying so, without `ray`.
set -uo pipefail
out="${OUT:?set OUT}/s2-ray"
mkdir -p "$out"
if ! python -c "import ray" 2>/dev/null; then
  echo "ray is not installed on the device machine: bench_cluster skipped (pip install 'mapper[ray]')" | tee "$out/skipped.txt"
  exit 0
fi
timeout 140 python benchmarks/bench_cluster.py --device cuda --workers 1,2,4 --clients 4 --points 120000 \
  --voxel 0.1 --warmup 3 --seconds 10 --out "$out/cluster_h200.md" > "$out/bench_cluster.log" 2>&1
rc=$?
tail -20 "$out/bench_cluster.log"
echo "bench_cluster exit $rc"
exit 0

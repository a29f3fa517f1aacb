#!/usr/bin/env bash
# H200 run of branch s5-esdf (issue 12: the per-frame ESDF update's host cost), <= 70 s on one H200, from the
# repository root with $OUT set (PYTHONPATH: the tree + the service wheels):  bash benchmarks/device_s5-esdf.sh
# Meant to run after the GPU suite of the same call (the ESDF tests marked for CUDA run there; the suite also
# leaves the Triton cache warm: this script uses the default cache, a cold one costs more than its slot).
# Old vs new in this one call: the base tree (main 04bf0e6) is this tree's mapper/ with
# benchmarks/device_s5-esdf.base.diff reversed (the branch's changes to mapper/), under /tmp/s5-base.
# 1. bench_warmup.py --cases inproc (kernels compiled by a throwaway map's 2 frames, then a new map's first
#    3 frames: integrate_lidar 115 k points + update_esdf, TSDF + ESDF 10 cm), new tree then base tree;
# 2. bench_esdf.py --parts lidar at 10 cm, new tree (3 frames after 1 warm-up frame; ops / launches /
#    syncs per update from the profiler and the sync debug mode).
# Every step has a deadline (seconds after the start), so the whole stays within 70 s; a step cut short
# leaves its log. Outputs: $OUT/s5-esdf/{gpu.txt,{new,base}/warmup.md,esdf_new.md,*.log}.
set -u
D="${OUT:-/tmp/out}/s5-esdf"
mkdir -p "$D/base" "$D/new"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MAPPER_BENCH_TRITON_CACHE="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
BASE=/tmp/s5-base
rm -rf "$BASE" && mkdir -p "$BASE" && cp -r mapper "$BASE/" \
  && (cd "$BASE" && patch -s -R -p1 < "$OLDPWD/benchmarks/device_s5-esdf.base.diff") >> "$D/gpu.txt" 2>&1
base_ok=$?
el base-tree $base_ok
for tree in new base; do
  [ "$tree" = base ] && [ "$base_ok" != 0 ] && continue
  PP="$PYTHONPATH"; [ "$tree" = base ] && PP="$BASE:$PYTHONPATH"
  end=46; [ "$tree" = new ] && end=25
  left=$(( end - ($(date +%s) - start) )); [ "$left" -lt 8 ] && left=8
  PYTHONPATH="$PP" timeout "$left" python3 benchmarks/bench_warmup.py --device cuda --voxel 0.1 --frames 3 \
    --cases inproc --label "$tree tree" --out "$D/$tree" > "$D/warmup_$tree.log" 2>&1
  el "warmup-$tree" $?
done
left=$(( 69 - ($(date +%s) - start) )); [ "$left" -lt 5 ] && left=5
timeout "$left" python3 benchmarks/bench_esdf.py --device cuda --parts lidar \
  --lidar-voxels 0.1 --lidar-frames 3 --warmup 1 --count-frames 1 --out "$D/esdf_new.md" > "$D/esdf_new.log" 2>&1
el esdf-new $?
cat "$D"/*/warmup.md "$D"/esdf_new.md 2>/dev/null | grep -v "^$"

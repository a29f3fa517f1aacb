#!/usr/bin/env bash
# H200 run of branch s5-esdf (issue 12: the per-frame ESDF update's host cost), <= 70 s on one H200, from the
# repository root with $OUT set (PYTHONPATH: the tree + the service wheels):  bash benchmarks/device_s5-esdf.sh
# Old vs new in this one call: the base tree (main 04bf0e6) is this tree's mapper/ with
# benchmarks/device_s5-esdf.base.diff reversed (the branch's changes to mapper/), under /tmp/s5-base.
# 1. the ESDF / envelope tests marked for the GPU (<= 24 s);
# 2. bench_warmup.py --cases inproc (kernels compiled by a throwaway map's 2 frames, then a new map's first
#    3 frames: integrate_lidar 115 k points + update_esdf, TSDF + ESDF 10 cm), base then new tree;
# 3. bench_esdf.py --parts lidar at 10 cm (5 frames after 2 warm-up frames; ops / launches / syncs per
#    update), base then new tree. Every step has a deadline (seconds after the start), so the whole stays
#    within 70 s; a step cut short leaves its log.
# Outputs: $OUT/s5-esdf/{gpu.txt,tests.log,{base,new}/warmup.md,esdf_{base,new}.md,*.log}.
set -u
D="${OUT:-/tmp/out}/s5-esdf"
mkdir -p "$D/base" "$D/new"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=/tmp/s5-esdf-triton MAPPER_BENCH_TRITON_CACHE=/tmp/s5-esdf-triton
start=$(date +%s)
el() { echo "$1 rc=$2 after $(( $(date +%s) - start )) s" | tee -a "$D/gpu.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$D/gpu.txt" 2>&1
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' >> "$D/gpu.txt" 2>&1
BASE=/tmp/s5-base
rm -rf "$BASE" && mkdir -p "$BASE" && cp -r mapper "$BASE/" \
  && (cd "$BASE" && patch -s -R -p1 < "$OLDPWD/benchmarks/device_s5-esdf.base.diff") >> "$D/gpu.txt" 2>&1
base_ok=$?
el base-tree $base_ok
XDIST=""
python3 -c 'import xdist' 2>/dev/null && XDIST="-n 4"
timeout 24 python3 -m pytest -q -p no:cacheprovider $XDIST -k "cuda or gpu" -rfE \
  tests/test_esdf.py tests/test_esdf_coarse.py tests/test_envelope.py > "$D/tests.log" 2>&1
el tests $?
for tree in base new; do
  [ "$tree" = base ] && [ "$base_ok" != 0 ] && continue
  PP="$PYTHONPATH"; [ "$tree" = base ] && PP="$BASE:$PYTHONPATH"
  end=52; [ "$tree" = base ] && end=40
  left=$(( end - ($(date +%s) - start) )); [ "$left" -lt 8 ] && left=8
  PYTHONPATH="$PP" timeout "$left" python3 benchmarks/bench_warmup.py --device cuda --voxel 0.1 --frames 3 \
    --cases inproc --label "$tree tree" --out "$D/$tree" > "$D/warmup_$tree.log" 2>&1
  el "warmup-$tree" $?
done
for tree in base new; do
  [ "$tree" = base ] && [ "$base_ok" != 0 ] && continue
  PP="$PYTHONPATH"; [ "$tree" = base ] && PP="$BASE:$PYTHONPATH"
  end=69; [ "$tree" = base ] && end=60
  left=$(( end - ($(date +%s) - start) )); [ "$left" -lt 5 ] && left=5
  PYTHONPATH="$PP" timeout "$left" python3 benchmarks/bench_esdf.py --device cuda --parts lidar \
    --lidar-voxels 0.1 --lidar-frames 5 --warmup 2 --count-frames 1 --out "$D/esdf_$tree.md" \
    > "$D/esdf_$tree.log" 2>&1
  el "esdf-$tree" $?
done
tail -n 3 "$D/tests.log"; cat "$D"/*/warmup.md "$D"/esdf_*.md 2>/dev/null | grep -v "^$"

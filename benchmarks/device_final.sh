#!/bin/bash
# The coordinator's final H200 run of a merged main: the GPU-marked suite, then the named steps of
# benchmarks/device_bench.sh (frame, lidar, depth, mesh, esdf, service, topology, ...: the list at its top).
# Prepare here: `mkdir -p .gpu && git archive HEAD -o .gpu/main.tar && cp benchmarks/device_final.sh .gpu/final.sh`;
# device `run` with carry [".whl", ".shdata", ".gpu"] (.whl = ../shared/tools/device-wheels.sh, .shdata/data = ../shared/data):
#   SUITE_S=200 BENCHES="frame:140 service:150" ROOM_S=80 bash .gpu/final.sh
# (a step as NAME or NAME:SECONDS, the whole step's limit; ROOM_S > 0 also runs the 1000-frame room sequence
# of bench_esdf.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/bin; command -v python >/dev/null || ln -sf "$(command -v python3)" /tmp/bin/python; export PATH=/tmp/bin:$PATH
ROOT=$PWD; mkdir -p /tmp/m /tmp/o && tar -xf .gpu/main.tar -C /tmp/m
mkdir -p /tmp/shared && ln -sfn $ROOT/.shdata/data /tmp/shared/data
cd /tmp/m
export PYTHONPATH=/tmp/site:/tmp/m MAPPER_SHARED_DATA=$ROOT/.shdata/data PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/o/gpuinfo.txt 2>&1
python3 -c "import sys,torch,triton;print(sys.version,torch.__version__,triton.__version__)" >> /tmp/o/gpuinfo.txt
s=$(date +%s)
timeout ${SUITE_S:-230} python3 -m pytest -q -p no:cacheprovider -p no:benchmark tests -k "cuda or gpu" -n 8 --continue-on-collection-errors -rfE > /tmp/o/gpusuite.txt 2>&1
echo "suite rc=$? in $(( $(date +%s) - s )) s" >> /tmp/o/gpusuite.txt
tail -n 30 /tmp/o/gpusuite.txt
if [ "${ROOM_S:-0}" -gt 0 ]; then
  mkdir -p /tmp/o/room; s=$(date +%s)
  timeout $((ROOM_S + 15)) python3 benchmarks/bench_esdf.py --device cuda --parts room --room-frames 1000 \
    --room-seconds $ROOM_S --room-every 100 --warmup 3 --out /tmp/o/room/room_h200.md > /tmp/o/room/room.log 2>&1
  echo "[room] rc=$? in $(( $(date +%s) - s )) s" | tee -a /tmp/o/room/room.log
fi
for spec in ${BENCHES:-frame service}; do
  b=${spec%%:*}; t=${spec#*:}; [ "$t" = "$spec" ] && t=${BENCH_S:-130}
  s=$(date +%s); mkdir -p /tmp/o/$b
  OUT=/tmp/o/$b timeout $t bash benchmarks/device_bench.sh $b > /tmp/o/$b/log.txt 2>&1
  echo "[$b] rc=$? in $(( $(date +%s) - s )) s" | tee -a /tmp/o/$b/log.txt
done
tar -cf $OUT/final.tar -C /tmp/o .

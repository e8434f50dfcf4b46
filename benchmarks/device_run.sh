#!/usr/bin/env bash
# Everything the GPU needs to check and measure, in one device call. Logs go to $OUT.
# Usage (on the device machine, repo root): bash benchmarks/device_run.sh [check] [bench] [sweep]
set -u
OUT=${OUT:-/tmp/flexhstu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
stages=${*:-check profile bench sweep}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
for s in $stages; do
  case $s in
    check) timeout 300 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/check.log" ;;
    bench) timeout 300 python3 benchmarks/bench.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    profile) timeout 200 python3 benchmarks/time_split.py 2>&1 | tee "$OUT/profile.log" ;;
    sweep) timeout 240 python3 benchmarks/sweep.py 2>&1 | tee "$OUT/sweep.log" ;;
  esac
done

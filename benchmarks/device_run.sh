#!/usr/bin/env bash
# Everything the GPU needs to check and measure, in one device call. Logs go to $OUT.
# Usage (on the device machine, repo root): bash benchmarks/device_run.sh [stage ...]
#   check    the GPU correctness suite (tests/gpu), outputs poisoned, float32 references (CHECK_K=expr: a subset)
#   compile  sm_90 compile of every kernel variant, registers and spills
#   bench    the attention suite of benchmarks/RESULTS.md (flexhstu bench --suite)
#   stu      the STU model step (flexhstu/bench_stu.py --suite), step time and peak memory
#   serving  cached delta scoring vs full recompute (flexhstu/bench_serving.py --quick)
#   aoti     the micro-batch scorer compiled with AOTInductor vs eager (flexhstu/bench_serving.py --aoti --quick)
#   seeds    the 5-seed model table (tools/run_seeds.sh; needs ml-100k.inter in .data/)
#   profile  per-kernel device time and host time per call
#   sweep    tile sweep
set -u
OUT=${OUT:-/tmp/flexhstu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
stages=${*:-check bench}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true; } 2>&1 | tee "$OUT/env.txt"
run() {  # run NAME SECONDS CMD...: one stage with its own time limit, its log under $OUT
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name exit $?"
  tail -n 40 "$OUT/$name.log"
}
for s in $stages; do
  case $s in
    check) run check 240 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider ${CHECK_K:+-k "$CHECK_K"} ;;
    compile) run compile 120 python3 benchmarks/compile_check.py ;;
    bench) run bench 200 python3 benchmarks/bench.py --json "$OUT/bench.json" ;;
    stu) run stu 220 python3 -m flexhstu.bench_stu --suite --dropout 0 --variants eager lean default \
           --json "$OUT/stu.json" ;;
    serving) run serving 200 python3 -m flexhstu.bench_serving --quick --json "$OUT/serving.json" ;;
    aoti) run aoti 420 python3 -m flexhstu.bench_serving --aoti --quick --json "$OUT/aoti.json" ;;
    seeds) OMP_NUM_THREADS=1 run seeds "${SEEDS_LIMIT:-300}" bash tools/run_seeds.sh --data .data/ml-100k.inter \
             --root /tmp/seeds -j 14
           python3 tools/models_table.py /tmp/seeds > "$OUT/seeds-table.md" 2>&1
           tar czf "$OUT/seeds-runs.tgz" --exclude='*.pt' -C /tmp seeds ;;
    profile) run profile 200 python3 benchmarks/time_split.py ;;
    sweep) run sweep 420 python3 benchmarks/sweep.py --jobs 14 --json "$OUT/sweep.json" ${SWEEP_ARGS:-} ;;
    *) echo "unknown stage $s" ;;
  esac
done

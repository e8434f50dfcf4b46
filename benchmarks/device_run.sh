#!/usr/bin/env bash
# Everything the GPU needs to check and measure, in one device call. Logs go to $OUT.
# Usage (on the device machine, repo root): bash benchmarks/device_run.sh [stage ...]
#   check    the GPU correctness suite (tests/gpu), outputs poisoned, float32 references (CHECK_K=expr: a subset;
#            CHECK_PARTS processes, default 4)
#   compile  sm_90 compile of every kernel variant, registers and spills
#   bench    the attention suite of benchmarks/RESULTS.md (flexhstu bench --suite)
#   graphs   which STU configurations capture in a CUDA graph (benchmarks/graph_check.py, a process each)
#   bias     the relative attention bias in the kernels vs the same kernels without it (benchmarks/bench_bias.py)
#   bias-ablate  where the bias's time goes: the bias with one part of its work taken out at a time
#            (benchmarks/bias_ablations.py, causal; ABLATE_ONLY=causal,sla for both)
#   stu      the STU model step (flexhstu/bench/stu_step.py --suite), step time and peak memory
#   stu-memory  the STU step's peak memory as users measure it (benchmarks/stu_memory.py)
#   serving  cached delta scoring vs full recompute (flexhstu/bench/serving.py --quick)
#   aoti-probe  which small AOTInductor packages compile, load and run (benchmarks/aoti_probe.py, a process each)
#   aoti     the micro-batch scorer compiled with AOTInductor vs eager (flexhstu/bench/serving.py --aoti --quick)
#   serving-profile  host and device time of the scoring paths, bf16 vs float32 scores (benchmarks/profile_serving.py)
#   seeds    the 5-seed model table (tools/run_seeds.sh; needs ml-100k.inter in .data/)
#   profile  per-kernel device time and host time per call
#   sweep    tile sweep
#   ddp      several GPUs (docs/distributed.md): DDP tokens/s on 1 GPU and on DDP_GPUS (default all), causal and
#            SLA, and the 10^8 x 128 item table (refused on 1 GPU, rowwise on all); DDP_PARTS="causal sla table"
#            picks parts (each under 8 minutes), OUT/ddp.md sums them up
set -u
OUT=${OUT:-/tmp/flexhstu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
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
    check)  # the tests spread round-robin over CHECK_PARTS processes (kernel compilation dominates: one process
            # took over 240 s), each part's log under $OUT
      parts=${CHECK_PARTS:-4}
      python3 -m pytest tests/gpu -o addopts="" -q --collect-only -p no:cacheprovider ${CHECK_K:+-k "$CHECK_K"} 2>/dev/null \
        | grep '::' > /tmp/check-ids.txt
      echo "== check: $(wc -l < /tmp/check-ids.txt) tests in $parts processes (limit ${CHECK_LIMIT:-480}s each)"
      for i in $(seq 0 $((parts - 1))); do
        awk -v n="$parts" -v i="$i" '(NR - 1) % n == i' /tmp/check-ids.txt > "/tmp/check-ids-$i.txt"
        xargs -d '\n' -a "/tmp/check-ids-$i.txt" timeout "${CHECK_LIMIT:-480}" python3 -m pytest -o addopts="" -q -rA -p no:cacheprovider \
          > "$OUT/check-$i.log" 2>&1 &
      done
      wait
      for i in $(seq 0 $((parts - 1))); do echo "-- part $i: $(tail -n 1 "$OUT/check-$i.log")"; done
      grep -h "^FAILED\|^ERROR" "$OUT"/check-*.log ;;
    compile) run compile 120 python3 benchmarks/compile_check.py ;;
    bench) run bench 330 python3 -m flexhstu.bench --suite --json "$OUT/bench.json" ;;
    graphs) run graphs 200 python3 benchmarks/graph_check.py ;;
    bias) run bias 240 python3 benchmarks/bench_bias.py --kernels --json "$OUT/bias.json" ${BIAS_ARGS:-} ;;
    bias-ablate) run bias-ablate 480 python3 benchmarks/bias_ablations.py --only "${ABLATE_ONLY:-causal}" --jobs 8 \
                   --out "$OUT/bias-ablations" ;;
    aoti-probe) run aoti-probe 420 python3 benchmarks/aoti_probe.py --log-dir "$OUT/aoti-probe" ;;
    stu) run stu 220 python3 -m flexhstu.bench.stu_step --suite --dropout 0 --variants eager lean default \
           --json "$OUT/stu.json" ;;
    stu-memory) run stu-memory 200 python3 benchmarks/stu_memory.py ;;
    serving) run serving 200 python3 -m flexhstu.bench.serving --quick --json "$OUT/serving.json" ;;
    serving-profile) run serving-profile 150 python3 benchmarks/profile_serving.py --out "$OUT/profile-serving" ;;
    aoti) run aoti 420 python3 -m flexhstu.bench.serving --aoti --quick --json "$OUT/aoti.json" ;;
    seeds) OMP_NUM_THREADS=1 run seeds "${SEEDS_LIMIT:-300}" bash tools/run_seeds.sh --data .data/ml-100k.inter \
             --root /tmp/seeds -j 14
           python3 tools/models_table.py /tmp/seeds > "$OUT/seeds-table.md" 2>&1
           tar czf "$OUT/seeds-runs.tgz" --exclude='*.pt' -C /tmp seeds ;;
    profile) run profile 200 python3 benchmarks/time_split.py ;;
    sweep) run sweep 420 python3 benchmarks/sweep.py --jobs 14 --json "$OUT/sweep.json" ${SWEEP_ARGS:-} ;;
    ddp) n=${DDP_GPUS:-$(nvidia-smi -L | wc -l)}
         # throughput-bound synthetic training: 10^6 users of up to 4096 events, 8 STU layers of width 512, no
         # relative bias (Triton kernels); 8 sequences per GPU per step (weak scaling); tokens/s after 3 steps
         scale="--data synthetic --synthetic-users 1000000 --synthetic-items 1000000 --synthetic-len 4096
                --max-len 4096 --dim 512 --layers 8 --heads 4 --no-rel-bias --dropout 0 --sla-k1 256 --sla-k2 32
                --epochs 1 --steps-per-epoch ${DDP_STEPS:-40} --eval-users 64 --no-checkpoint --quiet"
         # 10^8 items x 128 float32 with its gradient and AdamW's moments: 204.8 GB, 102.4 GB per GPU on 2
         table="--data synthetic --synthetic-users 100000 --synthetic-items 100000000 --synthetic-len 200
                --max-len 200 --dim 128 --layers 2 --heads 2 --no-rel-bias --dropout 0 --batch-size 64 --epochs 1
                --steps-per-epoch 20 --eval-users 128 --no-checkpoint --shard-embeddings rowwise --quiet"
         launch="python3 -m torch.distributed.run --standalone --nproc-per-node"
         for part in ${DDP_PARTS:-causal sla table}; do  # each part: two runs, under 8 minutes together
           case $part in
             causal|sla)
               for g in $(echo 1 "$n" | tr ' ' '\n' | sort -un); do
                 echo "$launch $g -m flexhstu.train" $scale "--mask $part --batch-size $((8 * g))" \
                   > "$OUT/ddp-$part-${g}gpu.cmd"
                 run "ddp-$part-${g}gpu" 230 $launch "$g" -m flexhstu.train $scale --mask "$part" \
                   --batch-size $((8 * g)) --out "$OUT/ddp-$part-${g}gpu"
               done ;;
             table)
               echo "python3 -m flexhstu.train" $table > "$OUT/table-1gpu.cmd"
               run table-1gpu 90 python3 -m flexhstu.train $table --out "$OUT/table-1gpu"  # expected: exit 2
               if [ "$n" -gt 1 ]; then
                 echo "$launch $n -m flexhstu.train" $table > "$OUT/table-${n}gpu.cmd"
                 run "table-${n}gpu" 360 $launch "$n" -m flexhstu.train $table --out "$OUT/table-${n}gpu"
               fi ;;
             *) echo "unknown ddp part $part (causal, sla, table)" ;;
           esac
         done
         python3 - "$OUT" > "$OUT/ddp.md" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | GPUs | tokens/s | tokens/s per GPU | scaling efficiency | peak GB per GPU |\n|---|---|---|---|---|---|")
for mask in ("causal", "sla", "table"):
    base = None
    for run in sorted(out.glob(f"*{mask}-*gpu"), key=lambda p: int(p.name.split("-")[-1][:-3])):
        f = run / "metrics.json"
        if not f.is_file():
            print(f"| {run.name} | | no metrics.json: see {run.name}.log | | | |")
            continue
        t = json.loads(f.read_text())["throughput"]
        s = t.get("after_warmup", t)
        base = base or s["tokens_per_s_per_rank"]
        peak = f"{max(t['peak_memory_gb']):.1f}" if "peak_memory_gb" in t else "-"
        print(f"| {run.name} | {t['ranks']} | {s['tokens_per_s']:,.0f} | {s['tokens_per_s_per_rank']:,.0f} | "
              f"{s['tokens_per_s_per_rank'] / base:.1%} | {peak} |")
print("\nCommands (each with --out OUT/<run>):\n")
for cmd in sorted(out.glob("*.cmd")):
    print(f"- {cmd.stem}: `{cmd.read_text().strip()}`")
PY
         cat "$OUT/ddp.md"; tail -n 3 "$OUT"/table-1gpu.log 2>/dev/null ;;
    *) echo "unknown stage $s" ;;
  esac
done

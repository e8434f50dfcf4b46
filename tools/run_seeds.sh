#!/usr/bin/env bash
# The 5-seed model table: HSTU causal (with and without the relative attention bias), HSTU SLA,
# SASRec-style, OneRank with and without task tokens (seeds 0..4) and popularity (once: it has no
# seed), all with the README's default settings, in parallel processes, each run in its own folder
# ROOT/<config>/seed<N>; then the tables.
#
#   tools/run_seeds.sh --data PATH/ml-100k.inter --root runs/seeds [-j 8] [--seeds "0 1 2 3 4"] [-- EXTRA...]
#
# --data: a copy of MovieLens-100K's ml-100k.inter (recbole's atomic file) or any file `flexhstu train
# --data` reads; EXTRA arguments go to every run (e.g. -- --epochs 1 --device cpu for a quick check).
# Run from the repository root; python3 must have flexhstu's dependencies (PYTHONPATH=$PWD is set here).
set -euo pipefail

data="" root="" jobs=4 seeds="0 1 2 3 4" extra=()
while (($#)); do
  case "$1" in
    --data) data="$2"; shift 2 ;;
    --root) root="$2"; shift 2 ;;
    -j) jobs="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run_seeds.sh: error: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -n "$data" && -n "$root" ]] || { echo "run_seeds.sh: error: --data PATH and --root FOLDER are required" >&2; exit 2; }
[[ -f "$data" ]] || { echo "run_seeds.sh: error: --data: no such file '$data'" >&2; exit 2; }
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "run_seeds.sh: error: -j: expected an integer >= 1, got '$jobs'" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

declare -A configs=(
  [hstu-causal]="--model hstu --mask causal"
  [hstu-causal-nobias]="--model hstu --mask causal --no-rel-bias"
  [hstu-sla]="--model hstu --mask sla --sla-k1 32 --sla-k2 4"
  [sasrec]="--model sasrec"
  [onerank-tasktokens]="--task ranking --model onerank"
  [onerank-targets]="--task ranking --model onerank --no-task-tokens"
)
commands=()
for name in "${!configs[@]}"; do
  for seed in $seeds; do
    commands+=("${configs[$name]} --seed $seed --out $root/$name/seed$seed")
  done
done
commands+=("--model popularity --out $root/popularity/seed0")
mkdir -p "$root"

run_one() {  # one training run; its output goes to OUT.log beside its folder
  local args="$1" out
  out=$(sed -E 's/.*--out ([^ ]+).*/\1/' <<<"$args")
  mkdir -p "$(dirname "$out")"
  # shellcheck disable=SC2086  # word splitting of the configuration's arguments is intended
  if python3 -m flexhstu.train $args --data "$DATA" --quiet "${EXTRA[@]}" >"$out.log" 2>&1; then
    echo "done   $out"
  else
    echo "FAILED $out (see $out.log)"; return 1
  fi
}
export -f run_one
export DATA="$data"
status=0
printf '%s\0' "${commands[@]}" | EXTRA_ARGS="${extra[*]-}" xargs -0 -P "$jobs" -I{} \
  bash -c 'EXTRA=($EXTRA_ARGS); run_one "$1"' _ {} || status=$?
python3 tools/models_table.py "$root"
exit "$status"

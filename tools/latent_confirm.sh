#!/usr/bin/env bash
# Train several synthetic-task runs at once on one GPU with the trainer, then run the demo on
# each and tabulate them (the use of Z in BENCHMARKS.md).
#   bash tools/latent_confirm.sh JOBS OUTDIR
# JOBS: a file (- for standard input) of "NAME trainer flags..." per line (BENCHMARKS.md gives each
# study's list as the command that ran it); every run uses configs/synthetic.toml with 64 rows a
# step (the studies' batch; the quick start trains 48), one process, bf16 and --compile. OUTDIR gets summary.md and metrics.jsonl (every run's records, named).
set -uo pipefail
jobs_file=$1 out=$2
[[ "$jobs_file" == - ]] && jobs_file=/dev/stdin
runs=${RUNS:-/tmp/latent-runs}
mkdir -p "$out" "$runs"
names=()
while read -r name args; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    names+=("$runs/$name")
    # shellcheck disable=SC2086
    ( OMP_NUM_THREADS=1 python3 train_fsdp.py --config configs/synthetic.toml --strategy none --param-dtype bf16 \
        --global-batch 64 --compile --log-every 250 --eval-every 250 --out-dir "$runs/$name" --overwrite $args \
        >"$runs/$name.log" 2>&1 && python3 sample.py --ckpt "$runs/$name" --demo >>"$runs/$name.log" 2>&1 \
        || echo "FAILED: $name (tail of $runs/$name.log)" && tail -n 3 "$runs/$name.log" ) </dev/null &
done <"$jobs_file"
wait
for r in "${names[@]}"; do
    [[ -f "$r/metrics.jsonl" ]] && sed "s|^{|{\"run\": \"$(basename "$r")\", |" "$r/metrics.jsonl"
done >"$out/metrics.jsonl"
done_runs=()
for r in "${names[@]}"; do [[ -f "$r/demo.json" ]] && done_runs+=("$r"); done
python3 runs_report.py "${done_runs[@]}" --table | tee "$out/summary.md"

#!/usr/bin/env bash
# Run many tests/latent_probe.py jobs at once on one GPU (the study of issue 11; BENCHMARKS.md).
#   bash tools/latent_sweep.sh JOBS OUTDIR SECONDS
# JOBS: a file (- for standard input) of one probe argument list per line (# comments allowed);
# BENCHMARKS.md gives each study's list as the command that ran it. Every job is stopped after
# SECONDS; its evaluations so far are kept. OUTDIR/probe.jsonl collects every line.
set -uo pipefail
jobs_file=$1 out=$2 limit=${3:-540}
[[ "$jobs_file" == - ]] && jobs_file=/dev/stdin
mkdir -p "$out/parts"
i=0
while read -r line; do
    [[ -z "$line" || "$line" == \#* ]] && continue
    i=$((i + 1))
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 timeout "$limit" python3 tests/latent_probe.py $line --out "$out/parts/$i.jsonl" \
        2>"$out/parts/$i.err" </dev/null &
done <"$jobs_file"
wait
cat "$out"/parts/*.jsonl >"$out/probe.jsonl"
tail -n 3 "$out"/parts/*.err | grep -B2 -i error | head -40
python3 - "$out/probe.jsonl" <<'PY'
import json, sys
last = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    last[(r["tag"], r["shape"], r["H"], r["arch"], r["kappa_bits"], " ".join(r["set"]))] = r
for k, r in sorted(last.items()):
    print(f'{r["tag"]:>10} {r["arch"]:>8} {r["shape"]:>8} H{r["H"]:<2} k{r["kappa_bits"]:<5} step {r["step"]:>5} '
          f'ce {r["val_ce"]:.4f} prior {r.get("val_prior_ce", 0):.4f} kl {r.get("val_kl", 0):.3f} '
          f'ratio {r.get("val_r_rms_ratio", 0):.3f} fixed {r.get("fixed_z", "-")} fresh {r.get("fresh_z", "-")} '
          f'{r["seconds"]}s | {" ".join(r["set"])}')
PY

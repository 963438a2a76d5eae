#!/usr/bin/env bash
# Issue 40's GPU runs, for a machine with 2 (x2) or 4 (x4) H200s: the NCCL tests, then the pipeline rows of
# bench_e2e.py beside a one-GPU row of the same pair in the same script run. Results land in $OUT (default
# benchmarks/results/pipeline_gpus/), each JSON with its command, GPUs, git SHA and date.
#   bash benchmarks/run_pipeline_gpus.sh x2      # Llama-3.1-8B + 3.2-1B and Qwen2.5-14B + 0.5B at PP = 2
#   bash benchmarks/run_pipeline_gpus.sh x4      # Llama-3.3-70B + 3.2-1B and Qwen2.5-72B + 0.5B at PP = 4
set -euo pipefail
kind=${1:?usage: run_pipeline_gpus.sh x2|x4}
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/results/pipeline_gpus}
mkdir -p "$out"
cd "$here"
balanced() {  # JSON METHOD -> the first stage's layer count that balanced that method's stages there
  python3 -c "import json, sys; rows = [r for r in json.load(open(sys.argv[1]))['rows'] if r.get('method') == sys.argv[2]]; print(rows[0]['balanced_first_stage_layers']['layers'])" "$1" "$2"
}
methods=vanilla,classic,magicdec,dustin-h,dustin-h-sparse-draft,dustin-ip,dustin-ip-sparse-draft,dustin-h-longspark
python3 -m pytest -q -p no:cacheprovider -n 0 ../tests/test_pipeline_nccl.py 2>&1 | tee "$out/gpu_tests_$kind.txt"
if [ "$kind" = x2 ]; then
  python3 bench_e2e.py --pair llama-8b --batches 16 --contexts 32768 --methods "$methods" --rounds 12 \
      --out "$out/e2e_llama-8b_pp1.json"
  for micro in 1 2; do
    python3 bench_e2e.py --pp 2 --micro-batches "$micro" --pair llama-8b --batches 16 --contexts 32768 \
        --methods "$methods" --rounds 12 --out "$out/e2e_llama-8b_pp2_m$micro.json"
  done
  # the split that the M = 2 run's dustin-h phases say balances the stages (its balanced_first_stage_layers)
  first=$(balanced "$out/e2e_llama-8b_pp2_m2.json" dustin-h)
  python3 bench_e2e.py --pp 2 --micro-batches 2 --first-stage-layers "$first" --pair llama-8b --batches 16 \
      --contexts 32768 --methods "$methods" --rounds 12 --out "$out/e2e_llama-8b_pp2_m2_balanced.json"
  python3 bench_e2e.py --pp 2 --micro-batches 2 --pair qwen-14b --batches 16 --contexts 32768 \
      --methods "$methods" --rounds 10 --out "$out/e2e_qwen-14b_pp2_m2.json"
else
  for pair in qwen-72b llama-70b; do
    python3 bench_e2e.py --pp 4 --micro-batches 4 --pair "$pair" --batches 16 --contexts 32768 \
        --methods "$methods" --rounds 8 --out "$out/e2e_${pair}_pp4_m4.json"
    first=$(balanced "$out/e2e_${pair}_pp4_m4.json" dustin-h)
    python3 bench_e2e.py --pp 4 --micro-batches 4 --first-stage-layers "$first" --pair "$pair" --batches 16 \
        --contexts 32768 --methods "$methods" --rounds 8 --out "$out/e2e_${pair}_pp4_m4_balanced.json"
  done
fi

#!/usr/bin/env bash
# Reproduces benchmarks/results/e2e_h200.{json,csv} and its plots on one H200 (about 5 minutes of GPU time):
#   bash benchmarks/run_e2e_h200.sh
set -euo pipefail
cd "$(dirname "$0")"
python3 bench_e2e.py --fused-elementwise on --pdl on --pair llama-8b --batches 8,16 --contexts 8192,16384,24576,32768,65536 --rounds 12
python3 bench_e2e.py --fused-elementwise on --pdl on --pair qwen-7b --batches 8,16 --contexts 8192,16384,32768,65536 --rounds 10
python3 bench_e2e.py --fused-elementwise on --pdl on --pair qwen-14b --batches 8 --contexts 16384,32768 --rounds 10
python3 plot_e2e.py

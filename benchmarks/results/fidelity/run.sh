#!/bin/bash
# The H200 runs of issue 24 (README.md beside this file), in the repository root on the GPU machine.
#   stash N     copy the carried part .carry/q/gguf.N of the SmolLM2 GGUF to ~/stash (one call per 12 MB part)
#   quality     join and check the GGUF, install, then at once on the one GPU: the quality run (every fidelity
#               method at k = 128 ... 2048, 4K and 8K; 10 processes), its k = 4096 complement at 8K, and the tau
#               of each method on the test windows; needs .carry/quality_tasks.json and .carry/test_prompts.npz
#   final       the changed tests on the GPU and the fp8 draft cache's tau (after the stash calls; GGUF, prompts)
#   e2e         the --budget frontier and the headline's round times at the Llama-3.1-8B + 1B shapes (no GGUF)
set -euo pipefail
S=~/stash
OUT=${OUT:-/tmp/out}
GGUF=$S/SmolLM2-135M-Instruct.Q4_1.gguf
install() {
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/gguf-*.whl 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-cache-dir "$S"/gguf-*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e .
}
case "$1" in
stash)
  mkdir -p "$S"
  cp .carry/q/gguf."$2" "$S"/
  for extra in .whl/gguf-0.19.0-py3-none-any.whl .carry/test_prompts.npz; do [ -f "$extra" ] && cp "$extra" "$S"/; done
  ls -la "$S"
  ;;
quality)
  cat "$S"/gguf.? > "$GGUF"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c
  install
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  cd benchmarks
  common=(--target "$GGUF" --tasks-file ../.carry/quality_tasks.json --samples 60 --batch-size 60 --m-sweep)
  R=~/res; rm -rf "$R"; mkdir -p "$R"  # the device returns few files: everything goes back as one archive
  python3 eval_tau.py --target "$GGUF" --prompts "$S"/test_prompts.npz \
    --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json \
    --methods classic magicdec dustin-h dustin-h-sparse-draft --budgets 512 1024 2048 --contexts 4096 8192 \
    --docs 24 --batch-size 8 --out "$R/tau_by_method_h200.json" > "$R/tau_by_method_h200.log" 2>&1 &
  tau=$!
  timeout 500 python3 eval_quality.py "${common[@]}" --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json \
    --contexts 4096 8192 --budgets 128 256 512 1024 2048 \
    --methods classic dustin-h dustin-h-sparse-draft oracle oracle-layer oracle-kv-head dustin-h-accum \
    dustin-h-kv-head dustin-h-periodic --jobs 10 --out "$R/quality_fidelity_h200.json" \
    2>&1 | tee "$R/quality_fidelity_h200.log" | grep -E "finished|units in" || true
  timeout 60 tail --pid=$tau -f /dev/null || echo "eval_tau still running at the deadline"
  tail -8 "$R/tau_by_method_h200.log"
  tar czf "$OUT/fidelity_h200.tgz" -C "$R" .
  ls -la "$OUT"
  ;;
final)
  # the changed tests on the GPU, and the tau of the fp8 draft cache on the same windows (the +fp8kv headline rows)
  cat "$S"/gguf.? > "$GGUF"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c
  install
  R=~/res; rm -rf "$R"; mkdir -p "$R"
  (cd benchmarks && python3 eval_tau.py --target "$GGUF" --prompts "$S"/test_prompts.npz \
    --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json --draft-kv-cache fp8 \
    --methods classic dustin-h dustin-h-sparse-draft --budgets 512 1024 --contexts 4096 8192 \
    --docs 24 --batch-size 28 --out "$R/tau_by_method_fp8_h200.json" > "$R/tau_by_method_fp8_h200.log" 2>&1) &
  tau=$!
  python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_fidelity_selectors.py tests/test_speculative.py \
    > "$R/gpu_tests.txt" 2>&1 || true
  tail -3 "$R/gpu_tests.txt"
  wait $tau || echo "eval_tau failed: see its log"
  tail -4 "$R/tau_by_method_fp8_h200.log"
  tar czf "$OUT/final_h200.tgz" -C "$R" .
  ;;
e2e)
  install
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_fidelity_selectors.py tests/test_plugins_sparse_verify_attention.py \
    2>&1 | tail -5 > "$OUT/gpu_tests.txt" || true
  cat "$OUT/gpu_tests.txt"
  cd benchmarks
  python3 bench_e2e.py --pair llama-8b --batches 16 --contexts 8192,16384,24576,32768 --budget 512,1024,2048,4096 \
    --methods vanilla,classic,magicdec,dustin-h,dustin-h-sparse-draft,classic+fp8kv,dustin-h+fp8kv --rounds 12 \
    --out "$OUT/e2e_budget_llama-8b_h200.json" 2>&1 | grep -vE "^\{" | tail -20
  ;;
esac

#!/bin/bash
# The H200 serving and engine runs of the default pair (README.md beside this file). Run in the repository root on the
# GPU machine, after these were copied to ~/stash by earlier calls of the same warm session: gguf.0-5 (the SmolLM2 GGUF
# split in 18 MB parts), pyt.0-3 (nvidia-pytriton's wheel, split), the tritonclient, python-rapidjson and numpy 1.26.4
# wheels; the call itself carries .whl/gguf-0.19.0-py3-none-any.whl and .carry/test_prompts.npz.
#   bash benchmarks/results/serving_h200_real/run.sh setup|engines|serve16|serve64
set -euo pipefail
S=~/stash
OUT=${OUT:-/tmp/out}
GGUF=$S/SmolLM2-135M-Instruct.Q4_1.gguf
case "$1" in
setup)
  if [ ! -f "$S/setup.done" ]; then
    cat "$S"/gguf.? > "$GGUF"
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c
    W=$S/nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl
    cat "$S"/pyt.? > "$W"
    echo "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df  $W" | sha256sum -c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" "$W" \
      "$S"/tritonclient-*.whl "$S"/python_rapidjson-*.whl
    # the backend stub's numpy (docs/serving.md): numpy 1.26 in <sys.prefix>/triton-site, read by the model.py shim
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$(python3 -c 'import sys; print(sys.prefix)')/triton-site" "$S"/numpy-1.26.4-*.whl
    touch "$S/setup.done"
  fi
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/gguf-*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e .
  ;;
engines)
  export PYTHONPATH=$S/site
  common=(--model "$GGUF" --draft smollm2-draft --longspark smollm2-longspark
          --dustin-config trtllm_dustin/weights/smollm2_draft/dustin.json --max-batch 16 --max-seq-len 8192
          --device cuda --force)
  t=$SECONDS; trtllm-dustin build --out ~/eng/smollm2-tuned "${common[@]}" --tune; echo "build tuned: $((SECONDS - t)) s"
  t=$SECONDS; trtllm-dustin build --out ~/eng/smollm2-packaged "${common[@]}"; echo "build packaged: $((SECONDS - t)) s"
  cp ~/eng/smollm2-tuned/manifest.json "$OUT/engine_smollm2_manifest.json"
  cp ~/eng/smollm2-tuned/tactics.json "$OUT/engine_smollm2_tactics.json"
  python3 benchmarks/bench_engine_load.py --engine ~/eng/smollm2-tuned --model "$GGUF" --draft smollm2-draft \
    --device cuda --reps 1 --out "$OUT/engine_load_smollm2_h200.json"
  for method in vanilla dustin-h; do
    for engine in smollm2-tuned smollm2-packaged; do
      echo "== $engine $method"
      trtllm-dustin generate --engine ~/eng/$engine --method $method --batch-size 16 --prompt-tokens 4096 \
        --max-new-tokens 256 --raw 2>&1 | grep -E "decode|tau|tactics" || true
    done
  done
  ;;
serve16|serve64)
  export PYTHONPATH=$S/site
  clients=${1#serve}
  cd benchmarks
  python3 bench_serving.py --model "$GGUF" --draft smollm2-draft \
    --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json --methods vanilla classic dustin-h \
    --clients "$clients" --max-batch "$clients" --duration 15 --max-tokens 128 --prompt-tokens 4096 \
    --max-seq-len 8192 --prompts ../.carry/test_prompts.npz --device cuda --out "$OUT/serving_real_$clients.json"
  ;;
esac

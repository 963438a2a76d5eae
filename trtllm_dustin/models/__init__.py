"""Model family: one decoder for Llama 3.x, Qwen2.5 and SmolLM2, its presets and its loaders."""

from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.models.loading import DEFAULT_MODEL, LoadedModel, ModelLoadError, load_model
from trtllm_dustin.models.presets import PRESETS, get_preset

__all__ = ["DEFAULT_MODEL", "PRESETS", "LoadedModel", "ModelLoadError", "QueryCapture", "Transformer", "get_preset",
           "load_model"]

"""Serving: a Triton Inference Server model repository over the runtime's in-flight batcher (docs/serving.md)."""

from trtllm_dustin.serving.config import ServingConfig
from trtllm_dustin.serving.repository import write_model_repository

__all__ = ["ServingConfig", "write_model_repository"]

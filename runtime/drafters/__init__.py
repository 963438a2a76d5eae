"""Drafter implementations (the seam is runtime/drafter.py) and what a model drafter attends to."""

from trtllm_dustin.runtime.drafters.full_cache import FullCacheView
from trtllm_dustin.runtime.drafters.longspark import LongSparkDrafter
from trtllm_dustin.runtime.drafters.model_drafter import DraftView, ModelDrafter
from trtllm_dustin.runtime.drafters.no_draft import NoDraft
from trtllm_dustin.runtime.drafters.streaming_window import StreamingWindowView
from trtllm_dustin.runtime.drafters.verification_set import VerificationSetView

__all__ = ["DraftView", "FullCacheView", "LongSparkDrafter", "ModelDrafter", "NoDraft", "StreamingWindowView",
           "VerificationSetView"]

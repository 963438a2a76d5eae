"""Selector implementations (the seam is runtime/selector.py); the evaluation-only ones are in runtime/experimental/."""

from trtllm_dustin.runtime.selectors.adaptive_share import AdaptiveShare, adaptive_m
from trtllm_dustin.runtime.selectors.dustin import DustinSelector
from trtllm_dustin.runtime.selectors.full import FullVerification
from trtllm_dustin.runtime.selectors.in_pass import InPassSelector, page_bounds, page_key_range
from trtllm_dustin.runtime.selectors.quest import QuestSelector, quest_indices, quest_page_scores
from trtllm_dustin.runtime.selectors.snapkv import SnapKVSelector, snapkv_indices, snapkv_priority, snapkv_scores
from trtllm_dustin.runtime.selectors.streamingllm import StreamingLLMSelector

__all__ = ["AdaptiveShare", "DustinSelector", "FullVerification", "InPassSelector", "QuestSelector", "SnapKVSelector",
           "StreamingLLMSelector", "adaptive_m", "page_bounds", "page_key_range", "quest_indices", "quest_page_scores",
           "snapkv_indices", "snapkv_priority", "snapkv_scores"]

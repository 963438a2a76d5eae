"""A LongSpark draft under pipeline parallelism: what the first stage needs of the target layers the drafter reads.

The LongSpark drafter (runtime/drafters/longspark.py) runs on the first stage, as every drafter does, but it reads
target layers that may live on any stage: their cached K/V (each round's recent window, and the rows it folds into
its summaries) and their hidden states (the boundary state). The first stage reads the layers it holds in its own
cache and keeps a copy of the others' K/V, the mirror [R, B, H_kv, S_max, D] of the R remote layers. Whatever the
later stages write into those layers reaches it, exactly, in one payload that travels the chain of stages:

    prefill   each stage s >= 1: its read layers' K/V rows [0, longest) of the prompts and their last tokens' hidden
              states, added to the payload it received from s - 1 (s >= 2) -> s + 1; the last stage -> the first
    round     each stage s >= 1: its read layers' K/V rows of the verified tokens (L_b .. L_b + Γ) and their hidden
              states, the same way; the last stage sends the payload after the verdict, and the first stage writes
              the rows into the mirror before the drafter observes the verdict

Chaining the payload through the stages, rather than sending each part straight to the first stage, keeps every pair
of ranks sending and receiving in one order: the first stage receives it from the last, in the place where it
receives the verdict. The rows are the ones the verification wrote, so the mirror equals those layers' cache
wherever the drafter reads it, and the pipeline drafts the single-process drafter's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.runtime.pipeline.stage import PipelineStage

__all__ = ["LongSparkRelay"]


class LongSparkRelay:
    """One micro-batch's LongSpark data on one stage: the first stage's mirror and views, a later stage's part of the
    payload. `layers`: the target layers the drafter reads; `owner`: global layer -> the rank that holds it."""

    def __init__(self, layers: Sequence[int], owner: Mapping[int, int], stage: PipelineStage, cache: KVCache,
                 gamma: int, dtype: torch.dtype) -> None:
        self.stage, self.cache, self.dtype = stage, cache, dtype
        self.layers = tuple(layers)
        self.remote = tuple(layer for layer in self.layers if owner[layer] != 0)  # the payload's layers, in order
        self.slot = {layer: j for j, layer in enumerate(self.remote)}  # remote layer -> its index in the payload
        self.owned = tuple(layer for layer in self.layers if stage.owns(layer))
        c, b, device = stage.config, cache.batch_slots, cache.seqlens.device
        self.rows = torch.arange(b, device=device)[:, None]  # [B, 1]
        self.offsets = torch.arange(gamma + 1, device=device)
        # this stage's capture of its read layers' hidden states (global layer keys), filled by every verification
        self.hidden_capture = {layer: torch.zeros(b, gamma + 1, c.hidden_size, dtype=dtype, device=device)
                               for layer in self.owned}
        # the round's payload: K/V rows [R, 2, B, Γ + 1, H_kv, D] and hidden states [R, B, Γ + 1, H]
        self.kv = torch.zeros(len(self.remote), 2, b, gamma + 1, c.num_kv_heads, c.head_dim, dtype=cache.k.dtype,
                              device=device)
        self.hidden = torch.zeros(len(self.remote), b, gamma + 1, c.hidden_size, dtype=dtype, device=device)
        self.mirror = KVCache.allocate(c.with_(num_layers=len(self.remote)), b, cache.max_seq_len, cache.k.dtype,
                                       device) if stage.first and self.remote else None
        # the first stage's Observation: target layer -> the verified tokens' hidden states [B, Γ + 1, H], the
        # buffers the capture and the payload write every round (built once)
        self.verify_hidden = {layer: self.hidden_capture[layer] if stage.owns(layer) else self.hidden[self.slot[layer]]
                              for layer in self.layers} if stage.first else {}

    @property
    def travels(self) -> bool:
        """Whether a payload goes round the stages (some layer read lives past the first stage)."""
        return bool(self.remote)

    # ---- the first stage's view of the layers --------------------------------------------------------------
    def kv_views(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Target layer -> its K, V [B, H_kv, S_max, D]: the first stage's cache or the mirror (the drafter's)."""
        return {layer: self.cache.layer(layer) if self.stage.owns(layer)
                else self.mirror.layer(self.slot[layer]) for layer in self.layers}

    # ---- a round -------------------------------------------------------------------------------------------
    def _verified(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long()[:, None] + self.offsets  # [B, Γ + 1]: where the verification wrote

    def pack_round(self, lengths: torch.Tensor) -> None:
        """A later stage, after its verification: its read layers' new K/V rows and hidden states into the payload."""
        positions = self._verified(lengths)
        for layer in self.owned:
            j, (k, v) = self.slot[layer], self.cache.layer(layer - self.stage.start)
            self.kv[j, 0], self.kv[j, 1] = k[self.rows, :, positions], v[self.rows, :, positions]  # [B, Γ+1, H_kv, D]
            self.hidden[j] = self.hidden_capture[layer]

    def unpack_round(self, lengths: torch.Tensor) -> None:
        """The first stage, with the payload received: the rows into the mirror, where the verification wrote them."""
        positions = self._verified(lengths)
        for j in range(len(self.remote)):
            self.mirror.write(j, self.kv[j, 0], self.kv[j, 1], positions)

    # ---- the prefill ---------------------------------------------------------------------------------------
    def prefill_hidden_out(self, n: int) -> dict[int, torch.Tensor]:
        """The prefill's hidden_out of this stage's read layers: [n, H] each, the last prompt token's."""
        c = self.stage.config
        return {layer: torch.zeros(n, c.hidden_size, dtype=self.dtype, device=self.cache.seqlens.device)
                for layer in self.owned}

    def prefill_payload(self, n: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty K/V rows [R, 2, n, H_kv, longest, D] and hidden states [R, n, H] of n prompts."""
        c, device = self.stage.config, self.cache.seqlens.device
        return (torch.zeros(len(self.remote), 2, n, c.num_kv_heads, longest, c.head_dim, dtype=self.cache.k.dtype,
                            device=device),
                torch.zeros(len(self.remote), n, c.hidden_size, dtype=self.dtype, device=device))

    def pack_prefill(self, kv: torch.Tensor, hidden: torch.Tensor, hidden_out: Mapping[int, torch.Tensor]) -> None:
        """A later stage, after the prompts' prefill: its read layers' rows and last hidden states into the payload."""
        n, longest = kv.shape[2], kv.shape[4]
        for layer in self.owned:
            j, local = self.slot[layer], layer - self.stage.start
            kv[j, 0], kv[j, 1] = self.cache.k[local, :n, :, :longest], self.cache.v[local, :n, :, :longest]
            hidden[j] = hidden_out[layer]

    def unpack_prefill(self, kv: torch.Tensor, hidden: torch.Tensor, hidden_out: Mapping[int, torch.Tensor]
                       ) -> dict[int, torch.Tensor]:
        """The first stage: the rows into the mirror; target layer -> the last prompt tokens' hidden states [n, H]."""
        n, longest = kv.shape[2], kv.shape[4]
        for j in range(len(self.remote)):
            self.mirror.k[j, :n, :, :longest] = kv[j, 0]
            self.mirror.v[j, :n, :, :longest] = kv[j, 1]
        return {layer: hidden_out[layer] if self.stage.owns(layer) else hidden[self.slot[layer]]
                for layer in self.layers}

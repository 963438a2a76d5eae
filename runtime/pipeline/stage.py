"""One pipeline stage of the target: its contiguous decoder layers [start, stop), the embedding on the first stage,
the final norm and the output head on the last (build_engines/engine.py `layer_split` and its per-rank shards).

    first stage   tokens [B, T]       -> embed -> its layers -> hidden [B, T, H]
    middle stage  hidden [B, T, H]    ->          its layers -> hidden [B, T, H]
    last stage    hidden [B, T, H]    ->          its layers -> norm -> head -> fp32 logits [B, T, V] (or [B, V])

The arithmetic is `Transformer.forward`'s (models/decoder.py), the same Block modules in the same order, so a
stage chain reproduces the whole model bit for bit on the module path. On the fused path (CUDA) the residual that
`_forward_fused` would fold into the next layer's norm is added at the stage boundary instead (one add of the
same two values). The stage's KV cache holds only its own layers: the forward indexes it by local layer
(global - start); query captures are asked for and returned by global layer, as the Dustin config names them.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.kv_cache import KVCache, check_fits
from trtllm_dustin.models.decoder import Block, QueryCapture, RMSNorm, Transformer
from trtllm_dustin.models.loading import copy_native
from trtllm_dustin.models.rope import rope_tables
from trtllm_dustin.plugins.fused_ops import FUSED_DTYPES, add_rms_norm
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.skinny_linear import SplitKWorkspace, skinny_linear

__all__ = ["PipelineStage"]


class PipelineStage(nn.Module):
    """Target layers [start, stop) of `config` (the whole model's), as stage `rank` of `pp_size`. Built by `create`
    (fresh modules), `from_model` (a whole model's own) or `load` (an engine shard)."""

    def __init__(self, config: ModelConfig, start: int, stop: int, rank: int, pp_size: int, layers: nn.ModuleList,
                 embed: nn.Embedding | None, norm: RMSNorm | None, lm_head: nn.Linear | None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        if not 0 <= start < stop <= config.num_layers or len(layers) != stop - start:
            raise ConfigError(f"stage layers [{start}, {stop}) are not a range of {config.name}'s "
                              f"{config.num_layers} layers")
        if config.head_vocab_size:
            raise ConfigError(f"{config.name} has a subset output head (head_vocab_size {config.head_vocab_size}); a "
                              "pipeline target must predict the whole vocabulary")
        self.config, self.start, self.stop, self.rank, self.pp_size = config, start, stop, rank, pp_size
        self.first, self.last = rank == 0, rank == pp_size - 1
        # The embedding feeds the first stage; a tied output head on the last stage reads it too.
        if (embed is not None) != (self.first or (self.last and config.tie_word_embeddings)):
            raise ConfigError(f"stage {rank} of {pp_size} holds the embedding exactly when it is the first or the "
                              "last with a tied head")
        if (norm is not None) != self.last or (lm_head is not None) != (self.last and not config.tie_word_embeddings):
            raise ConfigError(f"stage {rank} of {pp_size}: the final norm and head belong to the last stage")
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.head_ids = None  # a target predicts every id (loading.copy_native reads this)
        self.max_positions = max_positions or config.max_position_embeddings
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.kernels = KernelConfig()  # set by the runtime, as Transformer.kernels
        self.linear_workspace: SplitKWorkspace | None = None

    # ---- building -----------------------------------------------------------------------------------------
    @classmethod
    def create(cls, config: ModelConfig, start: int, stop: int, rank: int, pp_size: int,
               max_positions: int | None = None) -> PipelineStage:
        """Fresh modules for the stage's parts (on torch's current default device)."""
        first, last, tied = rank == 0, rank == pp_size - 1, config.tie_word_embeddings
        return cls(config, start, stop, rank, pp_size, nn.ModuleList(Block(config) for _ in range(start, stop)),
                   nn.Embedding(config.vocab_size, config.hidden_size) if first or (last and tied) else None,
                   RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None,
                   nn.Linear(config.hidden_size, config.vocab_size, bias=False) if last and not tied else None,
                   max_positions)

    @classmethod
    def from_model(cls, model: Transformer, start: int, stop: int, rank: int, pp_size: int) -> PipelineStage:
        """The stage over a whole model's own modules (shared, not copied): tests, and a host that has the model."""
        first, last, tied = rank == 0, rank == pp_size - 1, model.config.tie_word_embeddings
        stage = cls(model.config, start, stop, rank, pp_size, nn.ModuleList(model.layers[start:stop]),
                    model.embed if first or (last and tied) else None, model.norm if last else None,
                    model.lm_head if last else None, model.max_positions)
        stage.kernels = model.kernels
        stage.setup_rope()
        return stage

    @classmethod
    def load(cls, config: ModelConfig, start: int, stop: int, rank: int, pp_size: int,
             tensors: Iterator[tuple[str, torch.Tensor]], source: str, device: torch.device | str,
             dtype: torch.dtype) -> PipelineStage:
        """The stage from an engine shard (`layers.<global>.*`, and embed/norm/lm_head where the stage has them,
        under the runtime's own names): only this stage's weights are allocated and read."""
        device = torch.device(device)
        with torch.device("meta"):
            stage = cls.create(config, start, stop, rank, pp_size).to(dtype)
        check_fits(f"weights of {config.name} layers [{start}, {stop})", stage.nbytes, device)
        stage = stage.to_empty(device=device).requires_grad_(False)

        def local_names() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                if name.startswith("layers."):
                    _, index, rest = name.split(".", 2)
                    name = f"layers.{int(index) - start}.{rest}"  # outside [start, stop): copy_native refuses it
                yield name, tensor

        copy_native(stage, local_names(), source)
        stage.setup_rope()
        return stage.eval()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def num_local_layers(self) -> int:
        return self.stop - self.start

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.stop

    def setup_rope(self) -> None:
        device = next(self.parameters()).device
        self.rope_cos, self.rope_sin = rope_tables(self.config, self.max_positions, device=device)

    def allocate_cache(self, batch_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device | str
                       ) -> KVCache:
        """A KV cache of this stage's layers only: [stop - start, B, H_kv, S_max, D]."""
        return KVCache.allocate(self.config.with_(num_layers=self.num_local_layers), batch_slots, max_seq_len, dtype,
                                device)

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                logit_index: torch.Tensor | None = None, capture: QueryCapture | None = None) -> torch.Tensor:
        """x: tokens [B, T] on the first stage, the previous stage's hidden states [B, T, H] elsewhere, at positions
        L_b + t. Returns hidden [B, T, H], or on the last stage fp32 logits [B, T, V] ([B, V] at logit_index [B]).
        capture: queries of global layers; those this stage owns are filled."""
        B, T = x.shape[:2]
        positions = meta.cache_seqlens.long()[:, None] + torch.arange(T, device=x.device)  # [B, T]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, D/2]
        h = self.embed(x) if self.first else x  # [B, T, H]
        local = self._local_capture(capture)
        fused = self.kernels.fused_elementwise
        if fused or (fused is None and h.is_cuda and h.dtype in FUSED_DTYPES):
            h, delta = self._layers_fused(h, cos, sin, positions, cache, meta, backend, local)
        else:
            for j, block in enumerate(self.layers):
                h = h + block.attention(block.attention_norm(h), cos, sin, positions, j, cache, meta, backend, local)
                h = h + block.feed_forward(block.ffn_norm(h))
            delta = None
        if not self.last:
            return h if delta is None else h + delta  # the residual the next stage's first norm would have folded
        if logit_index is not None:
            rows = torch.arange(B, device=h.device), logit_index
            h, delta = h[rows][:, None], (delta[rows][:, None] if delta is not None else None)  # [B, 1, H]
        if delta is None:
            out = F.linear(self.norm(h), self._output_weight())
        else:
            normed, _ = add_rms_norm(h, delta, self.norm.weight, self.norm.eps, pdl=self.kernels.pdl)
            out = skinny_linear(normed, self._output_weight(), kernels=self.kernels)
        logits = out.float()
        return logits[:, 0] if logit_index is not None else logits

    def _layers_fused(self, h, cos, sin, positions, cache, meta, backend, capture
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers as `Transformer._forward_fused` runs them: (residual sum, the last block's pending delta)."""
        kernels, delta = self.kernels, None
        if self.linear_workspace is None or self.linear_workspace.counters.device != h.device:
            self.linear_workspace = SplitKWorkspace.for_outputs(self.config.hidden_size, h.device)
        norm = partial(add_rms_norm, pdl=kernels.pdl)
        for j, block in enumerate(self.layers):
            x, h = norm(h, delta, block.attention_norm.weight, block.attention_norm.eps)
            delta = block.attention.forward_fused(x, cos, sin, positions, j, cache, meta, backend, capture, kernels)
            x, h = norm(h, delta, block.ffn_norm.weight, block.ffn_norm.eps)
            delta = block.feed_forward.forward_fused(x, self.linear_workspace, kernels)
        return h, delta

    def _local_capture(self, capture: QueryCapture | None) -> QueryCapture | None:
        """The capture re-keyed by local layer (the attention modules see local indices), same buffers."""
        if capture is None:
            return None
        queries = {layer - self.start: q for layer, q in capture.queries.items() if self.owns(layer)}
        if capture.hidden:
            raise ConfigError("a pipeline stage keeps no hidden states of its layers (drafters that read them, "
                              "LongSpark, run with --pp-size 1)")
        return QueryCapture(tuple(queries), queries) if queries else None

    def _output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

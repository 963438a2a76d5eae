"""One pipeline stage of the target: a Transformer restricted to its contiguous decoder layers [start, stop), with the
embedding on the first stage, the final norm and the output head on the last (runtime/pipeline/layers.py
`layer_split`, which the engine builder writes its per-rank shards by).

    first stage   tokens [B, T]       -> embed -> its layers -> hidden [B, T, H]
    middle stage  hidden [B, T, H]    ->          its layers -> hidden [B, T, H]
    last stage    hidden [B, T, H]    ->          its layers -> head -> fp32 logits [B, T, V] (or [B, V])

The phases are `Transformer`'s own (models/decoder.py: embed, run_layers, head), over the same Block modules in the
same order, so a stage chain reproduces the whole model bit for bit on the module path. On the fused path (CUDA) the
residual that run_layers leaves pending for the next layer's norm is added at the stage boundary instead (one add of
the same two values). The stage's KV cache holds only its own layers: the forward indexes it by local layer
(global - start); query and hidden-state captures are asked for and returned by global layer, as the Dustin config
and the LongSpark drafter name them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.kv_cache import KVCache, check_fits
from trtllm_dustin.models.decoder import QueryCapture, Transformer
from trtllm_dustin.models.loading import copy_native

__all__ = ["PipelineStage"]


class PipelineStage(Transformer):
    """Target layers [start, stop) of `config` (the whole model's), as stage `rank` of `pp_size`. Built by `create`
    (fresh modules), `from_model` (a whole model's own) or `load` (an engine shard)."""

    def __init__(self, config: ModelConfig, start: int, stop: int, rank: int, pp_size: int,
                 max_positions: int | None = None, shared: Transformer | None = None) -> None:
        """Fresh modules for the stage's parts, or (shared) a whole model's own ones."""
        if not 0 <= start < stop <= config.num_layers:
            raise ConfigError(f"stage layers [{start}, {stop}) are not a range of {config.name}'s "
                              f"{config.num_layers} layers")
        if config.head_vocab_size:
            raise ConfigError(f"{config.name} has a subset output head (head_vocab_size {config.head_vocab_size}); a "
                              "pipeline target must predict the whole vocabulary")
        first, last = rank == 0, rank == pp_size - 1
        embeds = first or (last and config.tie_word_embeddings)  # a tied head on the last stage reads the embedding
        fresh = shared is None
        super().__init__(config, max_positions, layers=range(start, stop) if fresh else range(0),
                         embed=embeds and fresh, head=last and fresh)
        if not fresh:
            self.layers = nn.ModuleList(shared.layers[start:stop])
            self.embed = shared.embed if embeds else None
            self.norm, self.lm_head = (shared.norm, shared.lm_head) if last else (None, None)
        self.start, self.stop, self.rank, self.pp_size = start, stop, rank, pp_size
        self.first, self.last = first, last

    # ---- building -----------------------------------------------------------------------------------------
    @classmethod
    def create(cls, config: ModelConfig, start: int, stop: int, rank: int, pp_size: int,
               max_positions: int | None = None) -> PipelineStage:
        """Fresh modules for the stage's parts (on torch's current default device)."""
        return cls(config, start, stop, rank, pp_size, max_positions)

    @classmethod
    def from_model(cls, model: Transformer, start: int, stop: int, rank: int, pp_size: int) -> PipelineStage:
        """The stage over a whole model's own modules (shared, not copied): tests, and a host that has the model."""
        stage = cls(model.config, start, stop, rank, pp_size, model.max_positions, shared=model)
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
        capture: queries and hidden states of global layers; those this stage owns are filled."""
        h, delta = self.run_layers(self.embed(x) if self.first else x, cache, meta, backend,
                                   capture=self._local_capture(capture))
        if self.last:
            return self.head(h, logit_index, delta)
        return h if delta is None else h + delta  # the residual the next stage's first norm would have folded

    def _local_capture(self, capture: QueryCapture | None) -> QueryCapture | None:
        """The capture re-keyed by local layer (the layers see local indices), the owned layers' only, same
        buffers."""
        if capture is None:
            return None
        queries = {layer - self.start: q for layer, q in capture.queries.items() if self.owns(layer)}
        hidden = {layer - self.start: h for layer, h in capture.hidden.items() if self.owns(layer)}
        return QueryCapture(tuple(queries), queries, hidden) if queries or hidden else None

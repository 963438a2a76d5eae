"""One decoder for the whole family: Llama 3.x, Qwen2/2.5 (qkv bias) and SmolLM2 (tied embeddings), GQA throughout.

q/k/v are one fused projection and gate/up another, so a decode step reads each weight once in one
matmul. Every forward writes its tokens' K/V into the static cache at positions L_b + t and lets the
attention backend read the cache; `cache.seqlens` is advanced by the decode loop, not here.

`Transformer.kernels` (a KernelConfig, plugins/kernel_config.py; default `KernelConfig()`) says which kernel paths a
forward runs. With `kernels.fused_elementwise` (True / False, or None: on for CUDA inputs in bf16 / fp16 / fp32) the
elementwise work between the matmuls runs as three fused kernels (plugins/fused_ops.py): residual add + RMSNorm,
rotary embedding of q/k + the K/V cache write, and SiLU x up. Same arithmetic as the module code (up to a rare
last-ulp flip); about 10 kernels per layer instead of about 50, which is what a CUDA-graph replay of a small batch
pays for. The fused path also runs its projections through plugins/skinny_linear.py, which takes the Triton skinny-M
GEMM for the decode shapes of `kernels`' tactic table and F.linear otherwise, and launches its kernels with PDL when
`kernels.pdl`. Inference only (`forward_train` runs the module code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata, WholeSequenceAttention, WholeSequenceKV
from trtllm_dustin.config import ModelConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.quantize import project
from trtllm_dustin.models.rope import apply_rope, rope_tables
from trtllm_dustin.plugins.fused_ops import FUSED_DTYPES, add_rms_norm, add_rms_norm_ref, rope_qkv_to_cache, silu_mul
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.skinny_linear import SplitKWorkspace, skinny_linear

__all__ = ["QueryCapture", "RMSNorm", "Transformer"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference checkpoints were trained; the one
        # definition is the fused op's reference (the fused path must reproduce it).
        return add_rms_norm_ref(x, None, self.weight, self.eps)[0]


@dataclass
class QueryCapture:
    """Where a forward stores the rotated queries of chosen layers (for SRH scoring, paper Sec. 4.2), and the hidden
    states (block outputs) of chosen layers (LongSpark's boundary state)."""

    layers: tuple[int, ...]  # decoder layers whose queries are kept
    queries: dict[int, torch.Tensor]  # layer -> [B, n, H_q, D] buffer: the last n tokens' queries, copied in place
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, n, H]: the last n tokens' outputs


def _keep_hidden(capture: QueryCapture | None, layer: int, h: torch.Tensor) -> None:
    if capture is not None and layer in capture.hidden:
        buffer = capture.hidden[layer]
        buffer.copy_(h[:, h.shape[1] - buffer.shape[1]:])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                layer_index: int, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                capture: QueryCapture | None) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(B, T, Hq, D), cos, sin)  # [B, T, H_q, D]
        k = apply_rope(k.view(B, T, Hkv, D), cos, sin)  # [B, T, H_kv, D]
        cache.write(layer_index, k, v.view(B, T, Hkv, D), positions)
        return self._attend_project(q, layer_index, cache, meta, backend, capture, self.wo)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      layer_index: int, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                      capture: QueryCapture | None, kernels: KernelConfig) -> torch.Tensor:
        """`forward` with the rotary embedding and the cache write in one kernel."""
        k_cache, v_cache = cache.layer(layer_index)
        q = rope_qkv_to_cache(project(self.wqkv, x, kernels), cos, sin, k_cache, v_cache, positions, self.num_heads,
                              self.num_kv_heads, self.head_dim, pdl=kernels.pdl)  # [B, T, H_q, D]
        return self._attend_project(q, layer_index, cache, meta, backend, capture,
                                    partial(project, self.wo, kernels=kernels))

    def _attend_project(self, q: torch.Tensor, layer_index: int, cache: KVCache, meta: AttentionMetadata,
                        backend: AttentionBackend, capture: QueryCapture | None,
                        output: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Both forwards' tail, once this step's K/V are in the cache: capture q, attend, output projection."""
        B, T, Hq, D = q.shape
        if capture is not None and layer_index in capture.queries:
            buffer = capture.queries[layer_index]  # keeps the queries of the last buffer.shape[1] tokens
            buffer.copy_(q[:, T - buffer.shape[1]:])
        k_cache, v_cache = cache.layer(layer_index)
        if meta.in_pass is not None and layer_index in meta.in_pass.selection_layers:
            meta.in_pass.choose(layer_index, q, k_cache, meta.cache_seqlens)  # the set this and later layers read
        out = backend.attend(q, k_cache, v_cache, meta.for_layer(layer_index))  # [B, T, H_q, D]
        return output(out.reshape(B, T, Hq * D))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.intermediate, dim=-1)
        return self.w_down(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, workspace: SplitKWorkspace, kernels: KernelConfig) -> torch.Tensor:
        # down (long K, few output columns) is where tuned launches split K; the workspace holds their partials
        activation = silu_mul(project(self.w_gate_up, x, kernels), pdl=kernels.pdl)
        return project(self.w_down, activation, kernels, workspace)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)


def scatter_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [..., len(ids)] of a subset head -> [..., vocab_size]: each at its vocabulary id, -inf elsewhere."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, ids, logits)


class Transformer(nn.Module):
    """Decoder-only transformer reading and writing a static KVCache, in three phases:

        embed(tokens)          tokens [B, T] -> hidden [B, T, H] (the nn.Embedding itself)
        run_layers(h, ...)     hidden through decoder layers, each writing its K/V and attending over the cache
        head(h, ...)           final norm and output head -> fp32 logits over the whole vocabulary

    `forward` is their composition. A module may hold only some parts (`layers`, `embed`, `head`): a pipeline stage
    is a Transformer restricted to its layer range (runtime/pipeline/stage.py); a whole model holds all of them.
    """

    def __init__(self, config: ModelConfig, max_positions: int | None = None, layers: range | None = None,
                 embed: bool = True, head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size) if embed else None
        self.layers = nn.ModuleList(Block(config) for _ in (range(config.num_layers) if layers is None else layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if head else None
        rows = config.head_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False) \
            if head and not config.tie_word_embeddings else None
        # Vocabulary ids of the output rows when the model predicts a subset of the vocabulary (a draft's head).
        self.register_buffer("head_ids", torch.arange(config.head_vocab_size) if config.head_vocab_size else None)
        self.max_positions = max_positions or config.max_position_embeddings
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.kernels = KernelConfig()  # which kernel paths forward runs (fused elementwise, skinny GEMM, PDL)
        self.linear_workspace: SplitKWorkspace | None = None  # split-K partials of the fused path's projections

    def setup_rope(self, max_positions: int | None = None) -> None:
        """(Re)build the cos/sin tables on the model's device for positions < max_positions."""
        if max_positions is not None:
            self.max_positions = max_positions
        device = next(self.parameters()).device
        self.rope_cos, self.rope_sin = rope_tables(self.config, self.max_positions, device=device)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                logit_index: torch.Tensor | None = None, capture: QueryCapture | None = None) -> torch.Tensor:
        """tokens [B, T] at positions L_b + t -> logits [B, T, V] (or [B, V] at logit_index [B] when given)."""
        h, delta = self.run_layers(self.embed(tokens), cache, meta, backend, capture=capture)
        return self.head(h, logit_index, delta)

    def fused_for(self, h: torch.Tensor) -> bool:
        """Whether run_layers takes the fused elementwise kernels for hidden states like h (kernels' switch)."""
        fused = self.kernels.fused_elementwise
        # H200: 1.36x per round; float64 models (tests) keep the module code, which the kernels do not cover
        return bool(fused) or (fused is None and h.is_cuda and h.dtype in FUSED_DTYPES)

    def run_layers(self, h: torch.Tensor, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                   layers: Sequence[int] | None = None, capture: QueryCapture | None = None,
                   fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states h [B, T, H] of tokens at positions L_b + t through `layers` (indices into self.layers, in
        order; None: all of them), layer i writing its K/V into the cache's layer i -> (h, delta): the last block's
        output is h + delta. On the module path delta is None; the fused path leaves the last block's delta for the
        next RMSNorm to add (`head`'s, or the caller's add at a stage boundary).

        capture: the queries and hidden states of chosen layers (by the same index). fused: None as `kernels`
        says; False the module code (autograd: training); True the fused kernels."""
        if self.rope_cos is None:
            self.setup_rope()
        T = h.shape[1]
        positions = meta.cache_seqlens.long()[:, None] + torch.arange(T, device=h.device)  # [B, T]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, D/2]
        layers = range(len(self.layers)) if layers is None else layers
        if self.fused_for(h) if fused is None else fused:
            return self._run_layers_fused(h, layers, cos, sin, positions, cache, meta, backend, capture)
        for i in layers:
            block = self.layers[i]
            h = h + block.attention(block.attention_norm(h), cos, sin, positions, i, cache, meta, backend, capture)
            h = h + block.feed_forward(block.ffn_norm(h))
            _keep_hidden(capture, i, h)
        return h, None

    def split_k_workspace(self, device: torch.device) -> SplitKWorkspace:
        """The fused path's split-K partials on `device`, allocated on first use (before a decode loop: drafters that
        run these layers' kernels ask for it at set-up) and kept."""
        if self.linear_workspace is None or self.linear_workspace.counters.device != device:
            self.linear_workspace = SplitKWorkspace.for_outputs(self.config.hidden_size, device)
        return self.linear_workspace

    def _run_layers_fused(self, h, layers, cos, sin, positions, cache, meta, backend, capture
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run_layers` with each residual add folded into the next RMSNorm (kernels.fused_elementwise)."""
        delta, kernels, workspace = None, self.kernels, self.split_k_workspace(h.device)
        norm = partial(add_rms_norm, pdl=kernels.pdl)
        for i in layers:
            block = self.layers[i]
            x, h = norm(h, delta, block.attention_norm.weight, block.attention_norm.eps)  # (normed, sum)
            delta = block.attention.forward_fused(x, cos, sin, positions, i, cache, meta, backend, capture, kernels)
            x, h = norm(h, delta, block.ffn_norm.weight, block.ffn_norm.eps)
            delta = block.feed_forward.forward_fused(x, workspace, kernels)
            if capture is not None and i in capture.hidden:  # the block's output is h + delta (added by the next norm)
                _keep_hidden(capture, i, h + delta)
        return h, delta

    def head_rows(self, h: torch.Tensor, logit_index: torch.Tensor | None = None,
                  delta: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and the output head: hidden h [B, T, H] (plus run_layers' pending delta on the fused path)
        -> the output rows [B, T, R] in the model's dtype ([B, 1, R] at logit_index [B]); any leading dims without
        logit_index. R is the vocabulary, or the head_vocab_size ids of `head_ids` for a subset head."""
        if logit_index is not None:
            rows = torch.arange(h.shape[0], device=h.device), logit_index
            h, delta = h[rows][:, None], (delta[rows][:, None] if delta is not None else None)  # [B, 1, H]
        if delta is None:
            return F.linear(self.norm(h), self.output_weight())
        x, _ = add_rms_norm(h, delta, self.norm.weight, self.norm.eps, pdl=self.kernels.pdl)
        return skinny_linear(x, self.output_weight(), kernels=self.kernels)

    def head(self, h: torch.Tensor, logit_index: torch.Tensor | None = None,
             delta: torch.Tensor | None = None) -> torch.Tensor:
        """`head_rows` -> fp32 logits over the whole vocabulary ([B, V] when logit_index picked one row per
        sequence)."""
        logits = self.full_vocab(self.head_rows(h, logit_index, delta).float())
        return logits[:, 0] if logit_index is not None else logits

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the output rows -> over the whole vocabulary (-inf for ids outside a subset head)."""
        return logits if self.head_ids is None else scatter_vocab(logits, self.head_ids, self.config.vocab_size)

    def forward_train(self, tokens: torch.Tensor, capture: QueryCapture | None = None) -> torch.Tensor:
        """Causal forward over whole sequences (positions 0..T-1) without a static cache, with autograd: tokens
        [B, T] -> the output rows [B, T, R] (no -inf padding for a subset head: see `head_rows`).

        The inference phases on the module path, over a WholeSequenceKV (each layer's K/V as computed) and
        WholeSequenceAttention (attention/whole_sequence.py): for training (draft distillation) and the features a
        trainer reads (capture: queries and hidden states of chosen layers; `run_whole` also gives the K/V)."""
        h, _ = self.run_whole(tokens, capture)
        return self.head_rows(h)

    def run_whole(self, tokens: torch.Tensor, capture: QueryCapture | None = None
                  ) -> tuple[torch.Tensor, WholeSequenceKV]:
        """`forward_train`'s layers: tokens [B, T] -> (the last block's output [B, T, H], before the final norm;
        the layers' K/V, [B, H_kv, T, D] each)."""
        kv = WholeSequenceKV(tokens.shape[0], tokens.device)
        h, _ = self.run_layers(self.embed(tokens), kv, AttentionMetadata(cache_seqlens=kv.seqlens),
                               WholeSequenceAttention(), capture=capture, fused=False)
        return h, kv

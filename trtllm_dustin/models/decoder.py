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
`kernels.pdl`. Inference only (`forward_train` keeps the module code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dustin.attention import AttentionBackend, AttentionMetadata
from trtllm_dustin.config import ModelConfig
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models.rope import apply_rope, rope_tables
from trtllm_dustin.plugins.fused_ops import FUSED_DTYPES, add_rms_norm, add_rms_norm_ref, rope_qkv_to_cache, silu_mul
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.skinny_linear import SplitKWorkspace, skinny_linear

__all__ = ["QueryCapture", "RMSNorm", "Transformer"]


def _skinny(layer: nn.Linear, kernels: KernelConfig, x: torch.Tensor) -> torch.Tensor:
    """A projection on the fused path: decode-sized inputs take the skinny-M Triton GEMM (plugins/skinny_linear.py)
    where `kernels`' tactic table has their shape, launched with PDL where kernels allow it."""
    return skinny_linear(x, layer.weight, layer.bias, kernels=kernels)


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
        q = rope_qkv_to_cache(_skinny(self.wqkv, kernels, x), cos, sin, k_cache, v_cache, positions, self.num_heads,
                              self.num_kv_heads, self.head_dim, pdl=kernels.pdl)  # [B, T, H_q, D]
        return self._attend_project(q, layer_index, cache, meta, backend, capture,
                                    partial(_skinny, self.wo, kernels))

    def _attend_project(self, q: torch.Tensor, layer_index: int, cache: KVCache, meta: AttentionMetadata,
                        backend: AttentionBackend, capture: QueryCapture | None,
                        project: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Both forwards' tail, once this step's K/V are in the cache: capture q, attend, output projection."""
        B, T, Hq, D = q.shape
        if capture is not None and layer_index in capture.queries:
            buffer = capture.queries[layer_index]  # keeps the queries of the last buffer.shape[1] tokens
            buffer.copy_(q[:, T - buffer.shape[1]:])
        k_cache, v_cache = cache.layer(layer_index)
        if meta.in_pass is not None and layer_index in meta.in_pass.selection_layers:
            meta.in_pass.choose(layer_index, q, k_cache, meta.cache_seqlens)  # the set this and later layers read
        out = backend.attend(q, k_cache, v_cache, meta.for_layer(layer_index))  # [B, T, H_q, D]
        return project(out.reshape(B, T, Hq * D))


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
        activation = silu_mul(_skinny(self.w_gate_up, kernels, x), pdl=kernels.pdl)
        return skinny_linear(activation, self.w_down.weight, None, workspace, kernels=kernels)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)


class Transformer(nn.Module):
    """Decoder-only transformer reading and writing a static KVCache."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rows = config.head_vocab_size or config.vocab_size
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
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
        self.rope_cos, self.rope_sin = rope_tables(self.config, self.max_positions, device=self.embed.weight.device)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                logit_index: torch.Tensor | None = None, capture: QueryCapture | None = None) -> torch.Tensor:
        """tokens [B, T] at positions L_b + t -> logits [B, T, V] (or [B, V] at logit_index [B] when given)."""
        if self.rope_cos is None:
            self.setup_rope()
        B, T = tokens.shape
        positions = meta.cache_seqlens.long()[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, D/2]
        h = self.embed(tokens)  # [B, T, hidden]
        fused = self.kernels.fused_elementwise
        if fused or (fused is None and h.is_cuda and h.dtype in FUSED_DTYPES):
            # H200: 1.36x per round; float64 models (tests) keep the module code, which the kernels do not cover
            return self._forward_fused(h, cos, sin, positions, cache, meta, backend, logit_index, capture)
        for i, block in enumerate(self.layers):
            h = h + block.attention(block.attention_norm(h), cos, sin, positions, i, cache, meta, backend, capture)
            h = h + block.feed_forward(block.ffn_norm(h))
            _keep_hidden(capture, i, h)
        if logit_index is not None:
            h = h[torch.arange(B, device=h.device), logit_index][:, None]  # [B, 1, hidden]
        return self._logits(F.linear(self.norm(h), self.output_weight()), logit_index)

    def _forward_fused(self, h, cos, sin, positions, cache, meta, backend, logit_index, capture) -> torch.Tensor:
        """`forward`'s layers with each residual add folded into the next RMSNorm (kernels.fused_elementwise)."""
        B, delta, kernels = h.shape[0], None, self.kernels
        if self.linear_workspace is None or self.linear_workspace.counters.device != h.device:
            self.linear_workspace = SplitKWorkspace.for_outputs(self.config.hidden_size, h.device)
        norm = partial(add_rms_norm, pdl=kernels.pdl)
        for i, block in enumerate(self.layers):
            x, h = norm(h, delta, block.attention_norm.weight, block.attention_norm.eps)  # (normed, sum)
            delta = block.attention.forward_fused(x, cos, sin, positions, i, cache, meta, backend, capture, kernels)
            x, h = norm(h, delta, block.ffn_norm.weight, block.ffn_norm.eps)
            delta = block.feed_forward.forward_fused(x, self.linear_workspace, kernels)
            if capture is not None and i in capture.hidden:  # the block's output is h + delta (added by the next norm)
                _keep_hidden(capture, i, h + delta)
        if logit_index is not None:
            rows = torch.arange(B, device=h.device), logit_index
            x, _ = norm(h[rows][:, None], delta[rows][:, None], self.norm.weight, self.norm.eps)
        else:
            x, _ = norm(h, delta, self.norm.weight, self.norm.eps)
        return self._logits(skinny_linear(x, self.output_weight(), kernels=kernels), logit_index)

    def _logits(self, head_out: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
        """The output head's rows [B, T or 1, R] -> fp32 logits over the whole vocabulary ([B, V] when logit_index
        picked one row per sequence)."""
        logits = self.full_vocab(head_out.float())
        return logits[:, 0] if logit_index is not None else logits

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the output rows -> over the whole vocabulary (-inf for ids outside a subset head)."""
        if self.head_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_ids, logits)

    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """Causal forward over whole sequences without a cache, with autograd: tokens [B, T] -> logits [B, T, R].

        For training (draft distillation); the same modules as `forward`, positions 0..T-1. R is the output rows:
        the vocabulary, or the head_vocab_size ids of `head_ids` for a subset head (no -inf padding here).
        """
        if self.rope_cos is None:
            self.setup_rope()
        B, T = tokens.shape
        cos, sin = self.rope_cos[:T][None].expand(B, -1, -1), self.rope_sin[:T][None].expand(B, -1, -1)
        h = self.embed(tokens)
        for block in self.layers:
            attn = block.attention
            Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
            q, k, v = attn.wqkv(block.attention_norm(h)).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_rope(q.view(B, T, Hq, D), cos, sin).transpose(1, 2)  # [B, H_q, T, D]
            k = apply_rope(k.view(B, T, Hkv, D), cos, sin).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
            h = h + attn.wo(out.transpose(1, 2).reshape(B, T, Hq * D))
            h = h + block.feed_forward(block.ffn_norm(h))
        return F.linear(self.norm(h), self.output_weight())

"""The real long pair's target (Qwen2.5-Coder-1.5B-Instruct, fetched with `trtllm-dustin fetch-model`) at 30K
tokens on the GPU: our loader and runtime (bf16, the Triton prefill and verification kernels) against a plain PyTorch
float32 forward written here from the file's dequantized tensors (RMSNorm, q/k/v with bias, rotary embedding at
theta 1e6, grouped-query attention, SwiGLU, an untied output head).

Teacher-forced over 32 positions after a 30,000-token prompt of real text: the top-1 next token must agree at
>= 30 of 32 positions and the logits within the tolerances below (bf16 weights, activations and KV cache over 28
layers against float32 everything). Skipped without CUDA or without the fetched model; the numbers are written to
$LONG_PAIR_REPORT when set.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from helpers.models import fetched

from trtllm_dustin.fetch import fetched_path

PROMPT, FORCED = 30_000, 32
MEAN_ABS_TOL = 0.25  # mean |logit difference| over the 32 positions x vocabulary
TOP1_MIN = 30  # of 32 teacher-forced positions


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(fetched("qwen2.5-coder-1.5b") is None,
                                 reason="needs `trtllm-dustin fetch-model qwen2.5-coder-1.5b`")]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (Hugging Face's layout): x [H, T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@torch.no_grad()
def reference_logits(t: dict[str, torch.Tensor], c, tokens: torch.Tensor, last: int) -> torch.Tensor:
    """float32 logits [last, V] of the last `last` positions of tokens [T], attention in query chunks."""
    T, H, Hkv, D = tokens.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    positions = torch.arange(T, device=tokens.device, dtype=torch.float64)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, device=tokens.device, dtype=torch.float64) / D))
    angles = torch.outer(positions, inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    h = t["model.embed_tokens.weight"][tokens]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (x @ t[p + "self_attn.q_proj.weight"].T + t[p + "self_attn.q_proj.bias"]).view(T, H, D).transpose(0, 1)
        k = (x @ t[p + "self_attn.k_proj.weight"].T + t[p + "self_attn.k_proj.bias"]).view(T, Hkv, D).transpose(0, 1)
        v = (x @ t[p + "self_attn.v_proj.weight"].T + t[p + "self_attn.v_proj.bias"]).view(T, Hkv, D).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        out = torch.empty_like(q)
        for s in range(0, T, 2048):  # [H, chunk, T] scores at a time
            e = min(T, s + 2048)
            scores = q[:, s:e] @ k[:, :e].transpose(1, 2) / D ** 0.5
            mask = torch.arange(e, device=tokens.device)[None, :] > torch.arange(s, e, device=tokens.device)[:, None]
            out[:, s:e] = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v[:, :e]
        h = h + out.transpose(0, 1).reshape(T, H * D) @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(h[-last:], t["model.norm.weight"], c.rms_norm_eps) @ t["lm_head.weight"].T


def long_prompt(tokenizer, n: int) -> list[int]:
    """n tokens of real text: the test split's books, the code corpus where they run short."""
    from trtllm_dustin.data import as_encoder, final_report_documents

    encode = as_encoder(tokenizer)
    tokens: list[int] = []
    for source in ("shakespeare", "cpython_stdlib"):
        for doc in final_report_documents([source]):
            tokens.extend(encode(doc.text))
            if len(tokens) >= n:
                return tokens[:n]
    raise AssertionError(f"the corpora hold fewer than {n} tokens")


def prompt_tokens(tokenizer) -> list[int]:
    path = os.environ.get("LONG_PAIR_PROMPTS")  # a prompts file from eval_tau.py --save-prompts (no corpora there)
    if path:
        import numpy as np

        data = np.load(path)
        tokens = [int(x) for k in sorted(k for k in data.files if k.startswith("books/")) for x in data[k]]
        return tokens[:PROMPT + FORCED]
    return long_prompt(tokenizer, PROMPT + FORCED)


@torch.no_grad()
def compare(device: torch.device, dtype: torch.dtype, prompt: int, forced: int = FORCED) -> dict:
    """Our model (in `dtype` on `device`, its runtime's prefill and chunk forward) against `reference_logits` over
    `forced` teacher-forced positions after `prompt` tokens: the agreement numbers."""
    from trtllm_dustin.attention import AttentionMetadata
    from trtllm_dustin.kv_cache import KVCache
    from trtllm_dustin.models.gguf import GGUFFile
    from trtllm_dustin.models.gguf_model import hf_tensors
    from trtllm_dustin.models.loading import open_model
    from trtllm_dustin.runtime.build import attention_backend
    from trtllm_dustin.runtime.prefill import prefill

    checkpoint = open_model("qwen2.5-coder-1.5b")
    c = checkpoint.config
    assert (c.rope_theta, c.max_position_embeddings, c.qkv_bias, c.tie_word_embeddings) == (1e6, 32768, True, False)
    tokens = prompt_tokens(checkpoint.tokenizer)[:prompt + forced]
    assert len(tokens) == prompt + forced
    ids = torch.tensor(tokens, device=device)

    tensors = {name: t.to(device) for name, t in hf_tensors(GGUFFile.open(fetched_path("qwen2.5-coder-1.5b")), c)}
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = reference_logits(tensors, c, ids[:-1], forced)  # positions prompt - 1 .. prompt + forced - 2
    del tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = checkpoint.load(device, dtype, prompt + forced + 8).model
    backend = attention_backend(device)
    cache = KVCache.allocate(c, 1, prompt + forced + 8, dtype, device)
    first, _ = prefill(model, cache, backend, [tokens[:prompt]])
    chunk = ids[prompt: prompt + forced - 1][None]
    meta = AttentionMetadata(cache_seqlens=cache.seqlens, max_kv_len=prompt + forced,
                             query_lens=torch.tensor([forced - 1], dtype=torch.int32, device=device))
    rest = model(chunk, cache, meta, backend)[0]
    ours = torch.cat([first, rest]).float()  # [forced, V]: the prompt's last token, then the teacher-forced ones
    diff = (ours - reference).abs()
    top1 = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    return {"prompt_tokens": prompt, "forced": forced, "top1_agree": top1, "mean_abs_diff": float(diff.mean()),
            "max_abs_diff": float(diff.max()), "reference_logit_std": float(reference.std()),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "tolerances": {"mean_abs": MEAN_ABS_TOL, "top1_min": TOP1_MIN}}


def test_real_target_at_30k_tokens_matches_a_float32_reference() -> None:
    report = compare(torch.device("cuda"), torch.bfloat16, PROMPT)
    if os.environ.get("LONG_PAIR_REPORT"):
        with open(os.environ["LONG_PAIR_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    print(report)
    assert report["top1_agree"] >= TOP1_MIN, report
    assert report["mean_abs_diff"] <= MEAN_ABS_TOL, report

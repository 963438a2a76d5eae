"""The decoder with fused elementwise kernels (Transformer.kernels.fused_elementwise) against its module code: logits,
the K/V written to the cache, captured queries, the logit_index path, and whole greedy generations.

CPU: the fused kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU the same tests use CUDA tensors.
"""

import pytest
import torch
from helpers.kernels import DEVICE, needs_kernel

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.decoder import QueryCapture
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import MethodSetup

pytestmark = needs_kernel
BACKEND = "triton" if DEVICE == "cuda" else "reference"


def forward(model, fused: bool, tokens, lens, logit_index=None):
    model.kernels = KernelConfig(fused_elementwise=fused)
    cache = KVCache.allocate(model.config, tokens.shape[0], 64, torch.float32, DEVICE)
    torch.manual_seed(0)
    cache.k.normal_()  # earlier context: whatever is there, both paths must leave it alone and read it the same
    cache.v.normal_()
    cache.seqlens.copy_(lens)
    capture = QueryCapture(layers=(1,), queries={1: torch.full((tokens.shape[0], 2, model.config.num_heads,
                                                                 model.config.head_dim), float("nan"), device=DEVICE)})
    with torch.inference_mode():
        logits = model(tokens, cache, AttentionMetadata(cache_seqlens=cache.seqlens), get_backend(BACKEND),
                       logit_index=logit_index, capture=capture)
    model.kernels = KernelConfig(fused_elementwise=False)
    return logits, cache, capture.queries[1]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen"])
@pytest.mark.parametrize("with_index", [False, True])
def test_fused_forward_equals_the_module_code(preset: str, with_index: bool) -> None:
    model = load_model(f"preset:{preset}", device=DEVICE, dtype=torch.float32, seed=3).model
    lens = torch.tensor([5, 17, 0], dtype=torch.int32, device=DEVICE)
    tokens = torch.randint(0, model.config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    index = torch.tensor([2, 0, 1], device=DEVICE) if with_index else None
    ref_logits, ref_cache, ref_q = forward(model, False, tokens, lens, index)
    logits, cache, q = forward(model, True, tokens, lens, index)
    assert logits.shape == ref_logits.shape == ((3, model.config.vocab_size) if with_index else (3, 3,
                                                                                              model.config.vocab_size))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.k, ref_cache.k, rtol=1e-5, atol=1e-5)  # new K/V at L_b + t, the rest untouched
    torch.testing.assert_close(cache.v, ref_cache.v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
    seeded = KVCache.allocate(model.config, 3, 64, torch.float32, DEVICE)
    torch.manual_seed(0)
    seeded.k.normal_()
    written = torch.zeros(64, 3, dtype=torch.bool)  # [S, B]: positions L_b .. L_b + 2
    for b, n in enumerate(lens.tolist()):
        written[n: n + 3, b] = True
    changed = (cache.k != seeded.k).any(-1).any(2).any(0).T.cpu()  # [layers, B, H, S, D] -> [S, B]
    assert torch.equal(changed, written)


def test_fused_greedy_generation_equals_the_module_code() -> None:
    """Dustin-H end to end (draft, SRH scoring on captured queries, sparse verify) gives the same tokens."""
    from helpers.speculative import dustin_config

    target = load_model("preset:tiny-llama", device=DEVICE, dtype=torch.float32, seed=7).model
    draft = load_model("preset:tiny-llama-draft", device=DEVICE, dtype=torch.float32, seed=8).model
    prompts = [list(range(5, 45)), [9, 8, 7], [200 + i % 13 for i in range(30)]]
    runs = []
    for fused in (False, True):
        kernels = KernelConfig(fused_elementwise=fused)  # build_decoder gives it to both models
        setup = MethodSetup(target=target, target_cache=KVCache.allocate(target.config, 3, 96, torch.float32, DEVICE),
                            backend=get_backend(BACKEND, kernels), draft=draft,
                            draft_cache=KVCache.allocate(draft.config, 3, 96, torch.float32, DEVICE), gamma=3,
                            dustin=dustin_config(budget=24, m=4, n_recent=8), kernels=kernels)
        runs.append(build_decoder("dustin-h", setup).generate(prompts, GenerationConfig(max_new_tokens=12,
                                                                                        prefill_chunk=16)))
    target.kernels = draft.kernels = KernelConfig(fused_elementwise=False)
    assert runs[1].tokens == runs[0].tokens and all(len(t) == 12 for t in runs[0].tokens)
    assert runs[1].committed_hist == runs[0].committed_hist


def test_fused_default_is_on_for_cuda_inputs_and_ignores_the_environment(monkeypatch) -> None:
    """The default KernelConfig's None: fused for CUDA inputs, the module code for CPU ones. The model reads no
    environment variable (KernelConfig.from_env does, where an entry point asks for it)."""
    monkeypatch.setenv("TRTLLM_DUSTIN_FUSED_ELEMENTWISE", "1")
    model = load_model("preset:tiny-llama", device="cpu", seed=0).model
    assert model.kernels == KernelConfig() and model.kernels.fused_elementwise is None

    def no_fused(*args, **kwargs):
        raise AssertionError("the fused path ran for CPU inputs with fused_elementwise=None")

    monkeypatch.setattr(model, "_run_layers_fused", no_fused)
    tokens, lens = torch.tensor([[5, 6]]), torch.tensor([3], dtype=torch.int32)
    cache = KVCache.allocate(model.config, 1, 16, torch.float32, "cpu")
    cache.seqlens.copy_(lens)
    with torch.inference_mode():
        logits = model(tokens, cache, AttentionMetadata(cache_seqlens=cache.seqlens), get_backend("reference"))
    assert logits.shape == (1, 2, model.config.vocab_size) and torch.isfinite(logits).all()

"""trtllm_dustin/models/quantize.py: weight-only int8 rows against the weights they stand for, Int8Linear and
`project` against a float64 product with the dequantized weight, and a decoder whose layers are int8 on the fused
path (the skinny kernel reading int8, under TRITON_INTERPRET=1 on the CPU) against its module code.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.kernels import DEVICE, needs_kernel

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.quantize import (
    INT8_WIDE_ROWS,
    Int8Linear,
    check_drafter_weights,
    project,
    quantize_int8,
    quantize_linears,
    quantize_rows,
)
from trtllm_dustin.plugins.kernel_config import KernelConfig


def test_rows_round_to_the_nearest_step_and_keep_their_peak() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=gen) * torch.logspace(-3, 1, 24)[:, None]
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # the nearest of the row's steps
    peak = w.abs().argmax(dim=1)
    rows = torch.arange(24)
    assert (q[rows[rows != 5], peak[rows != 5]].abs() == 127).all()  # each row's largest weight is a full step
    assert torch.equal(q[5], torch.zeros(40, dtype=torch.int8)) and scale[5] == 1.0
    assert q.min() >= -127  # symmetric: -128 is never used


def test_int8_linear_is_the_product_with_the_weight_it_stands_for() -> None:
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(48, 20, bias=True).double()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(20, 48, generator=gen, dtype=torch.float64))
    int8 = quantize_int8(linear)
    x = torch.randn(3, 5, 48, generator=gen, dtype=torch.float64)
    expected = F.linear(x, int8.weight.double() * int8.scale.double()[:, None], linear.bias)
    torch.testing.assert_close(int8(x), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(int8.bias, linear.bias) and int8.bias.data_ptr() != linear.bias.data_ptr()
    moved = int8.to(torch.bfloat16)  # a dtype move keeps the int8 weight int8
    assert moved.weight.dtype == torch.int8 and moved.scale.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="int8 weight"):
        Int8Linear(linear.weight.detach(), torch.ones(20), None)


def test_quantize_linears_replaces_every_projection_below_a_module() -> None:
    model = load_model("preset:tiny-qwen", dtype=torch.float32, seed=3).model  # Qwen: its qkv has a bias
    layer = model.layers[0]
    before = {name: m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert quantize_linears(layer) == len(before) == 4
    after = dict(layer.named_modules())
    for name, linear in before.items():
        assert isinstance(after[name], Int8Linear)
        assert (after[name].bias is None) == (linear.bias is None)
    assert any(after[name].bias is not None for name in before)
    assert isinstance(model.layers[1].attention.wqkv, torch.nn.Linear)  # other layers untouched


def test_bad_kinds_name_the_choices() -> None:
    assert check_drafter_weights("int8") == "int8"
    with pytest.raises(ConfigError, match="'fp4': choose one of model, int8"):
        check_drafter_weights("fp4")


@needs_kernel
def test_project_runs_the_kernel_on_int8_and_on_model_weights() -> None:
    """bf16 rows: an Int8Linear takes the skinny kernel (no table entry needed), an nn.Linear whose shape is not in the
    table takes F.linear; both equal their float64 products within the output's rounding."""
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) / 10)
    linear = linear.to(DEVICE, torch.bfloat16)
    int8 = quantize_int8(linear).to(DEVICE)
    x = torch.randn(2, 3, 96, generator=gen).to(DEVICE, torch.bfloat16)
    kernels = KernelConfig()
    for layer, weight in ((int8, int8.dequantized()), (linear, linear.weight.float())):
        got = project(layer, x, kernels)
        ref = F.linear(x.double(), weight.double())
        assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 40)
        assert ((got.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2 * ref.abs().max()).all()


@needs_kernel
def test_calls_of_many_rows_take_the_wide_copy_and_calls_of_few_the_int8_kernel() -> None:
    """keep_wide: the dequantized weight in the model's dtype; `project` takes cuBLAS on it for more than
    INT8_WIDE_ROWS rows with KernelConfig.int8_wide on, and the int8 kernel for fewer rows, with the switch off or
    without a copy. The copy is then marked (doubled) so that only a call that reads it can match."""
    gen = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) / 10)
        linear.bias.copy_(torch.randn(40, generator=gen))
    linear = linear.to(DEVICE, torch.bfloat16)
    int8, plain = quantize_int8(linear).to(DEVICE), quantize_int8(linear).to(DEVICE)
    assert int8.wide is None
    assert int8.keep_wide(torch.bfloat16) is int8 and plain.wide is None
    assert int8.wide.dtype == torch.bfloat16 and torch.equal(int8.wide, int8.dequantized().to(torch.bfloat16))
    assert "wide" not in int8.state_dict()  # derived from the int8 weight: never saved
    many = torch.randn(2, INT8_WIDE_ROWS // 2 + 1, 96, generator=gen).to(DEVICE, torch.bfloat16)  # 66 rows
    few = many[:, : INT8_WIDE_ROWS // 2]  # 64 rows
    on, off = KernelConfig(int8_wide=True), KernelConfig()  # off by default
    ref = F.linear(many.double(), int8.dequantized().double(), linear.bias.double())
    for got in (project(int8, many, on), project(int8, many, off)):
        assert got.shape == (2, INT8_WIDE_ROWS // 2 + 1, 40) and got.dtype == torch.bfloat16
        assert ((got.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2 * ref.abs().max()).all()
    int8.wide = int8.wide * 2  # the mark
    assert torch.equal(project(int8, many, on), F.linear(many, int8.wide, int8.bias))
    assert torch.equal(project(int8, many, off), project(plain, many, on))  # off: the int8 kernel
    assert torch.equal(project(int8, few, on), project(plain, few, on))  # few rows: the int8 kernel
    with pytest.raises(ValueError, match="keep_wide takes a float dtype"):
        int8.keep_wide(torch.int8)


@needs_kernel
def test_a_decoder_with_int8_layers_runs_the_fused_path_as_its_module_code(monkeypatch) -> None:
    """A tiny Llama in bf16 with every layer's projections in int8 (a draft model served that way): the fused path's
    logits (the skinny kernel reading int8: four launches per layer) equal the module code's (the widened copy)
    within bf16 rounding, and both stay near the unquantized model's."""
    import trtllm_dustin.plugins.skinny_linear as skinny

    launched, real = [], skinny.skinny_linear_forward
    monkeypatch.setattr(skinny, "skinny_linear_forward",
                        lambda *a, **k: launched.append(a[1].dtype) or real(*a, **k))
    model = load_model("preset:tiny-llama", device=DEVICE, dtype=torch.bfloat16, seed=3).model
    tokens = torch.randint(0, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    lens = torch.tensor([5, 11], dtype=torch.int32, device=DEVICE)

    def logits(fused: bool) -> torch.Tensor:
        model.kernels = KernelConfig(fused_elementwise=fused)
        cache = KVCache.allocate(model.config, 2, 32, torch.bfloat16, DEVICE)
        torch.manual_seed(0)
        cache.k.normal_()
        cache.v.normal_()
        cache.seqlens.copy_(lens)
        with torch.inference_mode():
            out = model(tokens, cache, AttentionMetadata(cache_seqlens=cache.seqlens), get_backend("reference"))
        model.kernels = KernelConfig()
        return out.float()

    plain = logits(False)
    for layer in model.layers:
        quantize_linears(layer)
    module = logits(False)
    assert not launched
    fused = logits(True)
    assert launched == [torch.int8] * 4 * len(model.layers)
    scale = module.abs().max()
    assert (fused - module).abs().max() < 0.03 * scale
    assert 0 < (module - plain).abs().max() < 0.1 * scale


def test_quantize_draft_rounds_the_layers_and_leaves_embedding_and_head() -> None:
    from trtllm_dustin.models.quantize import quantize_draft

    model = load_model("preset:tiny-llama", dtype=torch.float32, seed=3).model
    assert quantize_draft(model, "model") is model
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    embed = model.embed.weight.clone()
    quantize_draft(model, "int8")
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * len(model.layers)
    assert not any(isinstance(m, torch.nn.Linear) for layer in model.layers for m in layer.modules())
    assert torch.equal(model.embed.weight, embed) and model.output_weight().dtype == torch.float32
    with pytest.raises(ConfigError, match="choose one of model, int8"):
        quantize_draft(model, "int4")

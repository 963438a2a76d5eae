"""The GGUF loader on what the long pair (Qwen2.5-Coder 1.5B + 0.5B) stores: Q4_K, Q5_0, Q6_K and Q8_0 tensors, qkv
biases, untied output heads, rotary theta 1e6 at 32768 positions, the chat template from the file.

On tiny files written here (CI): our reader against gguf-py's GGUFReader + dequantize for every type, and for Q8_0
and Q5_0 against a block decoder written below from ggml's layout, so the two readers are checked against something
that is neither; the rotary tables against transformers' Qwen2 implementation at 32768 positions. On the real files
(only where `trtllm-dustin fetch-model` has put them; CI never downloads them): every tensor type against gguf-py,
the shapes, the template and the shared tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers.models import fetched

from trtllm_dustin.models.gguf import GGUFFile

TYPES = (Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0)
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_0: (0,), Q.Q6_K: (208,), Q.Q8_0: (0,)}  # byte offsets of a block's f16 scales


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes as `rows` rows of `qtype` blocks, every f16 scale a finite value (random bytes can be NaN)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        data[..., offset: offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def decode_q8_0(raw: np.ndarray) -> np.ndarray:
    """ggml block_q8_0: f16 d, 32 x int8 q; x = d * q."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)


def decode_q5_0(raw: np.ndarray) -> np.ndarray:
    """ggml block_q5_0: f16 d, u32 qh (the fifth bits), 16 bytes of nibbles; element j < 16 is the low nibble of byte j
    with bit j of qh, element j + 16 the high nibble with bit j + 16; x = d * (q - 16)."""
    blocks = raw.reshape(-1, 22)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    qh = blocks[:, 2:6].copy().view(np.uint32)[:, 0]
    qs = blocks[:, 6:].astype(np.uint32)
    j = np.arange(16, dtype=np.uint32)
    low = (qs & 0xF) | (((qh[:, None] >> j) & 1) << 4)
    high = (qs >> 4) | (((qh[:, None] >> (j + 16)) & 1) << 4)
    q = np.concatenate([low, high], axis=1).astype(np.float32) - 16
    return (d * q).reshape(raw.shape[0], -1)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A GGUF of one tensor per type (and odd row counts), written with gguf.GGUFWriter; returns its raw blocks."""
    path = tmp_path_factory.mktemp("quant") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    rng = np.random.default_rng(7)
    raw = {}
    for i, qtype in enumerate(TYPES):
        rows, cols = (3, 7, 5, 11)[i], 512
        raw[f"t.{qtype.name}"] = random_blocks(qtype, rows, cols, rng)
        writer.add_tensor(f"t.{qtype.name}", raw[f"t.{qtype.name}"], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, raw


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_each_type_equals_gguf_reader(quantized, qtype: Q) -> None:
    path, raw = quantized
    name = f"t.{qtype.name}"
    ours = GGUFFile.open(path).tensor(name)
    info = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    reference = gguf.quants.dequantize(np.asarray(info.data), qtype).reshape(ours.shape)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (raw[name].shape[0], 512)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, torch.from_numpy(np.array(reference, dtype=np.float32)), rtol=0,
                               atol=0)


@pytest.mark.parametrize("qtype, decode", [(Q.Q8_0, decode_q8_0), (Q.Q5_0, decode_q5_0)], ids=["Q8_0", "Q5_0"])
def test_simple_types_equal_a_block_decoder_written_from_the_layout(quantized, qtype: Q, decode) -> None:
    path, raw = quantized
    ours = GGUFFile.open(path).tensor(f"t.{qtype.name}")
    torch.testing.assert_close(ours, torch.from_numpy(decode(raw[f"t.{qtype.name}"])), rtol=0, atol=0)


def test_q5_0_and_q8_0_round_trip_within_their_step() -> None:
    """Quantized by gguf-py and decoded by the layout decoder: each element within one quantization step (the scale
    is the block's largest magnitude over the level count, stored in f16; the far end of the range may clip)."""
    x = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    for qtype, decode, levels in ((Q.Q8_0, decode_q8_0, 127), (Q.Q5_0, decode_q5_0, 16)):
        y = decode(gguf.quants.quantize(x, qtype))
        step = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / levels
        assert (np.abs(y.reshape(-1, 32) - x.reshape(-1, 32)) <= step * 1.01 + 1e-6).all(), qtype.name


def test_rotary_tables_at_32768_positions_equal_transformers_qwen2() -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from trtllm_dustin.config import ModelConfig
    from trtllm_dustin.models.rope import rope_tables

    config = ModelConfig(name="qwen-rope", vocab_size=64, hidden_size=1536, num_layers=1, num_heads=12, num_kv_heads=2,
                         head_dim=128, intermediate_size=64, rope_theta=1e6, max_position_embeddings=32768,
                         qkv_bias=True)
    cos, sin = rope_tables(config, 32768)
    hf = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                          max_position_embeddings=32768))
    positions = torch.arange(32768)[None]
    hf_cos, hf_sin = hf(torch.zeros(1, 1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, hf_cos[0, :, :64], rtol=0, atol=1e-6)  # HF repeats the 64 pairs twice
    torch.testing.assert_close(sin, hf_sin[0, :, :64], rtol=0, atol=1e-6)
    assert float(cos[-1].sub(cos[-2]).abs().max()) > 0  # the last positions still rotate (no clamping)


# ---- the real files, where fetched ------------------------------------------------------------------------------
REAL = {name: fetched(name) for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}
needs_pair = pytest.mark.skipif(not all(REAL.values()), reason="needs `trtllm-dustin fetch-model` of the long pair")


@needs_pair
@pytest.mark.parametrize("name", list(REAL))
def test_real_files_every_type_equals_gguf_reader(name: str) -> None:
    path = REAL[name]
    ours = GGUFFile.open(path)
    reader = gguf.GGUFReader(str(path))
    checked = set()
    for info in reader.tensors:  # the first tensor of each stored type
        qtype = Q(int(info.tensor_type))
        if qtype in checked:
            continue
        checked.add(qtype)
        mine = ours.tensor(info.name)
        reference = gguf.quants.dequantize(np.asarray(info.data), qtype).reshape(mine.shape)
        torch.testing.assert_close(mine, torch.from_numpy(np.array(reference, dtype=np.float32)),
                                   rtol=0, atol=0, msg=f"{name}: {info.name} ({qtype.name})")
    assert {Q.Q4_K, Q.Q6_K} <= checked and (name != "qwen2.5-coder-0.5b" or {Q.Q5_0, Q.Q8_0} <= checked)


@needs_pair
def test_real_pair_shapes_template_and_shared_tokenizer() -> None:
    from trtllm_dustin.models.loading import open_model

    target, draft = open_model("qwen2.5-coder-1.5b"), open_model("qwen2.5-coder-0.5b")
    for c, layers, hidden, heads in ((target.config, 28, 1536, 12), (draft.config, 24, 896, 14)):
        assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (layers, hidden, heads, 2)
        assert (c.rope_theta, c.max_position_embeddings, c.qkv_bias, c.tie_word_embeddings) == (1e6, 32768, True, False)
        assert c.vocab_size == 151936
    for checkpoint, path in ((target, REAL["qwen2.5-coder-1.5b"]), (draft, REAL["qwen2.5-coder-0.5b"])):
        assert checkpoint.tokenizer.chat_template == GGUFFile.open(path).metadata["tokenizer.chat_template"]
    texts = ["def f(x):\n    return x ** 2  # square", "Hello, world!", "naïve café 日本語 😀", "\n\n\t  spaces"]
    for text in texts:
        assert target.tokenizer.encode(text) == draft.tokenizer.encode(text)
    chat = [{"role": "user", "content": "Write a haiku."}]
    ids = target.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in ids and "Write a haiku." in ids

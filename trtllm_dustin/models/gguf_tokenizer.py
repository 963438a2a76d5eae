"""The tokenizer a GGUF file describes, built from the metadata already parsed (no second read of the file).

A GGUF has no tokenizer.json; llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), its token types, the BPE
merges and the special ids as metadata, and names the text split the merges were learned on (`tokenizer.ggml.pre`).
For byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen2) this rebuilds the tokenizer with
the `tokenizers` library, the way transformers' GGUF path does: BPE over GPT-2's byte alphabet, control tokens
(type 3) as special tokens, user-defined ones (type 4) as plain added tokens, the split regex of the `pre` value.
Anything else falls back to `AutoTokenizer.from_pretrained(gguf_file=...)`, which parses the file again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trtllm_dustin.models.errors import ModelLoadError
from trtllm_dustin.models.gguf import GGUFFile

__all__ = ["BYTE_LEVEL_SPLITS", "gguf_tokenizer"]

# The published split regexes of the vocabularies that llama.cpp tags by `tokenizer.ggml.pre` (None: GPT-2's own
# split, which the ByteLevel pre-tokenizer applies itself). A value missing here takes the fallback.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS: dict[str | None, str | None] = {None: None, "gpt2": None, "smollm": None, "llama-bpe": _LLAMA3,
                                                   "llama3": _LLAMA3, "qwen2": _QWEN2}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def gguf_tokenizer(gguf: GGUFFile) -> Any | None:
    """A transformers fast tokenizer for the file's vocabulary, its special tokens and chat template (None for a
    file without a tokenizer)."""
    meta = gguf.metadata
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind is None:
        return None
    if kind == "gpt2" and pre in BYTE_LEVEL_SPLITS:
        return _byte_level_bpe(meta, BYTE_LEVEL_SPLITS[pre], gguf.path)
    from transformers import AutoTokenizer

    print(f"tokenizer: {kind!r} with pre-tokenizer {pre!r} is not built from the metadata here; transformers reads "
          f"{gguf.path.name} again for it (slow)", flush=True)
    return AutoTokenizer.from_pretrained(gguf.path.parent, gguf_file=gguf.path.name)


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the other 68 bytes are spelled
    with the characters from U+0100 on, so every byte sequence is a string of visible characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return spelling


def _byte_level_bpe(meta: dict[str, Any], split: str | None, path: Path) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{path}: {len(types)} token types for {len(tokens)} tokens; the file is corrupt")
    # A token written in plain text rather than the byte alphabet is respelled, so the byte-level pieces reach it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter's mislabel; adding it would grow the
    # vocabulary past the embedding's rows, so it stays an ordinary token.
    typed = list(zip(tokens, types, strict=True))
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in typed
                                if kind == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in typed
                        if kind == _USER_DEFINED and t in vocab])
    specials = {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in _SPECIAL_IDS.items()
                if f"tokenizer.ggml.{key}" in meta}
    flags = {name: meta[f"tokenizer.ggml.{name}"] for name in ("add_bos_token", "add_eos_token")
             if f"tokenizer.ggml.{name}" in meta}
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
                                   **specials, **flags)

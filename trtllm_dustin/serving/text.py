"""Text in, text out: encoding prompts, detokenizing committed tokens as they stream, cutting at stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["CodepointCodec", "IncrementalDetokenizer", "StopStrings", "TextCodec", "TokenizerCodec", "codec_for"]


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """(role, content) pairs through the model's chat template, ending with the assistant's turn's opening;
        ValueError when the model has none."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CodepointCodec:
    """For tokenizer-less presets (tests, benchmarks): token id i is the character chr(i), one for one.

    Exact in both directions, so a served text maps back to the very ids the runtime produced."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) for c in text]
        bad = next((i for i in ids if i >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"character U+{bad:04X} is outside this model's {self.vocab_size}-token vocabulary (a "
                             f"preset without a tokenizer reads each character as token id ord(c) < "
                             f"{self.vocab_size}); send only such characters")
        return ids

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        raise ValueError("this model has no tokenizer and so no chat template; send the prompt as text (the OpenAI "
                         "API's /v1/completions, or text_input)")

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


class TokenizerCodec:
    """A Hugging Face tokenizer; optionally wraps the prompt in its chat template."""

    def __init__(self, tokenizer: Any, chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        if self.chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send the prompt as text (the OpenAI API's "
                             "/v1/completions, or text_input)")
        return list(self.tokenizer.apply_chat_template([{"role": role, "content": content}
                                                        for role, content in messages],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def codec_for(tokenizer: Any | None, vocab_size: int, chat_template: bool = False) -> TextCodec:
    return CodepointCodec(vocab_size) if tokenizer is None else TokenizerCodec(tokenizer, chat_template)


class IncrementalDetokenizer:
    """Turns committed ids into text pieces whose concatenation is the streamed text.

    Decodes a short window of ids (from the last piece boundary) instead of the whole sequence each time, and
    holds text back while it ends in U+FFFD: a multi-byte character whose remaining bytes are in later tokens.
    Streaming and non-streaming responses are both built from these pieces, so they always agree."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are settled text
        self.read = 0  # ids up to here have been turned into text

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(ids)
        settled = self.codec.decode(self.ids[self.prefix: self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        if len(text) <= len(settled) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(settled):]


class StopStrings:
    """Cuts the text at the first stop string (excluded from the output), holding back what might start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters that may begin a stop string
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str, final: bool = False) -> str:
        """Append a piece; return the text that is safe to send now. Sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        cut = len(self.pending) if final else max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

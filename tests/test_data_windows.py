"""Token windows: exact lengths, faithful slices of the document's encoding, and the test split refused."""

from __future__ import annotations

import random

import pytest

from trtllm_dustin.data import Document, TestSplitError, as_encoder, document_split, split_of, token_windows


def _byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _random_documents(count: int, seed: int, split: str) -> list[Document]:
    rng = random.Random(seed)
    words = ["the", "king", "startup", "def", "lambda", "ſ", "é", "\n", "  "]
    documents, index = [], 0
    while len(documents) < count:
        doc_id = f"synthetic/{seed}-{index}"
        index += 1
        if split_of(doc_id) != split:
            continue
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 1500)))
        documents.append(Document(doc_id, "synthetic", f"random {index}", "CC0", text))
    return documents


@pytest.mark.parametrize("length", [1, 7, 19, 111, 989])
@pytest.mark.parametrize("stride", [None, 1, 5, 1000])
def test_windows_are_exact_slices_of_the_encoding(length: int, stride: int | None) -> None:
    documents = _random_documents(12, seed=length, split="train")
    windows = list(token_windows(documents, _byte_encode, length, stride=stride))
    step = length if stride is None else stride
    expected = []
    for document in documents:
        ids = _byte_encode(document.text)
        for start in range(0, len(ids) - length + 1, step):
            expected.append((document.doc_id, start, tuple(ids[start : start + length])))
    assert [(w.doc_id, w.start, w.tokens) for w in windows] == expected
    assert all(len(w.tokens) == length for w in windows)


def test_back_to_back_windows_tile_each_document() -> None:
    length = 37
    for document in _random_documents(8, seed=3, split="validation"):
        ids = _byte_encode(document.text)
        tiled = [t for w in token_windows([document], _byte_encode, length) for t in w.tokens]
        assert tiled == ids[: len(ids) // length * length]


def test_max_per_document_gives_prefixes() -> None:
    documents = _random_documents(10, seed=11, split="train")
    windows = list(token_windows(documents, _byte_encode, 50, max_per_document=1))
    long_enough = [d for d in documents if len(_byte_encode(d.text)) >= 50]
    assert [w.doc_id for w in windows] == [d.doc_id for d in long_enough]
    assert all(w.start == 0 for w in windows)


def test_test_documents_are_refused_unless_final_report() -> None:
    test_docs = _random_documents(2, seed=5, split="test")
    train_docs = _random_documents(2, seed=5, split="train")
    with pytest.raises(TestSplitError, match="test split"):
        list(token_windows(train_docs + test_docs, _byte_encode, 4))
    windows = list(token_windows(test_docs, _byte_encode, 4, allow_test=True))
    assert {w.doc_id for w in windows} == {d.doc_id for d in test_docs}
    assert all(document_split(d) == "test" for d in test_docs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length": 0}, "length=0"),
        ({"length": 4, "stride": 0}, "stride=0"),
        ({"length": 4, "max_per_document": 0}, "max_per_document=0"),
    ],
)
def test_bad_window_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(token_windows(_random_documents(1, seed=1, split="train"), _byte_encode, **kwargs))


def test_bad_tokenizers_are_refused() -> None:
    with pytest.raises(TypeError, match="Hugging Face tokenizer"):
        as_encoder(42)
    with pytest.raises(TypeError):
        list(token_windows(_random_documents(1, seed=2, split="train"), lambda text: list(text), 4))


def test_hugging_face_tokenizer_encodes_without_special_tokens() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "<unk>": 1, "the": 2, "king": 3, "startup": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    assert tokenizer.encode("the king") == [0, 2, 3]  # the tokenizer adds BOS by default ...
    assert list(as_encoder(tokenizer)("the king")) == [2, 3]  # ... a window never holds one
    document = _random_documents(1, seed=9, split="train")[0]
    windows = list(token_windows([document], tokenizer, 3))
    assert windows and all(len(w.tokens) == 3 and 0 not in w.tokens for w in windows)

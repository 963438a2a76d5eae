"""The HTTP front of `trtllm-dustin serve` (OpenAI API, /metrics, the body guard, restarts) on the default model,
SmolLM2-135M-Instruct with its packaged draft, started on 127.0.0.1 as a user starts it (docs/serving.md).

Checked here: the official `openai` client (chat and completions, streamed and not) answers what `trtllm-dustin
generate` answers for the same prompt and method; /metrics parses with prometheus_client's parser and its request,
token and acceptance counters equal what the requests got; a battery of malformed requests (bad JSON, wrong types,
deep nesting, huge bodies, bad sampling values, unknown models, a client gone mid-stream) each gets its 4xx with the
field named, after which the same good request gets the same answer; 64 concurrent clients, half streaming, half
malformed; tritonserver killed with SIGSEGV and a backend stub killed by hand each come back within 30 s, counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.serving import wait_ready

from trtllm_dustin.cli import main
from trtllm_dustin.models.loading import default_gguf_path
from trtllm_dustin.serving.launch import ServerError, processes_in_group, pytriton_distribution

httpx = pytest.importorskip("httpx", reason="the serve extra is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

try:
    pytriton_distribution()
    default_gguf_path()
except (ServerError, RuntimeError) as e:
    pytest.skip(str(e), allow_module_level=True)

TIMEOUT_S = 300.0
CHAT = "What is the capital of France?"
PROMPT = "The capital of France is"
MAX_TOKENS = 10
GOOD = {"model": "dustin:vanilla", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}


class Served:
    def __init__(self, process: subprocess.Popen, url: str, lines: list[str], log: Path,
                 references: dict[str, subprocess.Popen]) -> None:
        self.process, self.url, self.lines, self.log = process, url, lines, log
        self.references = references  # generate's runs, started beside the server
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def post(self, path: str, body: bytes | dict, timeout: float = TIMEOUT_S) -> httpx.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}{path}", content=data, timeout=timeout)

    def good(self) -> str:
        response = self.post("/v1/completions", GOOD)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, parsed by prometheus_client: (name, sorted labels) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def output(self, timeout_s: float = 0.0) -> str:
        """serve's output so far (read without blocking past `timeout_s`)."""
        os.set_blocking(self.process.stdout.fileno(), False)
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.process.stdout.readline()
            if line:
                self.lines.append(line)
            elif time.monotonic() >= deadline:
                return "".join(self.lines)
            else:
                time.sleep(0.1)


def _generate(prompt: str, chat: bool) -> subprocess.Popen:
    """`trtllm-dustin generate` for the same prompt and method, greedy (its own process: the CLI as a user runs it)."""
    command = [sys.executable, "-m", "trtllm_dustin.cli", "generate", "--device", "cpu", "--method", "dustin-h",
               "--prompt", prompt, "--max-new-tokens", str(MAX_TOKENS), *(() if chat else ("--raw",))]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="0"))


def _generated_text(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out
    return out.split("[0] ", 1)[1].rsplit("\nmodel ", 1)[0]  # generate prints "[0] TEXT" then "model ..."


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("front")
    repo = root / "repo"
    assert main(["triton-repo", "--out", str(repo), "--method", "dustin-h", "vanilla", "--max-batch", "8",
                 "--max-seq-len", "256", "--queue-size", "64"]) == 0
    log = root / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_INTERPRET="0")
    process = subprocess.Popen([sys.executable, "-m", "trtllm_dustin.cli", "serve", "--repo", str(repo),
                                "--http-port", "0", "--grpc-port", "0", "--server-dir", str(root / "server"),
                                "--log", str(log), "--drain", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    references = {"chat": _generate(CHAT, chat=True), "completion": _generate(PROMPT, chat=False)}
    line, lines = wait_ready(process)
    server = Served(process, "http://" + line.split("HTTP http://")[1].split(",")[0], lines, log, references)
    yield server
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)


@pytest.fixture(scope="module")
def references(served: Served) -> dict[str, str]:
    """generate's greedy answers: chat (its default, the chat template) and completion (--raw)."""
    return {kind: _generated_text(run) for kind, run in served.references.items()}


# ---- the OpenAI client -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_openai_client_answers_as_generate(served: Served, references: dict[str, str], kind: str,
                                               stream: bool) -> None:
    common = {"model": "dustin:dustin-h", "max_tokens": MAX_TOKENS, "temperature": 0}
    if kind == "chat":
        call = served.client.chat.completions.create
        common["messages"] = [{"role": "user", "content": CHAT}]
    else:
        call = served.client.completions.create
        common["prompt"] = PROMPT
    if not stream:
        answer = call(**common)
        text = answer.choices[0].message.content if kind == "chat" else answer.choices[0].text
        usage = answer.usage
        assert answer.choices[0].finish_reason in ("stop", "length")
    else:
        chunks = list(call(**common, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content or "" if kind == "chat" else c.choices[0].text
                  for c in chunks if c.choices]
        text, usage = "".join(pieces), chunks[-1].usage
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
        if kind == "chat":
            assert chunks[0].choices[0].delta.role == "assistant"
    assert text == references[kind]
    assert 1 <= usage.completion_tokens <= MAX_TOKENS and usage.prompt_tokens > 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_models_are_listed_with_their_methods(served: Served) -> None:
    assert sorted(m.id for m in served.client.models.list()) == ["dustin", "dustin:dustin-h", "dustin:vanilla"]


def test_stop_strings_and_seeds(served: Served) -> None:
    base = {"model": "dustin:vanilla", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    whole = served.client.completions.create(**base).choices[0].text
    stop = whole.strip()[-1]  # a character of the answer: the text ends before it
    cut = served.client.completions.create(**base, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [served.client.completions.create(**dict(base, temperature=0.9, top_p=0.9, seed=7)).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


# ---- /metrics ------------------------------------------------------------------------------------------------------
def _delta(after: dict, before: dict, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels`, after minus before."""
    def total(samples: dict) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
    return total(after) - total(before)


def _settled(served: Served) -> dict:
    """/metrics once the engine's snapshot holds everything finished so far (it is written twice a second)."""
    time.sleep(1.2)
    return served.metrics()


def test_metrics_count_what_the_requests_got(served: Served) -> None:
    before = _settled(served)
    got = []  # (prompt tokens, generated tokens, method, rounds, accepted draft tokens)
    for kind in ("chat", "completion"):
        for stream in (False, True):
            body = {"model": "dustin:dustin-h" if stream else "dustin:vanilla", "max_tokens": 6, "temperature": 0,
                    "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
            body.update({"messages": [{"role": "user", "content": CHAT}]} if kind == "chat" else {"prompt": PROMPT})
            response = served.post(f"/v1/{'chat/' if kind == 'chat' else ''}completions", body)
            assert response.status_code == 200, response.text
            if stream:
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                last = json.loads(events[-2])
            else:
                last = response.json()
            stats = last["dustin"]
            got.append((last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"], stats["method"],
                        stats["rounds"], stats["accepted_draft_tokens"]))
    triton = served.post("/v2/models/dustin/generate", {"text_input": PROMPT, "max_tokens": 5, "method": "dustin-h"})
    out = triton.json()
    got.append((out["prompt_tokens"], out["generated_tokens"], "dustin-h", out["rounds"],
                out["total_accepted_draft_tokens"]))
    after = _settled(served)
    assert _delta(after, before, "dustin_requests_total", outcome="ok") == len(got)
    assert _delta(after, before, "dustin_prompt_tokens_total") == sum(g[0] for g in got)
    assert _delta(after, before, "dustin_generated_tokens_total") == sum(g[1] for g in got)
    for method in ("dustin-h", "vanilla"):
        mine = [g for g in got if g[2] == method]
        assert _delta(after, before, "dustin_requests_total", method=method, outcome="ok") == len(mine)
        # each round observes the tokens it committed (accepted + 1): count = rounds, sum = accepted + rounds
        assert _delta(after, before, "dustin_accepted_length_count", method=method) == sum(g[3] for g in mine)
        assert _delta(after, before, "dustin_accepted_length_sum", method=method) == sum(g[3] + g[4] for g in mine)
        assert _delta(after, before, "dustin_time_to_first_token_seconds_count", method=method) == len(mine)
        assert _delta(after, before, "dustin_phase_seconds_count", method=method, phase="verify") > 0
    assert _delta(after, before, "dustin_http_requests_total", route="/v1/completions", status="200") == 2
    assert _delta(after, before, "dustin_http_requests_total", route="/v1/chat/completions", status="200") == 2
    assert _delta(after, before, "dustin_http_requests_total", route="/v2/generate", status="200") == 1
    tau = after[("dustin_mean_accepted_length", (("method", "dustin-h"), ("model", "dustin")))]
    assert 1.0 <= tau <= 4.0
    for gauge in ("dustin_queue_depth", "dustin_running_slots", "dustin_kv_cache_tokens"):
        assert _delta(after, {}, gauge) == 0  # idle again
    assert _delta(after, {}, "dustin_slots") == 16
    assert _delta(after, {}, "dustin_kv_cache_capacity_tokens") == 2 * 8 * 256
    assert after[("dustin_backend_up", ())] == 1


# ---- malformed requests ------------------------------------------------------------------------------------------
def _nested(depth: int) -> bytes:
    return b'{"model": "dustin", "prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'


HUGE = b'{"model": "dustin", "prompt": "' + b"a" * 10_000_000 + b'"}'
C, CC, V2 = "/v1/completions", "/v1/chat/completions", "/v2/models/dustin/generate"
OK = {"model": "dustin:vanilla", "prompt": PROMPT, "max_tokens": 2}
CHAT_OK = {"model": "dustin:vanilla", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (path, body, status, the error's param (OpenAI) or a part of Triton's error)
MALFORMED = [
    (C, b"{not json", 400, None), (C, b"", 400, None), (C, b"[1, 2]", 400, None), (C, b'"text"', 400, None),
    (C, {"prompt": PROMPT, "max_tokens": 2}, 400, "model"), (C, dict(OK, model="gpt-4"), 404, "model"),
    (C, dict(OK, model="dustin:beam-search"), 404, "model"), (C, dict(OK, model=5), 400, "model"),
    (C, {"model": "dustin", "max_tokens": 2}, 400, "prompt"), (C, dict(OK, prompt=5), 400, "prompt"),
    (C, dict(OK, prompt=""), 400, "prompt"), (C, dict(OK, prompt=["a", "b"]), 400, "prompt"),
    (C, dict(OK, prompt="hello " * 400), 400, "prompt"), (C, dict(OK, prompt=[5, 10**6]), 400, "prompt"),
    (C, dict(OK, max_tokens="ten"), 400, "max_tokens"), (C, dict(OK, max_tokens=0), 400, "max_tokens"),
    (C, dict(OK, max_tokens=4.5), 400, "max_tokens"), (C, dict(OK, max_tokens=100000), 400, "max_tokens"),
    (C, dict(OK, temperature=-1), 400, "temperature"), (C, dict(OK, temperature="hot"), 400, "temperature"),
    (C, dict(OK, top_p=1.5), 400, "top_p"), (C, dict(OK, top_p=0), 400, "top_p"), (C, dict(OK, seed=-1), 400, "seed"),
    (C, dict(OK, seed="x"), 400, "seed"), (C, dict(OK, n=2), 400, "n"), (C, dict(OK, stream="yes"), 400, "stream"),
    (C, dict(OK, stream_options={"include_usage": True}), 400, "stream_options"), (C, dict(OK, stop=[1]), 400, "stop"),
    (C, dict(OK, logprobs=5), 400, "logprobs"), (C, dict(OK, tempreature=0.5), 400, "tempreature"),
    (CC, {"model": "dustin", "max_tokens": 2}, 400, "messages"), (CC, dict(CHAT_OK, messages=[]), 400, "messages"),
    (CC, dict(CHAT_OK, messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    (CC, dict(CHAT_OK, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CC, dict(CHAT_OK, max_completion_tokens=0), 400, "max_completion_tokens"),
    (CC, dict(CHAT_OK, messages=[{"role": "user", "content": "hi " * 300}]), 400, "messages"),
    (C, _nested(100_000), 400, None), (CC, _nested(40), 400, None), (C, HUGE, 413, None),
    (V2, _nested(100_000), 400, "nests 100001 arrays or objects deep"), (V2, HUGE, 413, "over this server's limit"),
    (V2, {"text_input": "hi", "max_tokens": 0}, 400, "max_tokens=0 must be in"),
    ("/v1/nothing", dict(OK), 404, None),
]


def _check_refusal(served: Served, path: str, body, status: int, param: str | None) -> float:
    t0 = time.perf_counter()
    response = served.post(path, body)
    elapsed = time.perf_counter() - t0
    assert response.status_code == status, (path, str(body)[:100], response.text[:300])
    error = response.json()["error"]
    if path.startswith("/v1/"):
        assert error["param"] == param and error["message"] and error["type"], error
    else:
        assert param in error
    return elapsed


def test_malformed_requests_get_their_errors_and_the_same_good_answer_after_each(served: Served) -> None:
    assert len(MALFORMED) >= 30
    want = served.good()
    for path, body, status, param in MALFORMED:
        elapsed = _check_refusal(served, path, body, status, param)
        if body is HUGE or body == _nested(100_000):
            assert elapsed < 1.0, f"{path} took {elapsed:.2f} s to refuse a {len(body)}-byte body"
        assert served.good() == want, (path, str(body)[:100])


def test_a_client_gone_mid_stream_frees_its_slot(served: Served) -> None:
    want = served.good()
    body = {"model": "dustin:vanilla", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one piece, then the client goes away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "cancelled by its client" not in served.log.read_text(errors="replace"):
        time.sleep(0.2)
    assert "cancelled by its client" in served.log.read_text(errors="replace")
    assert served.good() == want


def test_64_concurrent_clients_half_streaming_half_malformed(served: Served) -> None:
    prompts = ["Once upon a time, a dragon", "List three facts about the Moon:\n1.", PROMPT,
               "def fibonacci(n):\n"]
    alone = {p: served.client.completions.create(model="dustin:vanilla", prompt=p, max_tokens=6, temperature=0)
             .choices[0].text for p in prompts}
    bad = [case for case in MALFORMED if case[1] is not HUGE]

    def streaming(i: int) -> tuple[str, str]:
        prompt = prompts[i % len(prompts)]
        chunks = served.client.completions.create(model="dustin:vanilla", prompt=prompt, max_tokens=6, temperature=0,
                                                  stream=True)
        return prompt, "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(64) as pool:
        streams = [pool.submit(streaming, i) for i in range(32)]
        refusals = [pool.submit(_check_refusal, served, *bad[i % len(bad)]) for i in range(32)]
        for future in refusals:
            future.result()
        for future in streams:
            prompt, text = future.result()
            assert text == alone[prompt]


# ---- restarts (last: they replace the backend) -------------------------------------------------------------------
def _wait_back(served: Served, want: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        try:
            if served.good() == want:
                return time.monotonic() - t0
        except (AssertionError, httpx.HTTPError):
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come back within 60 s:\n" + served.output())


def _child_group(served: Served) -> int:
    """tritonserver's process group (its pid): the one child of serve that leads its own group."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == served.process.pid and int(fields[2]) == int(entry.name):
                return int(entry.name)
    raise AssertionError("serve has no tritonserver child")


@pytest.mark.parametrize("victim", ["tritonserver", "stub"])
def test_a_dead_backend_is_restarted_within_30_s_and_counted(served: Served, victim: str) -> None:
    want = served.good()
    before = served.metrics().get(("dustin_backend_restarts_total", ()), 0)
    group = _child_group(served)
    if victim == "tritonserver":  # the crash of the issue: a stack overflow in Triton's JSON parser
        os.kill(group, signal.SIGSEGV)
    else:  # the Python-backend stub that runs the engine
        os.kill(max(set(processes_in_group(group)) - {group}), signal.SIGKILL)
    assert _wait_back(served, want) < 30
    assert served.metrics()[("dustin_backend_restarts_total", ())] == before + 1
    output = served.output(timeout_s=1)
    assert "restarting it" in output and "tritonserver is back" in output
    if victim == "tritonserver":
        assert "exited with -11" in output

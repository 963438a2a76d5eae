"""The default pair, SmolLM2-135M-Instruct + its packaged draft, served by a real tritonserver started with
`trtllm-dustin serve` on 127.0.0.1, as a new user starts it (docs/serving.md).

The repository holds three models: `dustin` (every offered method, 2 slots each), `dustin_load` (dustin-h and vanilla,
16 slots each) and `broken` (its checkpoint does not exist). Checked here: every served method answers what
`generate()` answers for the same request alone (through Triton's HTTP generate endpoint, and gRPC streaming); the
generate and generate_stream endpoints with plain HTTP; 64 concurrent streaming clients with mixed prompts, sampling
and cancellations, in two waves (no failed request, greedy answers equal to `generate()`, every wave's answers equal
to the first's, no token lost or duplicated in a stream, the model's memory flat); a killed client; a model that
fails to load; malformed requests; SIGTERM while a request streams.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers.registry import OFFERED
from helpers.serving import reference_kernels, wait_ready

from trtllm_dustin.cli import main
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.runtime.methods import OFFERED_METHODS
from trtllm_dustin.runtime.sampling import SamplingParams
from trtllm_dustin.serving import ServingConfig
from trtllm_dustin.serving.engine import served_decoders
from trtllm_dustin.serving.launch import ServerError, processes_in_group, pytriton_distribution

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
try:
    pytriton_distribution()
except ServerError as e:
    pytest.skip(str(e), allow_module_level=True)

MAX_SEQ_LEN = 256
LOAD_METHODS = ("dustin-h", "vanilla")
TIMEOUT_S = 300.0  # any one request (CPU, behind up to 64 others)
PROMPTS = [  # real text of different lengths: from 5 to about 120 tokens
    "Once upon a time, a dragon",
    "The history of the printing press begins in",
    "Write a short poem about the sea.\nThe sea",
    "List three facts about the Moon:\n1.",
    "In mathematics, a prime number is a natural number greater than 1 that is not a product of two smaller natural "
    "numbers. The first primes are",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods "
    "from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment chlorophyll and "
    "generates oxygen as a byproduct. Scientists study it because",
    "Dear team,\nThank you for the meeting yesterday. As discussed, the next steps are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


# ---- the server ------------------------------------------------------------------------------------------------
class Served:
    def __init__(self, process: subprocess.Popen, lines: list[str], http: str, grpc: str, log: Path,
                 config: ServingConfig, load_config: ServingConfig) -> None:
        self.process, self.lines, self.http, self.grpc, self.log = process, lines, http, grpc, log
        self.config, self.load_config = config, load_config


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2):
    root = tmp_path_factory.mktemp("real-pair")
    repo = root / "repo"
    common = ["--max-seq-len", str(MAX_SEQ_LEN), "--queue-size", "64"]
    assert main(["triton-repo", "--out", str(repo), "--method", *OFFERED_METHODS, "--max-batch", "2", *common]) == 0
    assert main(["triton-repo", "--out", str(repo), "--name", "dustin_load", "--method", *LOAD_METHODS,
                 "--max-batch", "16", *common]) == 0
    assert main(["triton-repo", "--out", str(repo), "--name", "broken", "--method", "vanilla", *common]) == 0
    broken = repo / "broken" / "1" / "serving_config.json"  # as if its checkpoint were deleted after writing it
    broken.write_text(broken.read_text().replace('"model": null', '"model": "/nonexistent/SmolLM2.gguf"'))
    assert "/nonexistent/SmolLM2.gguf" in broken.read_text()
    log = root / "serve.log"
    # The server runs the plugins' PyTorch references on the CPU, as the references below do (no interpreter).
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_INTERPRET="0")
    process = subprocess.Popen([sys.executable, "-m", "trtllm_dustin.cli", "serve", "--repo", str(repo),
                                "--http-port", "0", "--grpc-port", "0", "--server-dir", str(root / "server"),
                                "--log", str(log), "--drain", "2"],  # 2 s: the last test's stream is cut, not done
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line, lines = wait_ready(process)
    http = line.split("HTTP http://")[1].split(",")[0]
    grpc = line.split("gRPC ")[1].split(" ")[0]
    server = Served(process, lines, http, grpc, log, ServingConfig.load(repo / "dustin" / "1" / "serving_config.json"),
                    ServingConfig.load(repo / "dustin_load" / "1" / "serving_config.json"))
    yield server
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)


@pytest.fixture(scope="module")
def reference(served: Served):
    """The served methods' decoders with one slot each, built as the server builds them (served_decoders)."""
    with reference_kernels():
        return served_decoders(served.config, batch_slots=1)


def alone(reference, method: str, prompt: str, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
          seed: int = 0) -> str:
    """The request run alone through generate() on a one-slot decoder, detokenized."""
    config = GenerationConfig(max_tokens, SamplingParams(temperature, top_p, seed), reference.eos_token_ids,
                              prefill_chunk=2048)
    with reference_kernels():
        tokens = reference.decoders[method].generate([reference.codec.encode(prompt)], config).tokens[0]
    return reference.codec.decode(tokens)


# ---- plain HTTP ------------------------------------------------------------------------------------------------
def post(served: Served, path: str, body: bytes | dict, timeout: float = TIMEOUT_S) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{served.http}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def generate(served: Served, model: str = "dustin", **body) -> dict:
    status, out = post(served, f"/v2/models/{model}/generate", body)
    assert status == 200, out
    return out


def generate_stream(served: Served, model: str = "dustin", cancel_after: int | None = None, **body) -> list[dict]:
    """The server-sent events of one generate_stream request; with cancel_after, close the connection after that
    many events (the client goes away mid-stream)."""
    request = urllib.request.Request(f"http://{served.http}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode(), method="POST")
    events = []
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if cancel_after is not None and len(events) >= cancel_after:
                    break
    return events


def grpc_stream(served: Served, model: str, prompt: str, max_tokens: int, cancel_after: int | None = None,
                **optional) -> list[tuple[str, int, bool]]:
    """(text piece, generated_tokens, final) of each response of one gRPC streaming request; with cancel_after, the
    client cancels its stream after that many responses."""
    arrays = {"text_input": np.array([[prompt.encode()]], dtype=np.object_),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32), "stream": np.array([[True]], dtype=np.bool_)}
    kinds = {"method": np.object_, "temperature": np.float32, "top_p": np.float32, "seed": np.int64}
    for name, value in optional.items():
        arrays[name] = np.array([[value.encode() if isinstance(value, str) else value]], dtype=kinds[name])
    types = {"O": "BYTES", "i": "INT32", "b": "BOOL", "f": "FP32"}
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else
                                       types[array.dtype.kind])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    responses: queue.Queue = queue.Queue()
    got = []
    with grpcclient.InferenceServerClient(served.grpc) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=TIMEOUT_S)
            if error is not None:
                client.stop_stream(cancel_requests=True)
                raise AssertionError(f"request failed: {error}")
            final = result.get_response().parameters["triton_final_response"].bool_param
            out = result.as_numpy("text_output")
            if out is not None:
                got.append((b"".join(out.reshape(-1)).decode(), int(result.as_numpy("generated_tokens")[0, 0]),
                            final))
            elif final:
                got.append(("", got[-1][1] if got else 0, True))
            if final or (cancel_after is not None and len(got) >= cancel_after):
                break
        client.stop_stream(cancel_requests=cancel_after is not None)
    return got


def stub_rss_mb(model: str) -> float:
    """Resident memory of the backend stub process that serves `model`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if "triton_python_backend_stub" in cmdline and f"/{model}/1/model.py" in cmdline:
                status = (entry / "status").read_text()
                return int(status.split("VmRSS:")[1].split()[0]) / 1024
        except OSError:
            continue
    raise AssertionError(f"no backend stub serves {model}")


# ---- the tests -------------------------------------------------------------------------------------------------
def test_serve_reports_the_model_that_failed_and_serves_the_others(served: Served) -> None:
    said = "".join(served.lines)
    assert "model broken failed to load" in said and "/nonexistent/SmolLM2.gguf" in said, said
    assert "ready: dustin, dustin_load on HTTP http://127.0.0.1:" in said, said  # 127.0.0.1 by default
    status, out = post(served, "/v2/models/broken/generate", {"text_input": "hello", "max_tokens": 2})
    assert status >= 400 and "broken" in out["error"], out
    assert generate(served, text_input=PROMPTS[0], max_tokens=2, method="vanilla")["generated_tokens"] == 2


@pytest.fixture(scope="module")
def method_answers(served: Served, reference) -> dict[str, tuple[dict, str]]:
    """method -> (the server's answer, generate()'s) for one greedy request: one request per offered method, sent at
    once, while this process computes the references."""
    prompt, tokens = PROMPTS[1], 6
    with ThreadPoolExecutor(len(OFFERED_METHODS)) as pool:
        answers = {m: pool.submit(generate, served, text_input=prompt, max_tokens=tokens, method=m)
                   for m in OFFERED_METHODS}
        wanted = {m: alone(reference, m, prompt, tokens) for m in OFFERED_METHODS}
        return {m: (answers[m].result(TIMEOUT_S), wanted[m]) for m in OFFERED_METHODS}


@pytest.mark.parametrize("method", OFFERED_METHODS)
def test_every_served_method_answers_what_generate_answers(served: Served, reference, method_answers,
                                                           method: str) -> None:
    assert served.config.methods == OFFERED  # exactly the offered methods, as the tests expect them
    out, want = method_answers[method]
    assert out["text_output"] == want, method
    assert out["prompt_tokens"] == len(reference.codec.encode(PROMPTS[1]))
    tau = out["mean_accepted_length"]
    assert tau == 1.0 if method == "vanilla" else 1.0 <= tau <= served.config.gamma + 1


@pytest.mark.parametrize("method", ["dustin-h", "classic"])
def test_seeded_sampling_answers_what_generate_answers(served: Served, reference, method: str) -> None:
    prompt, tokens = PROMPTS[6], 8
    out = generate(served, text_input=prompt, max_tokens=tokens, method=method, temperature=0.8, top_p=0.9, seed=77)
    assert out["text_output"] == alone(reference, method, prompt, tokens, 0.8, 0.9, 77)


def test_http_generate_and_generate_stream(served: Served, reference) -> None:
    prompt, tokens = PROMPTS[0], 10
    want = alone(reference, "dustin-h", prompt, tokens)
    whole = generate(served, text_input=prompt, max_tokens=tokens, method="dustin-h")
    assert whole["text_output"] == want and whole["generated_tokens"] == tokens
    events = generate_stream(served, text_input=prompt, max_tokens=tokens, method="dustin-h", stream=True)
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == want
    counts = [e["generated_tokens"] for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == tokens  # each event adds tokens; none repeated
    [one] = generate_stream(served, text_input=prompt, max_tokens=tokens, method="dustin-h")  # stream false: one
    assert one["text_output"] == want
    # the prompt as token ids, as TensorRT-LLM's clients send it
    ids = reference.codec.encode(prompt)
    assert generate(served, input_ids=ids, max_tokens=tokens, method="dustin-h")["text_output"] == want
    # stop strings: the text ends before the first one
    stop = want[3:6]
    cut = generate(served, text_input=prompt, max_tokens=tokens, method="dustin-h", stop=[stop, "\u2603"])
    assert cut["text_output"] == want[: want.index(stop)]
    # gRPC streaming stays
    assert "".join(p for p, _, _ in grpc_stream(served, "dustin", prompt, tokens, method="dustin-h")) == want


def _load_jobs() -> list[dict]:
    """64 requests: 8 prompts (5 to about 80 tokens) x 2 methods x 4, a third sampled (at temperature 0.7 or 1; top-p
    is left at 1 here, since a nucleus sorts the whole vocabulary of every slot: test_seeded_sampling has it), half
    over HTTP; every eighth goes away after two pieces, long before its limit."""
    jobs = []
    for i in range(64):
        sampled, cancel, p = i % 3 == 2, i % 8 == 5, i % len(PROMPTS)
        jobs.append(dict(prompt=PROMPTS[p], max_tokens=48 if cancel else (2, 3, 4, 6)[p % 4],
                         method=LOAD_METHODS[(i // len(PROMPTS)) % 2], temperature=(0.7, 1.0)[i % 2] if sampled else
                         0.0, top_p=1.0, seed=1000 + i, http=i % 2 == 0, cancel_after=2 if cancel else None))
    return jobs


def _run_load_job(served: Served, job: dict) -> tuple[str, list[int]]:
    """(the streamed text, the generated-token count of each piece) of one client."""
    if job["http"]:
        events = generate_stream(served, "dustin_load", job["cancel_after"], text_input=job["prompt"],
                                 max_tokens=job["max_tokens"], method=job["method"], temperature=job["temperature"],
                                 top_p=job["top_p"], seed=job["seed"], stream=True)
        return "".join(e["text_output"] for e in events), [e["generated_tokens"] for e in events]
    pieces = grpc_stream(served, "dustin_load", job["prompt"], job["max_tokens"], job["cancel_after"],
                         method=job["method"], temperature=job["temperature"], top_p=job["top_p"], seed=job["seed"])
    return "".join(p for p, _, _ in pieces), [n for p, n, final in pieces if p or not final]


def test_sixty_four_streaming_clients_in_waves(served: Served, reference) -> None:
    """64 concurrent streaming clients (half HTTP generate_stream, half gRPC) over 16 slots per method: mixed
    prompts, token limits, methods and sampling; 8 of them go away after two pieces. Two waves of the same
    requests (the memory is read after each)."""
    jobs = _load_jobs()
    cancelled_before = served.log.read_text().count("cancelled by its client")
    waves, rss = [], []
    for _ in range(2):
        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(_run_load_job, served, job) for job in jobs]
            waves.append([f.result(TIMEOUT_S) for f in futures])  # 0 failed: any error raises here
        rss.append(stub_rss_mb("dustin_load"))
    wanted: dict[tuple, str] = {}
    for i, job in enumerate(jobs):
        for wave in waves:
            text, counts = wave[i]
            assert counts == sorted(set(counts)) and counts, (i, counts)  # every piece adds tokens: none duplicated
            if job["cancel_after"] is not None:
                assert len(counts) <= job["cancel_after"]
                continue
            assert counts[-1] <= job["max_tokens"]
            assert text == waves[0][i][0], i  # the same request answers the same, whatever shares its batch
        if job["cancel_after"] is None and job["temperature"] == 0.0:
            key = (job["method"], job["prompt"], job["max_tokens"])
            if key not in wanted:
                wanted[key] = alone(reference, job["method"], job["prompt"], job["max_tokens"])
            assert waves[0][i][0] == wanted[key], (i, job)  # and what generate() answers for it alone
    assert len(wanted) >= 10
    assert rss[1] - rss[0] < 64, f"the model's memory grew from one wave to the next: {rss} MB"
    expected = len(waves) * sum(j["cancel_after"] is not None for j in jobs)
    deadline = time.monotonic() + 30  # the last wave's are noticed at the scheduler's next step
    while served.log.read_text().count("cancelled by its client") - cancelled_before < expected and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    cancelled = served.log.read_text().count("cancelled by its client") - cancelled_before
    assert cancelled == expected  # each one's slot freed, and logged


def test_a_killed_client_leaves_the_others_unaffected(served: Served, reference) -> None:
    script = ("import json, sys, urllib.request\n"
              f"r = urllib.request.urlopen(urllib.request.Request('http://{served.http}/v2/models/dustin_load/"
              "generate_stream', data=json.dumps({'text_input': 'Once upon a time, a dragon', 'max_tokens': 200, "
              "'stream': True, 'method': 'dustin-h'}).encode(), method='POST'))\n"
              "for line in r:\n    print(line.decode().strip(), flush=True)\n")
    before = served.log.read_text().count("cancelled by its client")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(generate, served, "dustin_load", text_input=PROMPTS[3], max_tokens=8, method="dustin-h")
        assert client.stdout.readline().startswith("data: ")  # it is streaming
        client.kill()
        client.wait(10)
        assert other.result(TIMEOUT_S)["text_output"] == alone(reference, "dustin-h", PROMPTS[3], 8)
    deadline = time.monotonic() + 60
    while served.log.read_text().count("cancelled by its client") == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert served.log.read_text().count("cancelled by its client") == before + 1  # the log says what happened


PARSE_INT = "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"
PAIR_METHODS = ", ".join(OFFERED_METHODS)
FIELDS = ("text_input, input_ids, messages, max_tokens, fit_max_tokens, temperature, top_p, seed, random_seed, stop, "
          "method, stream")
# (body, HTTP status, the error exactly): each through HTTP generate, against the real pair (the `dustin` model:
# every offered method, vanilla the default, 256 positions per request; "hi" is one token). 400: refused by the
# model, in the request's terms (validation.py); 500: refused by Triton's own JSON parser before the model sees the
# request (docs/serving.md lists them); 200 with an error: Triton's generate endpoint on a streamed answer.
ONE_PROMPT = ("send exactly one of text_input (BYTES), input_ids (INT32 token ids) and messages (BYTES: a JSON "
              "chat)")
MALFORMED = [
    ({"text_input": "hi"}, 400, "max_tokens (INT32) is required"),
    ({"text_input": "hi", "max_tokens": "ten"}, 500, PARSE_INT),  # a string for an integer
    ({"text_input": "hi", "max_tokens": 4.5}, 500, PARSE_INT),  # a float for an integer
    ({"text_input": "hi", "max_tokens": 1e9}, 500, PARSE_INT),  # 1000000000.0: a float too
    ({"text_input": "hi", "max_tokens": 10**9}, 400, "max_tokens=1000000000 does not fit: this model holds 256 "
     "positions per request, and text_input takes 1; send max_tokens <= 255"),
    ({"text_input": "hi", "max_tokens": 10**12}, 400, "max_tokens=-727379968 must be in 1..2147483647 (an INT32: "
     "Triton wraps a JSON number past 2147483647 around); send a larger value"),
    ({"text_input": "hi", "max_tokens": [4, 5]}, 400, "[request id: <id_unknown>] input 'text_input' batch size does "
     "not match other inputs for 'dustin'"),  # two values for one
    ({"text_input": "hi", "max_tokens": -3}, 400, "max_tokens=-3 must be in 1..2147483647 (an INT32: Triton wraps a "
     "JSON number past 2147483647 around); send a larger value"),
    ({"text_input": "hi", "max_tokens": 0}, 400, "max_tokens=0 must be in 1..2147483647 (an INT32: Triton wraps a "
     "JSON number past 2147483647 around); send a larger value"),
    ({"text_input": "hi", "max_tokens": 4, "method": "beam-search"}, 400, "method 'beam-search' is not served by this "
     f"model; choose one of {PAIR_METHODS} (regenerate the repository with --method to serve others)"),
    ({"text_input": "word " * 300, "max_tokens": 4}, 400, "text_input is 301 tokens long, and this model holds 256 "
     "positions per request; send a prompt of at most 255 tokens"),
    ({"text_input": "hi", "max_tokens": MAX_SEQ_LEN}, 400, "max_tokens=256 does not fit: this model holds 256 "
     "positions per request, and text_input takes 1; send max_tokens <= 255"),
    ({"text_input": "hi", "max_tokens": 253, "method": "classic"}, 400, "max_tokens=253 does not fit: this model "
     "holds 256 positions per request, 3 of them kept free for a round's draft tokens, and text_input takes 1; send "
     "max_tokens <= 252"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 1.5}, 400, "top_p=1.5 must be in (0, 1] (the nucleus's "
     "probability mass; 1: no cut); send a smaller value"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 0}, 400, "top_p=0.0 must be in (0, 1] (the nucleus's probability "
     "mass; 1: no cut); send a larger value"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": -1}, 400, "temperature=-1.0 must be >= 0 (0: greedy); send "
     "a larger value"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": "hot"}, 500, "Unable to parse 'data': attempt to access "
     "JSON non-number as double"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": 1e39}, 400, "temperature=inf is not a finite number; send "
     "a number >= 0 (0: greedy)"),  # past FP32's range: inf
    ({"text_input": "hi", "max_tokens": 4, "seed": -1}, 400, "seed=-1 must be in 0..9223372036854775806; send a "
     "larger value"),
    ({"text_input": "hi", "max_tokens": 4, "random_seed": 2**64 - 1}, 400, "random_seed=18446744073709551615 must be "
     "in 0..9223372036854775806; send a smaller value"),
    ({"text_input": "hi", "max_tokens": 4, "seed": 1, "random_seed": 2}, 400, "send either seed (INT64) or "
     "random_seed (UINT64), not both"),
    ({"text_input": "hi", "input_ids": [1, 2], "max_tokens": 4}, 400, ONE_PROMPT),
    ({"max_tokens": 4}, 400, ONE_PROMPT),
    ({"input_ids": [5, 10 ** 6], "max_tokens": 4}, 400, "input_ids holds 1000000, outside this model's vocabulary "
     "[0, 49152); tokenize with the model's own tokenizer"),
    ({"input_ids": [], "max_tokens": 4}, 400, "input_ids is empty; send at least one token id"),
    ({"text_input": "", "max_tokens": 4}, 400, "text_input is empty; send at least one token"),
    ({"text_input": 5, "max_tokens": 4}, 500, "Unable to parse JSON bytes array: attempt to access JSON non-string as "
     "string"),  # a number for text
    ({"text_input": "\ud800", "max_tokens": 4}, 500, "failed to parse the request JSON buffer: The surrogate pair in "
     "string is invalid. at 16"),  # not valid UTF-16/UTF-8 text
    ({"text_input": "hi", "max_tokens": 4, "stream": "yes"}, 500, "Unable to parse 'data': attempt to access JSON "
     "non-boolean as boolean"),
    ({"text_input": "hi", "max_tokens": 4, "stream": True}, 200, "generate expects model to produce exactly 1 "
     "response, use generate stream for model that generates various number of responses"),  # stream on /generate
    ({"text_input": "hi", "max_tokens": 4, "tempreature": 0.5}, 400, "'tempreature' is not a field of this model's "
     f"requests; send only {FIELDS}"),  # a typo: Triton passes it on as a parameter
    ({"text_input": "hi", "max_tokens": 4, "parameters": {"top_k": 5}}, 400, "'top_k' is not a field of this model's "
     f"requests; send only {FIELDS}"),
    (b"{not json", 500, "failed to parse the request JSON buffer: Missing a name for object member. at 1"),
    (b"[1, 2]", 500, "attempt to get members for non-object"),
    (b"", 500, "failed to parse the request JSON buffer: The document is empty. at 0"),
]


@pytest.mark.parametrize("body, status, message", MALFORMED, ids=[f"case{i}" for i in range(len(MALFORMED))])
def test_a_malformed_request_gets_its_error_and_the_server_keeps_serving(served: Served, body, status: int,
                                                                         message: str) -> None:
    assert post(served, "/v2/models/dustin/generate", body) == (status, {"error": message})
    assert generate(served, text_input="hi", max_tokens=1, method="vanilla")["generated_tokens"] == 1


def test_the_server_serves_after_the_malformed_requests(served: Served, reference) -> None:
    assert len(MALFORMED) >= 20
    out = generate(served, text_input=PROMPTS[2], max_tokens=8, method="dustin-h")
    assert out["text_output"] == alone(reference, "dustin-h", PROMPTS[2], 8)
    status, out = post(served, "/v2/models/nonexistent/generate", {"text_input": "hi", "max_tokens": 2})
    assert status >= 400 and "nonexistent" in out["error"]


def test_sigterm_while_streaming_stops_cleanly(served: Served) -> None:
    """Last: SIGTERM to `serve` while a request streams. The server stops within its exit timeout, the client's
    stream ends (it does not hang), and no process of the server is left."""
    pieces: list[dict] = []
    ended = threading.Event()

    def client() -> None:
        body = {"text_input": PROMPTS[0], "max_tokens": 200, "method": "vanilla", "stream": True}
        request = urllib.request.Request(f"http://{served.http}/v2/models/dustin_load/generate_stream",
                                         data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
                for raw in r:
                    if raw.startswith(b"data: "):
                        pieces.append(json.loads(raw[len(b"data: "):]))
        except (OSError, urllib.error.URLError, json.JSONDecodeError):
            pass  # the connection closed under it
        finally:
            ended.set()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not pieces and not ended.is_set() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pieces and not ended.is_set(), "the request did not start streaming"
    [server_pid] = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and
                    _parent(e) == served.process.pid and b"tritonserver" in _cmdline(e)]
    group = processes_in_group(server_pid)  # tritonserver runs in its own process group, with its backend stubs
    stub_pids = [p for p in group if b"triton_python_backend_stub" in _cmdline(Path(f"/proc/{p}"))]
    start = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    rest, _ = served.process.communicate(timeout=120)
    took = time.monotonic() - start
    assert served.process.returncode == 0 and rest.rstrip().endswith("stopped"), rest
    assert took < 60, f"stopping took {took:.0f} s"
    assert ended.wait(30), "the streaming client still hangs after the server stopped"
    assert "shutting down" in pieces[-1].get("error", ""), pieces[-1]  # its stream ends with why
    assert len(stub_pids) == 2 and processes_in_group(server_pid) == []  # the two models' stubs, then nothing
    log = served.log.read_text()
    assert "dustin: the server is stopping: 1 running request(s) get 2 s to finish" in log
    assert "successfully unloaded 'dustin_load'" in log and "successfully unloaded 'dustin'" in log  # no forced exit


def _parent(entry: Path) -> int:
    try:
        stat = (entry / "stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""

"""A real tritonserver (nvidia-pytriton's binary, Python backend) on a generated repository, on 127.0.0.1 with
ephemeral ports, queried with tritonclient over HTTP and gRPC. Skipped when those packages are not installed."""

from __future__ import annotations

import importlib.util
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers.serving import MAX_SEQ_LEN, SERVED, direct_text, prompt_text, reference_kernels

if importlib.util.find_spec("pytriton") is None:  # found, not imported: only its tritonserver files are used
    pytest.skip("nvidia-pytriton (the tritonserver binary) is not installed", allow_module_level=True)
if int(np.__version__.split(".")[0]) >= 2 and not (Path(sys.prefix) / "triton-site").is_dir():
    pytest.skip("numpy 2 without a numpy 1.x for the backend stub: `pip install --target $VIRTUAL_ENV/triton-site "
                "numpy==1.26.4` (docs/serving.md)", allow_module_level=True)
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtllm_dustin.serving import write_model_repository  # noqa: E402
from trtllm_dustin.serving.launch import TritonServer, prepare_pytriton_server, processes_in_group  # noqa: E402

TIMEOUT_S = 60.0  # any one request; the tiny model answers in well under a second when alone


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """Models: `dustin` (decoupled: streaming, in-flight batching), `dustin_sync` (non-decoupled, HTTP infer) and
    `dustin_tiny_queue` (one slot, a queue of one, for the queue bound)."""
    root = tmp_path_factory.mktemp("triton")
    repo = root / "repo"
    write_model_repository(repo, SERVED, "dustin")
    write_model_repository(repo, SERVED.with_(decoupled=False, methods=("vanilla", "classic")), "dustin_sync")
    write_model_repository(repo, SERVED.with_(methods=("vanilla",), max_batch=1, queue_size=1), "dustin_tiny_queue")
    server = TritonServer(repo, prepare_pytriton_server(root / "server"), root / "server.log")
    with reference_kernels():  # the server's environment: the plugins' PyTorch references, not the interpreter
        server.start()
    try:
        yield server
    finally:
        server.stop()


def _inputs(module, text: str | None, max_tokens: int, dtype_of_max_tokens=np.int32, ids: list[int] | None = None,
            **optional) -> list:
    arrays = {} if text is None else {"text_input": np.array([[text.encode()]], dtype=np.object_)}
    if ids is not None:
        arrays["input_ids"] = np.array([ids], dtype=np.int32)
    arrays["max_tokens"] = np.array([[max_tokens]], dtype=dtype_of_max_tokens)
    for name, value in optional.items():
        if name == "stop":
            arrays[name] = np.array([[s.encode() for s in value]], dtype=np.object_)
        elif isinstance(value, str):
            arrays[name] = np.array([[value.encode()]], dtype=np.object_)
        else:
            arrays[name] = np.array([[value]], dtype={float: np.float32, bool: np.bool_, int: np.int64}[type(value)])
    types = {np.dtype(np.object_): "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
             np.dtype(np.float32): "FP32", np.dtype(np.bool_): "BOOL", np.dtype(np.uint64): "UINT64"}
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _text(result) -> str:
    return result.as_numpy("text_output").reshape(-1)[0].decode()


def stream(server: TritonServer, text: str | None, max_tokens: int, model: str = "dustin", **optional) -> list:
    """One request over a gRPC stream; returns its responses (the last has the final flag) or raises its error."""
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, _inputs(grpcclient, text, max_tokens, **optional),
                                  enable_empty_final_response=True)
        got = []
        for _ in range(max_tokens + 2):  # at most one response per token, plus the first and a final
            result, error = responses.get(timeout=TIMEOUT_S)
            if error is not None:
                client.stop_stream()
                raise error
            got.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    assert got[-1].get_response().parameters["triton_final_response"].bool_param, "no final response"
    return [r for r in got if r.as_numpy("text_output") is not None]


@pytest.mark.parametrize("method", SERVED.methods)
@pytest.mark.parametrize("temperature, top_p, seed", [(0.0, 1.0, 0), (0.8, 0.9, 12345)])
def test_outputs_equal_the_runtime_for_the_same_seed(server, method: str, temperature: float, top_p: float,
                                                     seed: int) -> None:
    text = prompt_text(1, 21)
    want = direct_text(method, text, 24, temperature, top_p, seed)
    [final] = stream(server, text, 24, method=method, temperature=temperature, top_p=top_p, seed=seed, stream=False)
    assert _text(final) == want
    assert int(final.as_numpy("generated_tokens").reshape(-1)[0]) == len(want)
    assert int(final.as_numpy("prompt_tokens").reshape(-1)[0]) == 21
    tau = float(final.as_numpy("mean_accepted_length").reshape(-1)[0])
    assert tau == 1.0 if method == "vanilla" else 1.0 <= tau <= SERVED.gamma + 1
    assert float(final.as_numpy("time_to_first_token_ms").reshape(-1)[0]) > 0
    if method in ("vanilla", "classic"):  # the non-decoupled model over HTTP gives the same answer
        with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S) as client:
            result = client.infer("dustin_sync", _inputs(httpclient, text, 24, method=method,
                                                         temperature=temperature, top_p=top_p, seed=seed))
        assert _text(result) == want


@pytest.mark.parametrize("method", ["classic", "dustin-h"])
def test_input_ids_answer_as_the_same_text_does(server, method: str) -> None:
    """Token ids instead of text_input: the runtime's answer for the same prompt. For the default method the
    request holds no BYTES input at all (the path around stubs that mis-read BYTES, docs/serving.md)."""
    assert SERVED.method == "classic"
    text = prompt_text(3, 17)
    want = direct_text(method, text, 20, 0.6, 1.0, 99)
    extra = {} if method == SERVED.method else {"method": method}
    [final] = stream(server, None, 20, ids=[ord(c) for c in text], temperature=0.6, seed=99, **extra)
    assert _text(final) == want
    assert int(final.as_numpy("prompt_tokens").reshape(-1)[0]) == 17


def test_streaming_delivers_tokens_in_order(server) -> None:
    text = prompt_text(2, 9)
    want = direct_text("classic", text, 30, 0.7, 1.0, 7)
    pieces = [_text(r) for r in stream(server, text, 30, method="classic", temperature=0.7, seed=7, stream=True)]
    assert len(pieces) > 2 and "".join(pieces) == want
    [whole] = stream(server, text, 30, method="classic", temperature=0.7, seed=7, stream=False)
    assert _text(whole) == "".join(pieces)


def test_sixteen_concurrent_clients(server) -> None:
    """16 streaming gRPC clients over 4 slots per method (in-flight admission) and 16 HTTP clients at once."""
    jobs = [dict(text=prompt_text(10 + i, 5 + 3 * i), max_tokens=8 + i, method=SERVED.methods[i % 3],
                 temperature=0.9 * (i % 2), seed=i) for i in range(16)]

    def via_grpc(job: dict) -> str:
        return "".join(_text(r) for r in stream(server, job["text"], job["max_tokens"], method=job["method"],
                                                temperature=job["temperature"], seed=job["seed"], stream=True))

    def via_http(job: dict) -> str:
        with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S) as client:
            return _text(client.infer("dustin_sync", _inputs(httpclient, job["text"], job["max_tokens"],
                                                             method="vanilla", seed=job["seed"],
                                                             temperature=job["temperature"])))

    with ThreadPoolExecutor(32) as pool:
        grpc_answers = [pool.submit(via_grpc, job) for job in jobs]
        http_answers = [pool.submit(via_http, job) for job in jobs]
        for job, g, h in zip(jobs, grpc_answers, http_answers, strict=True):
            assert g.result(TIMEOUT_S) == direct_text(job["method"], job["text"], job["max_tokens"],
                                                      job["temperature"], 1.0, job["seed"])
            assert h.result(TIMEOUT_S) == direct_text("vanilla", job["text"], job["max_tokens"], job["temperature"],
                                                      1.0, job["seed"])


def test_stop_strings_end_the_text(server) -> None:
    text = prompt_text(4, 8)
    full = direct_text("vanilla", text, 20)
    stop = full[6:8]
    [final] = stream(server, text, 20, method="vanilla", stop=[stop, "\u0101\u0102\u0103"])
    assert _text(final) == full[: full.index(stop)]


@pytest.mark.parametrize("make, message", [
    (lambda m: _inputs(m, "abc", 4)[:1], "max_tokens"),  # missing a required input: Triton itself refuses
    (lambda m: _inputs(m, "abc", 4, dtype_of_max_tokens=np.int64), "expects 'INT32'"),  # wrong dtype
    (lambda m: _inputs(m, "abc", -3), "max_tokens=-3 must be in 1..2147483647"),
    (lambda m: _inputs(m, "abc", 4, method="beam-search"), "method 'beam-search' is not served by this model"),
    (lambda m: _inputs(m, "a" * 90, 10), f"max_tokens=10 does not fit: this model holds {MAX_SEQ_LEN} positions per "
     "request, and text_input takes 90; send max_tokens <= 6"),  # dustin_sync's default method: vanilla
    (lambda m: _inputs(m, "abc", 4, top_p=1.5), "top_p=1.5 must be in (0, 1]"),
    (lambda m: _inputs(m, "abc", 4, stream=True), "stream=true needs the decoupled model"),
    (lambda m: _inputs(m, "abc", 4, ids=[97, 98]), "send exactly one of text_input (BYTES), input_ids"),
    (lambda m: _inputs(m, None, 4), "send exactly one of text_input (BYTES), input_ids"),
    (lambda m: _inputs(m, None, 4, ids=[97, 10**6]), "input_ids holds 1000000, outside this model's vocabulary"),
])
def test_malformed_requests_get_a_clear_error_and_the_server_keeps_serving(server, make, message: str) -> None:
    with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S) as client:
        with pytest.raises(InferenceServerException, match=None) as error:
            client.infer("dustin_sync", make(httpclient))
        assert message in str(error.value)
        assert _text(client.infer("dustin_sync", _inputs(httpclient, "abc", 4))) == direct_text("vanilla", "abc", 4)
    with pytest.raises(InferenceServerException) as error:  # the same over a gRPC stream to the decoupled model
        stream(server, "abc", 4, **({"method": "beam-search"} if "method" in message else {}),
               **({} if "method" in message else {"top_p": 2.0}))
    assert "is not served" in str(error.value) or "top_p=2.0" in str(error.value)
    assert "".join(_text(r) for r in stream(server, "abc", 4, method="vanilla")) == direct_text("vanilla", "abc", 4)


def test_a_full_queue_is_refused_clearly(server) -> None:
    errors, texts = [], []
    lock = threading.Lock()
    together = threading.Barrier(8)  # all eight at once: one runs, one waits, the rest find the queue full

    def one(i: int) -> None:
        try:
            together.wait(TIMEOUT_S)
            text = "".join(_text(r) for r in stream(server, "hello", 40, model="dustin_tiny_queue"))
            with lock:
                texts.append(text)
        except InferenceServerException as e:
            with lock:
                errors.append(str(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert len(errors) + len(texts) == 8 and texts and errors
    assert all("the request queue is full" in e for e in errors), errors[:2]
    assert all(t == direct_text("vanilla", "hello", 40) for t in texts)


def test_server_stops_cleanly_leaving_no_process(server) -> None:
    pgid = server.process.pid
    assert len(processes_in_group(pgid)) >= 4  # the server and one backend stub per model
    server.stop()
    assert server.process.returncode == 0, server.log_tail()
    assert processes_in_group(pgid) == []
    assert "successfully unloaded 'dustin'" in Path(server.log_path).read_text()

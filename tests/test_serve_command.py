"""`trtllm-dustin serve`: a real tritonserver (nvidia-pytriton's) serving the default pair, SmolLM2-135M-Instruct +
its packaged draft, on 127.0.0.1; a streamed request answers what the serving engine answers in process; SIGTERM stops
it cleanly."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from trtllm_dustin.cli import main
from trtllm_dustin.serving import ServingConfig
from trtllm_dustin.serving.engine import GenerationRequest, ServingEngine
from trtllm_dustin.serving.launch import ServerError, pytriton_distribution

grpcclient = pytest.importorskip("tritonclient.grpc")
try:
    pytriton_distribution()
except ServerError as e:
    pytest.skip(str(e), allow_module_level=True)

PROMPT, TOKENS = "The capital of France is", 12


def streamed(url: str, method: str) -> str:
    """One streaming gRPC request; the concatenated text pieces."""
    pieces: queue.Queue = queue.Queue()
    arrays = {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
              "max_tokens": np.array([[TOKENS]], dtype=np.int32), "stream": np.array([[True]], dtype=np.bool_),
              "method": np.array([[method.encode()]], dtype=np.object_)}
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), {"O": "BYTES", "i": "INT32", "b": "BOOL"}[
            array.dtype.kind])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    text = ""
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: pieces.put((result, error)))
        client.async_stream_infer("dustin", inputs, enable_empty_final_response=True)
        for _ in range(TOKENS + 2):
            result, error = pieces.get(timeout=120)
            assert error is None, error
            out = result.as_numpy("text_output")
            if out is not None:
                text += b"".join(out.reshape(-1)).decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return text


def in_process(config: ServingConfig, method: str) -> str:
    engine, done, chunks = ServingEngine.from_config(config), threading.Event(), []
    try:
        engine.submit(GenerationRequest(text=PROMPT, max_tokens=TOKENS, method=method, stream=True),
                      lambda c: (chunks.append(c), c.final and done.set()))
        assert done.wait(120)
    finally:
        engine.close()
    return "".join(c.text for c in chunks)


def test_serve_runs_the_default_pair_and_stops_cleanly(tmp_path: Path, smollm2) -> None:
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--out", str(repo), "--method", "dustin-h", "--max-batch", "1",
                 "--max-seq-len", "256"]) == 0
    command = [sys.executable, "-m", "trtllm_dustin.cli", "serve", "--repo", str(repo), "--http-port", "0",
               "--grpc-port", "0", "--server-dir", str(tmp_path / "server")]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines, deadline = [], time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line, "serve exited before it was ready:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("ready:"):
                break
        http = line.split("HTTP http://")[1].split(",")[0]
        grpc = line.split("gRPC ")[1].split(" ")[0]
        assert http.startswith("127.0.0.1:") and grpc.startswith("127.0.0.1:")  # this machine only, by default
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
        served = {method: streamed(grpc, method) for method in ("dustin-h",)}
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=120)
    assert server.returncode == 0 and rest.rstrip().endswith("stopped"), rest
    config = ServingConfig.load(repo / "dustin" / "1" / "serving_config.json")
    for method, text in served.items():
        assert text and text == in_process(config, method), method

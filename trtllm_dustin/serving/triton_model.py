"""The Triton Python-backend model: tensors in -> GenerationRequest -> ServingEngine -> responses out.

The repository's `1/model.py` only re-exports `TritonPythonModel` from here, so the logic lives in the installed
package (tested, linted) and the stub process needs `trtllm_dustin` importable (docs/serving.md, "environment").

Decoupled mode (`model_transaction_policy { decoupled: true }`): execute() hands each request to the engine and
returns at once; the scheduler thread sends responses through the request's response sender (many when
`stream` is true, one otherwise, the last with TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG), so requests of later
execute() calls join the running batch. Non-decoupled mode: execute() waits for its batch (Triton's dynamic
batcher forms it) and returns one response per request.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from trtllm_dustin.serving.config import ServingConfig
from trtllm_dustin.serving.stats import METRICS_DIR_ENV

__all__ = ["INPUTS", "OUTPUTS", "TritonPythonModel"]

# name -> (Triton type, dims without the batch dimension, optional). TensorRT-LLM's names where they exist.
# A request sends exactly one of text_input and input_ids (token ids, as TensorRT-LLM's `tensorrt_llm` model takes
# them; also the way around Python-backend stubs that mis-read BYTES inputs, docs/serving.md).
INPUTS: dict[str, tuple[str, list[int], bool]] = {
    "text_input": ("TYPE_STRING", [1], True),
    "input_ids": ("TYPE_INT32", [-1], True),
    "messages": ("TYPE_STRING", [1], True),  # a chat: JSON [{"role": ..., "content": ...}], the model's chat template
    "max_tokens": ("TYPE_INT32", [1], False),
    "fit_max_tokens": ("TYPE_BOOL", [1], True),  # true: max_tokens is lowered to what fits after the prompt
    "temperature": ("TYPE_FP32", [1], True),
    "top_p": ("TYPE_FP32", [1], True),
    "seed": ("TYPE_INT64", [1], True),
    "random_seed": ("TYPE_UINT64", [1], True),  # TensorRT-LLM's name and type for the seed
    "stop": ("TYPE_STRING", [-1], True),
    "method": ("TYPE_STRING", [1], True),
    "stream": ("TYPE_BOOL", [1], True),
}
# Request parameters Triton reserves for itself (besides every name starting with "triton_"), Triton's parameters
# extension: passed through, never refused as unknown fields.
_TRITON_PARAMETERS = ("sequence_id", "priority", "timeout", "sequence_start", "sequence_end", "headers")
# name -> (Triton type, numpy type, dims, RequestStats attribute or None for the text)
OUTPUTS: dict[str, tuple[str, Any, list[int], str | None]] = {
    "text_output": ("TYPE_STRING", np.object_, [-1], None),
    "generated_tokens": ("TYPE_INT32", np.int32, [1], "generated_tokens"),
    "prompt_tokens": ("TYPE_INT32", np.int32, [1], "prompt_tokens"),
    "rounds": ("TYPE_INT32", np.int32, [1], "rounds"),
    "mean_accepted_length": ("TYPE_FP32", np.float32, [1], "mean_accepted_length"),
    "acceptance_rate": ("TYPE_FP32", np.float32, [1], "acceptance_rate"),
    "total_accepted_draft_tokens": ("TYPE_INT32", np.int32, [1], "accepted_draft_tokens"),
    "total_draft_tokens": ("TYPE_INT32", np.int32, [1], "draft_tokens"),
    "time_to_first_token_ms": ("TYPE_FP32", np.float32, [1], "time_to_first_token_ms"),
    "decode_tokens_per_s": ("TYPE_FP32", np.float32, [1], "decode_tokens_per_s"),
    "finish_reason": ("TYPE_STRING", np.object_, [1], "finish_reason"),
}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        model_config = json.loads(args["model_config"])
        self.decoupled = bool(pb_utils.using_decoupled_model_transaction_policy(model_config))
        config = ServingConfig.load(Path(args["model_repository"]) / args["model_version"] / "serving_config.json")
        from trtllm_dustin.serving.engine import ServingEngine

        metrics_dir = os.environ.get(METRICS_DIR_ENV)  # set by the launcher: the HTTP front exports the snapshot
        self.engine = ServingEngine.from_config(
            config.with_(decoupled=self.decoupled),
            None if not metrics_dir else Path(metrics_dir) / f"{args['model_name']}.json")
        self.timeout_s = config.request_timeout_s
        # Named TRITONSERVER_RESPONSE_COMPLETE_FINAL in the Python backend of nvidia-pytriton 0.7.0 (Triton 2.5x),
        # TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG in other releases; both are 1.
        self.final_flag = getattr(pb_utils, "TRITONSERVER_RESPONSE_COMPLETE_FINAL_FLAG",
                                  getattr(pb_utils, "TRITONSERVER_RESPONSE_COMPLETE_FINAL", 1))

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            for request in requests:
                self._submit(request, request.get_response_sender())
            return None
        results: list[Any] = [None] * len(requests)
        done = [threading.Event() for _ in requests]
        for i, request in enumerate(requests):
            self._submit(request, None, results, i, done[i])
        for i, event in enumerate(done):  # bounded: a request past the timeout is answered with an error
            if not event.wait(self.timeout_s):
                results[i] = self._error(f"the request did not finish within request_timeout_s={self.timeout_s}; "
                                         "lower max_tokens or raise the timeout", "UNAVAILABLE")
        return results

    def finalize(self) -> None:
        self.engine.close()

    # ---- one request -------------------------------------------------------------------------------------
    def _submit(self, request: Any, sender: Any, results: list[Any] | None = None, index: int = 0,
                done: threading.Event | None = None) -> None:
        from trtllm_dustin.serving.engine import QueueFullError, RequestError, ResponseChunk

        def reply(response: Any, final: bool) -> None:
            if sender is not None:
                sender.send(response, flags=self.final_flag if final else 0)
            elif final:
                results[index] = response
                done.set()

        def on_chunk(chunk: ResponseChunk) -> None:
            if chunk.error is not None:
                reply(self._error(chunk.error, "CANCELLED" if chunk.cancelled else "INTERNAL"), True)
            else:
                reply(self._response(chunk), chunk.final)

        # The client closed its stream or its connection (decoupled: the sender knows; otherwise the request).
        cancelled = getattr(sender if sender is not None else request, "is_cancelled", None)
        try:
            parsed = _parse(request, self.pb)
        except RequestError as e:
            self.engine.refused("invalid")
            reply(self._error(str(e), "INVALID_ARG"), True)
            return
        try:
            self.engine.submit(parsed, on_chunk, cancelled)
        except RequestError as e:
            reply(self._error(str(e), "INVALID_ARG"), True)
        except QueueFullError as e:
            reply(self._error(str(e), "UNAVAILABLE"), True)

    def _response(self, chunk: Any) -> Any:
        tensors = [self.pb.Tensor("text_output", np.array([[chunk.text.encode("utf-8")]], dtype=np.object_))]
        for name, (_, np_type, _, attr) in OUTPUTS.items():
            if attr is not None:
                value = getattr(chunk.stats, attr)
                if isinstance(value, float) and not math.isfinite(value):
                    value = 0.0  # not known yet (no round, one token): 0, so that the generate endpoints' JSON parses
                if isinstance(value, str):
                    value = value.encode("utf-8")
                tensors.append(self.pb.Tensor(name, np.array([[value]], dtype=np_type)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _error(self, message: str, code: str) -> Any:
        code_value = getattr(self.pb.TritonError, code, None)
        error = self.pb.TritonError(message) if code_value is None else self.pb.TritonError(message, code_value)
        return self.pb.InferenceResponse(output_tensors=[], error=error)


def _scalar(request: Any, pb_utils: Any, name: str, default: Any = None) -> Any:
    """The single value of a [1, 1] input (batch of one), or `default` when the input was not sent."""
    from trtllm_dustin.serving.engine import RequestError

    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    array = tensor.as_numpy()
    if array.size != 1:
        raise RequestError(f"{name} has shape {list(array.shape)}; send one value per request (shape [1, 1]), one "
                           "prompt per request")
    return array.reshape(-1)[0]


def _text(value: Any, name: str) -> str:
    from trtllm_dustin.serving.engine import RequestError

    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not valid UTF-8 ({e}); send UTF-8 text") from e


def _parse(request: Any, pb_utils: Any) -> Any:
    """Triton tensors -> GenerationRequest. Types and required inputs are already checked by Triton itself, the
    values by the engine's submit (validation.py, in the request's terms)."""
    from trtllm_dustin.serving.engine import GenerationRequest, RequestError
    from trtllm_dustin.validation import HTTP, InputError, check_value

    # The generate endpoints hand every JSON key that names no input on as a request parameter: refused here, so that
    # a misspelt field ("tempreature") is not silently ignored. Triton's own parameters are reserved names.
    unknown = [name for name in json.loads(request.parameters() or "{}")
               if name not in _TRITON_PARAMETERS and not name.startswith("triton_")]
    if unknown:
        raise RequestError(f"{unknown[0]!r} is not a field of this model's requests; send only "
                           f"{', '.join(INPUTS)}")
    text = _scalar(request, pb_utils, "text_input")
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    messages = _scalar(request, pb_utils, "messages")
    max_tokens = _scalar(request, pb_utils, "max_tokens")
    if (text is None) + (ids_tensor is None) + (messages is None) != 2:
        raise RequestError("send exactly one of text_input (BYTES), input_ids (INT32 token ids) and messages (BYTES: "
                           "a JSON chat)")
    if max_tokens is None:
        raise RequestError("max_tokens (INT32) is required")
    input_ids = None if ids_tensor is None else tuple(int(i) for i in ids_tensor.as_numpy().reshape(-1))
    seed, random_seed = _scalar(request, pb_utils, "seed"), _scalar(request, pb_utils, "random_seed")
    if seed is not None and random_seed is not None:
        raise RequestError("send either seed (INT64) or random_seed (UINT64), not both")
    if random_seed is not None:  # checked under its own name; the engine checks the rest (validation.py)
        try:
            check_value("random_seed", int(random_seed), HTTP)
        except InputError as e:
            raise RequestError(str(e)) from None
    seed = int(seed if seed is not None else random_seed if random_seed is not None else 0)
    temperature = float(_scalar(request, pb_utils, "temperature", 0.0))
    top_p = float(_scalar(request, pb_utils, "top_p", 1.0))
    stop_tensor = pb_utils.get_input_tensor_by_name(request, "stop")
    stop = () if stop_tensor is None else tuple(_text(s, "stop") for s in stop_tensor.as_numpy().reshape(-1))
    method = _scalar(request, pb_utils, "method")
    return GenerationRequest(
        text="" if text is None else _text(text, "text_input"), input_ids=input_ids, max_tokens=int(max_tokens),
        messages=None if messages is None else _chat(_text(messages, "messages")),
        fit_max_tokens=bool(_scalar(request, pb_utils, "fit_max_tokens", False)),
        temperature=temperature, top_p=top_p, seed=seed,
        stop=stop, method=None if method is None else _text(method, "method"),
        stream=bool(_scalar(request, pb_utils, "stream", False)))


def _chat(text: str) -> tuple[tuple[str, str], ...]:
    """The `messages` input: a JSON list of {"role": str, "content": str} objects -> (role, content) pairs."""
    from trtllm_dustin.serving.engine import RequestError

    try:
        chat = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"messages is not JSON ({type(e).__name__}: {e}); send a JSON list of "
                           '{"role": ..., "content": ...} objects') from None
    if not isinstance(chat, list) or not chat or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in chat):
        raise RequestError('messages must be a non-empty JSON list of {"role": str, "content": str} objects')
    return tuple((m["role"], m["content"]) for m in chat)

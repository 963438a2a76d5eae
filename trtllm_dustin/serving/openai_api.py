"""The OpenAI API in Triton's terms: an OpenAI request -> the Triton model's generate request, and its answers back.

The front (front.py) sends what `to_triton` builds to the Triton model's own generate / generate_stream endpoint, so
the one engine and its scheduler serve both APIs. Here: checking an OpenAI body field by field (a 400 whose `param`
names the field), naming the model and method (`model`: a Triton model, `<model>:<method>` for a method other than
its default), and the completion, chat completion, streamed chunk and usage objects.

OpenAI's defaults are kept: temperature 1, top_p 1, a random seed, 16 tokens for a completion, and for a chat as
many as the model holds after the prompt (the `fit_max_tokens` input).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtllm_dustin.serving.config import ServingConfig

__all__ = ["ApiError", "GenerateCall", "ServedModel", "chunk", "completion", "error_body", "from_triton_error",
           "parse_request", "served_models", "usage"]

_MAX_SEED = 2**63 - 2  # the engine's seed range (validation.py)
_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_ROLES = ("system", "developer", "user", "assistant")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user")
_FIELDS = {True: (*_COMMON, "messages", "max_completion_tokens"), False: (*_COMMON, "prompt")}
# Accepted at these values only (what the openai client and common tools send as defaults); anything else is refused
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, None), "presence_penalty": (0, None), "logprobs": (False, None), "top_logprobs": (None,),
    "echo": (False, None), "best_of": (1, None), "logit_bias": (None, {}), "suffix": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "service_tier": (None, "auto", "default"), "metadata": (None, {}), "store": (None, False),
}


class ApiError(Exception):
    """An OpenAI error: HTTP status, one-line message, the field it concerns (`param`), its type and code."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


@dataclass(frozen=True)
class ServedModel:
    """A Triton model of the repository as the OpenAI API names it."""

    name: str  # the Triton model: its `model` id serves its default method
    methods: tuple[str, ...]
    default_method: str

    def ids(self) -> list[str]:
        return [self.name, *(f"{self.name}:{m}" for m in self.methods)]


def served_models(repository: str | Path) -> dict[str, ServedModel]:
    """The repository's models (each `<name>/1/serving_config.json`), by name."""
    models = {}
    for path in sorted(Path(repository).glob("*/1/serving_config.json")):
        config = ServingConfig.load(path)
        name = path.parent.parent.name
        models[name] = ServedModel(name, config.methods, config.method)
    return models


@dataclass(frozen=True)
class GenerateCall:
    """One OpenAI request, translated: where it goes, what Triton gets, how its answer is written."""

    chat: bool
    model_id: str  # as the client named it (echoed in every answer)
    triton_model: str
    method: str
    payload: dict  # the Triton generate request's JSON
    stream: bool
    include_usage: bool
    request_id: str
    created: int


def parse_request(body: bytes, chat: bool, models: dict[str, ServedModel]) -> GenerateCall:
    """Check an OpenAI completion (chat: chat completion) body; raise ApiError naming the first bad field."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as e:  # the guard bounded the nesting; this is the JSON's own error
        raise ApiError(400, f"the body is not JSON ({e}); send a JSON object", code="invalid_json") from None
    if not isinstance(request, dict):
        raise ApiError(400, f"the body is a JSON {type(request).__name__}, not an object; send a JSON object",
                       code="invalid_json")
    for name, value in request.items():
        if name in _DEFAULTS:
            if not any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in _DEFAULTS[name]):
                raise ApiError(400, f"{name}={json.dumps(value)[:60]} is not supported by this server; drop it",
                               name, code="unsupported_parameter")
        elif name not in _FIELDS[chat]:
            raise ApiError(400, f"unrecognized request argument supplied: {name}; send only "
                           f"{', '.join(_FIELDS[chat])}", name, code="unknown_parameter")
    model_id = _typed(request, "model", str, required=True)
    name, _, method = model_id.partition(":")
    served = models.get(name)
    if served is None or (method and method not in served.methods):
        ids = [i for m in models.values() for i in m.ids()]
        raise ApiError(404, f"the model {model_id!r} does not exist; choose one of {', '.join(ids)} (GET /v1/models)",
                       "model", code="model_not_found")
    n = _typed(request, "n", int)
    if n not in (None, 1):
        raise ApiError(400, f"n={n}: this server returns one choice per request; send n=1 (or send the request n "
                       "times with different seeds)", "n", code="unsupported_value")
    stream = bool(_typed(request, "stream", bool))
    options = _typed(request, "stream_options", dict)
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream=true; drop it or stream",
                           "stream_options")
        unknown = [k for k in options if k != "include_usage"]
        if unknown:
            raise ApiError(400, f"stream_options.{unknown[0]} is not supported; send only include_usage",
                           f"stream_options.{unknown[0]}")
        include_usage = bool(_typed(options, "include_usage", bool, prefix="stream_options."))
    payload: dict[str, Any] = {"method": method or served.default_method, "stream": stream}
    if chat:
        payload["messages"] = json.dumps(_messages(request.get("messages")))
    else:
        payload.update(_prompt(request.get("prompt")))
    field = "max_completion_tokens" if chat and request.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(request, field, int)  # chat: max_completion_tokens first, as OpenAI reads them
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{field}={max_tokens} must be >= 1; send a positive number", field)
    if max_tokens is None and chat:  # OpenAI: as many as fit
        payload.update(max_tokens=2**31 - 1, fit_max_tokens=True)
    else:
        payload["max_tokens"] = min(max_tokens or _COMPLETION_MAX_TOKENS, 2**31 - 1)
    for field, default in (("temperature", 1.0), ("top_p", 1.0)):
        value = _typed(request, field, float)
        payload[field] = default if value is None else value
    seed = _typed(request, "seed", int)
    payload["seed"] = secrets.randbelow(_MAX_SEED + 1) if seed is None else seed
    stop = request.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 16:
            raise ApiError(400, f"stop={json.dumps(stop)[:60]} must be a string or a list of at most 16 strings",
                           "stop")
        if stops:
            payload["stop"] = stops
    _typed(request, "user", str)
    prefix = "chatcmpl" if chat else "cmpl"
    return GenerateCall(chat, model_id, served.name, payload["method"], payload, stream, include_usage,
                        f"{prefix}-{secrets.token_hex(12)}", int(time.time()))


def _typed(request: dict, name: str, kind: type, required: bool = False, prefix: str = "") -> Any:
    """request[name] checked against `kind` (int: not a bool nor a float; float: any finite number), or None."""
    value = request.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{prefix}{name} is required", f"{prefix}{name}", code="missing_required_parameter")
        return None
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        want = {float: "a number", int: "an integer", bool: "true or false", str: "a string", dict: "an object"}[kind]
        raise ApiError(400, f"{prefix}{name}={json.dumps(value)[:60]} must be {want}", f"{prefix}{name}",
                       code="invalid_type")
    return float(value) if kind is float else value


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with role and content", where)
        unknown = [k for k in message if k not in ("role", "content", "name")]
        if unknown:
            raise ApiError(400, f"{where}.{unknown[0]} is not supported; send role and content",
                           f"{where}.{unknown[0]}")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise ApiError(400, f"{where}.role={json.dumps(role)[:40]} must be one of {', '.join(_ROLES)}",
                           f"{where}.role")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"{where}.content parts must be {{\"type\": \"text\", \"text\": str}} objects "
                               "(this server reads text only)", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(prompt: Any) -> dict[str, Any]:
    """A completion's prompt: a string, a list of one string, a list of token ids, or a list of one such list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty; send at least one character", "prompt")
        return {"text_input": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"input_ids": prompt}
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server answers one per request, send them one "
                       "by one", "prompt")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")


# ---- answers -------------------------------------------------------------------------------------------------
def usage(response: dict) -> dict[str, int]:
    prompt, generated = int(response.get("prompt_tokens", 0)), int(response.get("generated_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _statistics(call: GenerateCall, response: dict) -> dict[str, Any]:
    """The speculative statistics of the answer (beside OpenAI's fields; clients ignore it or read it as extra)."""
    return {"method": call.method, "rounds": int(response.get("rounds", 0)),
            "mean_accepted_length": float(response.get("mean_accepted_length", 0.0)),
            "accepted_draft_tokens": int(response.get("total_accepted_draft_tokens", 0)),
            "draft_tokens": int(response.get("total_draft_tokens", 0)),
            "time_to_first_token_ms": float(response.get("time_to_first_token_ms", 0.0))}


def completion(call: GenerateCall, response: dict) -> dict:
    """The whole answer from the Triton model's one response."""
    text, reason = response.get("text_output", ""), response.get("finish_reason") or "stop"
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": call.request_id, "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created, "model": call.model_id, "choices": [choice], "usage": usage(response),
            "dustin": _statistics(call, response)}


def chunk(call: GenerateCall, text: str | None, finish_reason: str | None = None, response: dict | None = None,
          first: bool = False) -> dict:
    """One streamed chunk: a piece of text (chat: the first also names the role), the last with its finish reason,
    or (text None, response given) the usage chunk with no choice."""
    body: dict[str, Any] = {"id": call.request_id, "object": "chat.completion.chunk" if call.chat else
                            "text_completion", "created": call.created, "model": call.model_id}
    if text is None and response is not None:
        body.update(choices=[], usage=usage(response), dustin=_statistics(call, response))
        return body
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if call.chat:
        choice["delta"] = {"role": "assistant", "content": text or ""} if first else \
            ({"content": text} if text else {})
    else:
        choice["text"] = text or ""
    body["choices"] = [choice]
    return body


_FIELD = re.compile(r"^(\w+)")
# Triton input name -> the OpenAI field a client sent it as (chat: messages, completion: prompt)
_RENAMES = {"text_input": "prompt", "input_ids": "prompt", "method": "model"}


def from_triton_error(call: GenerateCall | None, status: int, message: str) -> ApiError:
    """The Triton model's error as an OpenAI error: its leading field name, in OpenAI's terms, is the `param`."""
    if "queue is full" in message:
        return ApiError(429, message, None, "rate_limit_error", "queue_full")
    if "shutting down" in message or "is not healthy" in message:  # stopping, or a backend stub died: restarting
        return ApiError(503, message, None, "server_error", "shutting_down")
    if status != 400:
        return ApiError(500 if status < 500 else status, message, None, "server_error", "backend_error")
    renames = dict(_RENAMES, text_input="messages") if call is not None and call.chat else _RENAMES
    for old, new in renames.items():
        message = re.sub(rf"\b{old}\b", new, message)
    match = _FIELD.match(message)
    param = match.group(1) if match and match.group(1) in (*_COMMON, "prompt", "messages") else None
    return ApiError(400, message, param)

"""The OpenAI path against Triton's generate path of one `trtllm-dustin serve`, on the same load.

N concurrent streaming clients each send the same prompts, greedy, `--max-tokens` tokens, through
`/v1/completions` (stream) and through `/v2/models/<model>/generate_stream`, alternating the two paths `--rounds`
times (the first round of each is a warm-up and not counted); prints generated tokens per second of each path (tokens
counted from the answers' usage / generated_tokens, time from the first request sent to the last answer ended).

    trtllm-dustin serve --repo models --http-port 8000 &
    python benchmarks/bench_front.py --url http://127.0.0.1:8000 --model dustin --method vanilla --clients 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

PROMPTS = ["Once upon a time, a dragon", "List three facts about the Moon:\n1.", "The capital of France is",
           "def fibonacci(n):\n", "Write a short poem about the sea.\nThe sea", "Dear team,\nThank you for"]


def _openai(url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
    return tokens


def _triton(url: str, model: str, method: str, prompt: str, max_tokens: int) -> int:
    body = {"text_input": prompt, "max_tokens": max_tokens, "method": method, "stream": True}
    tokens = 0
    with httpx.stream("POST", f"{url}/v2/models/{model}/generate_stream", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens = json.loads(line[6:]).get("generated_tokens", tokens)
    return tokens


def run(path: str, args: argparse.Namespace) -> float:
    """Tokens per second of `args.clients` concurrent requests over `path`."""
    def one(i: int) -> int:
        prompt = PROMPTS[i % len(PROMPTS)]
        if path == "openai":
            return _openai(args.url, f"{args.model}:{args.method}", prompt, args.max_tokens)
        return _triton(args.url, args.model, args.method, prompt, args.max_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        tokens = sum(pool.map(one, range(args.clients)))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="dustin")
    parser.add_argument("--method", default="vanilla")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per path, after one warm-up each")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"triton": [], "openai": []}
    for round_ in range(args.rounds + 1):
        for path in ("triton", "openai"):
            rate = run(path, args)
            if round_:
                rates[path].append(rate)
            print(f"round {round_} {path}: {rate:.1f} tokens/s{' (warm-up)' if not round_ else ''}", flush=True)
    medians = {path: statistics.median(r) for path, r in rates.items()}
    ratio = medians["openai"] / medians["triton"]
    print(f"median tokens/s: Triton generate_stream {medians['triton']:.1f}, OpenAI /v1/completions "
          f"{medians['openai']:.1f} (OpenAI / Triton = {ratio:.3f})")
    if args.out is not None:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "git": sha, "rates": rates,
                                        "median": medians, "ratio": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()

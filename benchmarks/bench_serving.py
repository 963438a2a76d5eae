"""Serving load test: N concurrent streaming gRPC clients against a tritonserver for a fixed duration per method.

Reports per method: completed requests, output tokens/s (all clients), time to first token and inter-token latency
percentiles (client side: a streamed piece's gap divided by the tokens it carries), and the server's mean
accepted length. By default it writes a repository and launches nvidia-pytriton's tritonserver itself; with
--url it loads an already running server (whose repository must serve the methods asked for).

CPU, tiny presets (what CI machines can run):
    python benchmarks/bench_serving.py --model preset:tiny-llama --draft preset:tiny-llama-draft \
        --dustin-placeholder --methods vanilla classic dustin-h --clients 8 --duration 20
H200 (SmolLM2 + the trained draft, prompts from the test split, final report only):
    python benchmarks/bench_serving.py --draft DRAFT --dustin-config CFG --device cuda --prompts test \
        --prompt-tokens 4096 --max-tokens 256 --clients 16 --duration 120

--mixed-load (in process, no server: the serving engine's own scheduler, what chunked prefill changes): `--clients`
- 1 background clients decode (`--prompt-tokens`, `--max-tokens`, back to back) while one client sends long prompts
(`--long-prompts` tokens, cycled, `--long-max-tokens` each) one after another; TTFT of the long requests and the
background clients' inter-token latency, p50 / p99, once per `--prefill-chunks` value (a chunk at least as long as
the longest prompt is the whole prompt at admission: no chunking):
    python benchmarks/bench_serving.py --mixed-load --model preset:llama-3.1-8b --device cuda --clients 16 \
        --prompt-tokens 1024 --max-tokens 512 --long-prompts 8192,16384,32768 --prefill-chunks 2048,8192,32768
"""

from __future__ import annotations

import argparse
import gc
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import RESULTS, environment, save_json

from trtllm_dustin.dustin_config import DustinConfig, LayerHeads
from trtllm_dustin.serving import ServingConfig, write_model_repository
from trtllm_dustin.serving.launch import TritonServer, prepare_pytriton_server
from trtllm_dustin.validation import DEFAULT_PREFILL_BUDGET

# The tiny presets' shapes; a stand-in where no searched config exists (it sets the estimator's cost, not quality).
TINY_DUSTIN = DustinConfig(target_layers=(LayerHeads(1, (0, 4)),),
                           draft_layers=(LayerHeads(0, (1,)), LayerHeads(1, (2, 3))), budget=64, m=16)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values)
    return {f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)} | {"mean": float(array.mean())}


def prompts(args: argparse.Namespace, count: int) -> list[str]:
    """Fixed prompts: random characters for tokenizer-less presets (character i is token i), the decoded windows of
    an eval_tau .npz, or document prefixes of a corpus split. --shared-prefix N: each one after the same N-token
    document (random characters, or the first of the windows / documents), as users who ask about one long
    document do."""
    if args.shared_prefix:
        return _after_shared_document(prompts, args, count)
    if args.prompts == "random":
        return ["".join(chr(i) for i in ids) for ids in prompt_ids(args, count)]
    if args.prompts.endswith(".npz"):  # test-split token windows from eval_tau.py --save-prompts (no corpora needed)
        from trtllm_dustin.models import load_model

        tokenizer = load_model(args.model).tokenizer
        return [tokenizer.decode(ids) for ids in prompt_ids(args, count)]
    from trtllm_dustin.data import final_report_documents, split_documents

    docs = final_report_documents() if args.prompts == "test" else split_documents(args.prompts)
    out = []
    for doc in docs:  # about 4 characters per token: the server counts the real prompt tokens
        if len(doc.text) >= 4 * args.prompt_tokens:
            out.append(doc.text[: 4 * args.prompt_tokens])
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} {args.prompts} documents are long enough for --prompt-tokens "
                     f"{args.prompt_tokens}; lower it")


def _after_shared_document(make, args: argparse.Namespace, count: int) -> list:
    """`count` prompts of `make` (prompts or prompt_ids), each after the same --shared-prefix-token document (the
    first prompt `make` gives at that length; the requests' own parts skip it)."""
    def without_prefix(**changes) -> argparse.Namespace:
        return argparse.Namespace(**(vars(args) | {"shared_prefix": 0} | changes))

    document = make(without_prefix(prompt_tokens=args.shared_prefix), 1)[0]
    return [document + own for own in make(without_prefix(), count + 1)[1:]]


def request_arrays(prompt: str | list[int], method: str | None, max_tokens: int) -> dict[str, np.ndarray]:
    """One streaming request's inputs: text_input, or input_ids for a token-id prompt; `method` only when named."""
    arrays = ({"input_ids": np.array([prompt], dtype=np.int32)} if isinstance(prompt, list)
              else {"text_input": np.array([[prompt.encode()]], dtype=np.object_)})
    arrays |= {"max_tokens": np.array([[max_tokens]], dtype=np.int32), "stream": np.array([[True]], dtype=np.bool_)}
    if method is not None:
        arrays["method"] = np.array([[method.encode()]], dtype=np.object_)
    return arrays


def prompt_ids(args: argparse.Namespace, count: int) -> list[list[int]]:
    """The prompts as token ids: random ids in [2, 257) for tokenizer-less presets, or windows of an eval_tau .npz
    (test-split token windows, no corpora needed), evenly spaced over its documents."""
    if args.shared_prefix:
        return _after_shared_document(prompt_ids, args, count)
    if args.prompts == "random":
        rng = np.random.default_rng(0)
        return [rng.integers(2, 257, args.prompt_tokens).tolist() for _ in range(count)]
    if not args.prompts.endswith(".npz"):
        raise SystemExit("--token-ids takes --prompts random or a .npz of token windows (eval_tau.py --save-prompts)")
    from eval_tau import load_documents

    docs = [d for family in load_documents(Path(args.prompts), None).values() for d in family]
    n = args.prompt_tokens
    ids = [tokens[: n].tolist() for _, tokens in docs if len(tokens) >= n]
    if len(ids) < count:  # more clients than long documents: later disjoint windows of the long ones too
        ids += [tokens[start: start + n].tolist() for _, tokens in docs for start in range(n, len(tokens) - n + 1, n)]
    if not ids:
        raise SystemExit(f"no window of {n} tokens in {args.prompts}; lower --prompt-tokens")
    if len(ids) < count:  # still short: clients share windows (no prefix cache in play unless asked for)
        print(f"only {len(ids)} windows of {n} tokens in {args.prompts}: {count} clients reuse them in turn",
              file=sys.stderr)
        ids = [ids[i % len(ids)] for i in range(count)]
    return ids[:: max(1, len(ids) // count)][:count]


def client(url: str, model: str, method: str | None, texts: list, max_tokens: int, deadline: float,
           record: dict, lock: threading.Lock, max_requests: int | None = None) -> None:
    """One client: streaming requests back to back until the deadline (or max_requests)."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
        i = 0
        while time.perf_counter() < deadline and (max_requests is None or i < max_requests):
            arrays = request_arrays(texts[i % len(texts)], method, max_tokens)
            i += 1
            inputs = []
            for name, array in arrays.items():
                tensor = grpcclient.InferInput(name, list(array.shape), {"O": "BYTES", "i": "INT32",
                                                                         "b": "BOOL"}[array.dtype.kind])
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            sent = time.perf_counter()
            c.async_stream_infer(model, inputs, enable_empty_final_response=True)
            last, tokens, gaps, ttft, tau = sent, 0, [], None, None
            for _ in range(max_tokens + 2):
                result, error, at = responses.get(timeout=600)
                if error is not None:
                    raise RuntimeError(f"request failed: {error}")
                if result.as_numpy("generated_tokens") is not None:
                    count = int(result.as_numpy("generated_tokens").reshape(-1)[0])
                    if ttft is None:
                        ttft = (at - sent) * 1e3
                    elif count > tokens:
                        gaps += [(at - last) * 1e3 / (count - tokens)] * (count - tokens)
                    tokens, last = count, at
                    if int(result.as_numpy("rounds").reshape(-1)[0]) > 0:  # 0 rounds: the server sends tau 0
                        tau = float(result.as_numpy("mean_accepted_length").reshape(-1)[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            with lock:
                record["requests"] += 1
                record["tokens"] += tokens
                record["ttft_ms"].append(ttft)
                record["itl_ms"] += gaps
                if tau is not None:  # a request that ended at its first token ran no round: no tau of its own
                    record["tau"].append(tau)
        c.stop_stream()


def run_method(url: str, model: str, method: str, args: argparse.Namespace, texts: list,
               send_method: bool = True) -> dict:
    """Warm-up, then args.clients clients for args.duration seconds. send_method=False: the server's default."""
    record = {"requests": 0, "tokens": 0, "ttft_ms": [], "itl_ms": [], "tau": []}
    lock = threading.Lock()
    # Warm-up, excluded: one request, so lazy set-up (graph capture, JIT) is not timed.
    named = method if send_method else None
    client(url, model, named, texts[:1], args.max_tokens, float("inf"), dict(record, ttft_ms=[], itl_ms=[], tau=[]),
           lock, max_requests=1)
    start = time.perf_counter()
    deadline = start + args.duration
    threads = [threading.Thread(target=client, args=(url, model, named, texts[i::args.clients] or texts,
                                                     args.max_tokens, deadline, record, lock))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.duration + 600)
    elapsed = time.perf_counter() - start  # includes finishing the requests running at the deadline
    taus = [t for t in record["tau"] if t == t]
    return {"method": method, "clients": args.clients, "requests": record["requests"], "seconds": elapsed,
            "output_tokens_per_s": record["tokens"] / elapsed, "ttft_ms": percentiles(record["ttft_ms"]),
            "inter_token_ms": percentiles(record["itl_ms"]),
            "mean_accepted_length": statistics.fmean(taus) if taus else None}


def mixed_load(args: argparse.Namespace, chunk: int) -> dict:
    """The serving engine in process at one prefill chunk: background decoders plus one client of long prompts."""
    from trtllm_dustin.serving.engine import GenerationRequest, ServingEngine

    longs = [int(n) for n in args.long_prompts.split(",")]
    rng = np.random.default_rng(0)
    config = ServingConfig(model=args.model, methods=tuple(args.methods[:1]), max_batch=args.clients,
                           max_seq_len=max(longs) + max(args.long_max_tokens, args.max_tokens) + 16,
                           queue_size=4 * args.clients, device=args.device, prefill_chunk=chunk,
                           prefill_budget=args.prefill_budget)
    engine = ServingEngine.from_config(config)
    vocab = engine.vocab_size or 256
    record = {"ttft_ms": {n: [] for n in longs}, "itl_ms": [], "background_tokens": 0}
    lock = threading.Lock()

    def run(ids: list[int], max_tokens: int, on_piece) -> None:
        """One streaming request, blocking until its final piece; on_piece(at, generated, stats) per piece."""
        done = threading.Event()

        def on_chunk(piece) -> None:
            on_piece(time.perf_counter(), piece.stats.generated_tokens, piece)
            if piece.final:
                done.set()

        engine.submit(GenerationRequest(text="", max_tokens=max_tokens, stream=True, input_ids=tuple(ids)), on_chunk)
        done.wait(600)

    def background(deadline: float) -> None:
        while time.perf_counter() < deadline:
            state = {"last": None, "count": 0}

            def on_piece(at, generated, piece, state=state) -> None:
                if state["last"] is not None and generated > state["count"]:
                    with lock:
                        record["itl_ms"] += [(at - state["last"]) * 1e3 / (generated - state["count"])] * \
                            (generated - state["count"])
                state["last"], state["count"] = at, generated

            run(rng.integers(2, vocab, args.prompt_tokens).tolist(), args.max_tokens, on_piece)
            with lock:
                record["background_tokens"] += state["count"]

    def long_client(deadline: float, warm: bool = False) -> None:
        i = 0
        while time.perf_counter() < deadline or warm:
            n = longs[i % len(longs)]
            i += 1
            sent, first = time.perf_counter(), []
            run(rng.integers(2, vocab, n).tolist(), args.long_max_tokens,
                lambda at, generated, piece, first=first: first.append(at) if not first else None)
            if warm:  # the first long prompt compiles the prefill kernels: excluded
                return
            with lock:
                record["ttft_ms"][n].append((first[0] - sent) * 1e3)

    long_client(0.0, warm=True)
    deadline = time.perf_counter() + args.duration
    threads = [threading.Thread(target=background, args=(deadline,)) for _ in range(args.clients - 1)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the background requests are decoding before the first long prompt arrives
    long_client(deadline)
    for t in threads:
        t.join(600)
    engine.close()
    engine = None  # the next chunk's engine loads its own weights and caches: free these first
    gc.collect()
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    result = {"prefill_chunk": chunk, "method": config.method, "clients": args.clients,
              "long_ttft_ms": {str(n): percentiles(v) | {"count": len(v)} for n, v in record["ttft_ms"].items()},
              "background_inter_token_ms": percentiles(record["itl_ms"]),
              "background_tokens_per_s": record["background_tokens"] / args.duration}
    ttft = ", ".join(f"{n}: p50 {r.get('p50', float('nan')):.0f} p99 {r.get('p99', float('nan')):.0f}"
                     for n, r in result["long_ttft_ms"].items())
    itl = result["background_inter_token_ms"]
    print(f"chunk {chunk}: long-prompt TTFT ms ({ttft}); background ITL p50 {itl.get('p50', float('nan')):.1f} "
          f"p99 {itl.get('p99', float('nan')):.1f} ms, {result['background_tokens_per_s']:.0f} tokens/s", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--dustin-config", type=Path, default=None)
    p.add_argument("--dustin-placeholder", action="store_true", help="the tiny presets' stand-in Dustin config")
    p.add_argument("--methods", nargs="+", default=["vanilla", "classic", "dustin-h"])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per method")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--prompts", default="random",
                   help="random, validation, test (corpora installed) or a .npz from eval_tau.py --save-prompts")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of one shared document before every prompt (0: none); --prompt-tokens is then each "
                   "request's own part")
    p.add_argument("--prefix-cache-mib", type=int, default=0, help="the served config's prefix cache (0: off)")
    p.add_argument("--prefix-block", type=int, default=256, help="the served config's prefix-cache block")
    p.add_argument("--prefill-budget", type=int, default=DEFAULT_PREFILL_BUDGET,
                   help="the served config's prompt tokens per scheduler step (0: one chunk per step, the scheduler "
                   "before batched prefill)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="the served config's prefill chunk")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--url", default=None, help="gRPC address of a running server (default: launch one)")
    p.add_argument("--model-name", default="dustin")
    p.add_argument("--token-ids", action="store_true",
                   help="send prompts as input_ids (INT32) and run one server per method, so that no request holds "
                        "a BYTES input (for Python-backend stubs that mis-read them; docs/serving.md)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--mixed-load", action="store_true", help="in process: background decoders + long prompts "
                   "(the docstring says how), the first of --methods")
    p.add_argument("--long-prompts", default="8192,16384,32768", help="--mixed-load: long prompt lengths, cycled")
    p.add_argument("--long-max-tokens", type=int, default=16, help="--mixed-load: tokens per long request")
    p.add_argument("--prefill-chunks", default="2048,8192,32768", help="--mixed-load: prefill chunk sizes compared")
    args = p.parse_args()
    if args.mixed_load:
        device = "h200" if args.device.startswith("cuda") else "cpu"
        results = []
        for chunk in args.prefill_chunks.split(","):  # saved after each, so a later failure keeps the earlier ones
            results.append(mixed_load(args, int(chunk)))
            save_json(args.out or RESULTS / "prefill" / f"serving_mixed_{device}.json",
                      {**environment(), "model": args.model, "prompt_tokens": args.prompt_tokens,
                       "max_tokens": args.max_tokens, "long_prompts": args.long_prompts,
                       "long_max_tokens": args.long_max_tokens, "duration_s": args.duration, "results": results})
        return
    dustin = DustinConfig.load(args.dustin_config) if args.dustin_config else (
        TINY_DUSTIN if args.dustin_placeholder else None)
    texts = prompt_ids(args, max(args.clients, 8)) if args.token_ids else prompts(args, max(args.clients, 8))
    config = ServingConfig(model=args.model, draft=args.draft, methods=tuple(args.methods), dustin=dustin,
                           max_batch=args.max_batch, max_seq_len=args.max_seq_len or 2 * args.prompt_tokens +
                           args.shared_prefix + args.max_tokens + 16, queue_size=4 * args.clients, device=args.device,
                           prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                           prefix_cache_mib=args.prefix_cache_mib, prefix_block=args.prefix_block)
    if args.token_ids and args.url is not None:
        raise SystemExit("--token-ids launches one server per method; it cannot use --url")
    results = []
    # --token-ids: one server per method serving only that method, so no request holds a BYTES input.
    rounds = [(config.with_(methods=(m,)), [m]) for m in args.methods] if args.token_ids else [(config, args.methods)]
    for served, methods in rounds:
        results += serve_and_load(served, methods, args, texts)
    device = "h200" if args.device.startswith("cuda") else "cpu"
    save_json(args.out or RESULTS / f"serving_{device}.json",
              {**environment(), "config": json_safe(config), "prompt_tokens": args.prompt_tokens,
               "shared_prefix_tokens": args.shared_prefix,
               "prompts": args.prompts, "max_tokens": args.max_tokens, "duration_s": args.duration,
               "prompt_inputs": "input_ids (one server per method)" if args.token_ids else "text_input",
               "results": results})


def serve_and_load(config: ServingConfig, methods: list[str], args: argparse.Namespace, texts: list) -> list[dict]:
    """Launch a server on `config` (unless --url) and run the load for each method in turn."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.url is None:
            write_model_repository(Path(tmp) / "repo", config, args.model_name)
            server = TritonServer(Path(tmp) / "repo", prepare_pytriton_server(Path(tmp) / "server"),
                                  Path(tmp) / "server.log", start_timeout_s=900)
        else:
            server, url = None, args.url
        try:
            if server is not None:
                url = server.start().grpc_url
            for method in methods:  # (the server log is copied beside the results if a method fails)
                results.append(run_method(url, args.model_name, method, args, texts, send_method=not args.token_ids))
                r = results[-1]
                print(f"{method:10s} {r['requests']:4d} req  {r['output_tokens_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{r['ttft_ms'].get('p50', float('nan')):7.1f} p99 {r['ttft_ms'].get('p99', float('nan')):7.1f}"
                      f" ms  ITL p50 {r['inter_token_ms'].get('p50', float('nan')):6.2f} p99 "
                      f"{r['inter_token_ms'].get('p99', float('nan')):6.2f} ms  tau {r['mean_accepted_length']}",
                      flush=True)
        except Exception:
            if server is not None and (Path(tmp) / "server.log").is_file():
                log = (args.out or RESULTS / "serving.json").with_suffix(".server.log")
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text((Path(tmp) / "server.log").read_text()[-200_000:])
                print(f"server log: {log}")
            raise
        finally:
            if server is not None:
                server.stop()
    return results


def json_safe(config: ServingConfig) -> dict:
    import json

    return json.loads(config.to_json())


if __name__ == "__main__":
    main()

"""Decoder.generate's stop rule on the GPU: the rounds run after the last sequence finished (idle rounds) and what they
cost, for GenerationConfig.run_ahead values (0: no bound, the earlier rule), on the real pair. Each decoder is built
once; every setting runs `--repeats` times after a warm-up, on the same prompts.

    python benchmarks/dev/bench_stop_rule.py --model SmolLM2-135M-Instruct.Q4_1.gguf --out stop_rule_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import DEFAULT_LONGSPARK, load_longspark
from trtllm_dustin.models.packaged import DEFAULT_DRAFT, default_dustin_config_path
from trtllm_dustin.runtime.build import build_runtime
from trtllm_dustin.runtime.generation import GenerationConfig
from trtllm_dustin.serving.text import TokenizerCodec

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="the target (None: the embedded default)")
    parser.add_argument("--methods", nargs="+", default=["dustin-ip-sparse-draft", "longspark", "vanilla"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--run-ahead", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # the CPU reads the flag after every round (no idle rounds): a check of the script, not a measurement
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    loaded = load_model(args.model, device=device, dtype=dtype)
    target, tokenizer = loaded.model, loaded.tokenizer
    draft = load_model(DEFAULT_DRAFT, device=device, dtype=dtype, share_with=target).model
    spark = load_longspark(DEFAULT_LONGSPARK, target)
    dustin = DustinConfig.from_json(default_dustin_config_path().read_text())
    prompt = TokenizerCodec(tokenizer, chat_template=True).encode(PROMPT)
    rows = []
    for method in args.methods:
        for batch in args.batches:
            decoder = build_runtime(method, target, draft=draft, longspark=spark, dustin=dustin, batch_slots=batch,
                                    max_seq_len=len(prompt) + args.max_new_tokens + 8, dtype=dtype)
            for ahead in args.run_ahead:
                config = GenerationConfig(args.max_new_tokens, eos_token_ids=tuple(target.config.eos_token_ids),
                                          run_ahead=ahead)
                decoder.generate([prompt] * batch, config)  # warm-up (capture)
                for _ in range(args.repeats):
                    r = decoder.generate([prompt] * batch, config)
                    rows.append(dict(method=method, batch=batch, run_ahead=ahead, rounds=r.rounds,
                                     decoding_rounds=r.decoding_rounds, idle_rounds=r.rounds - r.decoding_rounds,
                                     decode_ms=r.decode_ms, decoding_ms=r.decoding_ms,
                                     tokens=sum(len(t) for t in r.tokens)))
                    print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    sha = os.environ.get("GIT_SHA") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                      text=True).stdout.strip()
    args.out.write_text(json.dumps(dict(command=" ".join(["python3", *sys.argv]), gpu=gpu, git_sha=sha,
                                        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

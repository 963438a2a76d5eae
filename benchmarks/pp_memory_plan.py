"""Memory plans of the pipeline-parallel runs of issues 27 and 28: what each stage holds, against one H200.

For each pair, pipeline size, batch and context: every stage's weights and KV caches as the engine's own check
computes them (build_engines/engine.py `stage_bytes`: contiguous target layers, the embedding on the first stage, the
norm and head on the last, the draft and its cache on the first), in bf16, the largest stage against the usable
memory of an idle H200 (90 % of 139.8 GiB free, the margin `check_fits` keeps). Configs only: nothing is allocated,
so this runs on any machine.

    python benchmarks/pp_memory_plan.py --out benchmarks/results/pipeline/memory_plans.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from trtllm_dustin.build_engines.engine import stage_bytes
from trtllm_dustin.models.presets import get_preset
from trtllm_dustin.runtime.pipeline import layer_split

GIB = 2 ** 30
H200_FREE = 139.8 * GIB  # what an idle H200 reports free (143771 MiB total)
USABLE = 0.9  # check_fits' margin
# (issue, target, draft, pipeline sizes, batches, contexts)
RUNS = [
    (27, "qwen2.5-14b", "qwen2.5-0.5b", (1, 2), (16,), (16384, 32768)),
    (27, "llama-3.1-8b", "llama-3.2-1b", (1, 2), (16,), (32768,)),
    (28, "qwen2.5-72b", "qwen2.5-0.5b", (1, 2, 4), (8, 16), (8192, 16384, 32768)),
    (28, "llama-3.3-70b", "llama-3.2-1b", (1, 2, 4), (8, 16), (8192, 16384, 32768)),
]


def plan(target: str, draft: str, pp: int, batch: int, context: int, margin: int = 512) -> dict:
    """The stages of one run: a cache of context + margin positions (the draft's Γ and the round's tokens)."""
    configs = {"target": get_preset(target), "draft": get_preset(draft)}
    layers = layer_split(configs["target"].num_layers, pp)
    stages = [stage_bytes(configs, layers, rank, batch, context + margin, torch.bfloat16) for rank in range(pp)]
    worst = max(w + c for w, c in stages)
    return {"target": target, "draft": draft, "pp": pp, "batch": batch, "context": context,
            "layers": layers, "stage_weights_gib": [w / GIB for w, _ in stages],
            "stage_kv_gib": [c / GIB for _, c in stages], "largest_stage_gib": worst / GIB,
            "usable_gib": USABLE * H200_FREE / GIB, "fits": worst <= USABLE * H200_FREE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON; a markdown table is written beside it")
    args = parser.parse_args()
    rows = [{"issue": issue, **plan(t, d, pp, b, c)} for issue, t, d, pps, bs, cs in RUNS
            for pp in pps for b in bs for c in cs]
    lines = [f"Usable memory per H200: {USABLE * H200_FREE / GIB:.1f} GiB (90 % of 139.8 GiB free). Per stage: "
             "weights + KV caches (bf16); the largest stage decides.", "",
             "| issue | target + draft | PP | B | context | stages: weights + KV, GiB | largest | fits one H200 each |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        stages = ", ".join(f"{w:.1f} + {c:.1f}" for w, c in zip(r["stage_weights_gib"], r["stage_kv_gib"],
                                                                 strict=True))
        lines.append(f"| {r['issue']} | {r['target']} + {r['draft']} | {r['pp']} | {r['batch']} | "
                     f"{r['context'] // 1024}K | {stages} | {r['largest_stage_gib']:.1f} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"h200_free_gib": H200_FREE / GIB, "usable": USABLE, "rows": rows},
                                       indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

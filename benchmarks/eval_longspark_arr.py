"""Does LongSpark's lookahead help Dustin's selection? ARR of the hybrid (Eq. 6 with the searched m) against
target-history-only selection (Dustin-T) when the draft is LongSpark, on test-split text with the real pair.

Teacher-forced along each window's true text: at anchors L (the committed length), the verification queries are
the true tokens at L .. L + Γ, and
  Ā        the target's attention of those Γ + 1 queries over [0, L), each renormalised there, averaged over the
           queries and over every head of every layer (the ARR of paper Eq. 1-4);
  S_target Eq. 5 on the target's SRH heads (the packaged Dustin config) of the token at L - 1, over [0, L - 1);
  S_draft  Eq. 5 on the same heads of the LongSpark block that reads the SRH layer: its queries of the Γ proposed
           positions (they do not depend on the drafted tokens), over the target's keys [0, L);
and the sets at budget k: dustin-h-longspark (m from the config, searched for the autoregressive draft),
dustin-t-longspark (m = 0), the hybrid at smaller shares of the free slots (--m-fractions), LongSpark-D (all free
slots by S_draft) and the oracle TopK(Ā). ARR = the mass of Ā the set holds. CPU or GPU.

    python benchmarks/eval_longspark_arr.py --prompts .carry/test_prompts.npz --contexts 4096 8192 --docs 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import RESULTS, environment, save_json
from eval_tau import FAMILIES, load_documents, windows

from trtllm_dustin.dustin_config import DustinConfig
from trtllm_dustin.models import load_model
from trtllm_dustin.models.loading import default_dustin_config_path
from trtllm_dustin.models.longspark import load_longspark
from trtllm_dustin.plugins.selection import select_verify_indices
from trtllm_dustin.plugins.srh_score import srh_score
from trtllm_dustin.search.arr import arr, oracle_indices
from trtllm_dustin.training.longspark import anchor_logits, target_features


def future_attention(feats: dict, layers: range, anchor: int, gamma: int) -> torch.Tensor:
    """Ā [L] at anchor L: the queries at L .. L + Γ over [0, L), renormalised, averaged over queries, heads, layers."""
    total = None
    for layer in layers:
        q = feats["queries"][layer][0, :, anchor: anchor + gamma + 1].float()  # [H_q, w, D]
        k = feats["keys"][layer][0, :, : anchor + gamma + 1].float()  # [H_kv, L + w, D]
        group = q.shape[0] // k.shape[0]
        scores = (q @ k.repeat_interleave(group, 0).transpose(-1, -2)) / q.shape[-1] ** 0.5  # [H_q, w, L + w]
        causal = torch.arange(k.shape[1])[None, :] <= (anchor + torch.arange(gamma + 1))[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)[..., :anchor]
        probs = probs / probs.sum(-1, keepdim=True)
        mean = probs.mean(dim=(0, 1))
        total = mean if total is None else total + mean
    return total / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=None, help="test windows from eval_tau.py --save-prompts")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096], help="default: 4096")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--docs", type=int, default=4, help="windows per family (default: 4)")
    parser.add_argument("--anchors", type=int, default=16, help="anchors per window, 8 tokens apart (default: 16)")
    parser.add_argument("--gamma", type=int, default=3, help="draft tokens per round (default: 3)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512], help="k (default: 512)")
    parser.add_argument("--m-fractions", type=float, nargs="*", default=[0.125, 0.25, 0.5],
                        help="also the hybrid with m = this share of the free slots (default: 0.125 0.25 0.5)")
    parser.add_argument("--longspark", default=None, help="LongSpark drafter (default: the packaged one)")
    parser.add_argument("--dustin-config", type=Path, default=None, help="default: the packaged pair's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "longspark" / "arr_longspark.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    dustin = DustinConfig.load(args.dustin_config or default_dustin_config_path())
    loaded = load_model(None, device=device, dtype=torch.float32, max_positions=max(args.contexts) + 8 * args.anchors
                        + 64)
    target = loaded.model
    spark = load_longspark(args.longspark, target).float()
    dustin.check_models(target.config, None)
    reads = spark.config.target_layers
    srh = [lh for lh in dustin.target_layers if lh.layer in reads]
    if not srh:
        raise SystemExit(f"the LongSpark drafter reads layers {reads}, none of the SRH layers of the Dustin config")
    documents = load_documents(args.prompts, loaded.tokenizer)
    free = {k: k - dustin.n_sink - dustin.n_recent for k in args.budgets}
    m_of = {k: round(dustin.m * free[k] / (dustin.budget - dustin.n_sink - dustin.n_recent)) for k in args.budgets}
    rows, t0 = [], time.perf_counter()
    for context in args.contexts:
        for family in args.families:
            extra = 8 * args.anchors + args.gamma + 2
            for doc_id, tokens in windows(documents[family], context + extra, args.docs):
                x = torch.tensor([tokens], device=device)
                layers = range(target.config.num_layers)
                feats = target_features(target, x, tuple(layers), queries=True)
                anchors = torch.arange(context, context + 8 * args.anchors, 8, device=device)
                j = reads.index(srh[0].layer)
                capture = {j: torch.zeros(len(anchors), args.gamma, target.config.num_heads, target.config.head_dim,
                                          device=device)}
                with torch.no_grad():
                    anchor_logits(spark, target, x, anchors, capture, feats)
                per = {}
                for a, L in enumerate(anchors.tolist()):
                    future = future_attention(feats, layers, L, args.gamma)[None]  # [1, L]
                    keys = {lh.layer: feats["keys"][lh.layer][:, :, :L + args.gamma].contiguous() for lh in srh}
                    lengths = torch.tensor([L], dtype=torch.int32, device=device)
                    s_target = s_draft = None
                    for lh in srh:
                        q_hist = feats["queries"][lh.layer][:, :, L - 1: L].transpose(1, 2).contiguous()
                        st = srh_score(q_hist, keys[lh.layer], lengths - 1, lh.heads)
                        sd = srh_score(capture[reads.index(lh.layer)][a: a + 1], keys[lh.layer], lengths, lh.heads)
                        s_target = st if s_target is None else s_target + st
                        s_draft = sd if s_draft is None else s_draft + sd
                    padded = torch.zeros(1, s_target.shape[1], device=device)
                    padded[:, :L] = future[:, :L]
                    for k in args.budgets:
                        sets = {"dustin-h-longspark": m_of[k], "dustin-t-longspark": 0, "longspark-lookahead-only":
                                free[k], **{f"hybrid m={f:g} free": round(f * free[k]) for f in args.m_fractions}}
                        for name, m in sets.items():
                            idx = select_verify_indices(s_draft, s_target, lengths, k, m, dustin.n_sink,
                                                        dustin.n_recent)
                            per.setdefault((name, k), []).append(float(arr(padded, idx)))
                        per.setdefault(("oracle", k), []).append(float(arr(padded, oracle_indices(padded, lengths,
                                                                                                  k))))
                for (name, k), values in per.items():
                    rows.append({"family": family, "context": context, "document": doc_id, "policy": name,
                                 "budget": k, "arr": sum(values) / len(values), "anchors": len(values)})
                print(f"{family} {context} {doc_id}: " + ", ".join(
                    f"{n}@{k} {sum(v) / len(v):.3f}" for (n, k), v in per.items()), flush=True)
    summary = {}
    for r in rows:
        summary.setdefault(f"{r['policy']}@k={r['budget']} ctx={r['context']}", []).append(r["arr"])
    summary = {key: {"mean_arr": sum(v) / len(v), "windows": len(v)} for key, v in summary.items()}
    for key, value in summary.items():
        print(f"{key}: ARR {value['mean_arr']:.4f} over {value['windows']} windows")
    save_json(args.out, {**environment(), "target": loaded.source, "longspark": args.longspark or "packaged",
                         "dustin_config": dustin.to_json(), "gamma": args.gamma, "m_by_budget": m_of,
                         "seconds": time.perf_counter() - t0, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()

"""What weight-only int8 does to the drafters' proposals, teacher-forced (CPU, a few minutes).

Along test-split windows of `--context` tokens, the packaged ring drafter's slots at every `--stride`-th anchor
(from W on, where the ring holds W rows) and the packaged AR draft's next-token predictions at every position are
computed twice: with the weights as packaged and with `quantize_weights("int8")` / `quantize_draft(.., "int8")`.
Per slot (the AR draft: pooled) it reports
- top-1 agreement with the target's argmax, each way (a greedy round accepts slot g only if slots 0..g all agree),
  and the greedy tau that the agreements give at Γ = 7 (ring) and Γ = 3 (AR: 1 + a + a^2 + a^3 from its pooled
  agreement a, as if positions were independent);
- the same at T = 1 from each slot's acceptance probability under rejection sampling, sum over ids of
  min(p_target, q_drafter) (teacher-forced: every slot sees the true tokens before it);
- how often the int8 proposal is the packaged one's (top-1 match), and KL(packaged || int8) over the ids they
  propose from (the ring drafter's subset head; the AR draft's head).
Lower-variance than tau from rounds, which at T = 1 follow different random paths once a proposal changes.

    python benchmarks/dev/int8_drafters.py --out benchmarks/results/longspark2/cpu_int8/int8_slots_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, eval_tau.py
from common import environment, save_json  # noqa: E402
from eval_tau import FAMILIES, load_documents, windows  # noqa: E402

from trtllm_dustin.models import load_model  # noqa: E402
from trtllm_dustin.models.quantize import quantize_draft  # noqa: E402
from trtllm_dustin.models.ring_drafter import load_ring_drafter  # noqa: E402
from trtllm_dustin.training.longspark import target_features  # noqa: E402


def compare(base: torch.Tensor, int8: torch.Tensor, teacher: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits [..., V] of the packaged drafter, the int8 one and the target -> per entry: greedy agreement with the
    target each way, the T = 1 acceptance probability each way (sum over ids of min(p_target, q_drafter): what
    rejection sampling accepts a draft with), top-1 match and KL between the two drafters."""
    finite = torch.isfinite(base)
    lb = F.log_softmax(base.masked_fill(~finite, -1e30), -1)
    lq = F.log_softmax(int8.masked_fill(~finite, -1e30), -1)
    kl = (lb.exp() * (lb - lq)).masked_fill(~finite, 0).sum(-1)
    p = F.softmax(teacher.float(), -1)
    top = teacher.argmax(-1)
    return {"agree_model": (base.argmax(-1) == top).float(), "agree_int8": (int8.argmax(-1) == top).float(),
            "accept_t1_model": torch.minimum(p, lb.exp()).sum(-1), "accept_t1_int8": torch.minimum(p, lq.exp()).sum(-1),
            "same": (base.argmax(-1) == int8.argmax(-1)).float(), "kl": kl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024, help="tokens per window (default: 1024)")
    parser.add_argument("--docs", type=int, default=6, help="windows per family (default: 6)")
    parser.add_argument("--stride", type=int, default=16, help="anchors every this many positions (default: 16)")
    parser.add_argument("--prompts", type=Path, default=None, help="test windows from eval_tau.py --save-prompts "
                        "(default: the installed corpora)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = environment()
    target = load_model(None, device="cpu", dtype=torch.float32, max_positions=args.context + 16)
    model = target.model.eval()
    ring = load_ring_drafter(None, model)
    ring8 = load_ring_drafter(None, model, weights="int8")
    draft = load_model("smollm2-draft", device="cpu", dtype=torch.float32, max_positions=args.context + 16,
                       share_with=model).model.eval()
    draft8 = quantize_draft(load_model("smollm2-draft", device="cpu", dtype=torch.float32,
                                       max_positions=args.context + 16, share_with=model).model.eval(), "int8")
    read, G, W = ring.config.read_layers, ring.config.block, ring.config.window
    if args.context < W + G + args.stride:
        raise SystemExit(f"--context {args.context}: give at least {W + G + args.stride} tokens (a full ring of "
                         f"W = {W}, a block and one stride)")
    documents = load_documents(args.prompts, target.tokenizer)
    ring_parts, ar_parts, counted = [], [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for family in FAMILIES:
            for doc_id, prompt in windows(documents[family], args.context, args.docs):
                tokens = torch.tensor([prompt])
                feats = target_features(model, tokens, read)
                hidden = torch.stack([feats["hidden"][layer] for layer in read], dim=2)
                anchors = torch.arange(W, args.context - G, args.stride)  # the ring holds W rows from here on
                slot_pos = anchors[:, None] + torch.arange(G)
                teacher = model.head(feats["final"][:, slot_pos]).reshape(-1, G, model.config.vocab_size)
                _, slots = ring.forward_train(tokens, hidden, anchors)
                _, slots8 = ring8.forward_train(tokens, hidden, anchors)
                ring_parts.append(compare(ring.logits(slots), ring8.logits(slots8), teacher))
                final = model.head(feats["final"][0, :-1])
                ar_parts.append(compare(draft.full_vocab(draft.forward_train(tokens).float())[0, :-1],
                                        draft8.full_vocab(draft8.forward_train(tokens).float())[0, :-1], final))
                counted.append(f"{family}/{doc_id}")
                ring_now, ar_now = ring_parts[-1], ar_parts[-1]
                print(f"{family:7s} {doc_id}: ring slot agreement {float(ring_now['agree_model'].mean()):.3f} -> int8 "
                      f"{float(ring_now['agree_int8'].mean()):.3f}; AR {float(ar_now['agree_model'].mean()):.3f} -> "
                      f"{float(ar_now['agree_int8'].mean()):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    ring_all = {k: torch.cat([p[k] for p in ring_parts]) for k in ring_parts[0]}  # [N, G]
    ar_all = {k: torch.cat([p[k] for p in ar_parts]) for k in ar_parts[0]}  # [N]

    def ring_tau(agree: torch.Tensor) -> float:
        return round(1 + float(agree.cumprod(dim=1).sum(1).mean()), 4)

    def ar_tau(a: float) -> float:
        return round(1 + a + a * a + a ** 3, 4)

    result = {
        **started, "context": args.context, "stride": args.stride, "windows": counted,
        "ring": {"anchors": int(ring_all["same"].shape[0]), "head_ids": None if ring.head_ids is None
                 else len(ring.head_ids),
                 "per_slot": {k: [round(float(x), 4) for x in v.mean(0)] for k, v in ring_all.items()},
                 "greedy_tau_gamma7_teacher_forced": {"model": ring_tau(ring_all["agree_model"]),
                                                      "int8": ring_tau(ring_all["agree_int8"])},
                 "t1_tau_gamma7_teacher_forced": {"model": ring_tau(ring_all["accept_t1_model"]),
                                                  "int8": ring_tau(ring_all["accept_t1_int8"])}},
        "ar_draft": {"positions": int(ar_all["same"].shape[0]),
                     **{k: round(float(v.mean()), 4) for k, v in ar_all.items()},
                     "greedy_tau_gamma3_independent": {"model": ar_tau(float(ar_all["agree_model"].mean())),
                                                       "int8": ar_tau(float(ar_all["agree_int8"].mean()))},
                     "t1_tau_gamma3_independent": {"model": ar_tau(float(ar_all["accept_t1_model"].mean())),
                                                   "int8": ar_tau(float(ar_all["accept_t1_int8"].mean()))}},
    }
    save_json(args.out, result)
    print("ring, greedy:", result["ring"]["greedy_tau_gamma7_teacher_forced"], "T = 1:",
          result["ring"]["t1_tau_gamma7_teacher_forced"], "\nAR draft:", result["ar_draft"])


if __name__ == "__main__":
    main()

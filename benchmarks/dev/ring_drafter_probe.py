"""A probe for issue 38's next drafter (evaluation only, nothing here is served): a drafter with its own layers over a
fixed ring of recent positions, fed with the target's hidden states, in two modes, scored beside the packaged AR draft
and the packaged LongSpark drafter by the greedy acceptance of real rounds.

The design probed. Each committed position p enters the drafter as x_p = embed(token p) + F(the target's hidden
states at p - 1 of the layers LongSpark reads), which the target computed for every committed position. The drafter
runs its own layers (trainable copies of target layers, like the autoregressive draft's init) causally over a band of
the last W positions: at serving time, only the newly committed tokens of a round pass through them, and their keys
and values go into a ring buffer of W rows per layer. Its cost and state stay fixed in the context, as LongSpark's
do. From the position L just committed (slot 0 is the band pass's own output at L) it proposes G tokens:
- `--mode ar`: slots one after another. Slot g >= 1 enters as embed(token L + g) + P(the drafter's own output at
  slot g - 1), the target's state there not being computed yet; it attends to the ring rows (L - W, L] and to the
  slots before it. Trained as it runs (the slots unrolled from the drafter's own outputs), the tokens teacher-forced.
- `--mode block`: one parallel block, as LongSpark's. Slot g >= 1 is a learned mask embedding + F(hidden at L - 1)
  at position L + g; the slots attend to the ring rows and to each other (bidirectional); with --markov-rank r > 0
  each slot adds LongSpark's per-slot rank-r bigram correction from the previous token.
F and P start at zero, so the drafter starts as the copied target layers over token embeddings. (The first run, git
91a9154, was block mode without a Markov correction, F started random and the band pass was trained at every 4th
position; its scores were teacher-forced on the test documents.)

Trains for --seconds on the train windows (KL to the target: the band pass at every --causal-stride position, plus
the slots at every --anchor-stride anchor). Then scores on greedy continuations: each test document's first
--prompt-len tokens, continued --gen tokens greedily by the target. On such a sequence a teacher-forced round is the
real greedy round: slot g is accepted when slots 0..g all agree with the target's argmax, so 1 + the leading
agreements is the round's tau at that anchor, and the mean over every anchor of the continuation estimates greedy tau
at each Γ. The packaged AR draft and LongSpark drafter are scored on the same anchors. The JSON goes to --out.

    python benchmarks/dev/ring_drafter_probe.py --tokens tokens.npy --prompts test_prompts.npz --seconds 480 \\
        --mode ar --out ring_ar.json     # GPU; --device cpu --seq-len 256 --window 64 --prompt-len 96 --gen 8
                                         # --docs books/2 code/1 --seconds 20: a CPU check
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, save_json  # noqa: E402
from longspark_slots import kl_top1  # noqa: E402  (the same per-slot scores as the packaged drafter's)

import trtllm_dustin.training.longspark as training  # noqa: E402
from trtllm_dustin.models import load_model  # noqa: E402
from trtllm_dustin.models.longspark import load_longspark  # noqa: E402
from trtllm_dustin.models.ring_drafter import RingDrafter, RingDrafterConfig  # noqa: E402
from trtllm_dustin.training.ring_drafter import RingTrainConfig, ring_loss  # noqa: E402
from trtllm_dustin.training.ring_drafter import slot_logits as training_slot_logits  # noqa: E402
from trtllm_dustin.training.windows import train_on_windows, write_trained  # noqa: E402

READ = (3, 9, 15, 22, 29)  # the target layers whose hidden states feed F (LongSpark's)
DOCS = ["books/2", "books/3", "books/4", "books/5", "code/1", "code/6", "code/9", "code/15",
        "essays/3", "essays/7", "essays/11", "essays/16"]
GAMMAS = (1, 2, 3, 5, 7)


class BlockRingDrafter(RingDrafter):
    """The same layers, inputs and ring as one parallel block (--mode block): slot g >= 1 is a learned mask embedding
    + F(hidden at L - 1) at position L + g, the slots attend to the ring rows [L - W, L) and to each other
    (bidirectional), and with a Markov rank each adds LongSpark's per-slot bigram correction from the previous token."""

    def __init__(self, config: RingDrafterConfig, target, markov_rank: int) -> None:
        super().__init__(config, target)
        H, G = target.config.hidden_size, config.block
        del self.own_norm, self.own  # no slot reads another's output
        self.mask_embed = nn.Parameter(torch.zeros(H))
        self.markov_rank = markov_rank
        if markov_rank:  # LongSpark's correction: silu(embed(previous) @ in[g]) @ out^T, out zero at the start
            self.markov_in = nn.Parameter(torch.randn(G, H, markov_rank) / math.sqrt(H))
            self.markov_out = nn.Parameter(torch.zeros(target.config.vocab_size, markov_rank))

    def markov(self, previous: torch.Tensor) -> torch.Tensor:
        if not self.markov_rank:
            return torch.zeros((), device=previous.device)
        e = self.target.embed(previous).float()
        return F.silu(torch.einsum("ngh,ghr->ngr", e, self.markov_in.float())) @ self.markov_out.float().T

    def forward_train(self, tokens, hidden, anchors):
        target, W, G = self.target, self.config.window, self.config.block
        B, T = tokens.shape
        A, device = anchors.shape[0], tokens.device
        f = self.features(hidden)
        f = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
        x = target.embed(tokens).to(self.dtype) + f
        pos = torch.arange(T, device=device)
        slot_pos = anchors[:, None] + torch.arange(G, device=device)  # [A, G]
        rows = anchors[:, None] - W + torch.arange(W, device=device)  # [L - W, L); slot 0 is x_L
        s = torch.cat([x[:, anchors, None], (self.mask_embed + f[:, anchors])[:, :, None].expand(-1, -1, G - 1, -1)],
                      dim=2).reshape(B * A, G, -1)
        block_mask = torch.cat([(rows >= 0)[:, None, :].expand(A, G, W),
                                torch.ones(A, G, G, dtype=torch.bool, device=device)], dim=-1).repeat(B, 1, 1)
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos[None].expand(B, T))
            ring_k = k[:, rows.clamp(min=0)].reshape(B * A, W, *k.shape[2:])
            ring_v = v[:, rows.clamp(min=0)].reshape(B * A, W, *v.shape[2:])
            sq, sk, sv = self._qkv(layer, s, slot_pos.repeat(B, 1))
            s = self._finish(layer, s, self._attend(sq, torch.cat([ring_k, sk], 1), torch.cat([ring_v, sv], 1),
                                                    block_mask))
            x = self._finish(layer, x, self._band(q, k, v))
        return x, s


def build(target, mode: str, own: tuple[int, ...], window: int, block: int, markov_rank: int) -> RingDrafter:
    config = RingDrafterConfig(READ, own, window, block)
    return RingDrafter(config, target) if mode == "ar" else BlockRingDrafter(config, target, markov_rank)


def slot_logits(model, target, tokens, anchors, feats):
    """The drafter's proposal logits [B * A, G, V] (fp32) at every anchor, beside the teacher's, and the band pass
    (the block variant adds its Markov correction of the true previous token)."""
    correction = model.markov if isinstance(model, BlockRingDrafter) else None
    return training_slot_logits(model, target, tokens, anchors, feats, correction)


@torch.no_grad()
def greedy_sequences(target, prompts, docs, prompt_len, gen, device):
    """Each document's first prompt_len tokens continued gen tokens by the target's argmax -> [len(docs), P + gen]."""
    seq = torch.stack([torch.from_numpy(prompts[d][:prompt_len].astype(np.int64)) for d in docs]).to(device)
    for _ in range(gen):
        final, _ = target.run_whole(seq)
        seq = torch.cat([seq, target.head(final[:, -1:]).argmax(-1)], dim=1)
    return seq


def round_tau(agree: torch.Tensor) -> dict[str, float]:
    """agree [N, G] (slot g agrees with the target's argmax) -> greedy tau at each Γ: 1 + mean leading agreements."""
    lead = agree.cumprod(dim=1)
    return {f"gamma{g}": round(1 + float(lead[:, :g].sum(1).mean()), 4) for g in GAMMAS if g <= agree.shape[1]}


@torch.no_grad()
def score(drafters: dict, target, seqs, docs, prompt_len, G):
    """Every drafter's per-anchor slot agreement and KL on the greedy sequences, one document at a time ->
    {drafter: {"top1", "kl" per slot, tau per Γ, tau per family}}."""
    rows = {name: {"agree": [], "kl": []} for name in drafters}
    families = [d.split("/")[0] for d in docs]
    anchors = torch.arange(prompt_len, seqs.shape[1] - G, device=seqs.device)
    slot_pos = anchors[:, None] + torch.arange(G, device=seqs.device)
    for b in range(seqs.shape[0]):
        tokens = seqs[b: b + 1]
        feats = training.target_features(target, tokens, (target.config.num_layers - 1,))
        teacher = target.head(feats["final"][:, slot_pos]).reshape(-1, G, target.config.vocab_size).float()
        for name, propose in drafters.items():
            kl, agree = kl_top1(teacher, propose(tokens, anchors, slot_pos))
            rows[name]["agree"].append(agree)
            rows[name]["kl"].append(kl)
    out = {}
    for name, r in rows.items():
        agree, kl = torch.cat(r["agree"]), torch.cat(r["kl"])
        per_doc = torch.stack(r["agree"])  # [docs, A, G]
        out[name] = {"top1": [round(float(v), 4) for v in agree.mean(0)],
                     # None where a drafter's head leaves tokens out (the AR draft's: KL is infinite there)
                     "kl": [round(float(v), 4) if torch.isfinite(v) else None for v in kl.mean(0)],
                     "tau": round_tau(agree),
                     "tau_by_family": {f: round_tau(per_doc[[i for i, x in enumerate(families) if x == f]]
                                                    .reshape(-1, G)) for f in dict.fromkeys(families)}}
    return out, int(anchors.shape[0]) * seqs.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=Path, required=True, help="train windows (prepare-distill-data)")
    parser.add_argument("--prompts", type=Path, required=True, help="test documents (eval_tau.py --save-prompts)")
    parser.add_argument("--docs", nargs="+", default=DOCS, help="test documents, each >= --prompt-len tokens "
                        "(default: four of each family)")
    parser.add_argument("--prompt-len", type=int, default=768, help="prompt tokens per document (default: 768)")
    parser.add_argument("--gen", type=int, default=256, help="greedy tokens scored per document (default: 256)")
    parser.add_argument("--mode", choices=("ar", "block"), default="ar", help="slots one after another (ar) or one "
                        "parallel block (default: ar)")
    parser.add_argument("--seq-len", type=int, default=4096, help="train window tokens (default: 4096)")
    parser.add_argument("--own-layers", default="0,10,20,29", help="target layers copied as the drafter's own")
    parser.add_argument("--window", type=int, default=256, help="ring rows W (default: 256)")
    parser.add_argument("--block", type=int, default=7, help="slots G (default: 7)")
    parser.add_argument("--markov-rank", type=int, default=16, help="block mode: rank of the per-slot bigram "
                        "correction; 0: none (default: 16, LongSpark's)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--anchor-stride", type=int, default=16)
    parser.add_argument("--causal-stride", type=int, default=2, help="band pass positions scored (default: 2)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seconds", type=float, default=280.0, help="training time in all (default: 280)")
    parser.add_argument("--train-dir", type=Path, required=True, help="training directory (resume.pt: a rerun with "
                        "the same options resumes; checkpoint/, the record and the loss curve)")
    parser.add_argument("--stop-after", type=float, default=None, help="train at most this many seconds in this "
                        "run (the learning-rate schedule still spans --seconds; rerun to resume)")
    parser.add_argument("--no-baselines", action="store_true", help="score only this drafter")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name in ("window", "block", "batch_size", "anchor_stride", "causal_stride", "gen", "prompt_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.markov_rank < 0:
        raise SystemExit(f"--markov-rank {args.markov_rank} must be >= 0 (0: no correction)")
    if args.gen <= args.block:
        raise SystemExit(f"--gen {args.gen} must exceed --block {args.block} (an anchor needs G greedy tokens)")
    device = torch.device(args.device)
    data = np.load(args.tokens, mmap_mode="r")
    prompts = np.load(args.prompts)
    if data.shape[1] < args.seq_len:
        raise SystemExit(f"--tokens holds windows of {data.shape[1]} tokens, fewer than --seq-len {args.seq_len}")
    short = [d for d in args.docs if d not in prompts or len(prompts[d]) < args.prompt_len]
    if short:
        raise SystemExit(f"--docs {short}: not in {args.prompts} or shorter than --prompt-len {args.prompt_len}")
    own = tuple(int(i) for i in args.own_layers.split(","))
    cfg = RingTrainConfig(read_layers=READ, own_layers=own, window=args.window, block=args.block,
                          causal_stride=args.causal_stride, seq_len=args.seq_len, batch_size=args.batch_size,
                          anchor_stride=args.anchor_stride, lr=args.lr)

    def loss(model, target, tokens, anchors):
        return ring_loss(model, target, tokens, anchors, cfg.causal_stride,
                         model.markov if isinstance(model, BlockRingDrafter) else None)

    model, target, common, losses = train_on_windows(
        args.tokens, args.train_dir, cfg, lambda t: build(t, args.mode, own, args.window, args.block, args.markov_rank),
        loss, f"the ring drafter ({args.mode})", None, str(device), args.seconds, stop_after=args.stop_after)
    if args.mode == "ar":  # a checkpoint `load_ring_drafter` reads (the block variant is the probe's own)
        write_trained(model, args.train_dir, common, losses, plot=False)
    target.setup_rope(max(target.max_positions, args.prompt_len + args.gen + 64))
    # scored in fp32: the teacher's argmax is the verifier's, and ties do not flip with the precision
    target.float()
    seqs = greedy_sequences(target, prompts, args.docs, args.prompt_len, args.gen, device)

    def ring(tokens, anchors, slot_pos):
        feats = training.target_features(target, tokens, READ)
        logits, _, _ = slot_logits(model, target, tokens, anchors, feats)
        return logits

    drafters = {f"ring drafter ({args.mode})": ring}
    if not args.no_baselines:
        draft = load_model("smollm2-draft", device=device, dtype=torch.float32, share_with=target,
                           max_positions=args.prompt_len + args.gen + 64).model.eval()
        spark = load_longspark(None, target).float().to(device)
        if spark.config.block < args.block:
            raise SystemExit(f"--block {args.block} exceeds the packaged LongSpark drafter's {spark.config.block}")

        def ar(tokens, anchors, slot_pos):  # the draft's logits at L + g predict L + g + 1, as slot g does
            V = target.config.vocab_size
            return draft.full_vocab(draft.forward_train(tokens).float())[:, slot_pos].reshape(-1, args.block, V)

        def longspark(tokens, anchors, slot_pos):
            base, _, previous = training.anchor_logits(spark, target, tokens, anchors)
            return (base + spark.markov_all(previous))[:, : args.block]

        drafters.update({"AR draft (packaged)": ar, "LongSpark (packaged)": longspark})
    result, blocks = score(drafters, target, seqs, args.docs, args.prompt_len, args.block)
    for name, r in result.items():
        print(f"{name:24s} tau {r['tau']}  top1 {r['top1']}")
    if args.out:
        save_json(args.out, {**environment(), "mode": args.mode, "steps": common["steps_done"],
                             "seconds": common["seconds"], "first_loss": common["first_loss"],
                             "final_loss": common["final_loss"], "own_layers": list(own), "window": args.window,
                             "block": args.block, "markov_rank": getattr(model, "markov_rank", 0),
                             "causal_stride": args.causal_stride, "anchor_stride": args.anchor_stride,
                             "seq_len": args.seq_len, "own_parameters": common["own_parameters"],
                             "test_docs": args.docs,
                             "prompt_len": args.prompt_len, "gen": args.gen, "scored_anchors": blocks,
                             "drafters": result, "loss_every_10_steps": [round(x, 4) for x in losses[::10]]})


if __name__ == "__main__":
    main()

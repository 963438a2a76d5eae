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
import copy
import math
import sys
import time
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
from trtllm_dustin.models.decoder import RMSNorm  # noqa: E402
from trtllm_dustin.models.longspark import load_longspark  # noqa: E402
from trtllm_dustin.models.rope import apply_rope  # noqa: E402

READ = (3, 9, 15, 22, 29)  # the target layers whose hidden states feed F (LongSpark's)
DOCS = ["books/2", "books/3", "books/4", "books/5", "code/1", "code/6", "code/9", "code/15",
        "essays/3", "essays/7", "essays/11", "essays/16"]
GAMMAS = (1, 2, 3, 5, 7)


class RingDrafter(nn.Module):
    def __init__(self, target, own_layers: tuple[int, ...], window: int, block: int, markov_rank: int,
                 mode: str, read: tuple[int, ...] = READ) -> None:
        super().__init__()
        self.__dict__["target"] = target
        H = target.config.hidden_size
        self.window, self.block, self.mode, self.read = window, block, mode, read
        self.layers = nn.ModuleList(copy.deepcopy(target.layers[i]).float().requires_grad_(True) for i in own_layers)
        self.read_norms = nn.ModuleList(RMSNorm(H, target.config.rms_norm_eps) for _ in read)
        self.fuse = nn.Linear(len(read) * H, H, bias=False)
        nn.init.zeros_(self.fuse.weight)
        if mode == "ar":  # P: the drafter's own output at the slot before -> its next slot's input
            self.own_norm = RMSNorm(H, target.config.rms_norm_eps)
            self.own = nn.Linear(H, H, bias=False)
            nn.init.zeros_(self.own.weight)
        else:
            self.mask_embed = nn.Parameter(torch.zeros(H))
        self.markov_rank = markov_rank if mode == "block" else 0
        if self.markov_rank:  # LongSpark's correction: silu(embed(previous) @ in[g]) @ out^T, out zero at the start
            self.markov_in = nn.Parameter(torch.randn(block, H, markov_rank) / math.sqrt(H))
            self.markov_out = nn.Parameter(torch.zeros(target.config.vocab_size, markov_rank))

    def markov(self, previous: torch.Tensor) -> torch.Tensor:
        """previous [N, G] token ids -> the correction [N, G, V] fp32 (0 without one)."""
        if not self.markov_rank:
            return torch.zeros((), device=previous.device)
        e = self.target.embed(previous).float()
        return F.silu(torch.einsum("ngh,ghr->ngr", e, self.markov_in.float())) @ self.markov_out.float().T

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """F(hidden at p - 1) for every position p: [B, T, H] (zero at p = 0)."""
        parts = [norm(hidden[layer].float()) for norm, layer in zip(self.read_norms, self.read, strict=True)]
        f = self.fuse(torch.cat(parts, dim=-1))
        return torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)

    def _qkv(self, layer, x, positions):
        att = layer.attention
        Hq, Hkv, D = att.num_heads, att.num_kv_heads, att.head_dim
        q, k, v = att.wqkv(layer.attention_norm(x)).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        cos, sin = self.target.rope_cos[positions], self.target.rope_sin[positions]
        shape = x.shape[:-1]
        return (apply_rope(q.view(*shape, Hq, D), cos, sin), apply_rope(k.view(*shape, Hkv, D), cos, sin),
                v.view(*shape, Hkv, D))

    @staticmethod
    def _attend(q, k, v, mask):
        """q [N, S, Hq, D], k/v [N, K, Hkv, D], mask [N or 1, S, K] -> [N, S, Hq * D]."""
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(*q.shape[:2], -1)

    def _band(self, q, k, v):
        """Every position attends to the last W positions, itself included: q/k/v [B, T, H*, D] -> [B, T, Hq * D],
        in chunks of W rows (each chunk reads itself and the chunk before), so the cost is O(T W), not O(T^2)."""
        B, T, W = q.shape[0], q.shape[1], self.window
        pad = -T % W
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        n = (T + pad) // W

        def chunks(t):
            c = t.reshape(B, n, W, *t.shape[2:])
            return torch.cat([torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], 1), c], dim=2)  # [B, n, 2W, ..]

        i = torch.arange(W, device=q.device)[:, None]
        j = torch.arange(2 * W, device=q.device)[None, :]
        mask = ((j > i) & (j <= i + W))[None].expand(n, W, 2 * W).clone()  # key j - W in (i - W, i]
        mask[0, :, :W] = False  # no chunk before the first
        out = self._attend(q.reshape(B * n, W, *q.shape[2:]), chunks(k).reshape(B * n, 2 * W, *k.shape[2:]),
                           chunks(v).reshape(B * n, 2 * W, *v.shape[2:]), mask.repeat(B, 1, 1))
        return out.reshape(B, n * W, -1)[:, :T]

    def _finish(self, layer, x, attn):
        x = x + layer.attention.wo(attn)
        return x + layer.feed_forward(layer.ffn_norm(x))

    def forward(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], anchors: torch.Tensor):
        """tokens [B, T], the target's hidden states, anchors [A] (W <= ... , L + G <= T) -> (band pass output
        [B, T, H], the slots' outputs [B * A, G, H])."""
        target, W, G = self.target, self.window, self.block
        B, T = tokens.shape
        A, device = anchors.shape[0], tokens.device
        f = self.features(hidden)
        x = target.embed(tokens).float() + f
        pos = torch.arange(T, device=device)
        slot_pos = anchors[:, None] + torch.arange(G, device=device)  # [A, G]
        if self.mode == "ar":
            rows = anchors[:, None] - W + 1 + torch.arange(W, device=device)  # ring rows (L - W, L]
        else:
            rows = anchors[:, None] - W + torch.arange(W, device=device)  # [L - W, L); slot 0 is x_L
            s = torch.cat([x[:, anchors, None],
                           (self.mask_embed + f[:, anchors])[:, :, None].expand(-1, -1, G - 1, -1)],
                          dim=2).reshape(B * A, G, -1)
            block_mask = torch.cat([(rows >= 0)[:, None, :].expand(A, G, W),
                                    torch.ones(A, G, G, dtype=torch.bool, device=device)], dim=-1).repeat(B, 1, 1)
        ring = []
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos[None].expand(B, T))
            ring_k = k[:, rows.clamp(min=0)].reshape(B * A, W, *k.shape[2:])
            ring_v = v[:, rows.clamp(min=0)].reshape(B * A, W, *v.shape[2:])
            ring.append((ring_k, ring_v))
            if self.mode == "block":
                sq, sk, sv = self._qkv(layer, s, slot_pos.repeat(B, 1))
                s = self._finish(layer, s, self._attend(sq, torch.cat([ring_k, sk], 1), torch.cat([ring_v, sv], 1),
                                                        block_mask))
            x = self._finish(layer, x, self._band(q, k, v))
        if self.mode == "block":
            return x, s
        valid = (rows >= 0).repeat(B, 1)  # [B * A, W]
        h = x[:, anchors].reshape(B * A, 1, -1)  # slot 0: the band pass at L
        outs, slot_kv = [h], [[] for _ in self.layers]
        for g in range(1, G):
            s = target.embed(tokens[:, slot_pos[:, g]]).float().reshape(B * A, 1, -1) + self.own(self.own_norm(h))
            positions = slot_pos[:, g].repeat(B)[:, None]
            mask = torch.cat([valid, torch.ones(B * A, g, dtype=torch.bool, device=device)], -1)[:, None]
            for layer, (ring_k, ring_v), kv in zip(self.layers, ring, slot_kv, strict=True):
                sq, sk, sv = self._qkv(layer, s, positions)
                kv.append((sk, sv))
                keys = torch.cat([ring_k, *(a for a, _ in kv)], 1)
                values = torch.cat([ring_v, *(b for _, b in kv)], 1)
                s = self._finish(layer, s, self._attend(sq, keys, values, mask))
            h = s
            outs.append(h)
        return x, torch.cat(outs, dim=1)


def slot_logits(model, target, tokens, anchors, feats):
    """The drafter's proposal logits [B * A, G, V] (fp32) at every anchor, beside the teacher's, and the band pass."""
    x, s = model(tokens, feats["hidden"], anchors)
    G = model.block
    slot_pos = anchors[:, None] + torch.arange(G, device=tokens.device)
    with torch.no_grad():
        teacher = target.head(feats["final"][:, slot_pos]).reshape(-1, G, target.config.vocab_size)
    previous = tokens[:, slot_pos].reshape(-1, G)  # slot g's previous token: the true one at L + g
    return target.head(s).float() + model.markov(previous), teacher, x


def train_loss(model, target, tokens, anchors, causal_stride):
    feats = training.target_features(target, tokens, model.read)
    logits, teacher, x = slot_logits(model, target, tokens, anchors, feats)
    kl, _ = kl_top1(teacher, logits)
    causal = torch.arange(0, tokens.shape[1] - 1, causal_stride, device=tokens.device)
    with torch.no_grad():
        t_causal = target.head(feats["final"][:, causal])
    kl_c, _ = kl_top1(t_causal, target.head(x[:, causal]))
    return kl.mean() + kl_c.mean()


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
    parser.add_argument("--checkpoint", type=Path, default=None, help="resume from this file if it exists, and "
                        "save the drafter and its optimizer there after training")
    parser.add_argument("--stop-after", type=float, default=None, help="train at most this many seconds in this "
                        "run (the learning-rate schedule still spans --seconds; resume with --checkpoint)")
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
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(None, device=device, dtype=dtype,
                        max_positions=max(args.seq_len, args.prompt_len + args.gen) + 64).model
    target.requires_grad_(False).eval()
    target.setup_rope()
    own = tuple(int(i) for i in args.own_layers.split(","))
    model = RingDrafter(target, own, args.window, args.block, args.markov_rank, args.mode).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    order = np.random.default_rng(0).permutation(data.shape[0])
    rng = np.random.default_rng(1)
    losses, step, done = [], 0, 0.0  # done: seconds trained by earlier runs
    if args.checkpoint and args.checkpoint.is_file():
        state = torch.load(args.checkpoint, map_location=device)
        if state["mode"] != args.mode or state["own_layers"] != list(own):
            raise SystemExit(f"--checkpoint {args.checkpoint} holds a {state['mode']} drafter on layers "
                             f"{state['own_layers']}: pass its --mode and --own-layers, or another path")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        losses, step, done = state["losses"], state["step"], state["seconds"]
        print(f"resumed at step {step}, {done:.0f} s", flush=True)
    t0 = time.perf_counter() - done
    stop = min(args.seconds, done + (args.stop_after if args.stop_after is not None else math.inf))
    while time.perf_counter() - t0 < stop:
        rows = order[np.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(order)]
        tokens = torch.from_numpy(np.asarray(data[rows, : args.seq_len]).astype(np.int64)).to(device)
        first = int(rng.integers(1, args.anchor_stride + 1))
        anchors = torch.arange(first, args.seq_len - args.block, args.anchor_stride, device=device)
        frac = (time.perf_counter() - t0) / args.seconds
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = train_loss(model, target, tokens, anchors, args.causal_stride)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 200 == 0:
            print(f"step {step} loss {np.mean(losses[-50:]):.3f} {time.perf_counter() - t0:.0f} s", flush=True)
    train_seconds = time.perf_counter() - t0
    if args.checkpoint:
        tmp = args.checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "losses": losses, "step": step,
                    "seconds": train_seconds, "mode": args.mode, "own_layers": list(own)}, tmp)
        tmp.replace(args.checkpoint)  # whole or not at all
    model.eval()
    # scored in fp32: the teacher's argmax is the verifier's, and ties do not flip with the precision
    target.float()
    seqs = greedy_sequences(target, prompts, args.docs, args.prompt_len, args.gen, device)

    def ring(tokens, anchors, slot_pos):
        feats = training.target_features(target, tokens, model.read)
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
        save_json(args.out, {**environment(), "mode": args.mode, "steps": step, "seconds": train_seconds,
                             "first_loss": losses[0], "final_loss": float(np.mean(losses[-50:])),
                             "own_layers": list(own), "window": args.window, "block": args.block,
                             "markov_rank": model.markov_rank, "causal_stride": args.causal_stride,
                             "anchor_stride": args.anchor_stride, "seq_len": args.seq_len,
                             "own_parameters": sum(p.numel() for p in params), "test_docs": args.docs,
                             "prompt_len": args.prompt_len, "gen": args.gen, "scored_anchors": blocks,
                             "drafters": result, "loss_every_10_steps": [round(x, 4) for x in losses[::10]]})


if __name__ == "__main__":
    main()

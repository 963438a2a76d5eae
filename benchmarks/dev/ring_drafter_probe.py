"""A probe for issue 38's next drafter (evaluation only, nothing here is served): does a block-parallel drafter with
its own layers over a fixed window of recent positions propose better than LongSpark's adapted target blocks?

The design probed. Each position p is drafted from x_p = embed(token p) + F(the target's hidden states at p - 1 of
the layers LongSpark reads), which the target computed for every committed position. The drafter runs its own
layers (trainable copies of target layers, like the autoregressive draft's init) causally over a band of the last
W positions: at serving time, only the newly committed tokens of a round pass through them, and their keys and
values go into a ring buffer of W rows per layer. The cost and the state then stay fixed in the context, as
LongSpark's do. A block of G slots at anchor L (slot 0: x_L; slot g: a learned mask embedding + F(hidden at
L - 1), at position L + g) attends to the ring's rows [L - W, L) and to the block's slots (bidirectional), and
slot g is scored against the target's distribution at L + g, as `training.longspark.anchor_logits` scores
LongSpark's. With --markov-rank r > 0 each slot adds LongSpark's per-slot rank-r bigram correction from the previous
token (teacher-forced: the true one); the first run (git 91a9154) had none, which is --markov-rank 0.

Trains for --seconds on the train windows (KL to the target at every anchor's slots, plus the band pass's own
next-token KL at every --causal-stride position), then scores the test windows exactly as
`longspark_slots.py` scores the packaged LongSpark drafter: per-slot top-1 agreement and KL, teacher-forced. The
JSON goes to --out.

    python benchmarks/dev/ring_drafter_probe.py --tokens tokens.npy --prompts test_prompts.npz --seconds 280 \\
        --out ring_probe.json      # GPU; --device cpu --seq-len 256 --context 256 --window 64 --seconds 20: a CPU check
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

from trtllm_dustin.models import load_model  # noqa: E402
from trtllm_dustin.models.decoder import RMSNorm  # noqa: E402
from trtllm_dustin.models.rope import apply_rope  # noqa: E402
from trtllm_dustin.training.longspark import target_features  # noqa: E402

READ = (3, 9, 15, 22, 29)  # the target layers whose hidden states feed F (LongSpark's)


class RingDrafter(nn.Module):
    def __init__(self, target, own_layers: tuple[int, ...], window: int, block: int, markov_rank: int) -> None:
        super().__init__()
        self.__dict__["target"] = target
        H = target.config.hidden_size
        self.window, self.block = window, block
        self.layers = nn.ModuleList(copy.deepcopy(target.layers[i]).float().requires_grad_(True) for i in own_layers)
        self.read_norms = nn.ModuleList(RMSNorm(H, target.config.rms_norm_eps) for _ in READ)
        self.fuse = nn.Linear(len(READ) * H, H, bias=False)
        nn.init.normal_(self.fuse.weight, std=0.02 / math.sqrt(len(READ)))
        self.mask_embed = nn.Parameter(torch.zeros(H))
        self.markov_rank = markov_rank
        if markov_rank:  # LongSpark's correction: silu(embed(previous) @ in[g]) @ out^T, out zero at the start
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
        parts = [norm(hidden[layer].float()) for norm, layer in zip(self.read_norms, READ, strict=True)]
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

    def _finish(self, layer, x, attn):
        x = x + layer.attention.wo(attn)
        return x + layer.feed_forward(layer.ffn_norm(x))

    def forward(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], anchors: torch.Tensor):
        """tokens [B, T], the target's hidden states, anchors [A] -> (band pass hidden [B, T, H], block hidden
        [B * A, G, H])."""
        target, W, G = self.target, self.window, self.block
        B, T = tokens.shape
        device = tokens.device
        f = self.features(hidden)
        x = target.embed(tokens).float() + f
        pos = torch.arange(T, device=device)
        band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)  # [T, T]: the last W, itself in
        slot_pos = anchors[:, None] + torch.arange(G, device=device)  # [A, G]
        A = anchors.shape[0]
        s = torch.cat([x[:, anchors, None], (self.mask_embed + f[:, anchors])[:, :, None].expand(-1, -1, G - 1, -1)],
                      dim=2).reshape(B * A, G, -1)
        rows = anchors[:, None] - W + torch.arange(W, device=device)  # [A, W]: ring rows [L - W, L)
        valid = rows >= 0
        local = torch.ones(A, G, G, dtype=torch.bool, device=device)
        block_mask = torch.cat([valid[:, None, :].expand(A, G, W), local], dim=-1).repeat(B, 1, 1)  # [B*A, G, W+G]
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos[None].expand(B, T))
            sq, sk, sv = self._qkv(layer, s, slot_pos.repeat(B, 1))
            ring_k = k[:, rows.clamp(min=0)].reshape(B * A, W, *k.shape[2:])
            ring_v = v[:, rows.clamp(min=0)].reshape(B * A, W, *v.shape[2:])
            s = self._finish(layer, s, self._attend(sq, torch.cat([ring_k, sk], 1), torch.cat([ring_v, sv], 1),
                                                    block_mask))
            x = self._finish(layer, x, self._attend(q, k, v, band[None]))
        return x, s


def block_loss(model, target, tokens, anchors, causal_stride, feats=None):
    feats = feats if feats is not None else target_features(target, tokens, READ)
    x, s = model(tokens, feats["hidden"], anchors)
    G = model.block
    slot_pos = anchors[:, None] + torch.arange(G, device=tokens.device)
    with torch.no_grad():
        teacher = target.head(feats["final"][:, slot_pos]).reshape(-1, G, target.config.vocab_size)
    previous = tokens[:, slot_pos].reshape(-1, G)  # slot g's previous token: the true one at L + g
    kl, top1 = kl_top1(teacher, target.head(s) + model.markov(previous))
    causal = torch.arange(0, tokens.shape[1] - 1, causal_stride, device=tokens.device)
    with torch.no_grad():
        t_causal = target.head(feats["final"][:, causal])
    kl_c, _ = kl_top1(t_causal, target.head(x[:, causal]))
    return kl.mean() + kl_c.mean(), kl, top1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=Path, required=True, help="train windows (prepare-distill-data)")
    parser.add_argument("--prompts", type=Path, required=True, help="test windows (eval_tau.py --save-prompts)")
    parser.add_argument("--docs", nargs="+", default=["books/2", "books/3", "code/1", "essays/7"])
    parser.add_argument("--context", type=int, default=1024, help="test window tokens (default: 1024)")
    parser.add_argument("--seq-len", type=int, default=4096, help="train window tokens (default: 4096)")
    parser.add_argument("--own-layers", default="0,10,20,29", help="target layers copied as the drafter's own")
    parser.add_argument("--window", type=int, default=256, help="ring rows W (default: 256)")
    parser.add_argument("--block", type=int, default=7, help="slots G (default: 7)")
    parser.add_argument("--markov-rank", type=int, default=16, help="rank of the per-slot bigram correction; 0: "
                        "none (default: 16, LongSpark's)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--anchor-stride", type=int, default=16)
    parser.add_argument("--causal-stride", type=int, default=4, help="band pass positions scored (default: 4)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seconds", type=float, default=280.0, help="training time (default: 280)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name in ("window", "block", "batch_size", "anchor_stride", "causal_stride"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.markov_rank < 0:
        raise SystemExit(f"--markov-rank {args.markov_rank} must be >= 0 (0: no correction)")
    device = torch.device(args.device)
    data = np.load(args.tokens, mmap_mode="r")
    prompts = np.load(args.prompts)
    if data.shape[1] < args.seq_len:
        raise SystemExit(f"--tokens holds windows of {data.shape[1]} tokens, fewer than --seq-len {args.seq_len}")
    short = [d for d in args.docs if d not in prompts or len(prompts[d]) < args.context]
    if short:
        raise SystemExit(f"--docs {short}: not in {args.prompts} or shorter than --context {args.context}")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(None, device=device, dtype=dtype, max_positions=args.seq_len + 64).model
    target.requires_grad_(False).eval()
    target.setup_rope()
    own = tuple(int(i) for i in args.own_layers.split(","))
    model = RingDrafter(target, own, args.window, args.block, args.markov_rank).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    order = np.random.default_rng(0).permutation(data.shape[0])
    rng = np.random.default_rng(1)
    losses, step, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        rows = order[np.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(order)]
        tokens = torch.from_numpy(np.asarray(data[rows, : args.seq_len]).astype(np.int64)).to(device)
        first = int(rng.integers(1, args.anchor_stride + 1))
        anchors = torch.arange(first, args.seq_len - args.block, args.anchor_stride, device=device)
        frac = (time.perf_counter() - t0) / args.seconds
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _, _ = block_loss(model, target, tokens, anchors, args.causal_stride)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 200 == 0:
            print(f"step {step} loss {np.mean(losses[-50:]):.3f} {time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    tokens = torch.stack([torch.from_numpy(prompts[d][: args.context].astype(np.int64)) for d in args.docs]).to(device)
    # longspark_slots.py's anchors at the default sizes (the run at 91a9154 started at 256: context // 4)
    anchors = torch.arange(min(300, args.context // 3), args.context - args.block - 1, 8, device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        _, kl, top1 = block_loss(model, target, tokens, anchors, args.causal_stride)
    result = {"top1": [round(float(x), 4) for x in top1.mean(0)], "kl": [round(float(x), 4) for x in kl.mean(0)]}
    print("per slot top1", result["top1"], "\nper slot KL", result["kl"])
    if args.out:
        save_json(args.out, {**environment(), "steps": step, "seconds": time.perf_counter() - t0,
                             "first_loss": losses[0], "final_loss": float(np.mean(losses[-50:])),
                             "own_layers": list(own), "window": args.window, "block": args.block,
                             "markov_rank": args.markov_rank,
                             "own_parameters": sum(p.numel() for p in params), "test_docs": args.docs,
                             "test_context": args.context, "test_blocks": int(top1.shape[0]), **result,
                             "loss_every_10_steps": [round(x, 4) for x in losses[::10]]})


if __name__ == "__main__":
    main()

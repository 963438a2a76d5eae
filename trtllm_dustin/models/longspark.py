"""LongSpark: a block-parallel drafter whose per-round cost does not grow with the prefix.

Context interface, per selected target layer l and KV head (all fixed-size):
- the boundary state: the target's hidden state (block l's output) of the last token the target processed;
- a recent window: the target's own cached K/V rows [L - W, L) of layer l, read from the target's cache each round
  (the drafter keeps no copy);
- a global summary of R entries: R learned queries u_r attend over every committed row of layer l; each entry keeps
  one value vector o_r (the attention output) and its log-normaliser lse_r, merged after each verification with only
  the newly committed rows (`summary_merge`, exact: the merge equals the attention recomputed from scratch).

Proposal model: one block per selected target layer, in layer order. Block j is target block l_j, frozen and
shared (its weights are the target's: nothing is copied), plus trained low-rank adapters on its four projections
and its own norms, so its queries, keys and values live in layer l_j's spaces and it can attend to that layer's
cached rows as they are. A block of G slots (slot 0: the last committed token `cur` at position L; slots 1..G-1 a
learned mask embedding at L + 1 ..) runs in parallel, every slot attending over R summary entries + W window rows +
the G local slots (bidirectional), G + W + R entries per head. The target's embedding, final norm and LM head are
reused frozen. Slot i's base logits predict the token at L + 1 + i; a per-position Markov correction (a rank-r
bigram term from the previous token, sequential and tiny) turns them into the proposal, so every proposed token
has the distribution it was drawn from.

A checkpoint holds only LongSpark's own weights (adapters, norms, fusion, summary, Markov terms): `save`/`load`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.dustin_config import model_fingerprint
from trtllm_dustin.models.checkpoint import save_drafter
from trtllm_dustin.models.decoder import Block, RMSNorm, Transformer
from trtllm_dustin.models.rope import apply_rope
from trtllm_dustin.validation import load_versioned, versioned_json

__all__ = ["DEFAULT_LONGSPARK", "LONGSPARK_SCHEMA_VERSION", "LongSpark", "LongSparkConfig", "default_longspark_path",
           "load_longspark", "longspark_config", "longspark_directory", "random_longspark", "spread_layers",
           "summary_attention", "summary_merge", "window_rows"]

LONGSPARK_SCHEMA_VERSION = 1
_PACKAGED = Path(__file__).resolve().parent.parent / "weights" / "smollm2_longspark"
DEFAULT_LONGSPARK = "smollm2-longspark"  # the packaged drafter trained for the default model


def default_longspark_path() -> Path:
    return _PACKAGED


@dataclass(frozen=True)
class LongSparkConfig:
    target_layers: tuple[int, ...]  # target layers read (one block each), ascending
    window: int = 256  # W: recent target KV rows per layer and head
    summary: int = 16  # R: summary entries per layer and KV head
    block: int = 7  # G: draft slots processed in parallel (proposes up to G tokens per round)
    lora_rank: int = 32  # rank of each block's adapters
    fuse_rank: int = 128  # rank of the boundary-state fusion
    markov_rank: int = 16  # rank of the per-position Markov (bigram) correction
    target_fingerprint: str = ""  # model_fingerprint of the target it was trained for ("" = any of its shape)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(x) for x in self.target_layers))
        if not self.target_layers:
            raise ConfigError("a LongSpark drafter needs at least one target layer")
        if list(self.target_layers) != sorted(set(self.target_layers)):
            raise ConfigError(f"target_layers {list(self.target_layers)} must be ascending and distinct")
        for name in ("window", "summary", "block", "lora_rank", "fuse_rank", "markov_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"LongSpark {name}={getattr(self, name)} must be >= 1")

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a target this drafter cannot read (layers outside it) or was not trained for."""
        bad = [x for x in self.target_layers if not 0 <= x < target.num_layers]
        if bad:
            raise ConfigError(f"LongSpark target layers {bad} do not exist in {target.name} ({target.num_layers} "
                              "layers); train a LongSpark drafter for this target (`trtllm-dustin train-longspark`)")
        if self.target_fingerprint and self.target_fingerprint != model_fingerprint(target):
            raise ConfigError(f"this LongSpark drafter was trained for another target than {target.name}; train one "
                              "for it with `trtllm-dustin train-longspark`")

    def to_json(self) -> str:
        return versioned_json(LONGSPARK_SCHEMA_VERSION, asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = "the LongSpark config") -> LongSparkConfig:
        """source: what the message calls the text (the checkpoint's config.json)."""
        return load_versioned(cls, text, (LONGSPARK_SCHEMA_VERSION,), source,
                              "retrain it with `trtllm-dustin train-longspark`")


# ---- the global summary ----------------------------------------------------------------------------------------
def summary_merge(o: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, values: torch.Tensor,
                  valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold new rows into a summary: o [..., R, D] and lse [..., R] (-inf: no rows yet) are the attention output and
    log-normaliser of R queries over the rows seen so far; scores [..., R, n] are those queries' logits against the
    n new rows, values [..., n, D] their values, valid [..., n] which of them are committed.

    Returns (o', lse'), equal to the attention of the R queries over old + valid new rows. No valid row leaves the
    state unchanged (bit for bit)."""
    scores = scores.masked_fill(~valid[..., None, :], float("-inf"))
    new_lse = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))  # [..., R]
    seen = torch.isfinite(new_lse)
    ref = torch.where(seen, new_lse, torch.zeros_like(new_lse))
    keep = torch.exp(lse - ref).masked_fill(~torch.isfinite(lse), 0.0)  # weight of the old rows
    weights = torch.exp(scores - ref[..., None])  # [..., R, n] (0 at invalid rows)
    merged = keep[..., None] * o + weights.to(values.dtype) @ values
    changed = valid.any(dim=-1)[..., None]  # [..., 1]: rows that saw no new valid row keep their state exactly
    return (torch.where(changed[..., None], merged, o), torch.where(changed & seen, new_lse, lse))


def summary_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """From scratch (the reference of `summary_merge`, and prompt-time state): queries [..., R, D] over keys and
    values [..., n, D] where valid [..., n] -> (o [..., R, D], lse [..., R])."""
    scores = (queries @ keys.transpose(-1, -2) * scale).masked_fill(~valid[..., None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return weights.to(values.dtype) @ values, lse


def window_rows(layer: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, window: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [L - W, L) of a cache layer [S, H_kv, T, D] for sequences `rows` [N] with lengths L [N] ->
    ([N, H_kv, W, D], valid [N, W]); positions before 0 are invalid (and read row 0)."""
    positions = lengths.long()[:, None] - window + torch.arange(window, device=lengths.device)  # [N, W]
    valid = positions >= 0
    picked = layer[rows.long()[:, None], :, positions.clamp(min=0)]  # [N, W, H_kv, D]
    return picked.transpose(1, 2), valid


# ---- the proposal model ----------------------------------------------------------------------------------------
class _Adapter(nn.Module):
    """A frozen target projection plus a trained low-rank update: x W^T (+ b) + (x A^T) B^T."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.__dict__["base"] = base  # the target's, not this module's parameter (not saved, not trained)
        self.down = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank))  # zero: training starts at the target's layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.base.weight, self.base.bias)
        return out + F.linear(F.linear(x, self.down.to(x.dtype)), self.up.to(x.dtype))


class _DraftBlock(nn.Module):
    """Target block l (frozen, shared) with adapters and its own norms."""

    def __init__(self, target_block: Block, rank: int) -> None:
        super().__init__()
        attn, ffn = target_block.attention, target_block.feed_forward
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = ffn.intermediate
        self.attention_norm = RMSNorm(target_block.attention_norm.weight.shape[0], target_block.attention_norm.eps)
        self.ffn_norm = RMSNorm(target_block.ffn_norm.weight.shape[0], target_block.ffn_norm.eps)
        with torch.no_grad():
            self.attention_norm.weight.copy_(target_block.attention_norm.weight)
            self.ffn_norm.weight.copy_(target_block.ffn_norm.weight)
        self.wqkv = _Adapter(attn.wqkv, rank)
        self.wo = _Adapter(attn.wo, rank)
        self.w_gate_up = _Adapter(ffn.w_gate_up, rank)
        self.w_down = _Adapter(ffn.w_down, rank)


class LongSpark(nn.Module):
    """The drafter's trained part, attached to a target (whose blocks, embedding, norm and head it uses)."""

    def __init__(self, config: LongSparkConfig, target: Transformer) -> None:
        super().__init__()
        config.check_target(target.config)
        self.config, tc = config, target.config
        self.__dict__["target"] = target  # shared, frozen: not a submodule (not saved, not moved, not trained)
        S, H, Hkv, D, R = len(config.target_layers), tc.hidden_size, tc.num_kv_heads, tc.head_dim, config.summary
        self.scale = 1.0 / math.sqrt(D)
        self.blocks = nn.ModuleList(_DraftBlock(target.layers[layer], config.lora_rank)
                                    for layer in config.target_layers)
        self.mask_embed = nn.Parameter(torch.zeros(H))
        self.fuse_norm = RMSNorm(S * H, tc.rms_norm_eps)
        self.fuse_down = nn.Parameter(torch.randn(config.fuse_rank, S * H) / math.sqrt(S * H))
        self.fuse_up = nn.Parameter(torch.zeros(H, config.fuse_rank))
        self.summary_q = nn.Parameter(torch.randn(S, Hkv, R, D) * 0.02)  # u: builds the summary (learned queries)
        self.summary_k = nn.Parameter(torch.randn(S, Hkv, R, D) * 0.02)  # kappa: the entries' keys for the blocks
        self.summary_bias = nn.Parameter(torch.zeros(S, Hkv, R))
        self.summary_gain = nn.Parameter(torch.zeros(S, Hkv, R))  # weight of (lse - log n), how peaked a match is
        self.markov_in = nn.Parameter(torch.randn(config.block, H, config.markov_rank) / math.sqrt(H))
        self.markov_out = nn.Parameter(torch.zeros(tc.vocab_size, config.markov_rank))

    # ---- shapes ----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.config.target_layers)

    def state_shapes(self, slots: int) -> dict[str, tuple[int, ...]]:
        """Per-run drafter state (independent of the prefix length): summary values, log-normalisers, boundary."""
        tc, c = self.target.config, self.config
        S, R = self.num_layers, c.summary
        return {"summary_o": (slots, S, tc.num_kv_heads, R, tc.head_dim), "summary_lse": (slots, S, tc.num_kv_heads, R),
                "boundary": (slots, S, tc.hidden_size)}

    # ---- the summary's scores ----------------------------------------------------------------------------------
    def summary_scores(self, j: int, keys: torch.Tensor) -> torch.Tensor:
        """Logits of layer j's summary queries against keys [N, H_kv, n, D] -> [N, H_kv, R, n] fp32 (also under
        autocast: training's summaries are the runtime's)."""
        with torch.autocast(keys.device.type, enabled=False):
            return (self.summary_q[j].float() @ keys.float().transpose(-1, -2)) * self.scale

    # ---- the parallel backbone -----------------------------------------------------------------------------------
    def backbone(self, cur: torch.Tensor, lengths: torch.Tensor, boundary: torch.Tensor,
                 windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], summary_o: torch.Tensor,
                 summary_lse: torch.Tensor, capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """One block of G slots for N sequences -> hidden states [N, G, H] (before the final norm).

        cur [N]: the token at position L = lengths [N]; boundary [N, S, H]: the target's hidden states of the token
        at L - 1; windows[j]: (K, V [N, H_kv, W, D], valid [N, W]) of target layer l_j; summary_o [N, S, H_kv, R, D]
        and summary_lse [N, S, H_kv, R] (fp32) over rows [0, L). capture: block j -> [N, G', H_q, D] buffers that
        receive the rotated queries of the first G' slots (Dustin's lookahead)."""
        target, G = self.target, self.config.block
        N, device = cur.shape[0], cur.device
        embed = target.embed(cur)  # [N, H]
        x = torch.cat([embed[:, None], self.mask_embed.to(embed.dtype).expand(N, G - 1, -1)], dim=1)  # [N, G, H]
        fused = F.linear(F.linear(self.fuse_norm(boundary.reshape(N, -1)), self.fuse_down.to(x.dtype)),
                         self.fuse_up.to(x.dtype))
        x = x + fused[:, None]
        if target.rope_cos is None:
            target.setup_rope()
        positions = lengths.long()[:, None] + torch.arange(G, device=device)  # [N, G]
        positions = positions.clamp(max=target.rope_cos.shape[0] - 1)  # slots past Γ near the end are unused
        cos, sin = target.rope_cos[positions], target.rope_sin[positions]
        rows_seen = lengths.float().clamp(min=1).log()[:, None, None]  # log n: the summary's rows
        for j, block in enumerate(self.blocks):
            Hq, Hkv, D = block.num_heads, block.num_kv_heads, block.head_dim
            q, k, v = block.wqkv(block.attention_norm(x)).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q_raw = q.view(N, G, Hq, D)
            q = apply_rope(q_raw, cos, sin)
            k = apply_rope(k.view(N, G, Hkv, D), cos, sin)
            if capture is not None and j in capture:
                buffer = capture[j]
                buffer.copy_(q[:, : buffer.shape[1]])
            win_k, win_v, win_valid = windows[j]
            lse = summary_lse[:, j]  # [N, H_kv, R]
            bias = self.summary_bias[j] + self.summary_gain[j] * (lse - rows_seen)
            bias = bias.masked_fill(~torch.isfinite(lse), float("-inf"))
            out = _block_attention(q, q_raw, k, v.view(N, G, Hkv, D), win_k, win_v, win_valid,
                                   self.summary_k[j], bias, summary_o[:, j], self.scale)
            x = x + block.wo(out.reshape(N, G, Hq * D))
            gate, up = block.w_gate_up(block.ffn_norm(x)).split(block.intermediate, dim=-1)
            x = x + block.w_down(F.silu(gate) * up)
        return x

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] -> the target head's fp32 logits [..., V] (one read of the head for all slots)."""
        return self.target.head(hidden)

    def markov(self, slot: int, previous: torch.Tensor) -> torch.Tensor:
        """The Markov correction of slot `slot` from the previous token ids [N] -> fp32 [N, V]."""
        e = self.target.embed(previous)  # [N, H]
        code = F.silu(e.float() @ self.markov_in[slot].float())  # [N, r]
        return code @ self.markov_out.float().T

    def markov_all(self, previous: torch.Tensor) -> torch.Tensor:
        """Teacher-forced corrections of every slot at once: previous [N, G] -> fp32 [N, G, V] (training)."""
        e = self.target.embed(previous).float()  # [N, G, H]
        code = F.silu(torch.einsum("ngh,ghr->ngr", e, self.markov_in.float()))
        return code @ self.markov_out.float().T

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, record: dict | None = None) -> None:
        """Write config.json and model.safetensors (LongSpark's own weights only, bf16)."""
        save_drafter(self, directory, self.config.to_json(), record)


def _block_attention(q, q_raw, k_loc, v_loc, win_k, win_v, win_valid, sum_k, sum_bias, sum_o, scale) -> torch.Tensor:
    """Slots' attention over [summary | window | local slots] in one softmax.

    q, q_raw [N, G, H_q, D] (rotated / not: summary entries have no position, so they score the unrotated query);
    k_loc, v_loc [N, G, H_kv, D]; win_k, win_v [N, H_kv, W, D] with win_valid [N, W]; sum_k [H_kv, R, D];
    sum_bias [N, H_kv, R] (-inf: no entry); sum_o [N, H_kv, R, D] -> [N, G, H_q, D]."""
    N, G, Hq, D = q.shape
    Hkv = k_loc.shape[2]
    group = Hq // Hkv
    qg = q.view(N, G, Hkv, group, D).permute(0, 2, 3, 1, 4)  # [N, H_kv, grp, G, D]
    qr = q_raw.view(N, G, Hkv, group, D).permute(0, 2, 3, 1, 4)
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)  # scores and weights in fp32 (fp64 stays)
    l_sum = torch.einsum("nhgtd,hrd->nhgtr", qr, sum_k.to(dtype)).to(acc) * scale
    l_sum = l_sum + sum_bias[:, :, None, None, :].to(acc)
    l_win = torch.einsum("nhgtd,nhwd->nhgtw", qg, win_k.to(dtype)).to(acc) * scale
    l_win = l_win.masked_fill(~win_valid[:, None, None, None, :], float("-inf"))
    l_loc = torch.einsum("nhgtd,nshd->nhgts", qg, k_loc).to(acc) * scale
    R, W = l_sum.shape[-1], l_win.shape[-1]
    p = torch.softmax(torch.cat([l_sum, l_win, l_loc], dim=-1), dim=-1)  # the local slots keep it finite
    out = (torch.einsum("nhgtr,nhrd->nhgtd", p[..., :R], sum_o.to(acc))
           + torch.einsum("nhgtw,nhwd->nhgtd", p[..., R: R + W], win_v.to(acc))
           + torch.einsum("nhgts,nshd->nhgtd", p[..., R + W:], v_loc.to(acc)))
    return out.to(dtype).permute(0, 3, 1, 2, 4).reshape(N, G, Hq, D)


def spread_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers evenly spread over a model's depth, the last one included (a random drafter's)."""
    count = min(count, num_layers)
    return tuple(sorted({round((num_layers - 1) * (i + 1) / count) for i in range(count)}))


def random_longspark(target: Transformer, seed: int = 0, **config) -> LongSpark:
    """LongSpark with every weight random (adapters, fusion and Markov terms too, which training starts at zero):
    the real shapes for benchmarks, and every path exercised for tests."""
    config = LongSparkConfig(**{"target_layers": spread_layers(target.config.num_layers), **config})
    device, dtype = target.embed.weight.device, target.embed.weight.dtype
    model = LongSpark(config, target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.ndim < 2 else 1.0 / math.sqrt(p.shape[-1])))
    return model.to(device=device, dtype=dtype).requires_grad_(False).eval()


def longspark_directory(spec: str | Path | None) -> Path:
    """The directory a LongSpark spec names (None / "smollm2-longspark": the packaged one), checked to hold one."""
    return _checkpoint_dir(spec)


def _checkpoint_dir(spec: str | Path | None) -> Path:
    directory = _PACKAGED if spec in (None, DEFAULT_LONGSPARK) else Path(spec)
    if not (directory / "config.json").is_file():
        if directory == _PACKAGED:
            raise ConfigError(f"the packaged LongSpark drafter is missing ({directory}); reinstall the package")
        if (directory / "checkpoint" / "config.json").is_file():
            raise ConfigError(f"--longspark {spec} is a training run's folder; its drafter is "
                              f"{directory / 'checkpoint'}: pass that")
        raise ConfigError(f"--longspark {spec}: no LongSpark checkpoint there (config.json missing); write one with "
                          "`trtllm-dustin train-longspark`")
    return directory


def longspark_config(spec: str | Path | None) -> LongSparkConfig | None:
    """The config of the drafter `spec` names (the forms of `load_longspark`), read without its weights, so that
    it can be checked against the target's config before anything loads; None for "random" (the target's shape)."""
    if spec == "random":
        return None
    path = _checkpoint_dir(spec) / "config.json"
    return LongSparkConfig.from_json(path.read_text(), f"LongSpark config {path}")


def load_longspark(spec: str | Path | None, target: Transformer, seed: int = 0) -> LongSpark:
    """A LongSpark drafter for `target`: a directory written by `LongSpark.save`, None or "smollm2-longspark" (the
    packaged one) or "random" (random weights at the target's shape; `seed`). Checks the config against the target
    before reading any weight."""
    from safetensors.torch import load_file

    config = longspark_config(spec)
    if config is None:
        return random_longspark(target, seed)
    config.check_target(target.config)
    directory = _checkpoint_dir(spec)
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{weights} is missing; the LongSpark checkpoint is incomplete")
    device, dtype = target.embed.weight.device, target.embed.weight.dtype
    model = LongSpark(config, target)
    state = load_file(str(weights))
    missing = set(model.state_dict()) - set(state)
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ConfigError(f"{weights} does not match its config (missing {sorted(missing)[:3]}, unexpected "
                          f"{sorted(unexpected)[:3]})")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).requires_grad_(False).eval()

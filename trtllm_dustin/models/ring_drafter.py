"""The ring drafter: a fixed-cost drafter with its own layers over a ring of the last W positions (issue 38).

Every committed position p enters as x_p = embed(token p) + F(the target's hidden states at p - 1 of `read_layers`),
which the target computed when it processed p - 1. The drafter's own layers (initialised as copies of target layers
`own_layers`, trained) run causally over a band of the last W positions, and each layer keeps the keys and values of
the positions it has seen in a ring. At serving time only the newly committed tokens of a round pass through the
layers (`ingest`), so the cost of a round and the state stay fixed in the prefix.

Proposals run one after another from the last committed position L (slot 0 is the ring pass's own output at L):
slot g >= 1 enters as embed(its proposed token) + P(the drafter's output at slot g - 1), because the target's state
there is not computed yet, and attends to the ring rows (L - W, L] and to the slots before it (`step`). The target's
embedding, final norm and LM head are reused frozen. Measured as a probe (benchmarks/results/longspark2/README.md,
third run): this design reaches the AR draft's greedy tau where the same layers as one parallel block do not.

Two paths compute the same thing: `forward_train` (whole windows: the band pass plus every anchor's slots unrolled)
and `ingest` + `step` (the serving path, position by position); tests hold them equal. F and P start at zero, so an
untrained drafter is the copied target layers over the token embeddings.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.dustin_config import model_fingerprint
from trtllm_dustin.models.checkpoint import save_drafter
from trtllm_dustin.models.decoder import RMSNorm, Transformer, scatter_vocab
from trtllm_dustin.models.longspark import spread_layers
from trtllm_dustin.models.quantize import Int8Linear, check_drafter_weights, project, quantize_linears, quantize_rows
from trtllm_dustin.models.rope import apply_rope
from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.plugins.fused_ops import add_rms_norm, rope_qkv_to_cache
from trtllm_dustin.plugins.ring_attention import ring_attention
from trtllm_dustin.plugins.skinny_linear import skinny_linear
from trtllm_dustin.validation import load_versioned, versioned_json

__all__ = ["DEFAULT_RING", "HEAD_IDS_FILE", "RING_SCHEMA_VERSION", "RingDrafter", "RingDrafterConfig", "RingState",
           "load_ring_drafter", "load_ring_weights", "random_ring_config", "random_ring_drafter",
           "read_ring_checkpoint", "ring_config", "ring_weight_bytes", "save_head_ids"]

RING_SCHEMA_VERSION = 1
_PACKAGED = Path(__file__).resolve().parent.parent / "weights" / "smollm2_ring"
DEFAULT_RING = "smollm2-ring"  # the packaged ring drafter, trained for the default model
_RETRAIN = "train one for it with `trtllm-dustin train-ring-drafter`"
HEAD_IDS_FILE = "head_ids.safetensors"  # beside the weights, optional: the vocabulary ids of a subset head


@dataclass(frozen=True)
class RingDrafterConfig:
    read_layers: tuple[int, ...]  # target layers whose hidden states at p - 1 feed position p
    own_layers: tuple[int, ...]  # target layers copied as the drafter's own at the start (their count is its depth)
    window: int = 256  # W: ring rows each slot attends to
    block: int = 7  # the most tokens a round proposes
    target_fingerprint: str = ""  # model_fingerprint of the target it was trained for ("" = any of its shape)

    def __post_init__(self) -> None:
        for name in ("read_layers", "own_layers"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
            if not getattr(self, name):
                raise ConfigError(f"a ring drafter needs at least one of {name}")
        for name in ("window", "block"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ring drafter {name}={getattr(self, name)} must be >= 1")

    def check_target(self, target: ModelConfig) -> None:
        bad = sorted({x for x in self.read_layers + self.own_layers if not 0 <= x < target.num_layers})
        if bad:
            raise ConfigError(f"ring drafter layers {bad} do not exist in {target.name} ({target.num_layers} layers); "
                              f"{_RETRAIN}")
        if self.target_fingerprint and self.target_fingerprint != model_fingerprint(target):
            raise ConfigError(f"this ring drafter was trained for another target than {target.name}; {_RETRAIN}")

    def to_json(self) -> str:
        return versioned_json(RING_SCHEMA_VERSION, asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = "the ring drafter config") -> RingDrafterConfig:
        return load_versioned(cls, text, (RING_SCHEMA_VERSION,), source, "retrain it with `trtllm-dustin "
                              "train-ring-drafter`")


@dataclass
class RingState:
    """A batch's ring: per own layer one buffer of keys and one of values [B, C + G, H_kv, D]. Their first C rows are
    the ring (row p % C holds position p; `keys` / `values` view them) and their last G rows the current round's slots
    (`slot_keys` / `slot_values`), so a slot step reads the ring and the slots as one tensor. `positions` [B, C]: the
    position each ring row holds (-1: none). C = W + block + 1, so that a round's newly committed rows (at most
    block + 1) never evict a row that one of them reads."""
    joined_keys: list[torch.Tensor]
    joined_values: list[torch.Tensor]
    positions: torch.Tensor

    @property
    def keys(self) -> list[torch.Tensor]:
        return [t[:, : self.positions.shape[1]] for t in self.joined_keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [t[:, : self.positions.shape[1]] for t in self.joined_values]

    @property
    def slot_keys(self) -> list[torch.Tensor]:
        return [t[:, self.positions.shape[1]:] for t in self.joined_keys]

    @property
    def slot_values(self) -> list[torch.Tensor]:
        return [t[:, self.positions.shape[1]:] for t in self.joined_values]

    def rows(self, slots: slice) -> RingState:
        """The state of sequences `slots` (views: writes reach this state)."""
        return RingState([t[slots] for t in self.joined_keys], [t[slots] for t in self.joined_values],
                         self.positions[slots])


class RingDrafter(nn.Module):
    def __init__(self, config: RingDrafterConfig, target: Transformer) -> None:
        super().__init__()
        config.check_target(target.config)
        self.config = config
        self.__dict__["target"] = target  # frozen and shared: not a submodule (not saved, not trained)
        H, eps = target.config.hidden_size, target.config.rms_norm_eps
        self.layers = nn.ModuleList(copy.deepcopy(target.layers[i]).float().requires_grad_(True)
                                    for i in config.own_layers)
        self.read_norms = nn.ModuleList(RMSNorm(H, eps) for _ in config.read_layers)
        self.fuse = nn.Linear(len(config.read_layers) * H, H, bias=False)  # F
        self.own_norm = RMSNorm(H, eps)
        self.own = nn.Linear(H, H, bias=False)  # P
        nn.init.zeros_(self.fuse.weight)
        nn.init.zeros_(self.own.weight)
        # a subset head (use_head): the vocabulary ids proposals come from and the target's output rows at them;
        # plain attributes, so not saved with the weights (HEAD_IDS_FILE holds the ids) and not trained
        self.head_ids: torch.Tensor | None = None
        self._head_rows: torch.Tensor | None = None
        self._head_scale: torch.Tensor | None = None  # per-row scales of int8 head rows (quantize_weights)

    def use_head(self, ids: torch.Tensor | None) -> RingDrafter:
        """Propose only tokens of the vocabulary ids `ids` (a subset head: the target's output rows at them, copied
        once; every other id gets logit -inf), or from the whole vocabulary (None). Call it once the target is on
        its device and in its dtype: the rows are taken from it as they are. Proposals from a subset are verified
        as any others, so decoding stays exact; what changes is how many bytes each slot's head reads."""
        if self.weights != "model":
            raise ConfigError("choose the subset head before quantize_weights: the head rows are quantized with the "
                              "layers")
        if ids is None:
            self.head_ids = self._head_rows = None
            return self
        V = self.target.config.vocab_size
        if self.target.head_ids is not None:
            raise ConfigError("the target has a subset head itself; a ring drafter's subset head takes rows of a "
                              "whole-vocabulary output matrix")
        ids = torch.as_tensor(ids).long().flatten()
        if not 0 < ids.numel() < V:
            raise ConfigError(f"a subset head of {ids.numel()} ids: give between 1 and {V - 1} vocabulary ids "
                              "(or none, for the whole vocabulary)")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ConfigError(f"subset head ids must lie in [0, {V}) (the target's vocabulary); got "
                              f"{int(ids.min())} .. {int(ids.max())}")
        ids = ids.sort().values
        if bool((ids[1:] == ids[:-1]).any()):
            raise ConfigError("subset head ids must be distinct; an id given twice would get two logits")
        weight = self.target.output_weight()
        self.head_ids = ids.to(weight.device)
        self._head_rows = weight.detach().index_select(0, self.head_ids).contiguous()
        return self

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The drafter's outputs h [..., H] -> fp32 logits over the whole vocabulary [..., V], through the target's
        final norm and output head, or its rows of a subset head (-inf at the other ids)."""
        if self.head_ids is None:
            return self.target.head(h).float()
        return scatter_vocab(self._subset_logits(h), self.head_ids, self.target.config.vocab_size)

    def _subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., len(head_ids)] at the subset head's ids."""
        return skinny_linear(self._norm(self.target.norm, h), self._head_rows, kernels=self.target.kernels,
                             scale=self._head_scale).float()

    def greedy(self, h: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        """The argmax of `logits(h)` [...] (int64), without scattering a subset head's logits over the whole
        vocabulary first: its ids ascend, so the first best of the subset is the first best of the scattered row."""
        if self.head_ids is None:
            return argmax_last(self.logits(h), use_kernel=use_kernel)
        return self.head_ids[argmax_last(self._subset_logits(h), use_kernel=use_kernel)]

    @property
    def weights(self) -> str:
        """What quantize_weights made of the layers and the subset head: "int8" or "model"."""
        return "int8" if isinstance(self.layers[0].attention.wqkv, Int8Linear) else "model"

    def quantize_weights(self, kind: str, wide: bool = False) -> RingDrafter:
        """Serve with `kind` weights: "model" leaves them as they are; "int8" rounds every projection of the own
        layers, and the subset head's rows where there is one, to weight-only int8 with one scale per output row
        (models/quantize.py). What a slot step reads from them halves; F, P and the norms stay in the model's
        dtype. Proposals change (tau is measured per kind), never what decoding commits. With `wide` (the run's
        `KernelConfig.int8_wide`), each int8 projection also keeps its dequantized weight in the drafter's dtype,
        which the observe pass's wide calls read (models/quantize.py). Call it after use_head, once, on a drafter that
        will not be trained further, in the dtype and on the device it serves in."""
        if check_drafter_weights(kind) == "model":
            return self
        if self.weights != "model":
            raise ConfigError(f"this ring drafter is already {self.weights}")
        for layer in self.layers:
            quantize_linears(layer, self.dtype if wide else None)
        if self._head_rows is not None:
            self._head_rows, self._head_scale = quantize_rows(self._head_rows)
        return self

    # ---- pieces both paths use ---------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The drafter's own weights' (fp32 master weights in training, the target's when loaded to serve): its
        inputs are cast to it."""
        return self.fuse.weight.dtype

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """F: the target's hidden states [..., len(read_layers), H] at p - 1 -> [..., H] for position p."""
        parts = [self._norm(norm, hidden[..., j, :].to(self.dtype)) for j, norm in enumerate(self.read_norms)]
        return self._linear(self.fuse, torch.cat(parts, dim=-1))

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether a pass over x takes the target's fused decode kernels (its KernelConfig decides, as for its own
        layers; never under autograd: training runs the module code)."""
        return not torch.is_grad_enabled() and self.target.fused_for(x)

    def _qkv(self, layer, x: torch.Tensor, positions: torch.Tensor):
        att = layer.attention
        Hq, Hkv, D = att.num_heads, att.num_kv_heads, att.head_dim
        qkv = self._linear(att.wqkv, self._norm(layer.attention_norm, x))  # fused: one RMSNorm kernel, the skinny GEMM
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        cos, sin = self.target.rope_cos[positions], self.target.rope_sin[positions]
        shape = x.shape[:-1]
        return (apply_rope(q.view(*shape, Hq, D), cos, sin), apply_rope(k.view(*shape, Hkv, D), cos, sin),
                v.view(*shape, Hkv, D))

    def _rope_into(self, layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                   values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The fused path's _qkv for positions entering the joined buffers: x [B, n, H] through the fused RMSNorm and
        the skinny GEMM, then one kernel rotates q and k (rope: the cos / sin tables at the positions, [B, n, D/2])
        and writes k and v into keys / values [B, R, H_kv, D] at rows [B, n] -> q [B, n, H_q, D]."""
        att = layer.attention
        qkv = self._linear(att.wqkv, self._norm(layer.attention_norm, x))
        return rope_qkv_to_cache(qkv, *rope, keys.transpose(1, 2), values.transpose(1, 2), rows, att.num_heads,
                                 att.num_kv_heads, att.head_dim, pdl=self.target.kernels.pdl)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [N, S, Hq, D], k / v [N, K, Hkv, D], mask [N or 1, S, K] (True: read) -> [N, S, Hq * D]. Each KV head's
        query group is folded into the query rows (row s * group + g), so the keys and values are read as they lie,
        never copied once per query head."""
        N, S, Hq, D = q.shape
        Hkv = k.shape[2]
        group = Hq // Hkv
        q = q.reshape(N, S, Hkv, group, D).permute(0, 2, 1, 3, 4).reshape(N, Hkv, S * group, D)
        mask = mask[:, None].repeat_interleave(group, dim=2) if group > 1 else mask[:, None]
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.reshape(N, Hkv, S, group, D).permute(0, 2, 1, 3, 4).reshape(N, S, Hq * D)

    def _finish(self, layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if self._fused(x):  # the target's fused path: skinny-M GEMMs, the residual add folded into the norm
            kernels, norm = self.target.kernels, layer.ffn_norm
            normed, x = add_rms_norm(x, project(layer.attention.wo, attn, kernels),
                                     norm.weight, norm.eps, pdl=kernels.pdl)
            return x + layer.feed_forward.forward_fused(normed, self.target.split_k_workspace(x.device), kernels)
        x = x + layer.attention.wo(attn)
        return x + layer.feed_forward(layer.ffn_norm(x))

    def _slot_input(self, tokens: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Slot g >= 1's input: its token's embedding + P(the drafter's output at slot g - 1)."""
        own = self._linear(self.own, self._norm(self.own_norm, previous.to(self.dtype)))
        return self.target.embed(tokens).to(self.dtype) + own

    def _linear(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """linear(x), through the skinny-M GEMM (and its tactic table) on the fused path, as the own layers' are."""
        return project(linear, x, self.target.kernels) if self._fused(x) else linear(x)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x), through the fused RMSNorm on the fused path (one kernel where the module code runs several)."""
        if self._fused(x):
            return add_rms_norm(x, None, norm.weight, norm.eps, pdl=self.target.kernels.pdl)[0]
        return norm(x)

    # ---- training: whole windows -------------------------------------------------------------------------
    def _band(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Every position attends to the last W positions, itself included: q / k / v [B, T, H*, D] -> [B, T, Hq * D],
        in chunks of W rows (each reads itself and the chunk before), so the cost is O(T W), not O(T^2). key_ok
        [B, T]: the positions others may read (None: all); each position always reads itself, so none is empty."""
        B, T, W = q.shape[0], q.shape[1], self.config.window
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
        mask = mask.repeat(B, 1, 1)
        if key_ok is not None:
            ok = chunks(F.pad(key_ok, (0, pad))[..., None])[..., 0].reshape(B * n, 1, 2 * W)
            mask = mask & (ok | (j == i + W)[None])
        out = self._attend(q.reshape(B * n, W, *q.shape[2:]), chunks(k).reshape(B * n, 2 * W, *k.shape[2:]),
                           chunks(v).reshape(B * n, 2 * W, *v.shape[2:]), mask)
        return out.reshape(B, n * W, -1)[:, :T]

    def forward_train(self, tokens: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T]; hidden [B, T, len(read_layers), H]: the target's hidden states at each position (position p
        reads those at p - 1); anchors [A] with L + block <= T -> (the ring pass's outputs [B, T, H], every anchor's
        slots [B * A, block, H]: slot 0 is the ring pass at L, slot g >= 1 unrolled from slot g - 1's output, with the
        true tokens at L + g)."""
        target, W, G = self.target, self.config.window, self.config.block
        B, T = tokens.shape
        A, device = anchors.shape[0], tokens.device
        f = self.features(hidden)
        x = target.embed(tokens).to(self.dtype) + torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
        pos = torch.arange(T, device=device)
        rows = anchors[:, None] - W + 1 + torch.arange(W, device=device)  # ring rows (L - W, L]
        slot_pos = anchors[:, None] + torch.arange(G, device=device)  # [A, G]
        ring = []
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos[None].expand(B, T))
            ring.append((k[:, rows.clamp(min=0)].reshape(B * A, W, *k.shape[2:]),
                         v[:, rows.clamp(min=0)].reshape(B * A, W, *v.shape[2:])))
            x = self._finish(layer, x, self._band(q, k, v))
        valid = (rows >= 0).repeat(B, 1)  # [B * A, W]
        h = x[:, anchors].reshape(B * A, 1, -1)
        outs, slot_kv = [h], [[] for _ in self.layers]
        for g in range(1, G):
            s = self._slot_input(tokens[:, slot_pos[:, g]].reshape(B * A, 1), h)
            positions = slot_pos[:, g].repeat(B)[:, None]
            mask = torch.cat([valid, torch.ones(B * A, g, dtype=torch.bool, device=device)], -1)[:, None]
            for layer, (ring_k, ring_v), kv in zip(self.layers, ring, slot_kv, strict=True):
                sq, sk, sv = self._qkv(layer, s, positions)
                kv.append((sk, sv))
                s = self._finish(layer, s, self._attend(sq, torch.cat([ring_k, *(a for a, _ in kv)], 1),
                                                        torch.cat([ring_v, *(b for _, b in kv)], 1), mask))
            h = s
            outs.append(h)
        return x, torch.cat(outs, dim=1)

    # ---- serving: position by position -------------------------------------------------------------------
    def new_state(self, batch: int, dtype: torch.dtype | None = None) -> RingState:
        """An empty ring for `batch` sequences (every row holds no position)."""
        layer = self.layers[0].attention
        C, G = self.config.window + self.config.block + 1, self.config.block
        device = self.fuse.weight.device
        dtype = dtype or self.fuse.weight.dtype
        shape = (batch, C + G, layer.num_kv_heads, layer.head_dim)  # the ring's C rows, then the G slots'
        n = len(self.layers)
        return RingState([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
                         [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
                         torch.full((batch, C), -1, dtype=torch.long, device=device))

    @property
    def fill_span(self) -> int:
        """Positions `fill` runs to give a fresh ring exactly the rows training would: the last W, and before them
        the (layers - 1)(W - 1) positions their deeper layers' keys and values depend on."""
        return len(self.layers) * (self.config.window - 1) + 1

    def fill(self, state: RingState, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             valid: torch.Tensor, outputs: bool = True) -> torch.Tensor | None:
        """A fresh ring from each sequence's last committed positions (a prompt at admission): tokens / positions /
        valid [B, T] (positions ascending by one per row; invalid ones, below 0 or not computed, are read by none),
        hidden [B, T, len(read_layers), H] (the target's at each position - 1) -> outputs [B, T, H]. The band pass
        runs over them as training's does, and the last W positions' keys and values fill the ring, its other rows
        emptied. With T >= fill_span (or positions from 0) the ring equals training's. outputs=False: only the ring
        is wanted (None is returned), and the last layer's attention output and MLP are not run."""
        C, W = state.positions.shape[1], self.config.window
        batch = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        x = self.target.embed(tokens).to(self.dtype) + self.features(hidden)
        last = positions[:, -W:]
        rows = last % C
        state.positions.fill_(-1)
        state.positions[batch, rows] = torch.where(valid[:, -W:], last, -1)
        rotary = positions.clamp(min=0)  # a position below 0 is read by none: any rotary row serves it
        last = len(self.layers) - 1
        for i, (layer, ring_k, ring_v) in enumerate(zip(self.layers, state.keys, state.values, strict=True)):
            q, k, v = self._qkv(layer, x, rotary)
            ring_k[batch, rows] = k[:, -W:].to(ring_k.dtype)
            ring_v[batch, rows] = v[:, -W:].to(ring_v.dtype)
            if i == last and not outputs:
                return None
            x = self._finish(layer, x, self._band(q, k, v, valid))
        return x

    def ingest(self, state: RingState, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor, outputs: bool = True, output_row: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """Pass committed positions through the layers and write them into the ring: tokens / positions / valid
        [B, n] (distinct ascending positions per row, invalid ones included, each valid one following the ring's
        last; at most block + 2 of them, so that none evicts a row one of them reads, unless the ring holds nothing
        they read: a fresh sequence takes up to the ring's rows), hidden [B, n, len(read_layers), H]
        (the target's at each position - 1) -> outputs [B, n, H]. Invalid entries write nothing into the ring (their
        outputs are meaningless; on the fused path their keys and values go to the slot rows, which the next slot
        steps rewrite before reading); a row whose entries are all invalid keeps its ring as it was. outputs=False:
        only the ring is wanted (None is returned), and the last layer's attention output and MLP are not run.
        output_row [B] (int64): only each sequence's entry at that index is wanted -> its output [B, H]; the last
        layer's attention output and MLP run for it alone (the observe pass wants the next `cur`'s)."""
        C, W = state.positions.shape[1], self.config.window
        if tokens.shape[1] > C:
            raise ValueError(f"ingest takes at most {C} positions at a time (the ring's rows), got {tokens.shape[1]}")
        batch = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        rows = positions % C
        x = self.target.embed(tokens).to(self.dtype) + self.features(hidden)
        written = torch.where(valid, positions, state.positions[batch, rows])
        state.positions[batch, rows] = written
        last = len(self.layers) - 1

        def pick(t: torch.Tensor) -> torch.Tensor:  # the last layer's rows [B, n, ...] -> [B, 1, ...] at output_row
            return t if output_row is None else t[batch[:, 0], output_row][:, None]

        if self._fused(x):  # the fused path: an invalid entry writes into a slot row (scratch until the next round)
            G = self.config.block
            scratch = C + torch.arange(tokens.shape[1], device=tokens.device) % G
            write = torch.where(valid, rows, scratch[None])
            rope = self.target.rope_cos[positions], self.target.rope_sin[positions]
            for i, (layer, keys, values) in enumerate(zip(self.layers, state.joined_keys, state.joined_values,
                                                          strict=True)):
                q = self._rope_into(layer, x, rope, keys, values, write)
                if i == last:
                    if not outputs:
                        return None
                    q, x, positions = pick(q), pick(x), pick(positions)
                x = self._finish(layer, x, ring_attention(q, keys, values, state.positions, positions, W, 0,
                                                          pdl=self.target.kernels.pdl).flatten(2))
            return x if output_row is None else x[:, 0]
        # query at p reads the ring rows holding positions in (p - W, p]
        held = state.positions[:, None, :]  # [B, 1, C]
        mask = (held >= 0) & (held <= positions[:, :, None]) & (held > positions[:, :, None] - W)
        for i, (layer, ring_k, ring_v) in enumerate(zip(self.layers, state.keys, state.values, strict=True)):
            q, k, v = self._qkv(layer, x, positions)
            keep = valid[:, :, None, None]
            ring_k[batch, rows] = torch.where(keep, k.to(ring_k.dtype), ring_k[batch, rows])
            ring_v[batch, rows] = torch.where(keep, v.to(ring_v.dtype), ring_v[batch, rows])
            if i == last:
                if not outputs:
                    return None
                q, x, mask = pick(q), pick(x), pick(mask)
            x = self._finish(layer, x, self._attend(q, ring_k.to(q.dtype), ring_v.to(q.dtype), mask))
        return x if output_row is None else x[:, 0]

    def step(self, state: RingState, g: int, tokens: torch.Tensor, previous: torch.Tensor, anchor: torch.Tensor
             ) -> torch.Tensor:
        """Slot g >= 1 of a round from anchor L [B] (the last committed position): tokens [B] (the proposal at L + g),
        previous [B, H] (the drafter's output at slot g - 1) -> its output [B, H]. It reads the ring rows (L - W, L]
        and the round's slots 1 .. g (its own keys and values are kept for the slots after it)."""
        W = self.config.window
        s = self._slot_input(tokens[:, None], previous[:, None])
        positions = (anchor + g)[:, None]
        held = state.positions
        slot = held.shape[1] + g - 1  # this slot's row in the joined buffers: after the ring's C rows
        if self._fused(s):
            rope = self.target.rope_cos[positions], self.target.rope_sin[positions]
            write = torch.full_like(positions, slot)
            for layer, keys, values in zip(self.layers, state.joined_keys, state.joined_values, strict=True):
                q = self._rope_into(layer, s, rope, keys, values, write)
                s = self._finish(layer, s, ring_attention(q, keys, values, held, anchor[:, None], W, g,
                                                          pdl=self.target.kernels.pdl).flatten(2))
            return s[:, 0]
        ring_ok = (held >= 0) & (held <= anchor[:, None]) & (held > anchor[:, None] - W)
        slots_ok = torch.arange(1, self.config.block + 1, device=held.device)[None].expand(held.shape[0], -1) <= g
        mask = torch.cat([ring_ok, slots_ok], dim=1)[:, None]  # [B, 1, C + G]
        for layer, keys, values in zip(self.layers, state.joined_keys, state.joined_values, strict=True):
            q, k, v = self._qkv(layer, s, positions)
            keys[:, slot] = k[:, 0].to(keys.dtype)
            values[:, slot] = v[:, 0].to(values.dtype)
            # the ring's rows and then the slots', in one buffer (the mask's order)
            s = self._finish(layer, s, self._attend(q, keys.to(q.dtype), values.to(q.dtype), mask))
        return s[:, 0]

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save(self, directory: str | Path, record: dict | None = None) -> None:
        """Write config.json and model.safetensors (the drafter's own weights only, bf16), and HEAD_IDS_FILE when
        it proposes from a subset head."""
        if self.weights != "model":
            raise ConfigError(f"a {self.weights} ring drafter is for serving; save the drafter it was quantized from")
        save_drafter(self, directory, self.config.to_json(), record)
        if self.head_ids is not None:
            save_head_ids(directory, self.head_ids)


def save_head_ids(directory: str | Path, ids: torch.Tensor) -> None:
    """Write a ring drafter's subset-head ids (HEAD_IDS_FILE) into its directory; `load_ring_drafter` applies them."""
    from safetensors.torch import save_file

    save_file({"head_ids": torch.as_tensor(ids).to("cpu", torch.int32).contiguous()},
              str(Path(directory) / HEAD_IDS_FILE), metadata={"format": "pt"})


def load_ring_drafter(spec: str | Path | None, target: Transformer, subset_head: bool = True,
                      weights: str = "model", seed: int = 0, wide: bool = False) -> RingDrafter:
    """The ring drafter `RingDrafter.save` wrote to directory `spec` (None or "smollm2-ring": the packaged one;
    "random": random weights at `random_ring_config`'s shape, drawn with `seed`), for `target` (its config checked
    against the target before any weight is read), in the target's dtype and on its device; proposing from the subset
    head of its HEAD_IDS_FILE where it has one and `subset_head` is on, else from the whole vocabulary; its layers and
    head quantized to `weights` (RingDrafter.quantize_weights, with `wide`: the run's KernelConfig.int8_wide)."""
    from safetensors.torch import load_file

    check_drafter_weights(weights)
    if spec == "random":
        return random_ring_drafter(target, random_ring_config(target.config), seed).quantize_weights(weights, wide)
    directory, config = read_ring_checkpoint(spec)
    config.check_target(target.config)
    model = load_ring_weights(RingDrafter(config, target), directory)
    model = model.to(device=target.embed.weight.device, dtype=target.embed.weight.dtype).requires_grad_(False).eval()
    head = directory / HEAD_IDS_FILE
    if subset_head and head.is_file():
        ids = load_file(str(head)).get("head_ids")
        if ids is None:
            raise ConfigError(f"{head} holds no 'head_ids' tensor; delete it to propose from the whole vocabulary")
        model.use_head(ids)
    return model.quantize_weights(weights, wide)


def ring_config(spec: str | Path | None, target: ModelConfig) -> RingDrafterConfig:
    """The config of ring drafter `spec` (as load_ring_drafter takes it), checked against `target`; no weight is
    read."""
    if spec == "random":
        return random_ring_config(target)
    config = read_ring_checkpoint(spec)[1]
    config.check_target(target)
    return config


def ring_weight_bytes(spec: str | Path | None, target: ModelConfig, itemsize: int) -> int:
    """Bytes of ring drafter `spec`'s own weights in a dtype of `itemsize` bytes (the memory checks' count, before
    any weight is read; int8 rounding halves its layers later, so this bounds it): its layers, F and P, and the
    target's output rows its subset head copies (the head file's length, read from its header)."""
    config = ring_config(spec, target)
    H = target.hidden_size
    head_rows = 0
    if spec != "random":
        head = read_ring_checkpoint(spec)[0] / HEAD_IDS_FILE  # the directory (the config was checked above)
        if head.is_file():
            from safetensors import safe_open

            with safe_open(str(head), framework="pt") as f:
                head_rows = f.get_slice("head_ids").get_shape()[0] if "head_ids" in f.keys() else 0
    params = len(config.own_layers) * target.layer_parameters() + (len(config.read_layers) + 1) * H * H
    return (params + head_rows * H) * itemsize


def random_ring_config(target: ModelConfig) -> RingDrafterConfig:
    """A random ring drafter's shape for `target`, as the packaged one's: it reads 5 target layers spread over the
    depth and copies 4 (the first and the last among them), W = 256, proposing up to 7 tokens."""
    n = target.num_layers
    own = tuple(sorted({round((n - 1) * i / 3) for i in range(4)}))
    return RingDrafterConfig(read_layers=spread_layers(n), own_layers=own)


def load_ring_weights(model: RingDrafter, directory: Path) -> RingDrafter:
    """The weights of checkpoint `directory` (read_ring_checkpoint's) into `model`, cast to its dtype; the names
    must be the model's, each one."""
    from safetensors.torch import load_file

    weights_file = directory / "model.safetensors"
    state = load_file(str(weights_file))
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ConfigError(f"{weights_file} does not match its config (missing {sorted(missing)[:3]}, unexpected "
                          f"{sorted(unexpected)[:3]})")
    model.load_state_dict(state)
    return model


def read_ring_checkpoint(spec: str | Path | None) -> tuple[Path, RingDrafterConfig]:
    """The directory of ring drafter `spec` (None or "smollm2-ring": the packaged one) and its config, read without
    loading any weight; its model.safetensors is checked to exist."""
    directory = _PACKAGED if spec in (None, DEFAULT_RING) else Path(spec)
    path = directory / "config.json"
    if not path.is_file():
        if directory == _PACKAGED:
            raise ConfigError(f"the packaged ring drafter is missing ({directory}); reinstall the package")
        if (directory / "checkpoint" / "config.json").is_file():
            raise ConfigError(f"{directory} is a training run's folder; its ring drafter is "
                              f"{directory / 'checkpoint'}: pass that")
        raise ConfigError(f"{directory}: no ring drafter there (config.json missing); write one with `trtllm-dustin "
                          "train-ring-drafter`")
    config = RingDrafterConfig.from_json(path.read_text(), f"ring drafter config {path}")
    if not (directory / "model.safetensors").is_file():
        raise ConfigError(f"{directory / 'model.safetensors'} is missing; the ring drafter's checkpoint is incomplete")
    return directory, config


def random_ring_drafter(target: Transformer, config: RingDrafterConfig, seed: int = 0) -> RingDrafter:
    """A ring drafter at `config`'s shape with F and P random too (training starts them at zero), in the target's
    dtype and on its device: the real shapes for benchmarks."""
    model = RingDrafter(config, target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear in (model.fuse, model.own):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / linear.weight.shape[1] ** 0.5)
    return model.to(device=target.embed.weight.device, dtype=target.embed.weight.dtype).requires_grad_(False).eval()

"""Dustin's estimator configuration: which heads score, how the budget splits. Written by the search, read by
the runtime, never edited by it (paper Sec. 4.2.2, Algorithm 1)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trtllm_dustin.config import ConfigError, ModelConfig
from trtllm_dustin.validation import load_versioned, versioned_json

__all__ = ["DUSTIN_SCHEMA_VERSION", "SCORE_WINDOW_OPS", "VARIANTS", "DustinConfig", "LayerHeads", "model_fingerprint"]

# 2: in-pass selection (selection_layers, selection_m, dense_layers); 3: pool_layers; 4: score_window(_op)
DUSTIN_SCHEMA_VERSION = 4
# a version-1 file is a config without in-pass selection, 2 one without pooling, 3 one without a score window
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)
SCORE_WINDOW_OPS = ("max", "mean")  # score_window_op: a sliding max (SnapKV's pooling) or mean over the window
VARIANTS = ("h", "t", "d")  # hybrid (Eq. 6), target history only, draft lookahead only


def model_fingerprint(config: ModelConfig) -> str:
    """A short hash of a model's shape, so a config searched for one pair is not used with another."""
    shape = {k: v for k, v in asdict(config).items() if k != "name"}
    if not shape["head_vocab_size"]:  # added later: a whole-vocabulary head keeps its earlier fingerprint
        del shape["head_vocab_size"]
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LayerHeads:
    """The semantic retrieval heads (query-head indices) of one decoder layer."""

    layer: int
    heads: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", tuple(int(h) for h in self.heads))
        if not self.heads:
            raise ConfigError(f"layer {self.layer} lists no heads")
        if len(set(self.heads)) != len(self.heads):
            raise ConfigError(f"layer {self.layer} lists a head twice: {self.heads}")


@dataclass(frozen=True)
class DustinConfig:
    target_layers: tuple[LayerHeads, ...]  # target SRH layers scoring the last committed token (S_target)
    draft_layers: tuple[LayerHeads, ...]  # draft SRH layers scoring the Γ lookahead queries (S_draft)
    budget: int = 512  # k: cached positions each verification reads, protected ones included
    m: int = 128  # positions taken by S_draft before S_target fills the rest (Eq. 6)
    n_sink: int = 4  # attention sinks, always kept
    n_recent: int = 16  # most recent committed positions, always kept
    gamma: int = 3  # draft tokens per round the config was searched for
    target_fingerprint: str = ""  # model_fingerprint of the target the search ran on
    draft_fingerprint: str = ""  # model_fingerprint of the draft the search ran on
    # In-pass selection (dustin-ip, runtime/selectors/in_pass.py): at these target layers the verification pass picks
    # the set from its own Γ + 1 queries, scored on the listed heads; the first one chooses, later ones re-select.
    selection_layers: tuple[LayerHeads, ...] = ()
    selection_m: int = 0  # in-pass: positions taken by the draft's lookahead (S_draft, Eq. 5) beside the pass's own
    dense_layers: int = 0  # in-pass: the first layers verified in full (else they read the previous round's set)
    # in-pass: earlier layers whose verification queries' scores (Eq. 5 on the listed heads) are summed into the first
    # selection layer's before it chooses (the search's phase C)
    pool_layers: tuple[LayerHeads, ...] = ()
    # in-pass: before the top-k, each position's score becomes the max (or mean) of the scores in a window of this odd
    # width centred on it, so a chosen position brings its neighbours (a retrieved fact is a phrase, not a token);
    # 1 = the scores as they are. Page bounds (dustin-ip-pages) choose whole pages and ignore it.
    score_window: int = 1
    score_window_op: str = "max"

    def __post_init__(self) -> None:
        for name in ("target_layers", "draft_layers", "selection_layers", "pool_layers"):
            object.__setattr__(self, name, tuple(x if isinstance(x, LayerHeads) else LayerHeads(**x)
                                                 for x in getattr(self, name)))
        protected = self.n_sink + self.n_recent
        if self.budget <= protected:
            raise ConfigError(f"budget k={self.budget} must exceed sinks + recent window = {protected}")
        if not 0 <= self.m <= self.budget - protected:
            raise ConfigError(f"m={self.m} must be in [0, k - sinks - window = {self.budget - protected}]")
        if self.gamma < 1:
            raise ConfigError(f"gamma={self.gamma} must be >= 1")
        if not self.target_layers and not self.draft_layers and not self.selection_layers:
            raise ConfigError("a Dustin config needs at least one target or draft SRH layer or a selection layer")
        if not 0 <= self.selection_m <= self.budget - protected:
            raise ConfigError(f"selection_m={self.selection_m} must be in [0, k - sinks - window = "
                              f"{self.budget - protected}]")
        layers = [lh.layer for lh in self.selection_layers]
        if layers != sorted(set(layers)):
            raise ConfigError(f"selection_layers {layers} must be distinct and ascending (the first one chooses)")
        if self.dense_layers < 0 or (layers and self.dense_layers > layers[0]):
            raise ConfigError(f"dense_layers={self.dense_layers} must be in [0, the first selection layer "
                              f"{layers[0] if layers else 0}]: the layers after it read the chosen set")
        pooled = [lh.layer for lh in self.pool_layers]
        if pooled and (not layers or pooled != sorted(set(pooled)) or pooled[-1] >= layers[0]):
            raise ConfigError(f"pool_layers {pooled} must be distinct, ascending and below the first selection layer "
                              f"{layers[0] if layers else '(none: pooling needs selection_layers)'}")
        if self.score_window < 1 or self.score_window % 2 == 0:
            raise ConfigError(f"score_window={self.score_window} must be an odd width >= 1 (1: no window)")
        if self.score_window_op not in SCORE_WINDOW_OPS:
            raise ConfigError(f"score_window_op={self.score_window_op!r} is unknown; choose one of {SCORE_WINDOW_OPS}")

    def with_budget(self, budget: int) -> DustinConfig:
        """This config at another budget k, m carried over as the same share of the free slots (k - sinks - recent);
        the SRH layers and heads, which the search chose independently of k, stay."""
        if budget == self.budget:
            return self
        protected = self.n_sink + self.n_recent
        if budget <= protected:
            raise ConfigError(f"--budget {budget} must exceed sinks + recent window = {protected}; raise it")
        free, old_free = budget - protected, self.budget - protected

        def scaled(m: int) -> int:
            return max(0, min(free, round(m * free / old_free)))

        return replace(self, budget=budget, m=scaled(self.m), selection_m=scaled(self.selection_m))

    def variant(self, name: str) -> DustinConfig:
        """dustin-h keeps m; dustin-t gives the whole free budget to S_target, dustin-d to S_draft."""
        if name not in VARIANTS:
            raise ConfigError(f"Dustin variant {name!r} is unknown; choose one of {VARIANTS}")
        free = self.budget - self.n_sink - self.n_recent
        return {"h": self, "t": replace(self, m=0), "d": replace(self, m=free)}[name]

    def check_models(self, target: ModelConfig, draft: ModelConfig | None, source: str = "this Dustin config"
                     ) -> None:
        """Refuse a config whose layers/heads do not exist in these models or that was searched for others (draft
        None: check the target side only, for a drafter that is not the searched draft model). source: what the
        message calls the config (the CLI: its file)."""
        fix = "fix the field, or write a config for this pair with `trtllm-dustin search`"
        sides = [("target", ("target_layers", "selection_layers", "pool_layers"), target, self.target_fingerprint)]
        if draft is not None:
            sides.append(("draft", ("draft_layers",), draft, self.draft_fingerprint))
        for side, fields, model, fingerprint in sides:
            if fingerprint and fingerprint != model_fingerprint(model):
                raise ConfigError(f"{source} was searched for another {side} model than {model.name}; run "
                                  "`trtllm-dustin search` for this pair")
            for field in fields:
                for i, lh in enumerate(getattr(self, field)):
                    if not 0 <= lh.layer < model.num_layers:
                        raise ConfigError(f"{source}: {field}[{i}].layer {lh.layer} does not exist in the {side} "
                                          f"{model.name} (layers 0..{model.num_layers - 1}); {fix}")
                    bad = [h for h in lh.heads if not 0 <= h < model.num_heads]
                    if bad:
                        raise ConfigError(f"{source}: {field}[{i}].heads {bad} do not exist in the {side} "
                                          f"{model.name} (heads 0..{model.num_heads - 1}); {fix}")

    def to_json(self) -> str:
        return versioned_json(DUSTIN_SCHEMA_VERSION, asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = "the Dustin config") -> DustinConfig:
        """source: what the message calls the text (load: the file)."""
        return load_versioned(cls, text, READABLE_SCHEMA_VERSIONS, source, "write it with `trtllm-dustin search`",
                              version_fix="re-run `trtllm-dustin search`")

    @classmethod
    def load(cls, path: str | Path) -> DustinConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Dustin config {path} does not exist; create one with `trtllm-dustin search`")
        return cls.from_json(path.read_text(), f"Dustin config {path}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

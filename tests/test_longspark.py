"""LongSpark: the summary merge is exact, the drafter's state and inputs are fixed-size and its training builds the
block the runtime builds, and speculative decoding with it keeps the target's output (greedy: token for token;
sampled: the target's distribution). Greedy equality of every longspark method against vanilla, and in-flight
parity, run in test_speculative.py and test_serving_inflight.py with the other methods."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from trtllm_dustin.attention import get_backend
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import (
    LongSpark,
    LongSparkConfig,
    load_longspark,
    random_longspark,
    summary_attention,
    summary_merge,
)
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafters import LongSparkDrafter
from trtllm_dustin.runtime.methods import MethodSetup
from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
from trtllm_dustin.runtime.state import Progress

pytestmark = pytest.mark.usefixtures("plugin_references")
WINDOW = 8


@pytest.fixture(scope="module")
def target():
    return load_model("preset:tiny-llama", dtype=torch.float64, seed=7).model


@pytest.fixture(scope="module")
def spark(target) -> LongSpark:
    return random_longspark(target, seed=3, window=WINDOW, summary=4, block=4)


# ---- the summary ---------------------------------------------------------------------------------------------
def test_summary_merge_equals_attention_from_scratch() -> None:
    """Rows folded in chunks (empty chunks and all-invalid chunks among them) give exactly the attention of the
    summary queries over all valid rows; an empty update leaves the state bit for bit."""
    g = torch.Generator().manual_seed(0)
    B, H, R, D = 2, 3, 4, 8
    queries = torch.randn(B, H, R, D, dtype=torch.float64, generator=g)
    chunks = [0, 5, 1, 0, 13, 18, 3]
    keys = torch.randn(B, H, sum(chunks), D, dtype=torch.float64, generator=g) * 2
    values = torch.randn(B, H, sum(chunks), D, dtype=torch.float64, generator=g)
    valid = torch.rand(B, H, sum(chunks), generator=g) < 0.7
    valid[..., 5] = False  # the one-row chunk is invalid: an update with nothing to add
    scale = 1 / math.sqrt(D)
    o = torch.zeros(B, H, R, D, dtype=torch.float64)
    lse = torch.full((B, H, R), float("-inf"), dtype=torch.float64)
    start = 0
    for n in chunks:
        rows = slice(start, start + n)
        scores = queries @ keys[:, :, rows].transpose(-1, -2) * scale
        new_o, new_lse = summary_merge(o, lse, scores, values[:, :, rows], valid[:, :, rows])
        if n == 0 or not valid[:, :, rows].any():
            assert torch.equal(new_o, o) and torch.equal(new_lse, lse)
        o, lse = new_o, new_lse
        start += n
        ref_o, ref_lse = summary_attention(queries, keys[:, :, :start], values[:, :, :start], valid[:, :, :start],
                                           scale)
        torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(lse).all()


def test_the_training_summaries_equal_the_merge() -> None:
    """anchor_summaries (training: every anchor from prefix sums) equals the attention over rows [0, L)."""
    from trtllm_dustin.training.longspark import anchor_summaries

    g = torch.Generator().manual_seed(1)
    B, H, R, T, D = 2, 2, 3, 40, 8
    scores = torch.randn(B, H, R, T, dtype=torch.float64, generator=g) * 3
    values = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
    anchors = torch.tensor([1, 7, 22, 39])
    o, lse = anchor_summaries(scores, values, anchors)
    for a, L in enumerate(anchors.tolist()):
        weights = torch.softmax(scores[..., :L], dim=-1)
        torch.testing.assert_close(o[:, a], weights @ values[:, :, None, :L].squeeze(2), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[:, a], torch.logsumexp(scores[..., :L], dim=-1), rtol=1e-10, atol=1e-10)


# ---- the drafter's state and inputs ----------------------------------------------------------------------------
def _decoder(target, spark, slots: int, max_seq_len: int, method: str = "longspark", gamma: int = 3, **setup):
    cache = KVCache.allocate(target.config, slots, max_seq_len, torch.float64, "cpu")
    return build_decoder(method, MethodSetup(target=target, target_cache=cache, backend=get_backend("reference"),
                                             longspark=spark, gamma=gamma, **setup))


def _started(decoder, prompts: list[list[int]], first: list[int]):
    progress = Progress.allocate(decoder.cache.batch_slots, 32, decoder.gamma, (), torch.device("cpu"))
    decoder.prefill(slice(0, len(prompts)), prompts)
    decoder.begin(progress, slice(0, len(prompts)), torch.tensor(first), prompts, 16)
    return progress


def test_the_state_does_not_grow_with_the_prefix(target, spark) -> None:
    """Same state bytes for a 64- and a 1024-position cache, and for prompts of 12 and 900 tokens."""
    short, long = _decoder(target, spark, 2, 64), _decoder(target, spark, 2, 1024)
    _started(short, [list(range(3, 15))] * 2, [4, 4])
    _started(long, [[3 + i % 200 for i in range(900)]] * 2, [4, 4])
    size = short.drafter.state_bytes()
    assert size == long.drafter.state_bytes() > 0
    S, cfg = len(spark.config.target_layers), target.config
    assert size == 2 * S * (cfg.num_kv_heads * spark.config.summary * (cfg.head_dim + 1) * 4 + cfg.hidden_size * 8)


def test_the_proposal_reads_only_the_window_and_the_summary(target, spark) -> None:
    """Poison every target cache row before the window (the summary already holds them): the proposal is the same.
    Poison one window row: it changes (the test can fail)."""
    prompt = [5 + (i * 7) % 240 for i in range(60)]
    decoder = _decoder(target, spark, 1, 96)
    _started(decoder, [prompt], [17])
    greedy = SlotSampling.batch(SamplingParams(), 1, torch.device("cpu"), use_kernel=False)
    before = decoder.drafter.propose(decoder.state, greedy).tokens.clone()
    base = decoder.drafter.base.clone()
    L = len(prompt)
    decoder.cache.k[:, :, :, : L - WINDOW] = 1e4
    decoder.cache.v[:, :, :, : L - WINDOW] = float("nan")
    assert torch.equal(decoder.drafter.propose(decoder.state, greedy).tokens, before)
    assert torch.equal(decoder.drafter.base, base)
    decoder.cache.v[:, :, :, L - 2] = 1e3
    decoder.drafter.propose(decoder.state, greedy)
    assert not torch.equal(decoder.drafter.base, base)


def test_the_summary_after_rounds_equals_the_summary_from_scratch(target, spark) -> None:
    """After a few rounds the incrementally merged summary equals the attention over every committed row."""
    prompts = [[5 + (i * 7) % 240 for i in range(30)], [9, 8, 7, 6, 5]]
    decoder = _decoder(target, spark, 2, 96)
    progress = _started(decoder, prompts, [17, 3])
    sampling = SlotSampling.batch(SamplingParams(), 2, torch.device("cpu"), use_kernel=False)
    for _ in range(4):
        decoder.round(progress, sampling)
    drafter, lengths = decoder.drafter, decoder.state.lengths
    assert int(lengths[0]) >= 34 and int(lengths[1]) >= 9  # every round committed rows (>= 1 per slot)
    for b in range(2):
        L = int(lengths[b])
        for j, layer in enumerate(spark.config.target_layers):
            k, v = decoder.cache.k[layer, b: b + 1, :, :L], decoder.cache.v[layer, b: b + 1, :, :L]
            o, lse = summary_attention(spark.summary_q[j].double()[None], k, v, torch.ones(1, 1, L, dtype=torch.bool),
                                       spark.scale)
            torch.testing.assert_close(drafter.summary_o[b: b + 1, j].double(), o, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(drafter.summary_lse[b: b + 1, j].double(), lse, rtol=1e-5, atol=1e-6)


def test_training_builds_the_block_the_runtime_builds(target, spark) -> None:
    """The training's block at anchor L (from one causal pass over the whole window) has the base logits the runtime
    drafter computes after prefilling tokens [0, L) with cur = token L."""
    from trtllm_dustin.training.longspark import anchor_logits

    tokens = torch.tensor([[5 + (i * 11) % 240 for i in range(48)]])
    anchors = torch.tensor([6, 20, 40])
    base, _, _ = anchor_logits(spark, target, tokens, anchors)
    for a, L in enumerate(anchors.tolist()):
        decoder = _decoder(target, spark, 1, 64)
        _started(decoder, [tokens[0, :L].tolist()], [int(tokens[0, L])])
        decoder.drafter.propose(decoder.state, SlotSampling.batch(SamplingParams(), 1, torch.device("cpu"),
                                                                 use_kernel=False))
        torch.testing.assert_close(decoder.drafter.base[0], base[a, : decoder.gamma], rtol=1e-6, atol=1e-6)


# ---- exactness of speculative decoding --------------------------------------------------------------------------
def _merged_chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value with the bins of expected count < 5 merged into one (Wilson-Hilferty)."""
    n = counts.sum()
    small = probs * n < 5
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(probs[~small] * n, probs[small].sum() * n)
    keep = e > 0
    stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_with_longspark_keeps_the_target_distribution() -> None:
    """3000 slots, one context: LongSpark's first drafted token follows the distribution it reports, and the first
    committed token of a rejection-sampled round follows the target's own distribution."""
    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=7).model
    spark = random_longspark(target, seed=3, window=WINDOW, summary=4, block=4)
    n, prompt = 3000, [5 + (i * 7) % 240 for i in range(20)]
    cache = KVCache.allocate(target.config, n, 32, torch.float32, "cpu")
    decoder = build_decoder("longspark", MethodSetup(target=target, target_cache=cache,
                                                     backend=get_backend("reference"), longspark=spark, gamma=2))
    params = SamplingParams(1.0, 1.0, seed=11)
    sampling = SlotSampling.batch(params, n, torch.device("cpu"), seed=11, use_kernel=False)
    progress = Progress.allocate(n, 8, decoder.gamma, (), torch.device("cpu"))
    decoder.prefill(slice(0, n), [prompt] * n)
    decoder.begin(progress, slice(0, n), torch.full((n,), 17), [prompt] * n, 8)
    with torch.inference_mode():
        full = target.forward_train(torch.tensor([prompt + [17]]))[0, -1].double()
    p_target = torch.softmax(full, -1).numpy()
    verdict = decoder.round(progress, sampling)
    drafted = decoder.drafter.tokens[:, 0]
    q = decoder.drafter.probs[0, 0].double().numpy()
    assert torch.allclose(decoder.drafter.probs[:, 0], decoder.drafter.probs[:1, 0].expand(n, -1))  # one context
    assert _merged_chi_square(np.bincount(drafted.numpy(), minlength=q.size), q) > 1e-3
    first = torch.where(verdict.accepted >= 1, drafted, verdict.next_tokens).numpy()
    assert _merged_chi_square(np.bincount(first, minlength=p_target.size), p_target) > 1e-3
    assert 0 < int((verdict.accepted >= 1).sum()) < n  # both branches of the acceptance ran


# ---- checks and training -----------------------------------------------------------------------------------------
def test_bad_configs_are_refused_with_the_fix(target, spark) -> None:
    with pytest.raises(ConfigError, match="target layers \\[7\\] do not exist"):
        LongSparkConfig(target_layers=(1, 7)).check_target(target.config)
    with pytest.raises(ConfigError, match="ascending"):
        LongSparkConfig(target_layers=(2, 1))
    with pytest.raises(ConfigError, match="trained for another target"):
        LongSparkConfig(target_layers=(1,), target_fingerprint="0" * 16).check_target(target.config)
    cache = KVCache.allocate(target.config, 1, 32, torch.float64, "cpu")
    with pytest.raises(ConfigError, match="proposes 1 .. 4 tokens"):
        LongSparkDrafter(spark, cache, 5, PhaseGraphs(False, KernelConfig()))
    with pytest.raises(ConfigError, match="needs a LongSpark drafter"):
        _decoder(target, None, 1, 32)
    with pytest.raises(ConfigError, match="no LongSpark checkpoint there"):
        load_longspark("/nonexistent", target)


def test_training_runs_resumes_and_round_trips(tmp_path) -> None:
    """A few CPU steps lower the loss; a second call with more steps resumes; the saved drafter loads and decodes."""
    from trtllm_dustin.training.longspark import LongSparkTrainConfig, train_longspark

    data = np.random.default_rng(0).integers(2, 257, size=(6, 48)).astype(np.uint16)
    data[:, 24:] = data[:, :24]  # a repeat: what the window and the summary can learn to copy
    np.save(tmp_path / "tokens.npy", data)
    cfg = dict(target_layers=(0, 2), window=8, summary=4, block=4, lora_rank=4, fuse_rank=8, markov_rank=4,
               seq_len=48, batch_size=2, anchor_stride=5, lr=3e-3, warmup=2)
    record = train_longspark(tmp_path / "tokens.npy", tmp_path / "run", LongSparkTrainConfig(**cfg, steps=24),
                             target_spec="preset:tiny-llama", device="cpu", plot=False)
    assert record["steps_done"] == 24
    resumed = train_longspark(tmp_path / "tokens.npy", tmp_path / "run", LongSparkTrainConfig(**cfg, steps=30),
                              target_spec="preset:tiny-llama", device="cpu", plot=False)
    curve = np.load(tmp_path / "run" / "loss_curve.npy")
    assert resumed["steps_done"] == 30 and len(curve) == 30
    assert curve[-3:].mean() < 0.8 * curve[:3].mean()  # it learns (seeded: 0.66 -> 0.43)
    with pytest.raises(ConfigError, match="another training config"):
        train_longspark(tmp_path / "tokens.npy", tmp_path / "run", LongSparkTrainConfig(**{**cfg, "lr": 1e-3},
                        steps=40), target_spec="preset:tiny-llama", device="cpu", plot=False)
    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=0).model
    loaded = load_longspark(tmp_path / "run" / "checkpoint", target)
    assert loaded.config.target_layers == (0, 2) and loaded.config.window == 8
    assert set(loaded.state_dict()) == set(LongSpark(loaded.config, target).state_dict())


def test_train_longspark_command_passes_every_rank(tmp_path, capsys) -> None:
    """--lora-rank, --fuse-rank and --markov-rank reach the trained drafter's config (a wider fusion is one of the
    measured variants of issue 38)."""
    from trtllm_dustin.cli import main

    np.save(tmp_path / "t.npy", np.random.default_rng(1).integers(2, 257, size=(2, 40)).astype(np.uint16))
    assert main(["train-longspark", "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "spark"),
                 "--target", "preset:tiny-llama", "--target-layers", "0,1", "--window", "8", "--summary", "2",
                 "--block", "3", "--lora-rank", "3", "--fuse-rank", "5", "--markov-rank", "2", "--seq-len", "40",
                 "--batch-size", "1", "--anchor-stride", "9", "--steps", "2", "--device", "cpu"]) == 0
    record = json.loads((tmp_path / "spark" / "training_record.json").read_text())
    assert (record["config"]["lora_rank"], record["config"]["fuse_rank"], record["config"]["markov_rank"]) == (3, 5, 2)
    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=0).model
    spark = load_longspark(tmp_path / "spark" / "checkpoint", target)
    assert (spark.fuse_down.shape[0], spark.markov_out.shape[1], spark.blocks[0].wo.down.shape[0]) == (5, 2, 3)

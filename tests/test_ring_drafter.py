"""trtllm_dustin/models/ring_drafter.py: the band pass against dense attention, and the serving path (ingest the
committed positions a round at a time, then step the slots) against the training path, on the tiny preset (CPU,
float64)."""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import needs_cuda, needs_kernel

from trtllm_dustin.config import ConfigError
from trtllm_dustin.models import load_model
from trtllm_dustin.models.ring_drafter import RingDrafter, RingDrafterConfig
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.training.longspark import target_features

READ, OWN, W, G = (0, 1), (0, 2), 6, 4


@pytest.fixture(scope="module")
def target():
    model = load_model("preset:tiny-llama", dtype=torch.float64, seed=7).model.eval()
    model.setup_rope()
    return model


def _drafter(target, window: int = W, trained: bool = True) -> RingDrafter:
    torch.manual_seed(0)
    model = RingDrafter(RingDrafterConfig(READ, OWN, window, G), target).double().eval()
    if trained:  # F and P start at zero; give them weights so that both paths use them
        with torch.no_grad():
            model.fuse.weight.normal_(std=0.05)
            model.own.weight.normal_(std=0.05)
    return model


def _hidden(target, tokens):
    feats = target_features(target, tokens, READ)
    return torch.stack([feats["hidden"][layer] for layer in READ], dim=2)  # [B, T, R, H]


def test_the_band_pass_equals_dense_attention_over_the_last_w_positions(target) -> None:
    model = _drafter(target, window=4)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 11, h, 16, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    reference = model._attend(q, k, v, ((j <= i) & (j > i - 4))[None])
    torch.testing.assert_close(model._band(q, k, v), reference)
    assert not torch.allclose(model._band(q, k, v), model._attend(q, k, v, (j <= i)[None]))  # the band does cut


def test_untrained_slots_repeat_the_causal_pass_when_the_ring_holds_every_position(target) -> None:
    """With F = P = 0 slot g's input is its token's embedding, as the ring pass's is at L + g; with a ring as long
    as the sequence both read the same keys, so slot g's output is the ring pass's at L + g."""
    model = _drafter(target, window=32, trained=False)
    tokens = torch.randint(2, 250, (2, 14), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([3, 6, 9])
    x, s = model.forward_train(tokens, _hidden(target, tokens), anchors)
    torch.testing.assert_close(s, x[:, anchors[:, None] + torch.arange(G)].reshape(6, G, -1))


def test_serving_a_round_at_a_time_gives_the_training_outputs(target) -> None:
    """Committed positions ingested in chunks of at most block + 1 (padded with invalid entries), the ring wrapping
    around several times (W = 6, 20 positions), and at each anchor the slots stepped from its output with the true
    tokens: every output equals forward_train's."""
    _serve_rounds(_drafter(target), torch.testing.assert_close)


@needs_kernel
def test_the_fused_kernels_serve_a_round_at_a_time_as_training_computes(monkeypatch) -> None:
    """The same rounds on the fused path (float32, as on a GPU: the rotary embedding and the ring writes in one
    kernel, the ring attention kernel, invalid padding written to scratch rows): the training path's outputs."""
    from trtllm_dustin.models import ring_drafter
    from trtllm_dustin.plugins.kernel_config import KernelConfig

    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=7).model.eval()
    target.setup_rope()
    model = _drafter(target).float()
    attended = []
    ring_kernel = ring_drafter.ring_attention
    monkeypatch.setattr(ring_drafter, "ring_attention", lambda *a, **k: attended.append(1) or ring_kernel(*a, **k))
    target.kernels = KernelConfig(fused_elementwise=True)
    try:
        _serve_rounds(model, lambda a, b: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4))
    finally:
        target.kernels = KernelConfig()
    assert len(attended) == len(OWN) * (6 + 4 * (G - 1))  # six ingests and four anchors' slot steps


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_kernel)])
def test_an_ingest_that_wants_one_row_gives_its_output_and_the_same_ring(fused: bool) -> None:
    """ingest(output_row=r): each sequence's output at its index r [B] equals the full ingest's there, and the ring
    (keys, values, positions) is the full ingest's, invalid entries included (module code in float64, and the fused
    path in float32 under the interpreter)."""
    from trtllm_dustin.plugins.kernel_config import KernelConfig

    dtype = torch.float32 if fused else torch.float64
    target = load_model("preset:tiny-llama", dtype=dtype, seed=7).model.eval()
    target.setup_rope()
    target.kernels = KernelConfig(fused_elementwise=fused)
    model = _drafter(target).to(dtype)
    tokens = torch.randint(2, 250, (2, 12), generator=torch.Generator().manual_seed(8))
    hidden = _hidden(target, tokens).to(dtype)
    states, outs = [], []
    with torch.no_grad():
        for row in (None, torch.tensor([2, 0])):
            state = model.new_state(2)
            pos = torch.arange(8)[None].expand(2, -1).clone()
            model.ingest(state, tokens[:, :8], hidden[:, :8], pos, torch.ones(2, 8, dtype=torch.bool))
            pos = torch.arange(8, 8 + G)[None].expand(2, -1).clone()
            valid = torch.tensor([[True, True, True, False], [True, False, False, False]])
            outs.append(model.ingest(state, tokens[:, 8:12], hidden[:, 7:11], pos, valid, output_row=row))
            states.append(state)
    target.kernels = KernelConfig()
    torch.testing.assert_close(outs[1], outs[0][torch.arange(2), torch.tensor([2, 0])])
    C = states[0].positions.shape[1]
    assert torch.equal(states[0].positions, states[1].positions)
    for a, b in zip([*states[0].joined_keys, *states[0].joined_values],
                    [*states[1].joined_keys, *states[1].joined_values], strict=True):
        torch.testing.assert_close(a[:, :C], b[:, :C])  # the ring rows (the slot rows are scratch on the fused path)


def _serve_rounds(model: RingDrafter, assert_close) -> None:
    """forward_train's outputs (the module code: it runs under autograd) against the serving passes (no grad)."""
    target = model.target
    T = 20
    tokens = torch.randint(2, 250, (2, T), generator=torch.Generator().manual_seed(3))
    hidden = _hidden(target, tokens)
    anchors = [5, 9, 12, 16]
    with torch.enable_grad():
        x, slots = (t.detach() for t in model.forward_train(tokens, hidden, torch.tensor(anchors)))
    torch.set_grad_enabled(False)
    try:
        _serve(model, tokens, hidden, anchors, x, slots, assert_close)
    finally:
        torch.set_grad_enabled(True)


def _serve(model, tokens, hidden, anchors, x, slots, assert_close) -> None:
    T = tokens.shape[1]
    slots = slots.reshape(2, len(anchors), G, -1)
    state = model.new_state(2)
    shifted = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)  # position p reads p - 1
    bounds = [0, 3, *[L + 1 for L in anchors], T]
    for start, end in zip(bounds, bounds[1:], strict=False):
        n = end - start
        pos = torch.arange(start, start + G + 1)  # padded to block + 1 entries
        valid = (pos < end)[None].expand(2, -1)
        take = pos.clamp(max=T - 1)  # the padding past the end reads any token: it is invalid
        out = model.ingest(state, tokens[:, take], shifted[:, take], pos[None].expand(2, -1).clone(), valid)
        assert_close(out[:, :n], x[:, start:end])
        L = end - 1
        if L in anchors:
            a = anchors.index(L)
            previous = out[:, n - 1]
            assert_close(previous, slots[:, a, 0])
            for g in range(1, G):
                previous = model.step(state, g, tokens[:, L + g], previous, torch.full((2,), L))
                assert_close(previous, slots[:, a, g])


def test_bad_configs_and_oversized_ingests_are_refused(target) -> None:
    with pytest.raises(ConfigError, match="do not exist"):
        RingDrafter(RingDrafterConfig((0, 5), OWN, W, G), target)
    with pytest.raises(ConfigError, match="window=0"):
        RingDrafterConfig(READ, OWN, 0, G)
    model = _drafter(target)
    state = model.new_state(1)
    n = W + G + 2
    with pytest.raises(ValueError, match="at most 11 positions"):
        model.ingest(state, torch.zeros(1, n, dtype=torch.long), torch.zeros(1, n, 2, 96, dtype=torch.float64),
                     torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))


def test_training_learns_resumes_and_round_trips(tmp_path, capsys) -> None:
    """train-ring-drafter on the tiny preset: --stop-after ends a run that the same command resumes, the loss falls,
    the checkpoint holds the trained weights (bf16) with the options given, a rerun with more steps resumes, and one
    with another config is refused."""
    import json

    import numpy as np

    from trtllm_dustin.cli import main
    from trtllm_dustin.models.ring_drafter import load_ring_drafter

    np.save(tmp_path / "t.npy", np.random.default_rng(1).integers(2, 257, size=(4, 48)).astype(np.uint16))
    args = ["train-ring-drafter", "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "ring"), "--target",
            "preset:tiny-llama", "--read-layers", "0,1", "--own-layers", "0,2", "--window", "8", "--block", "3",
            "--seq-len", "48", "--batch-size", "2", "--anchor-stride", "5", "--causal-stride", "1", "--lr", "3e-3",
            "--device", "cpu"]
    assert main([*args, "--steps", "40", "--stop-after", "0.001"]) == 0  # one step, then resumable
    assert json.loads((tmp_path / "ring" / "training_record.json").read_text())["steps_done"] == 1
    assert main([*args, "--steps", "40"]) == 0
    assert "resuming at step 1" in capsys.readouterr().out
    record = json.loads((tmp_path / "ring" / "training_record.json").read_text())
    assert record["steps_done"] == 40 and record["final_loss"] < 0.8 * record["first_loss"]
    assert (record["config"]["own_layers"], record["config"]["window"], record["config"]["block"]) == ([0, 2], 8, 3)
    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=0).model
    loaded = load_ring_drafter(tmp_path / "ring" / "checkpoint", target)
    trained = torch.load(tmp_path / "ring" / "resume.pt", weights_only=False)["model"]
    assert loaded.fuse.weight.abs().max() > 0 and loaded.own.weight.abs().max() > 0  # F and P trained off zero
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[name].to(value.dtype), rtol=1e-2, atol=1e-2)
    assert main([*args, "--steps", "44"]) == 0
    assert "resuming at step 40" in capsys.readouterr().out
    assert json.loads((tmp_path / "ring" / "training_record.json").read_text())["steps_done"] == 44
    assert main([*args[:-4], "--lr", "1e-3", "--device", "cpu", "--steps", "50"]) != 0
    assert "written with another training config" in capsys.readouterr().err


def test_training_from_a_trained_drafter_starts_where_it_ended(tmp_path, capsys) -> None:
    """--init: a run starts from the given checkpoint's weights (at a learning rate too small to move them, its
    checkpoint equals the one it started from, and its first loss is the first run's last level, far below a fresh
    start's), keeps the subset head file it proposed from, and a checkpoint of another shape is refused, naming the
    option to pass, before anything loads."""
    import json

    import numpy as np
    from safetensors.torch import load_file

    from trtllm_dustin.cli import main
    from trtllm_dustin.models.ring_drafter import save_head_ids

    np.save(tmp_path / "t.npy", np.random.default_rng(1).integers(2, 257, size=(4, 48)).astype(np.uint16))
    args = ["train-ring-drafter", "--tokens", str(tmp_path / "t.npy"), "--target", "preset:tiny-llama",
            "--read-layers", "0,1", "--own-layers", "0,2", "--window", "8", "--block", "3", "--seq-len", "48",
            "--batch-size", "2", "--anchor-stride", "5", "--causal-stride", "1", "--device", "cpu"]
    assert main([*args, "--out", str(tmp_path / "a"), "--lr", "3e-3", "--steps", "40"]) == 0
    first = json.loads((tmp_path / "a" / "training_record.json").read_text())
    save_head_ids(tmp_path / "a" / "checkpoint", torch.arange(0, 257, 2))
    init = str(tmp_path / "a" / "checkpoint")
    assert main([*args, "--out", str(tmp_path / "b"), "--lr", "1e-12", "--steps", "2", "--init", init]) == 0
    again = json.loads((tmp_path / "b" / "training_record.json").read_text())
    assert again["config"]["init"] == init
    assert again["first_loss"] < 0.8 * first["first_loss"]
    a, b = (load_file(str(tmp_path / d / "checkpoint" / "model.safetensors")) for d in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "b" / "checkpoint" / "head_ids.safetensors").is_file()
    capsys.readouterr()
    assert main([*args, "--own-layers", "0,1", "--out", str(tmp_path / "c"), "--init", init]) != 0  # the last wins
    assert "--init " + init + " has own_layers 0,2, this run own_layers 0,1; pass --own-layers 0,2" \
        in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "c"), "--init", str(tmp_path / "none")]) != 0
    assert "no ring drafter there (config.json missing)" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_the_command_refuses_bad_layers_before_loading_anything(tmp_path, capsys) -> None:
    import numpy as np

    from trtllm_dustin.cli import main

    np.save(tmp_path / "t.npy", np.zeros((2, 48), dtype=np.uint16))
    base = ["train-ring-drafter", "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "r"), "--device",
            "cpu", "--target", "preset:tiny-llama"]
    for extra, message in ((["--own-layers", "a,b"], "--own-layers 'a,b': give layer numbers"),
                           (["--read-layers", ""], "at least one of read_layers"),
                           (["--window", "0"], "--window 0")):
        assert main([*base, *extra]) != 0
        assert message in capsys.readouterr().err
    assert main([*base[:2], str(tmp_path / "missing.npy"), *base[3:]]) != 0
    assert "does not exist; write it with `trtllm-dustin prepare-distill-data" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ---- the runtime drafter (runtime/drafters/ring.py, the experimental method "ring") -------------------------------
def _ring_decoder(target, model, slots: int, max_seq_len: int, gamma: int):
    import trtllm_dustin.runtime.experimental  # noqa: F401  (registers "ring")
    from trtllm_dustin.attention import get_backend
    from trtllm_dustin.kv_cache import KVCache
    from trtllm_dustin.runtime.build import build_decoder
    from trtllm_dustin.runtime.methods import MethodSetup

    cache = KVCache.allocate(target.config, slots, max_seq_len, torch.float64, "cpu")
    return build_decoder("ring", MethodSetup(target=target, target_cache=cache, backend=get_backend("reference"),
                                             ring=model, gamma=gamma))


@pytest.mark.parametrize("weights", ["model", "int8"])
@pytest.mark.parametrize("prompt_len", [20, 4])
def test_the_runtime_proposes_what_training_unrolls(target, prompt_len: int, weights: str) -> None:
    """Admission (a prompt longer than W, prefilled in chunks shorter than W) and then rounds: each greedy proposal
    is the argmax of forward_train's slots at the anchor L over the committed tokens followed by the proposal
    itself, so the ring the rounds keep (filled at admission, cur at propose, accepted drafts at observe, fed the
    verification's hidden states) is the ring training builds. A prompt longer than fill_span (11 here) and one
    shorter than W; the drafter as it is and with its layers in weight-only int8."""
    from trtllm_dustin.runtime.sampling import SamplingParams, SlotSampling
    from trtllm_dustin.runtime.state import Progress

    model = _drafter(target).quantize_weights(weights)
    prompt = [5 + (i * 7) % 240 for i in range(prompt_len)]
    decoder = _ring_decoder(target, model, 1, 64, gamma=G)
    progress = Progress.allocate(1, 40, G, (), torch.device("cpu"))
    decoder.prefill(slice(0, 1), [prompt], chunk=5)
    decoder.begin(progress, slice(0, 1), torch.tensor([17]), [prompt], 30)
    greedy = SlotSampling.batch(SamplingParams(), 1, torch.device("cpu"), use_kernel=False)
    committed = [*prompt, 17]
    for _ in range(4):
        L = int(decoder.state.lengths[0])
        assert L == len(committed) - 1
        proposal = decoder.drafter.propose(decoder.state, greedy).tokens[0].clone()
        seq = torch.tensor([committed + proposal[:-1].tolist()])
        _, slots = model.forward_train(seq, _hidden(target, seq), torch.tensor([L]))
        assert torch.equal(proposal, target.head(slots[0]).argmax(-1))
        verdict = decoder.round(progress, greedy)
        a = int(verdict.accepted[0])
        committed += proposal[:a].tolist() + [int(verdict.next_tokens[0])]
    # a verdict that accepts drafts (a random drafter's rarely are): observe feeds the accepted ones into the ring
    from trtllm_dustin.runtime.state import Observation

    L = int(decoder.state.lengths[0])
    proposal = decoder.drafter.propose(decoder.state, greedy).tokens[0].clone()
    seq = torch.tensor([committed + proposal.tolist()])
    hidden = _hidden(target, seq)[:, L:]  # the verification's: positions L .. L + Γ
    decoder.drafter.observe(Observation(
        accepted=torch.tensor([2]), next_tokens=torch.tensor([31]), active=torch.tensor([True]),
        lengths=decoder.state.lengths.clone(), indices=None, verify_queries={},
        verify_hidden={layer: hidden[:, :, j] for j, layer in enumerate(READ)}))
    committed += proposal[:2].tolist() + [31]
    decoder.state.lengths.fill_(L + 3)
    decoder.state.cur.fill_(31)
    proposal = decoder.drafter.propose(decoder.state, greedy).tokens[0].clone()
    seq = torch.tensor([committed + proposal[:-1].tolist()])
    _, slots = model.forward_train(seq, _hidden(target, seq), torch.tensor([L + 3]))
    assert torch.equal(proposal, target.head(slots[0]).argmax(-1))
    assert decoder.drafter.state_bytes() == _ring_decoder(target, model, 1, 640, gamma=G).drafter.state_bytes()


@pytest.mark.parametrize("weights", ["model", "int8"])
def test_ring_rounds_generate_what_the_target_alone_generates(target, weights: str) -> None:
    """Greedy speculative decoding with the ring drafter commits exactly the target's own greedy tokens (prompts
    shorter and longer than the ring, several slots), and with a drafter trained to copy the target's argmax it
    accepts drafts; T = 1 runs too, drawing valid tokens. A drafter in weight-only int8 too."""
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig
    from trtllm_dustin.runtime.sampling import SamplingParams

    model = _drafter(target).quantize_weights(weights)
    prompts = [[9, 8, 7], [5 + (i * 7) % 240 for i in range(20)], [3 + (i * 5) % 200 for i in range(11)]]
    config = GenerationConfig(max_new_tokens=12, eos_token_ids=(), prefill_chunk=4)
    ring = _ring_decoder(target, model, 3, 64, gamma=3).generate(prompts, config)
    vanilla = build_runtime("vanilla", target, batch_slots=3, max_seq_len=64, dtype=torch.float64, device="cpu",
                            backend="reference").generate(prompts, config)
    assert ring.tokens == vanilla.tokens
    assert ring.rounds <= vanilla.rounds
    sampled = _ring_decoder(target, model, 3, 64, gamma=3).generate(
        prompts, GenerationConfig(max_new_tokens=8, eos_token_ids=(), prefill_chunk=4,
                                  sampling=SamplingParams(1.0, 1.0, seed=3)))
    assert all(len(t) == 8 and all(0 <= x < target.config.vocab_size for x in t) for t in sampled.tokens)


def test_the_ring_method_is_refused_without_a_ring_drafter(target) -> None:
    import trtllm_dustin.runtime.experimental  # noqa: F401
    from trtllm_dustin.runtime.build import build_runtime

    with pytest.raises(ConfigError, match="needs a ring drafter; pass --ring DIR"):
        build_runtime("ring", target, batch_slots=1, max_seq_len=32, dtype=torch.float64, device="cpu")
    other = load_model("preset:tiny-llama", dtype=torch.float64, seed=8).model
    with pytest.raises(ConfigError, match="attached to another target"):
        build_runtime("ring", other, batch_slots=1, max_seq_len=32, dtype=torch.float64, device="cpu",
                      ring=_drafter(target))


def test_a_loaded_drafter_serves_in_the_targets_dtype(tmp_path) -> None:
    """Saved and loaded beside a bf16 target (as served on the GPU), the drafter runs rounds in bf16 (no dtype
    mismatch between the target's hidden states, its weights and the ring) and proposes valid tokens."""
    import trtllm_dustin.runtime.experimental  # noqa: F401
    from trtllm_dustin.models.ring_drafter import load_ring_drafter
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig

    fp32 = load_model("preset:tiny-llama", dtype=torch.float32, seed=7).model
    model = RingDrafter(RingDrafterConfig(READ, OWN, W, G), fp32)
    with torch.no_grad():
        model.fuse.weight.normal_(std=0.05)
    model.save(tmp_path / "ring")
    bf16 = load_model("preset:tiny-llama", dtype=torch.bfloat16, seed=7).model
    assert load_ring_drafter(tmp_path / "ring", bf16).head_ids is None  # saved without a subset head
    model.use_head(torch.arange(0, 257, 2))
    model.save(tmp_path / "ring")
    ring = load_ring_drafter(tmp_path / "ring", bf16)
    assert ring.dtype == torch.bfloat16 and ring.target is bf16
    assert torch.equal(ring.head_ids, torch.arange(0, 257, 2)) and ring._head_rows.dtype == torch.bfloat16
    assert load_ring_drafter(tmp_path / "ring", bf16, subset_head=False).head_ids is None
    torch.testing.assert_close(ring.fuse.weight.float(), model.fuse.weight.to(torch.bfloat16).float())
    out = build_runtime("ring", bf16, ring=ring, batch_slots=2, max_seq_len=64, dtype=torch.bfloat16, device="cpu",
                        gamma=3).generate([[9, 8, 7], list(range(5, 30))],
                                          GenerationConfig(max_new_tokens=6, eos_token_ids=(), prefill_chunk=8))
    assert all(len(t) == 6 and all(0 <= x < 257 for x in t) for t in out.tokens)


@needs_kernel
def test_the_fused_kernels_serve_as_the_module_code_does(monkeypatch) -> None:
    """With the target's KernelConfig on the fused path (as on a GPU in bf16), the serving passes (fill, ingest, the
    slot steps) run the fused RMSNorm and the skinny GEMM path and give the module code's outputs (float32)."""
    from trtllm_dustin.models import ring_drafter
    from trtllm_dustin.plugins.kernel_config import KernelConfig

    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=7).model.eval()
    target.setup_rope()
    torch.manual_seed(0)
    model = RingDrafter(RingDrafterConfig(READ, OWN, W, G), target).eval()
    with torch.no_grad():
        model.fuse.weight.normal_(std=0.05)
        model.own.weight.normal_(std=0.05)
    tokens = torch.randint(2, 250, (2, 12), generator=torch.Generator().manual_seed(4))
    hidden = _hidden(target, tokens)
    calls = []
    fused_norm = ring_drafter.add_rms_norm
    monkeypatch.setattr(ring_drafter, "add_rms_norm", lambda *a, **k: calls.append(1) or fused_norm(*a, **k))
    attended = []
    ring_kernel = ring_drafter.ring_attention
    monkeypatch.setattr(ring_drafter, "ring_attention", lambda *a, **k: attended.append(1) or ring_kernel(*a, **k))

    def serve(kernels: KernelConfig) -> list[torch.Tensor]:
        target.kernels = kernels
        state = model.new_state(2)
        pos = torch.arange(8)[None].expand(2, -1).clone()
        with torch.no_grad():
            outs = [model.fill(state, tokens[:, :8], hidden[:, :8], pos, torch.ones(2, 8, dtype=torch.bool))]
            pos = torch.arange(8, 8 + G)[None].expand(2, -1).clone()
            outs.append(model.ingest(state, tokens[:, 8:12], hidden[:, 7:11], pos, torch.ones(2, G, dtype=torch.bool)))
            previous = outs[-1][:, -1]
            for g in range(1, G):
                previous = model.step(state, g, tokens[:, g], previous, torch.full((2,), 11))
                outs.append(previous)
        return outs

    module = serve(KernelConfig(fused_elementwise=False))
    assert not calls and not attended
    fused = serve(KernelConfig(fused_elementwise=True))
    # two norms per own layer in each of the passes, each slot step's norm of its input, and the fill's and the
    # ingest's norms of the target's hidden states (one per read layer)
    assert len(calls) == 2 * len(OWN) * (2 + G - 1) + G - 1 + 2 * len(READ)
    assert len(attended) == len(OWN) * G  # the ring kernel in every own layer of the ingest and the slot steps
    for a, b in zip(fused, module, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    target.kernels = KernelConfig()


def test_a_prompt_far_shorter_than_the_rings_pass_is_served() -> None:
    """The admission pass spans fill_span positions back from the prompt's end; those before position 0 are read by
    none, and their rotary rows must not be looked up either (the rotary table is only max_positions long)."""
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig

    target = load_model("preset:tiny-llama", dtype=torch.float64, seed=7, max_positions=80).model.eval()
    target.setup_rope()
    model = _drafter(target, window=150)
    assert model.fill_span > target.rope_cos.shape[0]
    prompts = [[9, 8, 7], [5 + (i * 7) % 240 for i in range(20)]]
    config = GenerationConfig(max_new_tokens=6, eos_token_ids=(), prefill_chunk=8)
    ring = _ring_decoder(target, model, 2, 64, gamma=3).generate(prompts, config)
    vanilla = build_runtime("vanilla", target, batch_slots=2, max_seq_len=64, dtype=torch.float64, device="cpu",
                            backend="reference").generate(prompts, config)
    assert ring.tokens == vanilla.tokens


def test_a_subset_head_proposes_only_its_ids_and_decoding_stays_exact(target) -> None:
    """With a subset head the logits at its ids are the whole head's and -inf elsewhere; every proposal (greedy, and
    drawn at T = 1 from a distribution with no mass outside the ids) lies in the subset, and greedy rounds still
    commit exactly the target's own tokens."""
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig
    from trtllm_dustin.runtime.sampling import SamplingParams

    ids = torch.arange(1, 257, 3)
    model = _drafter(target).use_head(ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))])
    assert torch.equal(model.head_ids, ids)  # kept sorted
    h = torch.randn(3, target.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    whole, subset = target.head(h).float(), model.logits(h)
    torch.testing.assert_close(subset[:, ids], whole[:, ids])
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(subset[:, outside]).all()
    # greedy() takes the subset's argmax without scattering it: the scattered row's argmax, ties to the lower id
    assert torch.equal(model.greedy(h), subset.argmax(-1))
    best = int((ids == int(subset[0].argmax())).nonzero())  # sequence 0's best, as an index into the subset
    assert best > 0
    rows = model._head_rows.clone()
    model._head_rows[best - 1] = model._head_rows[best]  # the id below it now ties with it
    assert torch.equal(model.greedy(h), model.logits(h).argmax(-1))
    assert int(model.greedy(h)[0]) == int(ids[best - 1])
    model._head_rows = rows

    prompts = [[9, 8, 7], [5 + (i * 7) % 240 for i in range(20)], [3 + (i * 5) % 200 for i in range(11)]]
    for sampling in (SamplingParams(), SamplingParams(1.0, 1.0, seed=3)):
        decoder = _ring_decoder(target, model, 3, 64, gamma=3)
        proposals, probs, propose = [], [], decoder.drafter.propose

        def spy(*args, propose=propose, proposals=proposals, probs=probs, **kwargs):
            proposal = propose(*args, **kwargs)
            proposals.append(proposal.tokens.clone())
            if proposal.probs is not None:
                probs.append(proposal.probs[..., outside].sum().item())
            return proposal

        decoder.drafter.propose = spy
        out = decoder.generate(prompts, GenerationConfig(max_new_tokens=10, eos_token_ids=(), prefill_chunk=4,
                                                         sampling=sampling))
        drafted = torch.cat([p.flatten() for p in proposals])
        assert proposals and torch.isin(drafted, ids).all()
        if sampling.temperature == 0:
            vanilla = build_runtime("vanilla", target, batch_slots=3, max_seq_len=64, dtype=torch.float64,
                                    device="cpu", backend="reference").generate(
                prompts, GenerationConfig(max_new_tokens=10, eos_token_ids=(), prefill_chunk=4))
            assert out.tokens == vanilla.tokens
        else:
            assert probs and max(probs) == 0.0
            assert all(len(t) == 10 for t in out.tokens)
    model.use_head(None)
    torch.testing.assert_close(model.logits(h), whole)


def test_bad_subset_heads_are_refused(target) -> None:
    model = _drafter(target)
    V = target.config.vocab_size
    for ids, match in ((torch.tensor([], dtype=torch.long), "between 1 and"), (torch.arange(V), "between 1 and"),
                       (torch.tensor([3, V]), r"must lie in \[0, 257\)"), (torch.tensor([-1, 4]), "must lie in"),
                       (torch.tensor([5, 9, 5]), "must be distinct")):
        with pytest.raises(ConfigError, match=match):
            model.use_head(ids)
    assert model.head_ids is None


@pytest.mark.parametrize("rows", [1, 5])
def test_grouped_query_attention_matches_attention_with_repeated_kv_heads(rows: int, device) -> None:
    """_attend folds each KV head's query group into the query rows instead of repeating the keys and values per
    query head: the outputs equal a float64 reference that repeats them, masked rows included (on a GPU in bf16,
    through its fused attention, with the keys and values strided as the ring's joined buffer leaves them)."""
    gen = torch.Generator().manual_seed(5)
    N, K, Hq, Hkv, D = 3, 11, 6, 2, 64
    q = torch.randn(N, rows, Hq, D, dtype=torch.float64, generator=gen)
    kv = torch.randn(N, K, 2, Hkv, D, dtype=torch.float64, generator=gen)
    k, v = kv[:, :, 0], kv[:, :, 1]  # strided views, as RingState's joined buffers give them
    mask = torch.rand(N, rows, K, generator=gen) < 0.6
    mask[..., 0] = True  # every query reads at least one key
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    on = kv.to(device, dtype)
    out = RingDrafter._attend(q.to(device, dtype), on[:, :, 0], on[:, :, 1], mask.to(device)).double().cpu()
    kr, vr = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("nshd,nkhd->nhsk", q, kr) / D ** 0.5
    weights = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    ref = torch.einsum("nhsk,nkhd->nshd", weights, vr).reshape(N, rows, Hq * D)
    if device.type == "cpu":
        torch.testing.assert_close(out, ref)
    else:  # the GPU path's error: bf16 rounding of q, k and v and of its output
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_a_pass_that_only_writes_the_ring_leaves_the_same_ring_and_skips_the_last_layers_work(target) -> None:
    """fill and ingest with outputs=False (the admission and the observe phase want only the ring) write the same
    keys, values and positions as with outputs, and run one layer's attention output and MLP fewer."""
    model = _drafter(target)
    tokens = torch.randint(2, 250, (2, 14), generator=torch.Generator().manual_seed(6))
    hidden = _hidden(target, tokens)
    finished = []
    finish = model._finish
    model._finish = lambda *a: finished.append(1) or finish(*a)

    def run(outputs: bool):
        state = model.new_state(2)
        ones = torch.ones(2, 10, dtype=torch.bool)
        pos = torch.arange(10)[None].expand(2, -1).clone()
        first = model.fill(state, tokens[:, :10], hidden[:, :10], pos, ones, outputs=outputs)
        valid = torch.tensor([[True, True, False, False], [True, True, True, True]])
        pos = torch.arange(10, 14)[None].expand(2, -1).clone()
        second = model.ingest(state, tokens[:, 10:], hidden[:, 10:], pos, valid, outputs=outputs)
        return state, first, second

    full, a, b = run(True)
    n_full, finished[:] = len(finished), []
    ring, c, d = run(False)
    assert a is not None and b is not None and c is None and d is None
    assert len(finished) == n_full - 2  # one fewer layer in each of the two passes
    assert torch.equal(full.positions, ring.positions)
    for x, y in zip([*full.joined_keys, *full.joined_values], [*ring.joined_keys, *ring.joined_values], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_int8_weights_halve_what_the_layers_and_head_hold_and_move_the_outputs_little(target) -> None:
    """quantize_weights("int8"): every projection of the own layers becomes an int8 weight with one scale per row
    (so a bf16 drafter's layers hold about half the bytes), the subset head's rows too; F, P and the norms stay.
    The slot outputs move by a small fraction of their size, and logits at the head's ids stay within the int8
    rounding of its rows."""
    from trtllm_dustin.models.quantize import Int8Linear

    tokens = torch.randint(2, 250, (2, 24), generator=torch.Generator().manual_seed(5))
    hidden = _hidden(target, tokens)
    anchors = torch.tensor([10, 16])
    ids = torch.arange(0, 257, 2)
    model = _drafter(target).use_head(ids)
    with torch.no_grad():
        _, before = model.forward_train(tokens, hidden, anchors)
        logits_before = model.logits(before)
    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * len(OWN)
    model.quantize_weights("int8")
    quantized = [m for layer in model.layers for m in layer.modules() if isinstance(m, Int8Linear)]
    assert len(quantized) == len(linears) and not any(
        isinstance(m, torch.nn.Linear) for layer in model.layers for m in layer.modules())
    for old, new in zip(linears, quantized, strict=True):
        assert new.weight.dtype == torch.int8 and new.weight.shape == old.weight.shape
        assert (new.dequantized() - old.weight.float()).abs().max() <= new.scale.max() / 2 * (1 + 1e-6)
        assert new.weight.numel() + 4 * new.scale.numel() < 0.55 * 2 * old.weight.numel()  # vs bf16
    assert model._head_rows.dtype == torch.int8 and model.weights == "int8"
    assert isinstance(model.fuse, torch.nn.Linear) and isinstance(model.own, torch.nn.Linear)
    with torch.no_grad():
        _, after = model.forward_train(tokens, hidden, anchors)
        logits_after = model.logits(after)
    change = (after - before).norm(dim=-1) / before.norm(dim=-1)
    assert 0 < change.max() < 0.05, change
    assert torch.equal(torch.isneginf(logits_after), torch.isneginf(logits_before))
    inside = logits_before[..., ids]
    assert ((logits_after[..., ids] - inside).abs().max() < 0.05 * inside.abs().max())


def test_int8_layers_keep_a_wide_copy_when_the_kernel_config_asks(target) -> None:
    """KernelConfig.int8_wide on: every int8 projection of the own layers keeps its dequantized weight in the
    drafter's dtype for the observe pass's wide calls; off (the default), none is kept (no memory spent)."""
    from trtllm_dustin.models.quantize import Int8Linear

    kept = _drafter(target).use_head(torch.arange(0, 257, 2)).quantize_weights(
        "int8", wide=KernelConfig(int8_wide=True).int8_wide)
    wide = [m for layer in kept.layers for m in layer.modules() if isinstance(m, Int8Linear)]
    assert len(wide) == 4 * len(OWN)
    for m in wide:
        assert m.wide is not None and m.wide.dtype == kept.dtype
        assert torch.equal(m.wide, m.dequantized().to(kept.dtype))
    bare = _drafter(target).quantize_weights("int8", wide=KernelConfig().int8_wide)
    assert all(m.wide is None for layer in bare.layers for m in layer.modules() if isinstance(m, Int8Linear))
    assert bare.weights == kept.weights == "int8"


def test_quantizing_is_refused_where_it_cannot_apply(target, tmp_path) -> None:
    from trtllm_dustin.models.ring_drafter import load_ring_drafter

    model = _drafter(target)
    with pytest.raises(ConfigError, match="drafter weights 'int4': choose one of model, int8"):
        model.quantize_weights("int4")
    with pytest.raises(ConfigError, match="drafter weights 'int4'"):  # checked before the directory is looked at
        load_ring_drafter(tmp_path / "absent", target, weights="int4")
    assert model.quantize_weights("model") is model and model.weights == "model"
    model.quantize_weights("int8")
    with pytest.raises(ConfigError, match="already int8"):
        model.quantize_weights("int8")
    with pytest.raises(ConfigError, match="choose the subset head before quantize_weights"):
        model.use_head(torch.arange(5))
    with pytest.raises(ConfigError, match="save the drafter it was quantized from"):
        model.save(tmp_path / "ring")
    assert not (tmp_path / "ring").exists()


@needs_cuda
@pytest.mark.parametrize("weights", ["model", "int8"])
def test_captured_rounds_on_the_gpu_propose_what_eager_rounds_propose(weights: str) -> None:
    """bf16 on the GPU, the fused path: rounds replayed from CUDA graphs (the proposal with and without entering
    `cur`, the observe pass that enters the next `cur`) propose what the same rounds run eagerly propose, slots
    admitted at different rounds, and both commit the target's own greedy tokens."""
    import trtllm_dustin.runtime.experimental  # noqa: F401  (registers "ring")
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig

    target = load_model("preset:tiny-llama", dtype=torch.bfloat16, seed=7, device="cuda").model.eval()
    target.setup_rope()
    torch.manual_seed(0)
    model = RingDrafter(RingDrafterConfig(READ, OWN, W, G), target)
    with torch.no_grad():
        model.fuse.weight.normal_(std=0.05)
        model.own.weight.normal_(std=0.05)
    model = model.to("cuda", torch.bfloat16).eval().quantize_weights(weights)
    prompts = [[9, 8, 7], [5 + (i * 7) % 240 for i in range(20)], [3 + (i * 5) % 200 for i in range(11)]]
    config = GenerationConfig(max_new_tokens=12, eos_token_ids=(), prefill_chunk=4)
    runs = {}
    for graphs in (False, True):
        decoder = build_runtime("ring", target, batch_slots=3, max_seq_len=96, dtype=torch.bfloat16, device="cuda",
                                ring=model, gamma=G, use_cuda_graph=graphs)
        proposals, propose = [], decoder.drafter.propose

        def spy(*args, propose=propose, proposals=proposals, **kwargs):
            proposal = propose(*args, **kwargs)
            proposals.append(proposal.tokens.clone())
            return proposal

        decoder.drafter.propose = spy
        result = decoder.generate(prompts, config)
        runs[graphs] = (result.tokens, proposals, result.decoding_rounds)
    vanilla = build_runtime("vanilla", target, batch_slots=3, max_seq_len=96, dtype=torch.bfloat16, device="cuda",
                            use_cuda_graph=False).generate(prompts, config)
    assert runs[True][0] == runs[False][0] == vanilla.tokens
    # the rounds with a sequence active; on the GPU the host may queue an idle round or two after the last one (how
    # many depends on the device's timing: runtime/phases.py FinishCheck), whose proposals nobody reads
    rounds = runs[True][2]
    assert runs[False][2] == rounds > 2 and min(len(runs[True][1]), len(runs[False][1])) >= rounds
    for captured, eager in zip(runs[True][1][:rounds], runs[False][1][:rounds], strict=True):
        assert torch.equal(captured, eager)


def test_the_memory_checks_count_a_ring_drafters_own_weights(tmp_path) -> None:
    """ring_weight_bytes, read from a checkpoint's config and head file without loading it: the bytes of the loaded
    drafter's layers, F, P and subset-head rows (its input and output norms, a few vectors, left out); a random
    drafter has no subset head. Counted at the itemsize asked (the run's dtype)."""
    from trtllm_dustin.models.ring_drafter import load_ring_drafter, random_ring_config, ring_weight_bytes

    target = load_model("preset:tiny-llama", dtype=torch.float32, seed=0).model
    config = random_ring_config(target.config)
    assert config == RingDrafterConfig(read_layers=(1, 2), own_layers=(0, 1, 2))

    def own_bytes(model: RingDrafter) -> int:
        linear = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                     if not name.startswith(("read_norms.", "own_norm.")))
        return linear + (0 if model._head_rows is None else model._head_rows.numel() * model._head_rows.element_size())

    random = load_ring_drafter("random", target, seed=1)
    assert random.config == config and random.head_ids is None
    assert ring_weight_bytes("random", target.config, 4) == own_bytes(random)
    random.use_head(torch.arange(0, 257, 3)).save(tmp_path / "ring")
    saved = load_ring_drafter(tmp_path / "ring", target)
    assert saved.head_ids is not None and len(saved.head_ids) == 86
    assert ring_weight_bytes(tmp_path / "ring", target.config, 4) == own_bytes(saved)
    assert ring_weight_bytes(tmp_path / "ring", target.config, 2) * 2 == own_bytes(saved)

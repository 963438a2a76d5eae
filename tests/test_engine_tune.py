"""The engine build's kernel tactic tuner (build_engines/tune.py): the decode shapes against hand-computed ones and
against the packaged H200 sweep of Llama-8B + 1B at B = 16, the compact grid against that sweep's winners, the
selection rule on synthetic timings, and the refusals. GPU: tunes the tiny presets and loads the table it wrote.
"""

import json
from dataclasses import asdict

import pytest
import torch
from helpers.kernels import HAS_CUDA, needs_cuda

from trtllm_dustin.build_engines.tune import (
    MIN_SPEEDUP,
    TIE_MARGIN,
    ProjectionShape,
    decode_shapes,
    linear_candidates,
    select_entry,
    tactic_table,
    tune_linear,
)
from trtllm_dustin.models.presets import get_preset
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.linear_tactics import PACKAGED_LINEAR_TACTICS, LinearConfig, LinearTactics, row_block
from trtllm_dustin.plugins.skinny_linear import SplitKWorkspace

H200_SMS = 132


def shape_rows(shapes: list[ProjectionShape]) -> list[tuple]:
    return [(s.role, s.rows, s.n, s.k, s.bias, s.workspace) for s in shapes]


def by_key(rows: list[tuple]) -> list[tuple]:
    return sorted(rows, key=lambda r: (row_block(r[1]), r[2], r[3]))


# ----------------------------------------------------------------------------------------------------------
# decode_shapes


def test_tiny_llama_pair_at_batch_16() -> None:
    # target: hidden 96, 6 + 2 * 2 heads of 16, SwiGLU 160, vocab 257; verify 16 * 4 = 64 rows, vanilla 16
    target = [("target.qkv", 160, 96, False), ("target.o", 96, 96, False), ("target.gate_up", 320, 96, False),
              ("target.down", 96, 160, True), ("target.lm_head", 257, 96, False)]
    # draft: hidden 64, 4 + 2 * 2 heads of 16, SwiGLU 96; step 0 on 32 rows, steps 1-2 on 16, its head on 16
    draft = [("draft.qkv", 128, 64, False), ("draft.o", 64, 64, False), ("draft.gate_up", 192, 64, False),
             ("draft.down", 64, 96, True)]
    expected = [(role, rows, n, k, False, ws) for rows in (64, 16) for role, n, k, ws in target]
    expected += [(role, rows, n, k, False, ws) for rows in (32, 16) for role, n, k, ws in draft]
    expected += [("draft.lm_head", 16, 257, 64, False, False)]
    got = decode_shapes(get_preset("tiny-llama"), get_preset("tiny-llama-draft"), 16, 3)
    assert shape_rows(got) == by_key(expected)
    assert [s.key for s in got] == sorted(s.key for s in got)


def test_tiny_qwen_alone_has_bias_and_dedups_vanilla_into_verify() -> None:
    # hidden 64, 4 + 2 * 4 heads of 16 with bias, SwiGLU 112, tied vocab 263; verify 4 * 4 = 16 rows and vanilla 4
    # rows share the 16-row bucket: the 16-row call is kept
    got = decode_shapes(get_preset("tiny-qwen"), None, 4, 3)
    assert shape_rows(got) == by_key([("target.qkv", 16, 192, 64, True, False), ("target.o", 16, 64, 64, False, False),
                                      ("target.gate_up", 16, 224, 64, False, False),
                                      ("target.down", 16, 64, 112, False, True),
                                      ("target.lm_head", 16, 263, 64, False, False)])


def test_llama_8b_and_1b_at_batch_16() -> None:
    got = decode_shapes(get_preset("llama-3.1-8b"), get_preset("llama-3.2-1b"), 16, 3)
    # 8B: hidden 4096, (32 + 2 * 8) heads of 128, SwiGLU 14336; 1B: hidden 2048, (32 + 2 * 8) heads of 64, SwiGLU 8192,
    # tied head; vocabulary 128256
    target = [("target.qkv", 6144, 4096, False), ("target.o", 4096, 4096, False),
              ("target.gate_up", 28672, 4096, False), ("target.down", 4096, 14336, True),
              ("target.lm_head", 128256, 4096, False)]
    draft = [("draft.qkv", 3072, 2048, False), ("draft.o", 2048, 2048, False), ("draft.gate_up", 16384, 2048, False),
             ("draft.down", 2048, 8192, True)]
    expected = [(role, rows, n, k, False, ws) for rows in (64, 16) for role, n, k, ws in target]
    expected += [(role, rows, n, k, False, ws) for rows in (32, 16) for role, n, k, ws in draft]
    expected += [("draft.lm_head", 16, 128256, 2048, False, False)]
    assert shape_rows(got) == by_key(expected)
    assert ("target.qkv", 64, 6144, 4096, False, False) in shape_rows(got)


def test_llama_8b_and_1b_match_the_packaged_sweep() -> None:
    """The packaged table's Llama-8B + 1B entries at B = 16 came from bench_linear's own shape list of that pair."""
    packaged = json.loads(PACKAGED_LINEAR_TACTICS.read_text())["entries"]
    swept = sorted((e["rows"], e["n"], e["k"], e["role"], e["measured_rows"]) for e in packaged
                   if e["pair"] == "llama-8b" and e["batch"] == 16)
    got = decode_shapes(get_preset("llama-3.1-8b"), get_preset("llama-3.2-1b"), 16, 3)
    assert sorted((*s.key, s.role, s.rows) for s in got) == swept


def test_one_shape_per_key_keeping_the_most_rows() -> None:
    # B = 4: target rows 16 and 4, draft rows 8 and 4 (head 4): every call lands in the 16-row bucket
    got = decode_shapes(get_preset("tiny-llama"), get_preset("tiny-llama-draft"), 4, 3)
    assert len(got) == len({s.key for s in got}) == 10
    assert {(s.role.split(".")[0], s.rows) for s in got} == {("target", 16), ("draft", 8), ("draft", 4)}
    assert {s.role for s in got if s.rows == 4} == {"draft.lm_head"}


def test_a_key_shared_with_and_without_the_workspace_takes_no_split_k() -> None:
    # hidden = heads * head_dim = intermediate: o (n=64, k=64) and down (n=64, k=64) share their key
    square = get_preset("tiny-llama-draft").with_(intermediate_size=64)
    got = decode_shapes(square, None, 16, 3)
    shared = [s for s in got if s.n == 64 and s.k == 64]
    assert len(shared) == 2 and not any(s.workspace for s in shared)  # the 64- and the 16-row bucket


def test_calls_over_64_rows_are_left_out() -> None:
    # B = 32: the target's verify (128 rows) runs F.linear whatever the table says; vanilla's 32 rows do not
    got = decode_shapes(get_preset("tiny-llama"), get_preset("tiny-llama-draft"), 32, 3)
    assert max(s.rows for s in got) == 64
    assert {s.rows for s in got if s.role.startswith("target")} == {32}
    assert {s.rows for s in got if s.role.startswith("draft")} == {64, 32}


def test_gamma_1_runs_the_draft_layers_on_2b_rows_only() -> None:
    got = decode_shapes(get_preset("tiny-llama"), get_preset("tiny-llama-draft"), 16, 1)
    assert {(s.role, s.rows) for s in got if s.role.startswith("draft")} == {
        ("draft.qkv", 32), ("draft.o", 32), ("draft.gate_up", 32), ("draft.down", 32), ("draft.lm_head", 16)}
    assert {s.rows for s in got if s.role.startswith("target")} == {32, 16}


@pytest.mark.parametrize("batch,gamma,draft,match", [(0, 3, None, "batch_slots=0"), (4, -1, None, "gamma=-1"),
                                                     (4, 0, "tiny-llama-draft", "gamma=0 .* draft")])
def test_decode_shapes_refuses(batch: int, gamma: int, draft: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_shapes(get_preset("tiny-llama"), None if draft is None else get_preset(draft), batch, gamma)


def test_projection_shape_refuses_more_than_64_rows() -> None:
    with pytest.raises(ValueError, match=r"rows=65 must be in 1\.\.64.*F\.linear"):
        ProjectionShape("target.qkv", 65, 128, 128)


# ----------------------------------------------------------------------------------------------------------
# the compact grid


def test_the_compact_grid_holds_every_winner_of_the_packaged_sweeps() -> None:
    """bench_linear's wider grid picked these on the H200; the engine build's grid must still offer each of them."""
    for entry in json.loads(PACKAGED_LINEAR_TACTICS.read_text())["entries"]:
        if entry["config"] is None:
            continue
        shape = ProjectionShape(entry["role"], entry["measured_rows"], entry["n"], entry["k"],
                                workspace=entry["role"].endswith(".down"))
        assert LinearConfig(**entry["config"]) in linear_candidates(shape, H200_SMS), entry


@pytest.mark.parametrize("shape", decode_shapes(get_preset("llama-3.1-8b"), get_preset("llama-3.2-1b"), 16, 3)
                         + decode_shapes(get_preset("qwen2.5-7b"), get_preset("qwen2.5-0.5b"), 8, 3),
                         ids=lambda s: f"{s.role}-{s.rows}")
def test_every_candidate_is_one_the_decoder_can_take(shape: ProjectionShape) -> None:
    configs = linear_candidates(shape, H200_SMS)
    assert 10 <= len(configs) <= 40 and len(set(configs)) == len(configs)
    for config in configs:
        assert config.block_k <= shape.k
        assert (config.block_n + row_block(shape.rows)) * config.block_k * 2 * config.num_stages <= 200 * 1024
    split = [config for config in configs if config.split_k > 1]
    assert not split or shape.workspace
    if split:  # the down projection: its n is the model's hidden size, what the decoder's workspace is sized for
        workspace = SplitKWorkspace.for_outputs(shape.n, torch.device("cpu"))
        for config in split:
            assert workspace.fits(shape.rows, shape.n, config)
            assert shape.k // (config.split_k * config.block_k) >= 2


def test_toy_shapes_still_get_candidates() -> None:
    shape = ProjectionShape("target.o", 16, 96, 96)
    assert {c.block_k for c in linear_candidates(shape, H200_SMS)} == {64}


# ----------------------------------------------------------------------------------------------------------
# the selection rule

SHAPE = ProjectionShape("target.qkv", 40, 6144, 4096)
FAST, SLOW = LinearConfig(block_n=32), LinearConfig(block_n=128)


@pytest.mark.parametrize("kernel_us,config,tie", [
    (97.0, FAST, False),  # 3 % faster: the kernel
    (100 * (1 - MIN_SPEEDUP) - 0.01, FAST, False),
    (99.0, FAST, True),  # 1 % faster: a tie
    (100.0, FAST, True),
    (100 * (1 + TIE_MARGIN) - 0.01, FAST, True),  # just under 1 % slower: still a tie
    (101.5, None, False),  # 1.5 % slower: F.linear
])
def test_select_entry_follows_the_packaged_rule(kernel_us: float, config: LinearConfig | None, tie: bool) -> None:
    entry = select_entry(SHAPE, 100.0, {SLOW: kernel_us + 5, FAST: kernel_us})
    assert entry == {"rows": 64, "n": 6144, "k": 4096, "config": None if config is None else asdict(config),
                     "tie": tie, "role": "target.qkv", "measured_rows": 40, "cublas_us": 100.0,
                     "kernel_us": round(kernel_us, 2)}


def test_select_entry_without_a_timed_configuration_keeps_f_linear() -> None:
    entry = select_entry(SHAPE, 12.345, {})
    assert entry["config"] is None and entry["tie"] is False and entry["kernel_us"] is None
    assert entry["cublas_us"] == 12.35


def test_equal_times_take_the_first_candidate() -> None:
    assert select_entry(SHAPE, 100.0, {SLOW: 90.0, FAST: 90.0})["config"] == asdict(SLOW)


def test_select_entry_refuses_non_positive_times() -> None:
    with pytest.raises(ValueError, match="must be > 0 us"):
        select_entry(SHAPE, 0.0, {FAST: 1.0})


def test_the_table_loads_and_looks_up_like_the_packaged_one(tmp_path) -> None:
    shapes = decode_shapes(get_preset("tiny-llama"), get_preset("tiny-llama-draft"), 16, 3)
    entries = [select_entry(shape, 10.0, {FAST: time, SLOW: 11.0})
               for shape, time in zip(shapes, [9.0, 9.95, 10.5] * len(shapes), strict=False)]
    table = tactic_table(entries, "test GPU")
    tactics = LinearTactics.from_dict(table, "tuned")
    assert tactics.gpu == "test GPU" and len(tactics) == len(shapes)
    packaged = json.loads(PACKAGED_LINEAR_TACTICS.read_text())
    assert {"how", "selection_rule", "tie_rule", "fallback_rule"} <= set(table) <= set(packaged)
    path = tmp_path / "linear_tactics.json"
    path.write_text(json.dumps(table))
    loaded = KernelConfig(linear_tactics=str(path)).tactics
    for shape, entry in zip(shapes, entries, strict=True):
        tactic = loaded.lookup(shape.rows, shape.n, shape.k)
        assert tactic.role == shape.role and tactic.tie == entry["tie"]
        assert tactic.config == (None if entry["config"] is None else FAST)


# ----------------------------------------------------------------------------------------------------------
# refusals and the GPU sweep

SHAPES = decode_shapes(get_preset("tiny-qwen"), None, 4, 3)


def test_tune_linear_refuses_a_cpu_device() -> None:
    with pytest.raises(ValueError, match=r"--tune needs a CUDA device \(got cpu\); build without --tune"):
        tune_linear(SHAPES, "cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a GPU")
def test_tune_linear_refuses_cuda_without_a_gpu() -> None:
    with pytest.raises(ValueError, match="--tune needs a CUDA device"):
        tune_linear(SHAPES, "cuda")


def test_tune_linear_refuses_two_shapes_of_one_key() -> None:
    twin = ProjectionShape("draft.qkv", 8, SHAPES[0].n, SHAPES[0].k)
    with pytest.raises(ValueError, match="share the table key"):
        tune_linear([*SHAPES, twin], "cpu")


@pytest.mark.gpu
@needs_cuda
def test_tunes_the_tiny_presets(tmp_path) -> None:
    shapes = {s.key: s for s in decode_shapes(get_preset("tiny-llama"), get_preset("tiny-llama-draft"), 16, 3)
              + decode_shapes(get_preset("tiny-qwen"), None, 4, 3)}
    shapes = list(shapes.values())
    table = tune_linear(shapes, "cuda", progress=False)
    assert table["gpu"] == torch.cuda.get_device_name()
    path = tmp_path / "linear_tactics.json"
    path.write_text(json.dumps(table))
    tactics = KernelConfig(linear_tactics=str(path)).tactics
    assert len(tactics) == len(shapes)
    assert [(e.rows, e.n, e.k) for e in tactics.entries] == sorted(s.key for s in shapes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in shapes:
        tactic = tactics.lookup(shape.rows, shape.n, shape.k)
        assert tactic.role == shape.role and tactic.measured_rows == shape.rows and tactic.cublas_us > 0
        assert tactic.kernel_us is not None  # every toy shape has candidates that compile and match F.linear
        if tactic.config is not None:
            assert tactic.config in linear_candidates(shape, sms)

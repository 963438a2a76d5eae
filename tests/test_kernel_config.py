"""KernelConfig: the one place the TRTLLM_DUSTIN_* switches are read, its JSON form, and the skinny-GEMM tactic table
it carries (the packaged table holds exactly the H200 sweeps' choices; unlisted shapes run F.linear), and the int8
table beside it (int8 weights' configurations; each field takes only a table of its own weights).

CPU: the skinny kernel runs under TRITON_INTERPRET=1 (tests/conftest.py).
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.kernels import DEVICE, needs_kernel, write_tactics

from trtllm_dustin.plugins.kernel_config import ENV_SWITCHES, KernelConfig
from trtllm_dustin.plugins.linear_tactics import (
    PACKAGED_INT8_LINEAR_TACTICS,
    PACKAGED_LINEAR_TACTICS,
    LinearConfig,
    LinearTactic,
    LinearTactics,
)
from trtllm_dustin.plugins.skinny_linear import skinny_linear

ROOT = Path(__file__).resolve().parents[1]
ON_OFF = [name for name in ENV_SWITCHES if name not in ("TRTLLM_DUSTIN_FUSED_ELEMENTWISE",
                                                         "TRTLLM_DUSTIN_LINEAR_TACTICS",
                                                         "TRTLLM_DUSTIN_INT8_LINEAR_TACTICS")]
# an entry of an int8 table (which has no null configs and no ties)
INT8_GOOD = {"rows": 16, "n": 40, "k": 96, "config": {"block_n": 16, "block_k": 32}, "tie": False}


# ----------------------------------------------------------------------------------------------------------
# from_env


def test_no_switches_set_gives_the_defaults(monkeypatch) -> None:
    for name in ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert KernelConfig.from_env() == KernelConfig.from_env({}) == KernelConfig()
    assert KernelConfig() == KernelConfig(pdl=True, fused_elementwise=None, skinny_linear=True, skinny_pdl=True,
                                          skinny_ties=True, round_kernels=True, int8_wide=False,
                                          linear_tactics=None, int8_linear_tactics=None)


@pytest.mark.parametrize("variable", ON_OFF)
def test_each_on_off_switch_sets_only_its_field(variable: str) -> None:
    field = ENV_SWITCHES[variable]
    off = KernelConfig.from_env({variable: "0"})
    assert getattr(off, field) is False
    assert off == replace(KernelConfig(), **{field: False})  # nothing else moved
    on = KernelConfig.from_env({variable: "1"})
    assert getattr(on, field) is True and on == replace(KernelConfig(), **{field: True})
    assert KernelConfig.from_env({variable: ""}) == KernelConfig()  # set but empty: the default


def test_fused_elementwise_is_three_valued() -> None:
    name = "TRTLLM_DUSTIN_FUSED_ELEMENTWISE"
    assert KernelConfig.from_env({name: "1"}).fused_elementwise is True
    assert KernelConfig.from_env({name: "0"}).fused_elementwise is False
    assert KernelConfig.from_env({}).fused_elementwise is None


def test_from_env_reads_os_environ_by_default(monkeypatch) -> None:
    monkeypatch.setenv("TRTLLM_DUSTIN_SKINNY_TIES", "0")
    monkeypatch.setenv("TRTLLM_DUSTIN_ROUND_KERNELS", "0")
    config = KernelConfig.from_env()
    assert (config.skinny_ties, config.round_kernels, config.pdl) == (False, False, True)


@pytest.mark.parametrize("variable", [*ON_OFF, "TRTLLM_DUSTIN_FUSED_ELEMENTWISE"])
@pytest.mark.parametrize("value", ["maybe", "off", "true", "2"])
def test_a_bad_value_is_refused_with_its_name_and_the_accepted_values(variable: str, value: str) -> None:
    with pytest.raises(ValueError) as error:
        KernelConfig.from_env({variable: value})
    message = str(error.value)
    assert f"{variable}={value!r}" in message and "'1'" in message and "'0'" in message


def test_the_tactics_path_comes_from_the_environment(tmp_path) -> None:
    path = write_tactics(tmp_path / "engine.json", [{"rows": 32, "n": 64, "k": 128, "config": None, "tie": False}])
    config = KernelConfig.from_env({"TRTLLM_DUSTIN_LINEAR_TACTICS": path})
    assert config.linear_tactics == path and len(config.tactics) == 1 and config.tactics.source == path
    assert config.tactics.lookup(20, 64, 128).config is None
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=re.escape(missing)):
        KernelConfig.from_env({"TRTLLM_DUSTIN_LINEAR_TACTICS": missing})


def test_the_int8_tactics_path_comes_from_the_environment(tmp_path) -> None:
    path = write_tactics(tmp_path / "int8.json", [{**INT8_GOOD, "rows": 128}], weights="int8")
    config = KernelConfig.from_env({"TRTLLM_DUSTIN_INT8_LINEAR_TACTICS": path})
    assert config.int8_linear_tactics == path and config.linear_tactics is None
    assert config.int8_tactics.source == path and config.int8_tactics.weights == "int8"
    assert config.int8_tactics.lookup(100, 40, 96).config == LinearConfig(block_n=16, block_k=32)
    assert config.tactics == KernelConfig().tactics  # the bf16 table stays the packaged one
    assert config == KernelConfig(int8_linear_tactics=path)
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=re.escape(missing)):
        KernelConfig.from_env({"TRTLLM_DUSTIN_INT8_LINEAR_TACTICS": missing})


def test_nothing_else_reads_the_environment() -> None:
    """plugins/, the models and the attention backends read no environment variable but TRITON_INTERPRET (which
    Triton itself is switched by); the TRTLLM_DUSTIN_* switches are read in KernelConfig.from_env only."""
    files = [*(ROOT / "plugins").glob("*.py"), *(ROOT / "trtllm_dustin" / "models").glob("*.py"),
             *(ROOT / "trtllm_dustin" / "attention").glob("*.py")]
    assert len(files) > 10
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "os.environ" in line or "getenv" in line:
                allowed = "TRITON_INTERPRET" in line or (path.name == "kernel_config.py" and "environ = os.environ"
                                                         in line)
                assert allowed, f"{path.relative_to(ROOT)}:{number} reads the environment: {line.strip()}"


# ----------------------------------------------------------------------------------------------------------
# The config as data


def test_validated_on_construction() -> None:
    with pytest.raises(ValueError, match="KernelConfig.pdl='yes'"):
        KernelConfig(pdl="yes")
    with pytest.raises(ValueError, match="KernelConfig.fused_elementwise=1"):
        KernelConfig(fused_elementwise=1)
    with pytest.raises(ValueError, match="KernelConfig.linear_tactics=''"):
        KernelConfig(linear_tactics="")
    with pytest.raises(ValueError, match="KernelConfig.int8_linear_tactics=3 must be a file path or None"):
        KernelConfig(int8_linear_tactics=3)


def test_json_round_trip(tmp_path) -> None:
    path = write_tactics(tmp_path / "engine.json", [{"rows": 16, "n": 40, "k": 96, "config": None, "tie": False}])
    config = KernelConfig(pdl=False, fused_elementwise=True, skinny_ties=False, round_kernels=False,
                          linear_tactics=path)
    text = config.to_json()
    data = json.loads(text)
    assert data["schema_version"] == 1 and data["linear_tactics"] == path and "tactics" not in data
    back = KernelConfig.from_json(text)
    assert back == config and hash(back) == hash(config) and back.tactics == config.tactics
    assert KernelConfig.from_json(KernelConfig().to_json()) == KernelConfig()
    assert {config: 1, back: 2} == {config: 2}  # hashable: usable as a key (a graph cache, say)
    int8 = KernelConfig(int8_linear_tactics=write_tactics(tmp_path / "int8.json", [INT8_GOOD], weights="int8"))
    data = json.loads(int8.to_json())
    assert data["int8_linear_tactics"] == int8.int8_linear_tactics and "int8_tactics" not in data
    back = KernelConfig.from_json(int8.to_json())
    assert back == int8 and back.int8_tactics == int8.int8_tactics and back != KernelConfig()


def test_json_without_the_int8_table_field_still_loads() -> None:
    """JSON written before int8_linear_tactics existed (same schema version): the packaged int8 table."""
    data = json.loads(KernelConfig(pdl=False).to_json())
    del data["int8_linear_tactics"]
    config = KernelConfig.from_json(json.dumps(data))
    assert config == KernelConfig(pdl=False) and config.int8_linear_tactics is None
    assert config.int8_tactics == LinearTactics.load(PACKAGED_INT8_LINEAR_TACTICS)


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_another_schema_version_is_refused(version) -> None:
    data = json.loads(KernelConfig().to_json())
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    with pytest.raises(ValueError, match=f"schema_version {re.escape(repr(version))}; this build reads version 1"):
        KernelConfig.from_json(json.dumps(data))


def test_unknown_fields_are_refused() -> None:
    data = {**json.loads(KernelConfig().to_json()), "pld": False}
    with pytest.raises(ValueError, match=r"unknown fields \['pld'\]"):
        KernelConfig.from_json(json.dumps(data))


def test_the_triton_backend_passes_its_pdl_to_the_attention_ops(monkeypatch) -> None:
    from trtllm_dustin import plugins
    from trtllm_dustin.attention import AttentionMetadata, get_backend

    seen = []
    monkeypatch.setattr(plugins, "verify_attention", lambda q, *a, pdl: seen.append(("full", pdl)) or q)
    monkeypatch.setattr(plugins, "sparse_verify_attention", lambda q, *a, pdl: seen.append(("sparse", pdl)) or q)
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 4, 16)
    lens = torch.tensor([2], dtype=torch.int32)
    for pdl in (True, False):
        backend = get_backend("triton", KernelConfig(pdl=pdl))
        backend.attend(q, k, k, AttentionMetadata(lens))
        backend.attend(q, k, k, AttentionMetadata(lens, indices=torch.tensor([[0, 1]], dtype=torch.int32)))
    assert seen == [("full", True), ("sparse", True), ("full", False), ("sparse", False)]
    assert get_backend("triton").kernels == KernelConfig()
    reference = get_backend("reference", KernelConfig(pdl=False))  # taken and ignored
    torch.testing.assert_close(reference.attend(q, k, k, AttentionMetadata(lens)),
                               get_backend("reference").attend(q, k, k, AttentionMetadata(lens)), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# The packaged tactic table

# Five of the entries as plugins/skinny_linear.py's TUNED held them before the table moved out of the code
# (git ba29b41): a tie, a split-K launch, a cuBLAS shape and an 8-warp head, with the numbers of their comments.
TODAY = [
    LinearTactic(rows=64, n=6144, k=4096, config=LinearConfig(64, 128, 1, False, 4, 6), tie=True, pair="llama-8b",
                 batch=16, role="target.qkv", measured_rows=64, cublas_us=16.3, kernel_us=16.2),
    LinearTactic(rows=16, n=2048, k=8192, config=LinearConfig(32, 128, 4, True, 4, 4), tie=False, pair="llama-8b",
                 batch=16, role="draft.down", measured_rows=16, cublas_us=13.9, kernel_us=12.5),
    LinearTactic(rows=32, n=3072, k=2048, config=None, tie=False, pair="llama-8b", batch=16, role="draft.qkv",
                 measured_rows=32, cublas_us=6.6, kernel_us=6.9),
    LinearTactic(rows=64, n=128256, k=4096, config=LinearConfig(128, 64, 1, False, 8, 4), tie=False,
                 pair="llama-8b", batch=16, role="target.lm_head", measured_rows=64, cublas_us=284.6,
                 kernel_us=264.5),
    LinearTactic(rows=16, n=27648, k=5120, config=LinearConfig(64, 128, 1, True, 4, 4), tie=True, pair="qwen-14b",
                 batch=8, role="target.gate_up", measured_rows=8, cublas_us=69.5, kernel_us=68.2),
]


def test_the_packaged_table_holds_todays_entries() -> None:
    tactics = KernelConfig().tactics
    assert tactics == LinearTactics.load(PACKAGED_LINEAR_TACTICS) and tactics.gpu == "NVIDIA H200"
    assert len(tactics) == 58
    assert sum(e.config is None for e in tactics.entries) == 7 and sum(e.tie for e in tactics.entries) == 14
    for expected in TODAY:
        assert tactics.lookup(expected.rows, expected.n, expected.k) == expected


def test_the_packaged_table_names_its_sources_and_rules() -> None:
    data = json.loads(PACKAGED_LINEAR_TACTICS.read_text())
    assert {s["git"] for s in data["sweeps"]} == {"2a7352b", "8182bae"}
    for sweep in data["sweeps"]:
        assert (ROOT / sweep["file"]).is_file(), sweep
    assert "F.linear" in data["fallback_rule"] and "2 %" in data["fallback_rule"] and "576" in data["fallback_rule"]
    assert "1 %" in data["tie_rule"] and "PDL" in data["tie_rule"]
    pairs = {(s["pair"], s["batch"]) for s in data["sweeps"]}
    assert {(e["pair"], e["batch"]) for e in data["entries"]} == pairs  # every entry points at its sweep


@needs_kernel
def test_a_shape_not_in_the_table_runs_f_linear(monkeypatch) -> None:
    """SmolLM2-135M's q|k|v projection (hidden 576, 960 outputs) at 16 rows: not in the table, so F.linear, bit for
    bit, and no kernel launch."""
    import trtllm_dustin.plugins.skinny_linear as module

    monkeypatch.setattr(module, "skinny_linear_forward", lambda *a, **k: pytest.fail("the kernel ran"))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 576, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(960, 576, generator=gen).to(DEVICE, torch.bfloat16)
    b = torch.randn(960, generator=gen).to(DEVICE, torch.bfloat16)
    assert KernelConfig().tactics.lookup(16, 960, 576) is None
    assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))


@needs_kernel
def test_skinny_linear_off_is_f_linear_for_a_tuned_shape(monkeypatch) -> None:
    """Qwen2.5-0.5B's output projection at 16 rows is tuned in the packaged table: it runs the kernel (close to the
    float64 product) and, with KernelConfig(skinny_linear=False), F.linear bit for bit."""
    import trtllm_dustin.plugins.skinny_linear as module

    launched = []
    real_forward = module.skinny_linear_forward
    monkeypatch.setattr(module, "skinny_linear_forward", lambda *a, **k: launched.append(a[3]) or real_forward(*a, **k))
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(16, 896, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(896, 896, generator=gen) / 30).to(DEVICE, torch.bfloat16)
    tuned = KernelConfig().tactics.lookup(16, 896, 896)
    assert tuned.config is not None and not tuned.tie and tuned.config.split_k == 1
    out = skinny_linear(x, w)
    assert launched == [tuned.config]
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double()), rtol=1e-2, atol=1e-2)
    assert torch.equal(skinny_linear(x, w, kernels=KernelConfig(skinny_linear=False)), F.linear(x, w))
    assert len(launched) == 1


GOOD = {"rows": 16, "n": 40, "k": 96, "config": {"block_n": 16, "block_k": 32}, "tie": False}


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    (json.dumps({"schema_version": 2, "gpu": "x", "entries": []}), "schema_version 2"),
    (json.dumps({"schema_version": 1, "entries": []}), 'needs "gpu"'),
    (json.dumps({"schema_version": 1, "gpu": "x", "entries": [{**GOOD, "config": {"block_n": 48}}]}),
     r"entry 0 .*block_n=48 must be a power of two"),
    (json.dumps({"schema_version": 1, "gpu": "x", "entries": [{**GOOD, "confg": None}]}),
     r"unknown fields \['confg'\]"),
    (json.dumps({"schema_version": 1, "gpu": "x", "entries": [GOOD, {**GOOD, "rows": 48}]}),
     r"entry 1 .*rows=48 must be a row bucket"),
    (json.dumps({"schema_version": 1, "gpu": "x", "entries": [GOOD, GOOD]}), r"entry 1: shape \(16, 40, 96\) repeats"),
    (json.dumps({"schema_version": 1, "gpu": "x", "entries": [{**GOOD, "config": None, "tie": True}]}),
     "tie=true needs a config"),
    (json.dumps({"schema_version": 1, "gpu": "x", "entries": [{**GOOD, "config": {"block_n": 16, "warps": 4}}]}),
     "entry 0 .*warps"),
])
def test_a_malformed_table_is_refused_with_its_name(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad_tactics.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        KernelConfig(linear_tactics=str(path))
    assert str(path) in str(error.value)


# ----------------------------------------------------------------------------------------------------------
# int8 tables ("weights": "int8"): the configurations of weight-only int8 weights, rows up to 128


def test_an_int8_table_round_trips_from_a_dict() -> None:
    """The fields bench_int8_linear.py's `table` writes (top-level notes included), the 128-row bucket accepted and
    keyed by row_block: 65..128 rows."""
    data = {"schema_version": 1, "weights": "int8", "kernel": "skinny_linear, int8", "gpu": "NVIDIA H100 80GB HBM3",
            "how": "test", "key": "rows, n, k", "selection_rule": "fastest", "fallback_rule": "bf16, else default",
            "entries": [
                {"rows": 16, "n": 40, "k": 96, "config": {"block_n": 32, "block_k": 64, "split_k": 2, "swap": True,
                                                           "num_warps": 4, "num_stages": 3},
                 "tie": False, "role": "ring.qkv", "measured_rows": 16, "cublas_us": 9.5, "kernel_us": 7.25},
                {"rows": 128, "n": 40, "k": 96, "config": {"block_n": 64, "block_k": 128, "split_k": 1, "swap": False,
                                                            "num_warps": 8, "num_stages": 4},
                 "tie": False, "role": "ring.qkv", "measured_rows": 128, "cublas_us": 20.0, "kernel_us": 18.5}]}
    tactics = LinearTactics.from_dict(json.loads(json.dumps(data)), "int8.json")
    small = LinearTactic(rows=16, n=40, k=96, config=LinearConfig(32, 64, 2, True, 4, 3), tie=False, role="ring.qkv",
                         measured_rows=16, cublas_us=9.5, kernel_us=7.25)
    large = LinearTactic(rows=128, n=40, k=96, config=LinearConfig(64, 128, 1, False, 8, 4), tie=False,
                         role="ring.qkv", measured_rows=128, cublas_us=20.0, kernel_us=18.5)
    assert tactics == LinearTactics(source="int8.json", gpu="NVIDIA H100 80GB HBM3", entries=(small, large),
                                    weights="int8")
    assert tactics.weights == "int8" and len(tactics) == 2
    assert tactics.lookup(1, 40, 96) == tactics.lookup(16, 40, 96) == small
    assert tactics.lookup(65, 40, 96) == tactics.lookup(128, 40, 96) == large
    assert tactics.lookup(64, 40, 96) is None and tactics.lookup(129, 40, 96) is None
    bf16 = {**data, "entries": [{**data["entries"][0], "config": None}]}
    del bf16["weights"]
    assert LinearTactics.from_dict(bf16, "old.json").weights == "bf16"  # absent: bf16
    assert LinearTactics.from_dict({**bf16, "weights": "bf16"}, "new.json").weights == "bf16"


@pytest.mark.parametrize("table, message", [
    ({"weights": "bf16", "entries": [{**INT8_GOOD, "rows": 128}]},
     r"entry 0 .*rows=128 must be a row bucket, one of \(16, 32, 64\) \(a table of bf16 weights\)"),
    ({"entries": [{**INT8_GOOD, "rows": 128}]}, r"entry 0 .*rows=128 must be a row bucket, one of \(16, 32, 64\)"),
    ({"weights": "int8", "entries": [{**INT8_GOOD, "rows": 256}]},
     r"entry 0 .*rows=256 must be a row bucket, one of \(16, 32, 64, 128\) \(a table of int8 weights\)"),
    ({"weights": "fp8", "entries": []}, r"weights='fp8' is not one of 'bf16', 'int8'"),
    ({"weights": None, "entries": []}, r"weights=None is not one of 'bf16', 'int8'"),
    ({"weights": "int8", "entries": [INT8_GOOD, {**INT8_GOOD, "rows": 32, "config": None}]},
     r"entry 1 .*an int8 table's entry needs a config and tie=false"),
    ({"weights": "int8", "entries": [{**INT8_GOOD, "tie": True}]},
     r"entry 0 .*an int8 table's entry needs a config and tie=false"),
])
def test_a_table_of_the_wrong_weights_is_refused_with_its_name(tmp_path, table: dict, message: str) -> None:
    path = tmp_path / "bad_weights.json"
    path.write_text(json.dumps({"schema_version": 1, "gpu": "x", **table}))
    field = "int8_linear_tactics" if table.get("weights") == "int8" else "linear_tactics"
    with pytest.raises(ValueError, match=message) as error:
        KernelConfig(**{field: str(path)})
    assert str(path) in str(error.value)


def test_each_table_field_takes_a_table_of_its_own_weights(tmp_path) -> None:
    int8 = write_tactics(tmp_path / "int8.json", [INT8_GOOD], weights="int8")
    bf16 = write_tactics(tmp_path / "bf16.json", [INT8_GOOD])
    with pytest.raises(ValueError) as error:
        KernelConfig(linear_tactics=int8)
    assert str(error.value) == (f"KernelConfig.linear_tactics={int8!r} is a table of int8 weights (\"weights\": "
                                "\"int8\"); linear_tactics (TRTLLM_DUSTIN_LINEAR_TACTICS) takes one of bf16 weights: "
                                "pass this file as int8_linear_tactics (TRTLLM_DUSTIN_INT8_LINEAR_TACTICS)")
    with pytest.raises(ValueError) as error:
        KernelConfig(int8_linear_tactics=bf16)
    assert str(error.value) == (f"KernelConfig.int8_linear_tactics={bf16!r} is a table of bf16 weights "
                                "(\"weights\": \"bf16\"); int8_linear_tactics (TRTLLM_DUSTIN_INT8_LINEAR_TACTICS) "
                                "takes one of int8 weights: pass this file as linear_tactics "
                                "(TRTLLM_DUSTIN_LINEAR_TACTICS)")
    with pytest.raises(ValueError, match="KernelConfig.linear_tactics="):
        KernelConfig.from_env({"TRTLLM_DUSTIN_LINEAR_TACTICS": int8})
    both = KernelConfig(linear_tactics=bf16, int8_linear_tactics=int8)
    assert (both.tactics.weights, both.int8_tactics.weights) == ("bf16", "int8")
    assert both.tactics.lookup(16, 40, 96).config == both.int8_tactics.lookup(16, 40, 96).config
    assert replace(both, linear_tactics=None).int8_tactics == both.int8_tactics  # an engine's replace keeps it


def test_the_packaged_int8_table_is_an_int8_sweep() -> None:
    tactics = KernelConfig().int8_tactics
    assert tactics == LinearTactics.load(PACKAGED_INT8_LINEAR_TACTICS) and tactics.weights == "int8"
    assert isinstance(tactics.gpu, str) and tactics.gpu.strip()
    assert len(tactics) > 0
    for entry in tactics.entries:
        assert isinstance(entry.config, LinearConfig) and entry.tie is False, entry
        assert entry.rows in (16, 32, 64, 128), entry
    assert KernelConfig().tactics.weights == "bf16"

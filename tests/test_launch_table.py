"""The kernels' launch choices as per-GPU data (plugins/launch.py, plugins/tactics/launch_<gpu>.json).

- the packaged H200 table holds the launches the sweeps chose (the values the launchers used before they were data);
- a GPU without a table of its own runs the H200 table; gpu_slug names the file;
- a malformed table is refused with the file and the field;
- the launchers read the table: a changed table changes the launch, and the kernels stay exact under it.
"""

import importlib
import json
import math

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, TOLERANCE, needs_interpreter, needs_kernel  # noqa: E402

from trtllm_dustin.config import ConfigError  # noqa: E402
from trtllm_dustin.plugins import launch  # noqa: E402
from trtllm_dustin.plugins.reference import sparse_verify_attention_ref, verify_attention_ref  # noqa: E402

va = importlib.import_module("trtllm_dustin.plugins.verify_attention")  # the modules (the package exports the ops)
sva = importlib.import_module("trtllm_dustin.plugins.sparse_verify_attention")
PACKAGED = launch.TACTICS_DIR / "launch_h200.json"


def test_the_h200_table_holds_the_swept_launches() -> None:
    table = launch.read_launch_table(PACKAGED)
    assert table.gpu == "NVIDIA H200"
    v, s, r, p = table.verify_attention, table.sparse_verify_attention, table.srh_score, table.prefill_attention
    assert (v.min_keys_per_split, v.tile_bytes, v.max_block_n, v.num_warps, v.wide_num_warps, v.num_stages,
            v.fp8_programs_per_sm) == (256, 32768, 256, 4, 8, 3, 2)
    assert (s.min_keys_per_split, s.block_n, s.num_warps, s.num_stages, s.tile_rows, s.small_tile_rows) == \
        (1024, 64, 4, 3, 64, 16)
    assert (r.min_keys_per_split, r.lse_programs_per_sm, r.wide_row_block_n, r.block_n, r.num_warps, r.num_stages,
            r.sum_block_n) == (1024, 4, 64, 128, 4, 2, 512)
    assert (p.block_m, p.block_n, p.num_warps, p.num_stages, p.fp32_block_m, p.fp32_block_n, p.fp32_num_stages) == \
        (128, 128, 8, 3, 64, 32, 2)
    assert (table.fused_ops.silu_block, table.fused_ops.rope_tile, table.argmax.chunk_num_warps) == (1024, 2048, 8)


@pytest.mark.parametrize(("name", "slug"), [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
                                            ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb")])
def test_gpu_slug(name: str, slug: str) -> None:
    assert launch.gpu_slug(name) == slug


def test_a_gpu_without_a_table_runs_the_h200_one() -> None:
    assert launch._table_for("h100-80gb-hbm3") == launch.read_launch_table(PACKAGED)
    assert launch.launch_table(torch.device("cpu")) == launch.read_launch_table(PACKAGED)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("commit"), "field commit is missing"),
    (lambda d: d["srh_score"].update(block_n="64"), "block_n"),
    (lambda d: d["argmax"].update(bogus=1), "'bogus' is not a field of ArgmaxLaunch"),
    (lambda d: d["verify_attention"].update(num_warps=0), "VerifyLaunch.num_warps=0 must be >= 1"),
    (lambda d: d.update(schema_version=9), "schema_version 9 is not 1"),
])
def test_a_bad_table_names_the_file_and_the_field(tmp_path, change, message) -> None:
    data = json.loads(PACKAGED.read_text())
    change(data)
    path = tmp_path / "launch_test.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        launch.read_launch_table(path)
    assert str(path) in str(e.value) and message in str(e.value)


def _with(monkeypatch, **parts) -> launch.LaunchTable:
    """Every launcher reads a table whose named parts are replaced (dataclasses.replace of the H200 one's)."""
    from dataclasses import replace

    base = launch.read_launch_table(PACKAGED)
    table = replace(base, **{name: replace(getattr(base, name), **fields) for name, fields in parts.items()})
    for module in (va, sva):
        monkeypatch.setattr(module, "launch_table", lambda device: table)
    return table


@needs_kernel
def test_the_verify_launcher_takes_its_split_rule_from_the_table(monkeypatch) -> None:
    seen = []
    real = va.pick_num_splits

    def spy(pairs, keys, min_keys, device, programs_per_sm=1):
        seen.append((min_keys, programs_per_sm))
        return real(pairs, keys, min_keys, device, programs_per_sm)

    monkeypatch.setattr(va, "pick_num_splits", spy)
    _with(monkeypatch, verify_attention={"min_keys_per_split": 4096, "fp8_programs_per_sm": 3})
    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    k = torch.randn(1, 2, 64, 16, device=DEVICE)
    va.verify_attention(q, k, k.clone(), torch.tensor([30], dtype=torch.int32, device=DEVICE))
    assert seen == [(4096, 1)]  # a 16-bit or fp32 cache: one program per SM


@needs_interpreter
@pytest.mark.parametrize("block_n", [16, 32])
def test_kernels_stay_exact_under_another_table(monkeypatch, block_n) -> None:
    """The interpreter's launches under a table with other tiles and splits match the float64 references."""
    _with(monkeypatch, verify_attention={"min_keys_per_split": 16, "max_block_n": block_n},
          sparse_verify_attention={"block_n": block_n, "min_keys_per_split": 16})
    torch.manual_seed(block_n)
    b, t, hq, hkv, d, s = 2, 3, 4, 2, 16, 96
    q = torch.randn(b, t, hq, d)
    k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    lens = torch.tensor([50, 71], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    rel, _ = TOLERANCE[torch.float32]
    out = va.verify_attention(q, k, v, lens)
    ref = verify_attention_ref(q.double(), k.double(), v.double(), lens, scale)
    assert ((out.double() - ref).norm() / ref.norm()) < rel
    indices = torch.stack([torch.randperm(int(n))[:24].sort().values for n in lens]).to(torch.int32)
    out = sva.sparse_verify_attention(q, k, v, lens, indices)
    ref = sparse_verify_attention_ref(q.double(), k.double(), v.double(), lens, indices, scale)
    assert ((out.double() - ref).norm() / ref.norm()) < rel

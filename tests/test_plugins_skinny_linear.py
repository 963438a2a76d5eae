"""The skinny-M linear kernel against a float64 matmul: odd M / N / K, bias, split-K (counters back at 0 for the
next call), both tile orientations, strided rows, poisoned outputs; the op's dispatch by the KernelConfig's tactic
table and switches, and its error messages.

CPU: runs the Triton kernel under TRITON_INTERPRET=1; the same tests run on CUDA tensors when a GPU is present
(there also inside a CUDA graph, where launches use PDL).
"""

from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from helpers.kernels import DEVICE, needs_cuda, needs_kernel, write_tactics  # noqa: E402

from trtllm_dustin.plugins.kernel_config import KernelConfig  # noqa: E402
from trtllm_dustin.plugins.linear_tactics import LinearConfig  # noqa: E402
from trtllm_dustin.plugins.pdl import pdl_supported  # noqa: E402
from trtllm_dustin.plugins.skinny_linear import (  # noqa: E402
    DEFAULT_KERNELS,
    MAX_ROWS,
    QUANTIZED_CONFIG,
    SplitKWorkspace,
    pick_config,
    skinny_linear,
    skinny_linear_forward,
    skinny_linear_ref,
)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def assert_close_to_f64(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    """fp32: accumulation-order error only; 16-bit: the output's own rounding (half an ulp, one with margin)."""
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref).abs()
    if out.dtype == torch.float32:
        bound = 1e-6 * k ** 0.5 * ref.abs().max()
    else:
        _, exponent = torch.frexp(ref.abs())
        ulp = torch.ldexp(torch.ones_like(ref), exponent - 1 - (7 if out.dtype == torch.bfloat16 else 10))
        bound = ulp + 1e-3 * ref.abs().max()  # + fp32 accumulation of 16-bit products in another order
    assert (err <= bound).all(), f"max error {err.max().item():.3g} over the bound"


SHAPES = [(1, 64, 256), (5, 72, 200), (16, 96, 512), (33, 200, 384), (64, 128, 1000)]
CONFIGS = [LinearConfig(block_n=32, block_k=64, swap=True, num_stages=2),
           LinearConfig(block_n=64, block_k=128, swap=False, num_stages=2),
           LinearConfig(block_n=32, block_k=64, split_k=3, swap=True, num_stages=2)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=["swap", "plain", "split3"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_float64(m: int, n: int, k: int, config: LinearConfig, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if n % 2 == 0 else None
    workspace = SplitKWorkspace.allocate(m, n, config, x.device) if config.split_k > 1 else None
    ref = reference(x, w, b)
    for _ in range(2):  # the second call finds the split-K counters reset by the first
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        skinny_linear_forward(x, w, b, config, workspace, out=out)
        assert_close_to_f64(out, ref, k)
        if workspace is not None:
            assert int(workspace.counters.abs().sum()) == 0, "split-K counters not reset after the launch"


def int8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight using the whole range (both ends included) and per-row scales spread over two decades."""
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q[:, 0], q[:, -1] = 127, -127
    scale = 10 ** (torch.rand(n, generator=gen) * 2 - 3) / k ** 0.5
    return q.to(DEVICE), scale.to(DEVICE)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=["swap", "plain", "split3"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (33, 200, 384), (2 * MAX_ROWS, 72, 200)])
def test_int8_weights_match_float64(m: int, n: int, k: int, config: LinearConfig, dtype: torch.dtype) -> None:
    """An int8 weight with one scale per row: the float64 product with the weight it stands for (q * scale), bias
    added after the scale; the widening to x's dtype is exact, so only the output's rounding remains. Up to
    2 * MAX_ROWS rows (the observe pass of a Γ = 7 round at B = 16)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k + 1)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    q, scale = int8_weight(n, k, gen)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if n % 2 == 0 else None
    workspace = SplitKWorkspace.allocate(m, n, config, x.device) if config.split_k > 1 else None
    ref = reference(x, q.double() * scale.double()[:, None], b)
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        skinny_linear_forward(x, q, b, config, workspace, out=out, scale=scale)
        assert_close_to_f64(out, ref, k)
        if workspace is not None:
            assert int(workspace.counters.abs().sum()) == 0, "split-K counters not reset after the launch"
    assert_close_to_f64(skinny_linear_ref(x, q, b, scale), ref, k)  # the widened copy the CPU path serves


@needs_kernel
def test_int8_weights_take_the_kernel_wherever_triton_runs(monkeypatch, tmp_path) -> None:
    """An int8 weight runs the kernel for 1..2 * MAX_ROWS rows: with the table's configuration where it has one
    (without its split when no workspace fits), else QUANTIZED_CONFIG; a tie needs no PDL launch (cuBLAS would
    read a widened copy). More rows, fp32 activations and skinny_linear=False take the widened copy."""
    launched = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    q, scale = int8_weight(40, 96, gen)
    few = torch.randn(2, 4, 96, generator=gen).to(DEVICE, torch.bfloat16)
    ref = reference(few, q.double() * scale.double()[:, None], None)
    assert_close_to_f64(skinny_linear(few, q, scale=scale), ref, 96)  # not in the packaged table
    assert launched == [QUANTIZED_CONFIG]
    split = LinearConfig(block_n=16, block_k=32, split_k=3, num_stages=2)
    kernels = KernelConfig(linear_tactics=write_tactics(tmp_path / "split.json", [table_entry(split, tie=True)]),
                           pdl=False)
    assert_close_to_f64(skinny_linear(few, q, kernels=kernels, scale=scale), ref, 96)
    workspace = SplitKWorkspace.for_outputs(40, few.device)
    assert_close_to_f64(skinny_linear(few, q, None, workspace, kernels=kernels, scale=scale), ref, 96)
    assert launched == [QUANTIZED_CONFIG, replace(split, split_k=1), split]
    rows = torch.randn(2 * MAX_ROWS, 96, generator=gen).to(DEVICE, torch.bfloat16)
    assert_close_to_f64(skinny_linear(rows, q, scale=scale), reference(rows, q.double() * scale.double()[:, None],
                                                                       None), 96)
    assert len(launched) == 4
    more = torch.randn(2 * MAX_ROWS + 1, 96, generator=gen).to(DEVICE, torch.bfloat16)
    for x, switches in ((more, {}), (few.float(), {}), (few, dict(skinny_linear=False))):
        got = skinny_linear(x, q, kernels=KernelConfig(**switches), scale=scale)
        assert torch.equal(got, skinny_linear_ref(x, q, None, scale))
    assert len(launched) == 4


@needs_kernel
def test_int8_weights_take_the_int8_tables_configuration_first(monkeypatch, tmp_path) -> None:
    """An int8 weight takes the int8 table's entry (its split only with a workspace that fits, up to 128 rows), else
    the bf16 table's (rows up to 64), else QUANTIZED_CONFIG; a bf16 weight reads only the bf16 table."""
    int8_split = LinearConfig(block_n=16, block_k=32, split_k=2, num_stages=2)
    int8_rows = LinearConfig(block_n=32, block_k=64, swap=False, num_warps=2, num_stages=3)
    int8_only = LinearConfig(block_n=16, block_k=64, num_stages=3)
    bf16_40 = LinearConfig(block_n=64, block_k=32, swap=False, num_stages=2)
    bf16_48 = LinearConfig(block_n=16, block_k=32, split_k=3, num_stages=2)
    kernels = KernelConfig(
        linear_tactics=write_tactics(tmp_path / "bf16.json", [table_entry(bf16_40), table_entry(bf16_48, n=48)]),
        int8_linear_tactics=write_tactics(tmp_path / "int8.json", [
            table_entry(int8_split), table_entry(int8_rows, rows=128), table_entry(int8_only, n=56)], weights="int8"))
    gen = torch.Generator().manual_seed(9)
    few = torch.randn(8, 96, generator=gen).to(DEVICE, torch.bfloat16)  # the 16-row bucket
    many = torch.randn(100, 96, generator=gen).to(DEVICE, torch.bfloat16)  # the 128-row bucket
    workspace = SplitKWorkspace.for_outputs(64, few.device)
    weights = {n: int8_weight(n, 96, gen)[0] for n in (40, 48, 56, 64)}
    for n, x, room, expected in [
        (40, few, workspace, int8_split),  # the int8 entry, not the bf16 one
        (40, few, None, replace(int8_split, split_k=1)),  # no workspace: its split dropped
        (40, few, SplitKWorkspace.allocate(8, 40, replace(int8_split, split_k=1), few.device),
         replace(int8_split, split_k=1)),  # a workspace too small for 2 slices: the same
        (40, many, None, int8_rows),
        (48, few, workspace, bf16_48),  # not in the int8 table: the bf16 table's
        (48, few, None, replace(bf16_48, split_k=1)),
        (48, many, workspace, QUANTIZED_CONFIG),  # the bf16 table has no 128-row bucket
        (56, few, None, int8_only),
        (64, few, workspace, QUANTIZED_CONFIG),  # in neither table
    ]:
        assert pick_config(kernels, x, weights[n], room) == expected, (n, x.shape[0], room is not None)
    dense = {n: torch.randn(n, 96, generator=gen).to(DEVICE, torch.bfloat16) for n in (40, 48, 56)}
    assert pick_config(kernels, few, dense[40], workspace) == bf16_40  # a bf16 weight: the bf16 table
    assert pick_config(kernels, few, dense[48], workspace) == bf16_48
    assert pick_config(kernels, few, dense[56], workspace) is None  # the int8 table's shape is not a bf16 one
    assert pick_config(kernels, many, dense[40], workspace) is None  # more than MAX_ROWS rows: F.linear
    # the call itself: the int8 entry's configuration, launched without its split, close to the float64 product
    launched = record_launches(monkeypatch)
    q, scale = int8_weight(40, 96, gen)
    out = skinny_linear(few, q, kernels=kernels, scale=scale)
    assert launched == [replace(int8_split, split_k=1)]
    assert_close_to_f64(out, reference(few, q.double() * scale.double()[:, None], None), 96)


@needs_kernel
def test_the_packaged_int8_table_configures_the_int8_calls_it_lists() -> None:
    """Each entry of the packaged int8 table is what an int8 call of its shape takes by default (no workspace: its
    split dropped), not the bf16 table's entry for the same shape."""
    table = DEFAULT_KERNELS.int8_tactics
    assert table.weights == "int8" and len(table) > 0
    for entry in table.entries:
        x = torch.empty(entry.measured_rows or entry.rows, entry.k, dtype=torch.bfloat16, device=DEVICE)
        q = torch.zeros(1, 1, dtype=torch.int8, device=DEVICE).expand(entry.n, entry.k)  # shape and dtype are read
        expected = replace(entry.config, split_k=1)
        assert pick_config(DEFAULT_KERNELS, x, q, None) == expected, entry
    down = table.lookup(16, 2048, 8192)  # the AR draft's down projection: split over K where the workspace fits
    if down is not None and down.config.split_k > 1:
        x = torch.empty(16, 8192, dtype=torch.bfloat16, device=DEVICE)
        q = torch.zeros(1, 1, dtype=torch.int8, device=DEVICE).expand(2048, 8192)
        assert pick_config(DEFAULT_KERNELS, x, q, SplitKWorkspace.for_outputs(2048, x.device)) == down.config
        assert down.config != DEFAULT_KERNELS.tactics.lookup(16, 2048, 8192).config


@needs_kernel
def test_leading_dims_and_strided_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 5, 2 * 160, generator=gen).to(DEVICE, torch.bfloat16)
    x = base[..., ::2]  # [3, 5, 160] with stride 2 along K: the launcher makes it contiguous
    w = torch.randn(48, 160, generator=gen).to(DEVICE, torch.bfloat16)
    out = skinny_linear_forward(x, w, None, LinearConfig(block_n=16, block_k=32, num_stages=2))
    assert out.shape == (3, 5, 48)
    assert_close_to_f64(out, reference(x, w, None), 160)
    rows = base[:, :, :160]  # unit stride along K, row stride 320: used in place
    out = skinny_linear_forward(rows, w, None, LinearConfig(block_n=16, block_k=32, num_stages=2))
    assert_close_to_f64(out, reference(rows, w, None), 160)


def table_entry(config: LinearConfig, rows: int = 16, n: int = 40, k: int = 96, tie: bool = False) -> dict:
    return {"rows": rows, "n": n, "k": k, "config": asdict(config), "tie": tie}


def record_launches(monkeypatch) -> list:
    """The LinearConfig of every kernel launch skinny_linear makes from now on."""
    import trtllm_dustin.plugins.skinny_linear as module

    launched = []
    real_forward = module.skinny_linear_forward
    monkeypatch.setattr(module, "skinny_linear_forward", lambda *a, **k: launched.append(a[3]) or real_forward(*a, **k))
    return launched


@needs_kernel
def test_op_dispatch(monkeypatch, tmp_path) -> None:
    """Shapes in the table run the kernel (split-K ones only with a workspace); everything else is F.linear, bit for
    bit: shapes not in the table, prefill-sized inputs, fp32, and KernelConfig(skinny_linear=False)."""
    launched = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=gen).to(DEVICE, torch.bfloat16)
    b = torch.randn(40, generator=gen).to(DEVICE, torch.bfloat16)
    few = torch.randn(2, 4, 96, generator=gen).to(DEVICE, torch.bfloat16)  # 8 rows: the 16-row bucket
    assert torch.equal(skinny_linear(few, w, b), F.linear(few, w, b)) and not launched  # not in the packaged table
    single = LinearConfig(block_n=16, block_k=32, num_stages=2)
    kernels = KernelConfig(linear_tactics=write_tactics(tmp_path / "single.json", [table_entry(single)]))
    assert_close_to_f64(skinny_linear(few, w, b, kernels=kernels), reference(few, w, b), 96)
    assert launched == [single]
    split = LinearConfig(block_n=16, block_k=32, split_k=3, num_stages=2)
    kernels = KernelConfig(linear_tactics=write_tactics(tmp_path / "split.json", [table_entry(split)]))
    assert torch.equal(skinny_linear(few, w, b, kernels=kernels), F.linear(few, w, b))  # no workspace
    assert launched == [single]
    workspace = SplitKWorkspace.for_outputs(40, few.device)
    assert_close_to_f64(skinny_linear(few, w, b, workspace, kernels=kernels), reference(few, w, b), 96)
    assert launched == [single, split] and int(workspace.counters.abs().sum()) == 0
    many = torch.randn(MAX_ROWS + 1, 96, generator=gen).to(DEVICE, torch.bfloat16)  # a prefill chunk: cuBLAS
    assert torch.equal(skinny_linear(many, w, b, kernels=kernels), F.linear(many, w, b))
    fp32 = few.float()
    assert torch.equal(skinny_linear(fp32, w.float(), b.float(), kernels=kernels), F.linear(fp32, w.float(), b.float()))
    off = KernelConfig(skinny_linear=False, linear_tactics=kernels.linear_tactics)
    assert torch.equal(skinny_linear(few, w, b, workspace, kernels=off), F.linear(few, w, b))
    assert len(launched) == 2


@needs_kernel
def test_a_tie_runs_the_kernel_only_on_a_pdl_launch(monkeypatch, tmp_path) -> None:
    """A shape that tied with cuBLAS runs the kernel only where the launch uses PDL (pdl and skinny_pdl and
    skinny_ties, on a device that supports it: sm_90 GPUs); anywhere else it stays on F.linear."""
    launched = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 96, generator=gen).to(DEVICE, torch.bfloat16)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, torch.bfloat16)
    tie = LinearConfig(block_n=16, block_k=32, num_stages=2)
    path = write_tactics(tmp_path / "tie.json", [table_entry(tie, tie=True)])
    for switches in (dict(pdl=False), dict(skinny_pdl=False), dict(skinny_ties=False)):
        assert torch.equal(skinny_linear(x, w, kernels=KernelConfig(linear_tactics=path, **switches)), F.linear(x, w))
    assert not launched
    out = skinny_linear(x, w, kernels=KernelConfig(linear_tactics=path))
    if pdl_supported(x.device):
        assert launched == [tie]
        assert_close_to_f64(out, reference(x, w, None), 96)
    else:
        assert torch.equal(out, F.linear(x, w)) and not launched


def test_the_packaged_table_keys_by_row_bucket() -> None:
    tactics = DEFAULT_KERNELS.tactics
    entry = tactics.lookup(64, 28672, 4096)  # Llama-8B's gate/up at 64 rows
    assert entry.config == LinearConfig(block_n=128, block_k=128, split_k=1, swap=False, num_warps=8, num_stages=4)
    assert tactics.lookup(33, 28672, 4096) is entry  # rows round up to the bucket
    assert tactics.lookup(32, 28672, 4096) is not entry
    assert tactics.lookup(64, 28672 + 16, 4096) is None  # not measured: F.linear
    assert any(e.config is None for e in tactics.entries), "shapes where cuBLAS won stay on cuBLAS"


def test_errors() -> None:
    with pytest.raises(ValueError, match="block_n=48"):
        LinearConfig(block_n=48)
    with pytest.raises(ValueError, match="split_k=0"):
        LinearConfig(split_k=0)
    x, w = torch.zeros(4, 32), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="does not match"):
        skinny_linear_forward(x, w, None, LinearConfig())
    with pytest.raises(ValueError, match="M=200"):
        skinny_linear_forward(torch.zeros(200, 16), w, None, LinearConfig())
    with pytest.raises(ValueError, match="split_k=2 needs a SplitKWorkspace"):
        skinny_linear_forward(torch.zeros(4, 16), w, None, LinearConfig(split_k=2))
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear_forward(torch.zeros(4, 16), w.half(), None, LinearConfig())
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 weight needs its per-row scale"):
        skinny_linear_forward(torch.zeros(4, 16), q, None, LinearConfig())
    with pytest.raises(ValueError, match="int8 weight needs its per-row scale"):
        skinny_linear_forward(torch.zeros(4, 16), w, None, LinearConfig(), scale=torch.ones(8))
    with pytest.raises(ValueError, match=r"scale must be a contiguous float tensor \[8\]"):
        skinny_linear_forward(torch.zeros(4, 16), q, None, LinearConfig(), scale=torch.ones(16))


@needs_cuda
def test_cuda_graph_chain() -> None:
    """Two dependent tuned projections (Llama-3.2-1B's down, split-K, then its output head) replayed from a CUDA
    graph."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(16, 8192, generator=gen, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(2048, 8192, generator=gen, device="cuda", dtype=torch.bfloat16) / 8192 ** 0.5
    w2 = torch.randn(128256, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    tactics = DEFAULT_KERNELS.tactics
    assert tactics.lookup(16, 2048, 8192).config.split_k > 1 and tactics.lookup(16, 128256, 2048).config is not None
    workspace = SplitKWorkspace.for_outputs(2048, x.device)
    step = lambda: skinny_linear(skinny_linear(x, w1, None, workspace), w2)  # noqa: E731
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(16, 8192, generator=gen, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    hidden = skinny_linear(x, w1, None, workspace)
    assert_close_to_f64(hidden, reference(x, w1, None), 8192)
    assert_close_to_f64(out, reference(hidden, w2, None), 2048)

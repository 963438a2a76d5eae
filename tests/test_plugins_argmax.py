"""The row argmax kernel against torch.argmax: odd widths around the chunk size, ties inside and across chunks,
NaN, signed zeros and -inf, strided rows and leading dims, every dtype; and the places the runtime uses it.

CPU: runs the Triton kernels under TRITON_INTERPRET=1; on a GPU the same tests run on CUDA tensors, plus a
CUDA-graph replay.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.plugins.argmax import CHUNK, MAX_CHUNKS, argmax_last  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (5, CHUNK - 1), (2, CHUNK), (4, CHUNK + 1), (16, 3 * CHUNK + 5),
                                       (7, 40001)])
def test_matches_torch_on_random_logits(rows: int, cols: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 100003 + cols)
    x = (torch.randn(rows, cols, generator=gen) * 8).to(DEVICE, dtype)
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_keep_the_first_index_within_and_across_chunks(dtype: torch.dtype) -> None:
    cols = 3 * CHUNK + 11
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(1)).clamp(-3, 3)
    x[0, [CHUNK + 9, 5, 2 * CHUNK]] = 10.0  # chunk 0 holds the first of three
    x[1, [2 * CHUNK + 1, CHUNK + 3]] = 10.0  # two later chunks: the earlier one wins
    x[2, [CHUNK - 1, CHUNK]] = 10.0  # either side of a chunk boundary
    x[3, [cols - 1, cols - 2]] = 10.0  # in the partial last chunk
    x[4] = 1.5  # a constant row: index 0
    x[5, [17, 3 * CHUNK]] = 10.0
    x = x.to(DEVICE, dtype)
    got = argmax_last(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [5, CHUNK + 3, CHUNK - 1, cols - 2, 0, 17]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_signed_zero_and_infinities_follow_torch(dtype: torch.dtype) -> None:
    cols = 2 * CHUNK + 3
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(2)).clamp(-3, 3)
    x[0, [CHUNK + 4, 9]] = float("nan")  # the first NaN wins over everything
    x[0, 3] = float("inf")
    x[1, CHUNK + 1] = -float("nan")  # a NaN with the sign bit set is still a NaN
    x[2] = -float("inf")  # all -inf: index 0
    x[3] = -1.0
    x[3, [CHUNK + 2, 40]] = torch.tensor([0.0, -0.0])  # -0.0 at 40 equals 0.0 and comes first
    x[4] = float("-inf")
    x[4, cols - 1] = -1e30 if dtype != torch.float16 else -6e4  # the only finite value
    x[5, 2 * CHUNK] = float("inf")
    x[6] = -5.0
    x[6, [CHUNK, 2]] = torch.tensor([-4.0, -4.0])  # negative maxima compare by value, not by bits
    x = x.to(DEVICE, dtype)
    got = argmax_last(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [9, CHUNK + 1, 0, 40, cols - 1, 2 * CHUNK, 2]


@needs_kernel
def test_strided_rows_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 2 * CHUNK + 77, generator=gen).to(DEVICE, torch.bfloat16)  # [B, T, V]
    assert torch.equal(argmax_last(logits), logits.argmax(dim=-1))  # [B, T]
    column = logits[:, 2]  # rows 5 * V apart
    assert torch.equal(argmax_last(column), column.argmax(dim=-1))
    transposed = logits.transpose(0, 1)  # leading dims that do not collapse into one stride
    assert torch.equal(argmax_last(transposed), transposed.argmax(dim=-1))
    every_other = logits[..., ::2]  # a strided last dim is copied first
    assert torch.equal(argmax_last(every_other), every_other.argmax(dim=-1))
    assert argmax_last(logits[:0]).shape == (0, 5)


def test_errors_name_the_shape_and_other_dtypes_fall_back() -> None:
    with pytest.raises(ValueError, match=r"shape \(3, 0\)"):
        argmax_last(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="no last dim"):
        argmax_last(torch.tensor(1.0))
    with pytest.raises(ValueError, match="use torch.argmax"):
        argmax_last(torch.zeros(1, CHUNK * MAX_CHUNKS + 1, dtype=torch.bfloat16, device="meta"))
    ints = torch.tensor([[3, 9, 9, 1]])
    assert argmax_last(ints).tolist() == [1]
    doubles = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    assert argmax_last(doubles).tolist() == [2]


@needs_cuda
def test_cuda_graph_replay() -> None:
    x = torch.randn(16, 128256, device="cuda")
    argmax_last(x)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_last(x)
    for seed in range(3):
        x.copy_(torch.randn(16, 128256, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1))


@needs_kernel
def test_use_kernel_false_runs_torch(monkeypatch) -> None:
    import trtllm_dustin.plugins.argmax as argmax_module

    def refuse(*args) -> None:
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(argmax_module, "argmax_forward", refuse)
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with pytest.raises(AssertionError, match="the kernel ran"):
        argmax_last(x)
    assert torch.equal(argmax_last(x, use_kernel=False), x.argmax(dim=-1))

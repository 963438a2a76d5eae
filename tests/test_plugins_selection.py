"""Eq. 6 selection and the StreamingLLM set against a plain-Python reference built from sets:
sinks and window kept, exactly m by the draft signal, the rest by the target signal, the budget
exact, output sorted, unique, -1 padded; short contexts keep everything."""

import pytest
import torch

from trtllm_dustin.plugins import select_verify_indices, streaming_indices
from trtllm_dustin.plugins.selection import window_scores

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(s_draft, s_target, lengths, budget, m, n_sink, n_recent):
    """Eq. 6 with Python sets, one sequence at a time: list of sorted index lists."""
    rows = []
    for b, length in enumerate(lengths):
        if length <= budget:
            rows.append(list(range(length)))
            continue
        protected = set(range(n_sink)) | set(range(length - n_recent, length))
        rest = [j for j in range(length) if j not in protected]
        draft = sorted(rest, key=lambda j: -s_draft[b, j].item())[:m]
        rest = [j for j in rest if j not in set(draft)]
        target = sorted(rest, key=lambda j: -s_target[b, j].item())[: budget - m - len(protected)]
        rows.append(sorted(protected | set(draft) | set(target)))
    return rows


def as_lists(indices):
    return [[i for i in row if i >= 0] for row in indices.tolist()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", [[1, 7, 1000, 4097], [600, 601, 4000], [20, 21, 2000]])
@pytest.mark.parametrize("budget, m", [(64, 0), (64, 44), (512, 200), (600, 100)])
def test_matches_set_reference(device, lengths, budget, m):
    torch.manual_seed(budget + m + len(lengths))
    s_max = max(lengths) + 8
    # Distinct random scores (ties would make top-k order ambiguous), garbage beyond L_b.
    s_draft = torch.rand(len(lengths), s_max, dtype=torch.float64).float().to(device)
    s_target = torch.rand(len(lengths), s_max, dtype=torch.float64).float().to(device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    indices = select_verify_indices(s_draft, s_target, seqlens, budget, m, n_sink=4, n_recent=16)
    assert indices.dtype == torch.int32 and indices.shape == (len(lengths), budget)
    expected = reference(s_draft.cpu(), s_target.cpu(), lengths, budget, m, 4, 16)
    assert as_lists(indices) == expected
    for row, length in zip(indices.tolist(), lengths, strict=True):
        valid = [i for i in row if i >= 0]
        assert row[: len(valid)] == valid and all(i == -1 for i in row[len(valid):]), "valid first, then -1"
        assert valid == sorted(set(valid)) and all(0 <= i < length for i in valid)
        assert len(valid) == min(length, budget)
        if length > budget:
            assert set(range(4)) <= set(valid) and set(range(length - 16, length)) <= set(valid)


def test_draft_split_is_honoured():
    """A draft signal peaked on positions the target ignores gets exactly m of them in."""
    length, budget, m = 1000, 64, 10
    s_draft = torch.zeros(1, length)
    s_draft[0, 100:130] = torch.linspace(2, 1, 30)  # 30 draft favourites, best first
    s_target = torch.rand(1, length) * 0.5
    s_target[0, 100:130] = -1.0  # the target never picks them
    indices = select_verify_indices(s_draft, s_target, torch.tensor([length], dtype=torch.int32), budget, m)
    chosen = set(as_lists(indices)[0])
    assert chosen & set(range(100, 130)) == set(range(100, 110))
    assert len(chosen) == budget


def test_budget_at_least_s_max_keeps_everything():
    seqlens = torch.tensor([5, 30], dtype=torch.int32)
    indices = select_verify_indices(torch.rand(2, 32), torch.rand(2, 32), seqlens, 64, 8)
    assert as_lists(indices) == [list(range(5)), list(range(30))]


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 30, "m": 20}, "smaller than n_sink"),
    ({"budget": 64, "m": -1}, ">= 0"),
])
def test_errors_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_verify_indices(torch.rand(1, 100), torch.rand(1, 100), torch.tensor([90], dtype=torch.int32), **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_streaming_indices(device):
    lengths = [1, 7, 100, 101, 4097]
    indices = streaming_indices(torch.tensor(lengths, dtype=torch.int32, device=device), 100, n_sink=4)
    assert indices.dtype == torch.int32 and indices.shape == (5, 100)
    for row, length in zip(as_lists(indices), lengths, strict=True):
        expected = list(range(length)) if length <= 100 else list(range(4)) + list(range(length - 96, length))
        assert row == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_capturable_in_cuda_graph():
    """Fixed shapes, no host sync: selection replays inside a CUDA graph."""
    s_draft, s_target = torch.rand(4, 5000, device="cuda"), torch.rand(4, 5000, device="cuda")
    seqlens = torch.tensor([4000, 100, 4990, 700], dtype=torch.int32, device="cuda")
    select_verify_indices(s_draft, s_target, seqlens, 512, 128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indices = select_verify_indices(s_draft, s_target, seqlens, 512, 128)
    s_draft.copy_(torch.rand_like(s_draft))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(indices, select_verify_indices(s_draft, s_target, seqlens, 512, 128))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 3, 7])
@pytest.mark.parametrize("op", ["max", "mean"])
def test_window_scores_match_a_loop(device, width, op):
    """Each position's max / mean over the centred window, against a float64 loop (the mean counts positions past
    either end as 0, the max as absent); width 1 returns the scores themselves."""
    torch.manual_seed(width)
    scores = torch.rand(3, 29, dtype=torch.float64).float().to(device)
    got = window_scores(scores, width, op)
    half = width // 2
    expected = torch.zeros(3, 29, dtype=torch.float64)
    for b in range(3):
        for j in range(29):
            inside = scores[b, max(0, j - half): j + half + 1].double().cpu()
            expected[b, j] = inside.max() if op == "max" else inside.sum() / width
    torch.testing.assert_close(got.double().cpu(), expected)
    if width == 1:
        assert got is scores


def test_window_scores_refuse_a_bad_window():
    scores = torch.rand(2, 10)
    for width, op in ((2, "max"), (0, "max"), (3, "median")):
        with pytest.raises(ValueError, match="window_scores"):
            window_scores(scores, width, op)

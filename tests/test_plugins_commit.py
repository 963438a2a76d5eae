"""The one-launch round commit against its torch reference: random verdicts, end ids inside and past the accepted
prefix, rows at their own token limits, inactive rows, several end ids, odd batch sizes and Γ, Γ = 0 (plain
decoding); plus hand-checked cases and the input checks.

CPU: runs the Triton kernel under TRITON_INTERPRET=1; on a GPU the same tests run on CUDA tensors.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, needs_kernel  # noqa: E402

from trtllm_dustin.plugins.commit import commit_round, commit_round_ref  # noqa: E402


def make_round(batch: int, gamma: int, width: int, seed: int, eos: list[int], per_row_limits: bool = False) -> dict:
    """A random round. width is W (out has W + 1 columns); limits are W for every row, or with per_row_limits each
    row's own in [1, W]. A third of the rows sit at most Γ tokens below their limit (the cut), the active rows below
    it."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 12  # small, so end ids turn up inside rounds
    drafts = torch.randint(0, vocab, (batch, gamma), generator=gen)
    cur = torch.randint(0, vocab, (batch,), generator=gen)
    limits = torch.randint(1, width + 1, (batch,), generator=gen) if per_row_limits else torch.full((batch,), width)
    generated = (torch.rand(batch, generator=gen) * (limits + 1)).long().clamp_max(limits)
    near = limits[: batch // 3] - torch.randint(0, gamma + 1, (batch // 3,), generator=gen)
    generated[: batch // 3] = near.clamp_min(0)
    out = torch.randint(-1, vocab, (batch, width + 1), generator=gen)
    state = dict(
        draft_tokens=drafts, verify_tokens=torch.cat([cur[:, None], drafts], dim=1),
        accepted=torch.randint(0, gamma + 1, (batch,), generator=gen),
        nxt=torch.randint(0, vocab, (batch,), generator=gen),
        eos=torch.tensor(eos), limits=limits, out=out,
        active=(torch.rand(batch, generator=gen) < 0.8) & (generated < limits), generated=generated,
        hist=torch.randint(0, 50, (gamma + 1,), generator=gen), prev=torch.randint(0, vocab, (batch,), generator=gen),
        cur=cur.clone(), seqlens=torch.randint(1, 1000, (batch,), generator=gen, dtype=torch.int32))
    return {k: v.to(DEVICE) for k, v in state.items()}


def clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def run_both(state: dict) -> tuple[dict, dict]:
    ref, got = clone(state), clone(state)
    commit_round_ref(**ref)
    commit_round(**got)
    return got, ref


def assert_same(got: dict, ref: dict) -> None:
    width = ref["out"].shape[1] - 1
    for name in ("active", "generated", "hist", "prev", "cur", "seqlens", "limits"):
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(got["out"][:, :width], ref["out"][:, :width])  # the last column only takes junk writes


def assert_within_limits(before: dict, after: dict) -> None:
    """Invariants of any round: no row passes its limit, a row that reached it is inactive, nothing is written at or
    past a row's limit or before what it had generated, and seqlens grow by exactly what generated grew by."""
    width = before["out"].shape[1] - 1
    grew = after["generated"] - before["generated"]
    assert (after["generated"] <= torch.maximum(before["generated"], before["limits"])).all()
    assert not (after["active"] & (after["generated"] >= after["limits"])).any()
    assert torch.equal(grew.int(), after["seqlens"] - before["seqlens"])
    assert (grew[~before["active"]] == 0).all()
    cols = torch.arange(width, device=DEVICE)[None, :]
    untouched = (cols < before["generated"][:, None]) | (cols >= after["generated"][:, None])
    assert torch.equal(after["out"][:, :width][untouched], before["out"][:, :width][untouched])


@needs_kernel
@pytest.mark.parametrize("batch,gamma", [(1, 1), (5, 3), (16, 3), (33, 4), (7, 7)])
@pytest.mark.parametrize("eos", [[-1], [3], [3, 7, 11]], ids=["none", "one", "three"])
def test_matches_the_torch_commit(batch: int, gamma: int, eos: list[int]) -> None:
    for seed in range(4):
        state = make_round(batch, gamma, width=9, seed=seed * 31 + batch + gamma, eos=eos)
        got, ref = run_both(state)
        assert_same(got, ref)
        assert_within_limits(state, got)


@needs_kernel
@pytest.mark.parametrize("batch,gamma", [(1, 1), (7, 3), (16, 4), (33, 2)])
def test_per_row_limits_match_the_torch_commit(batch: int, gamma: int) -> None:
    """Every row has its own limit: rows stop at different lengths, each at its own limit."""
    stopped = 0
    for seed in range(6):
        state = make_round(batch, gamma, width=11, seed=seed * 17 + batch, eos=[5], per_row_limits=True)
        got, ref = run_both(state)
        assert_same(got, ref)
        assert_within_limits(state, got)
        stopped += int((state["active"] & ~got["active"] & (got["generated"] == state["limits"])).sum())
    assert stopped > 0, "no row reached its own limit: the test does not exercise the cut"


@needs_kernel
def test_hand_checked_round() -> None:
    # Γ = 3, every limit 6; end id 9.
    state = dict(
        draft_tokens=torch.tensor([[1, 2, 3], [4, 9, 5], [6, 7, 8], [1, 1, 1]]),
        accepted=torch.tensor([3, 3, 1, 2]), nxt=torch.tensor([20, 21, 22, 23]), eos=torch.tensor([9]),
        limits=torch.tensor([6, 6, 6, 6]), out=torch.full((4, 7), -1), active=torch.tensor([True, True, True, False]),
        generated=torch.tensor([1, 0, 4, 2]), hist=torch.zeros(4, dtype=torch.int64),
        prev=torch.tensor([-5, -5, -5, -5]), cur=torch.tensor([30, 31, 32, 33]),
        seqlens=torch.tensor([10, 20, 30, 40], dtype=torch.int32))
    state["verify_tokens"] = torch.cat([state["cur"][:, None], state["draft_tokens"]], dim=1)
    state = {k: v.to(DEVICE) for k, v in state.items()}
    commit_round(**state)
    out = state["out"][:, :6].tolist()
    assert out[0] == [-1, 1, 2, 3, 20, -1]  # all four kept
    assert out[1] == [4, 9, -1, -1, -1, -1]  # cut after the end id, row done
    assert out[2] == [-1, -1, -1, -1, 6, 22]  # two kept: the limit is reached
    assert out[3] == [-1] * 6  # inactive: nothing
    assert state["generated"].tolist() == [5, 2, 6, 2]
    assert state["active"].tolist() == [True, False, False, False]
    assert state["hist"].tolist() == [0, 1, 0, 2]
    assert state["prev"].tolist() == [3, 5, 6, -5]  # verify_tokens[a]; the inactive row keeps its own
    assert state["cur"].tolist() == [20, 21, 22, 33]
    assert state["seqlens"].tolist() == [14, 22, 32, 40]


@needs_kernel
def test_hand_checked_per_row_limits() -> None:
    # Γ = 2, no end id; limits 3, 8, 2 with 1, 4, 0 generated: rows keep 2 (cut), 3 (all), 2 (cut at its limit).
    state = dict(
        draft_tokens=torch.tensor([[1, 2], [3, 4], [5, 6]]), accepted=torch.tensor([2, 2, 2]),
        nxt=torch.tensor([10, 11, 12]), eos=torch.tensor([-1]), limits=torch.tensor([3, 8, 2]),
        out=torch.full((3, 9), -1), active=torch.tensor([True, True, True]), generated=torch.tensor([1, 4, 0]),
        hist=torch.zeros(3, dtype=torch.int64), prev=torch.zeros(3, dtype=torch.int64), cur=torch.tensor([7, 8, 9]),
        seqlens=torch.tensor([5, 6, 7], dtype=torch.int32))
    state["verify_tokens"] = torch.cat([state["cur"][:, None], state["draft_tokens"]], dim=1)
    state = {k: v.to(DEVICE) for k, v in state.items()}
    commit_round(**state)
    assert state["out"][:, :8].tolist() == [[-1, 1, 2, -1, -1, -1, -1, -1], [-1, -1, -1, -1, 3, 4, 11, -1],
                                            [5, 6, -1, -1, -1, -1, -1, -1]]
    assert state["generated"].tolist() == [3, 7, 2]
    assert state["active"].tolist() == [False, True, False]
    assert state["seqlens"].tolist() == [7, 9, 9]


@needs_kernel
@pytest.mark.parametrize("batch", [1, 6, 19])
def test_gamma_zero_is_plain_decoding(batch: int) -> None:
    """Γ = 0: draft_tokens [B, 0], verify_tokens [B, 1]; the round commits nxt alone, like the reference."""
    for seed in range(3):
        state = make_round(batch, 0, width=5, seed=seed + 7 * batch, eos=[3], per_row_limits=True)
        got, ref = run_both(state)
        assert_same(got, ref)
        assert_within_limits(state, got)
        took = state["active"] & (state["generated"] < state["limits"])
        assert torch.equal(got["generated"] - state["generated"], took.long())
        rows = torch.arange(batch, device=DEVICE)[took]
        assert torch.equal(got["out"][rows, state["generated"][took]], state["nxt"][took])
        assert torch.equal(got["hist"], state["hist"] + state["active"].sum())


@needs_kernel
def test_hand_checked_gamma_zero() -> None:
    state = dict(
        draft_tokens=torch.zeros(3, 0, dtype=torch.int64), verify_tokens=torch.tensor([[4], [5], [6]]),
        accepted=torch.zeros(3, dtype=torch.int64), nxt=torch.tensor([7, 8, 9]), eos=torch.tensor([8]),
        limits=torch.tensor([4, 4, 4]), out=torch.full((3, 5), -1), active=torch.tensor([True, True, False]),
        generated=torch.tensor([0, 2, 1]), hist=torch.zeros(1, dtype=torch.int64),
        prev=torch.zeros(3, dtype=torch.int64), cur=torch.tensor([4, 5, 6]),
        seqlens=torch.tensor([10, 11, 12], dtype=torch.int32))
    state = {k: v.to(DEVICE) for k, v in state.items()}
    commit_round(**state)
    assert state["out"][:, :4].tolist() == [[7, -1, -1, -1], [-1, -1, 8, -1], [-1, -1, -1, -1]]
    assert state["generated"].tolist() == [1, 3, 1]
    assert state["active"].tolist() == [True, False, False]  # row 1 kept its end id; row 2 was inactive
    assert state["hist"].tolist() == [2]
    assert state["prev"].tolist() == [4, 5, 0] and state["cur"].tolist() == [7, 8, 6]
    assert state["seqlens"].tolist() == [11, 12, 12]


def test_input_checks_name_the_tensor() -> None:
    state = {k: v.cpu() for k, v in make_round(4, 3, 8, 0, [-1]).items()}
    with pytest.raises(ValueError, match="accepted is torch.int32"):
        commit_round(**{**state, "accepted": state["accepted"].int()})
    with pytest.raises(ValueError, match=r"hist is torch.int64 \(3,\)"):
        commit_round(**{**state, "hist": state["hist"][:3]})
    with pytest.raises(ValueError, match=r"limits is torch.int64 \(\)"):
        commit_round(**{**state, "limits": torch.tensor(8)})
    with pytest.raises(ValueError, match="out is"):
        commit_round(**{**state, "out": state["out"][:, :1]})
    with pytest.raises(ValueError, match="eos is"):
        commit_round(**{**state, "eos": torch.tensor([], dtype=torch.int64)})
    with pytest.raises(ValueError, match="contiguous"):
        commit_round(**{**state, "generated": torch.zeros(8, dtype=torch.int64)[::2]})
    with pytest.raises(TypeError, match="draft_tokens dtype"):
        commit_round(**{**state, "draft_tokens": state["draft_tokens"].int()})


def test_the_removed_arguments_are_refused() -> None:
    """max_new_tokens became limits and draft_seqlens (written every round, never read) is gone."""
    state = {k: v.cpu() for k, v in make_round(4, 3, 8, 0, [-1]).items()}
    with pytest.raises(TypeError, match="draft_seqlens"):
        commit_round(**state, draft_seqlens=torch.zeros(4, dtype=torch.int32))
    limits = state.pop("limits")
    with pytest.raises(TypeError, match="max_new_tokens"):
        commit_round(**state, max_new_tokens=int(limits[0]))


@needs_kernel
def test_use_kernel_false_runs_the_reference(monkeypatch) -> None:
    import trtllm_dustin.plugins.commit as commit_module

    def refuse(*args) -> None:
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(commit_module, "commit_round_forward", refuse)
    state = make_round(6, 3, 9, 5, [3])
    with pytest.raises(AssertionError, match="the kernel ran"):
        commit_round(**clone(state))
    got, ref = clone(state), clone(state)
    commit_round(**got, use_kernel=False)
    commit_round_ref(**ref)
    assert_same(got, ref)
    assert torch.equal(got["out"], ref["out"])  # the same code ran: the junk column too

"""The one-launch round commit against its torch reference: random verdicts, end ids inside and past the accepted
prefix, rows at the token limit, inactive rows, several end ids, odd batch sizes and Γ; plus hand-checked cases
and the input checks.

CPU: runs the Triton kernel under TRITON_INTERPRET=1; on a GPU the same tests run on CUDA tensors.
"""

import pytest
import torch

pytest.importorskip("triton")

from kernel_common import DEVICE, needs_kernel  # noqa: E402

from trtllm_dustin.plugins.commit import commit_round, commit_round_ref  # noqa: E402


def make_round(batch: int, gamma: int, width: int, seed: int, eos: list[int]) -> dict:
    gen = torch.Generator().manual_seed(seed)
    vocab = 12  # small, so end ids turn up inside rounds
    drafts = torch.randint(0, vocab, (batch, gamma), generator=gen)
    cur = torch.randint(0, vocab, (batch,), generator=gen)
    generated = torch.randint(0, width + 1, (batch,), generator=gen)
    generated[: batch // 3] = width - torch.randint(0, gamma + 1, (batch // 3,), generator=gen).clamp_max(width)
    out = torch.randint(-1, vocab, (batch, width + 1), generator=gen)
    state = dict(
        draft_tokens=drafts, verify_tokens=torch.cat([cur[:, None], drafts], dim=1),
        accepted=torch.randint(0, gamma + 1, (batch,), generator=gen),
        nxt=torch.randint(0, vocab, (batch,), generator=gen),
        eos=torch.tensor(eos), max_new_tokens=width, out=out,
        active=(torch.rand(batch, generator=gen) < 0.8) & (generated < width), generated=generated,
        hist=torch.randint(0, 50, (gamma + 1,), generator=gen), prev=torch.randint(0, vocab, (batch,), generator=gen),
        cur=cur.clone(), target_seqlens=torch.randint(1, 1000, (batch,), generator=gen, dtype=torch.int32),
        draft_seqlens=torch.zeros(batch, dtype=torch.int32))
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def run_both(state: dict) -> tuple[dict, dict]:
    ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    got = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    commit_round_ref(**ref)
    commit_round(**got)
    return got, ref


def assert_same(got: dict, ref: dict) -> None:
    width = ref["max_new_tokens"]
    for name in ("active", "generated", "hist", "prev", "cur", "target_seqlens", "draft_seqlens"):
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(got["out"][:, :width], ref["out"][:, :width])  # the last column only takes junk writes


@needs_kernel
@pytest.mark.parametrize("batch,gamma", [(1, 1), (5, 3), (16, 3), (33, 4), (7, 7)])
@pytest.mark.parametrize("eos", [[-1], [3], [3, 7, 11]], ids=["none", "one", "three"])
def test_matches_the_torch_commit(batch: int, gamma: int, eos: list[int]) -> None:
    for seed in range(4):
        state = make_round(batch, gamma, width=9, seed=seed * 31 + batch + gamma, eos=eos)
        got, ref = run_both(state)
        assert_same(got, ref)
        assert torch.equal(got["draft_seqlens"], got["target_seqlens"])


@needs_kernel
def test_hand_checked_round() -> None:
    # Γ = 3, max_new_tokens 6; end id 9.
    state = dict(
        draft_tokens=torch.tensor([[1, 2, 3], [4, 9, 5], [6, 7, 8], [1, 1, 1]]),
        accepted=torch.tensor([3, 3, 1, 2]), nxt=torch.tensor([20, 21, 22, 23]), eos=torch.tensor([9]),
        max_new_tokens=6, out=torch.full((4, 7), -1), active=torch.tensor([True, True, True, False]),
        generated=torch.tensor([1, 0, 4, 2]), hist=torch.zeros(4, dtype=torch.int64),
        prev=torch.tensor([-5, -5, -5, -5]), cur=torch.tensor([30, 31, 32, 33]),
        target_seqlens=torch.tensor([10, 20, 30, 40], dtype=torch.int32),
        draft_seqlens=torch.zeros(4, dtype=torch.int32))
    state["verify_tokens"] = torch.cat([state["cur"][:, None], state["draft_tokens"]], dim=1)
    state = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
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
    assert state["target_seqlens"].tolist() == [14, 22, 32, 40]
    assert state["draft_seqlens"].tolist() == [14, 22, 32, 40]


def test_input_checks_name_the_tensor() -> None:
    state = make_round(4, 3, 8, 0, [-1])
    state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with pytest.raises(ValueError, match="accepted is torch.int32"):
        commit_round(**{**state, "accepted": state["accepted"].int()})
    with pytest.raises(ValueError, match=r"hist is torch.int64 \(3,\)"):
        commit_round(**{**state, "hist": state["hist"][:3]})
    with pytest.raises(ValueError, match="out is"):
        commit_round(**{**state, "max_new_tokens": 9})
    with pytest.raises(ValueError, match="eos is"):
        commit_round(**{**state, "eos": torch.tensor([], dtype=torch.int64)})
    with pytest.raises(ValueError, match="contiguous"):
        commit_round(**{**state, "generated": torch.zeros(8, dtype=torch.int64)[::2]})
    with pytest.raises(TypeError, match="draft_tokens dtype"):
        commit_round(**{**state, "draft_tokens": state["draft_tokens"].int()})


@needs_kernel
def test_round_kernels_off_runs_the_reference(monkeypatch) -> None:
    import trtllm_dustin.plugins.commit as commit_module

    def refuse(*args) -> None:
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(commit_module, "commit_round_forward", refuse)
    state = make_round(6, 3, 9, 5, [3])
    with pytest.raises(AssertionError, match="the kernel ran"):
        commit_round(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    monkeypatch.setenv("TRTLLM_DUSTIN_ROUND_KERNELS", "0")
    got, ref = run_both(state)
    assert_same(got, ref)

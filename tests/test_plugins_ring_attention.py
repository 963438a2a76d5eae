"""ring_attention against a float64 oracle built as the ring drafter's module code builds its masks: rings that wrapped
around, empty rows, rows past the window, slot rows read and unread, GQA ratios, joined (strided) buffers, poisoned
outputs and poisoned rows no query may read.

CPU: runs the Triton kernel under TRITON_INTERPRET=1 on a small sweep; the full sweep needs CUDA.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels import DEVICE, TOLERANCE, needs_cuda, needs_kernel  # noqa: E402

from trtllm_dustin.plugins.ring_attention import ring_attention, ring_attention_ref  # noqa: E402


def oracle(q, keys, values, held, bound, window, slots_read):
    """float64, with the query heads' KV heads repeated and the mask written out row by row (the rules of the
    module docstring), not through ring_attention_ref's broadcasting."""
    B, S, Hq, D = q.shape
    R, Hkv, C = keys.shape[1], keys.shape[2], held.shape[1]
    k = keys.double().repeat_interleave(Hq // Hkv, dim=2)
    v = values.double().repeat_interleave(Hq // Hkv, dim=2)
    mask = torch.zeros(B, S, R, dtype=torch.bool)
    for b in range(B):
        for s in range(S):
            for r in range(R):
                if r < C:
                    p, top = int(held[b, r]), int(bound[b, s])
                    mask[b, s, r] = 0 <= p <= top and p > top - window
                else:
                    mask[b, s, r] = r - C < slots_read
    scores = torch.einsum("bshd,brhd->bhsr", q.double(), k) / D ** 0.5
    probs = scores.masked_fill(~mask[:, None].to(scores.device), float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhsr,brhd->bshd", probs, v)


def make_problem(batch, s, heads_kv, group, head_dim, dtype, window=6, ring=11, slots=4, gen_seed=0):
    """A joined buffer [B, R, 2, H_kv, D] (keys and values are strided views of it, as RingState's), rings that hold
    positions wrapped around (row = position % C) with some rows empty, and query bounds near the newest position."""
    g = torch.Generator().manual_seed(gen_seed)
    R = ring + slots
    joined = torch.randn(batch, R, 2, heads_kv, head_dim, generator=g).to(DEVICE, dtype)
    newest = torch.randint(ring, 4 * ring, (batch,), generator=g)
    positions = newest[:, None] - torch.arange(ring)  # the last C positions, newest first
    held = torch.full((batch, ring), -1, dtype=torch.long)
    held.scatter_(1, positions % ring, positions)
    held[torch.rand(batch, ring, generator=g) < 0.2] = -1  # some rows hold nothing
    bound = newest[:, None] - torch.randint(0, 3, (batch, s), generator=g)
    q = torch.randn(batch, s, heads_kv * group, head_dim, generator=g).to(DEVICE, dtype)
    return q, joined, held.to(DEVICE), bound.to(DEVICE)


def check(batch, s, heads_kv, group, head_dim, dtype, slots_read, window=6, ring=11, slots=4):
    q, joined, held, bound = make_problem(batch, s, heads_kv, group, head_dim, dtype, window=window, ring=ring,
                                          slots=slots, gen_seed=batch * 31 + s * 7 + slots_read)
    keys, values = joined[:, :, 0], joined[:, :, 1]
    ref = oracle(q.cpu(), keys.cpu(), values.cpu(), held.cpu(), bound.cpu(), window, slots_read)
    # rows no query reads are poisoned: the slot rows past slots_read, and ring rows whose position none may read
    poisoned = joined.clone()
    poisoned[:, held.shape[1] + slots_read:] = float("nan")
    stale = (held < 0) | (held > bound.max(dim=1).values[:, None]) | (held <= bound.min(dim=1).values[:, None] - window)
    poisoned[:, : held.shape[1]][stale] = float("nan")
    out = torch.full_like(q, float("nan"))
    result = ring_attention(q, poisoned[:, :, 0], poisoned[:, :, 1], held, bound, window, slots_read, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "unwritten or NaN output elements"
    rel_tol, max_tol = TOLERANCE[dtype]
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < rel_tol, f"relative error {err:.2e} >= {rel_tol:.0e}"
    worst = (out.cpu().double() - ref).abs().max() / ref.abs().max()
    assert worst < max_tol, f"max error {worst:.2e} >= {max_tol:.0e}"


# (batch, S, H_kv, group, D, dtype, slots_read, window, ring rows): S 1 (a slot step) and 5 / 8 (committed positions
# entering), slots read 0 .. all, GQA 1 / 3 / 4; rings of 11 rows (one program per pair) and of 70 (two, merged)
CPU_SHAPES = [
    (2, 1, 2, 3, 16, torch.float32, 2, 6, 11),
    (3, 5, 1, 4, 32, torch.float32, 0, 6, 11),
    (1, 8, 2, 1, 64, torch.float32, 4, 6, 11),
    (2, 1, 2, 4, 64, torch.bfloat16, 1, 6, 11),
    (2, 3, 2, 2, 16, torch.float32, 3, 50, 70),
    (3, 1, 1, 4, 32, torch.float32, 0, 64, 70),
]


@needs_kernel
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_ring_attention_matches_the_oracle(shape) -> None:
    check(*shape)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("s", [1, 8])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ring_attention_matches_the_oracle_on_the_gpu(dtype, s, group, head_dim) -> None:
    for slots_read in (0, 3):
        check(16, s, 2, group, head_dim, dtype, slots_read)
    for slots_read in (0, 7):  # the served shape: W = 256, a ring of W + Γ + 1 = 264 rows, Γ = 7 slot rows
        check(4, s, 2, group, head_dim, dtype, slots_read, window=256, ring=264, slots=7)


def test_the_reference_matches_the_oracle() -> None:
    q, joined, held, bound = make_problem(3, 4, 2, 3, 16, torch.float64)
    for slots_read in (0, 2, 4):
        ref = ring_attention_ref(q.cpu(), joined[:, :, 0].cpu(), joined[:, :, 1].cpu(), held.cpu(), bound.cpu(), 6,
                                 slots_read)
        torch.testing.assert_close(ref, oracle(q.cpu(), joined[:, :, 0].cpu(), joined[:, :, 1].cpu(), held.cpu(),
                                               bound.cpu(), 6, slots_read))


@pytest.mark.parametrize("ring", [11, 70])  # one program per pair, and two merged
@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)])
def test_a_query_that_reads_nothing_gets_zeros(kernel, ring, monkeypatch) -> None:
    """An entry that is not valid (its bound below every held position, no slot rows) reads no row: zeros, where a
    masked softmax would give NaN; the other queries are untouched by it."""
    from helpers.kernels import use_interpreter

    if DEVICE == "cpu":
        use_interpreter(monkeypatch, kernel)
    q, joined, held, bound = make_problem(2, 3, 2, 2, 16, torch.float32, ring=ring)
    bound[0, 1] = -5
    out = ring_attention(q, joined[:, :, 0], joined[:, :, 1], held, bound, 6, 0)
    assert (out[0, 1] == 0).all()
    assert out.abs().sum(dim=(-1, -2)).gt(0).sum() == 5
    ref = oracle(q.cpu(), joined[:, :, 0].cpu(), joined[:, :, 1].cpu(), held.cpu(), bound.cpu(), 6, 0)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(held=a["held"].int()), "held is torch.int32"),
    (lambda a: a.update(bound=a["bound"][:, :1]), "bound is torch.int64"),
    (lambda a: a.update(values=a["values"][:, :-1]), "values"),
    (lambda a: a.update(keys=a["keys"].half(), values=a["values"].half()), "all must be one of"),
    (lambda a: a.update(slots_read=5), "slots_read 5 within 0 .. 4"),
    (lambda a: a.update(window=0), "window 0 must be >= 1"),
    (lambda a: a.update(q=a["q"][..., :8]), "do not match q"),
    (lambda a: a.update(q=torch.zeros(2, 3, 4, 24), keys=torch.zeros(2, 15, 2, 24), values=torch.zeros(2, 15, 2, 24)),
     "head dim 24 is not supported"),
    (lambda a: a.update(q=torch.zeros(2, 9, 16, 16)), "tile rows"),
])
def test_bad_inputs_are_refused_with_the_value_and_the_limit(change, message) -> None:
    q, joined, held, bound = make_problem(2, 3, 2, 2, 16, torch.float32)
    args = dict(q=q.cpu(), keys=joined[:, :, 0].cpu(), values=joined[:, :, 1].cpu(), held=held.cpu(),
                bound=bound.cpu(), window=6, slots_read=2)
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        ring_attention(**args)

"""Speculative rejection sampling, batched with no host sync: the committed tokens are distributed exactly as
samples of the target (at each slot's own temperature and top-p).

Token i + 1 is accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the next token is drawn
from normalise(max(p_i - q_i, 0)); when all Γ are accepted it is drawn from p_Γ. In a batch that mixes greedy and
sampled slots, the greedy slots keep the greedy verdict.
"""

from __future__ import annotations

import torch

from trtllm_dustin.runtime.acceptor import Verdict
from trtllm_dustin.runtime.acceptors.greedy import greedy_accept, leading_true
from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Progress

__all__ = ["RejectionAcceptor", "rejection_accept"]


def rejection_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                     sampling: SlotSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, Γ] were sampled from draft_probs [B, Γ, V]; target_logits [B, Γ + 1, V].

    Random draws, in this order: u [B, Γ], then the residual's race [B, V] (from each slot's generator in
    per-slot mode). Returns (accepted [B], next_token [B]) for every row as if it were sampled.
    """
    B, gamma = draft_tokens.shape
    p = sampling.probs(target_logits)  # [B, Γ+1, V]
    p_x = p[:, :-1].gather(2, draft_tokens[..., None])[..., 0]  # [B, Γ]
    q_x = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    u = sampling.uniform((B, gamma))
    accepted = leading_true(u * q_x < p_x)  # u < p/q without dividing by a zero q
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    q_last = draft_probs.new_zeros(B, 1, draft_probs.shape[-1])  # q_Γ := 0
    q_next = torch.cat([draft_probs, q_last], dim=1)[rows, accepted]
    residual = (p_next - q_next).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; then any rejection had probability 0, so p itself is right.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_next)
    race = sampling.exponential(tuple(residual.shape))
    return accepted, (residual / race).argmax(dim=-1)


class RejectionAcceptor:
    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel  # the argmax kernel of the greedy slots (KernelConfig.round_kernels)

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, progress: Progress,
               sampling: SlotSampling) -> Verdict:
        if proposal.probs is None:
            raise ValueError("rejection sampling needs the draft's distributions; the proposal was greedy")
        accepted, nxt = rejection_accept(proposal.tokens, proposal.probs, target_logits, sampling)
        if not sampling.any_greedy:
            return Verdict(accepted, nxt)
        greedy_accepted, greedy_next = greedy_accept(proposal.tokens, target_logits, self.use_kernel)
        rows = sampling.greedy_rows
        return Verdict(torch.where(rows, greedy_accepted, accepted), torch.where(rows, greedy_next, nxt))

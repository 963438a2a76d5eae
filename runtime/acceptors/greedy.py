"""Greedy acceptance: draft token i + 1 stands while it equals the target's argmax after position i.

The next token is the target's argmax after the last accepted one, so the output equals plain greedy decoding.
"""

from __future__ import annotations

import torch

from trtllm_dustin.plugins.argmax import argmax_last
from trtllm_dustin.runtime.acceptor import Verdict
from trtllm_dustin.runtime.drafter import Proposal
from trtllm_dustin.runtime.sampling import SlotSampling
from trtllm_dustin.runtime.state import Progress

__all__ = ["GreedyAcceptor", "greedy_accept", "greedy_accept_ids", "leading_true"]


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, Γ] bool -> [B] int64: length of each row's leading run of True."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def greedy_accept_ids(draft_tokens: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, Γ], the target's argmax ids [B, Γ + 1] -> (accepted [B], next_token [B])."""
    accepted = leading_true(draft_tokens == target_ids[:, :-1])
    return accepted, target_ids.gather(1, accepted[:, None])[:, 0]


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor, use_kernel: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, Γ], target_logits [B, Γ + 1, V] -> (accepted [B], next_token [B])."""
    return greedy_accept_ids(draft_tokens, argmax_last(target_logits, use_kernel=use_kernel))


class GreedyAcceptor:
    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel  # the argmax kernel (KernelConfig.round_kernels)

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, progress: Progress,
               sampling: SlotSampling) -> Verdict:
        return Verdict(*greedy_accept(proposal.tokens, target_logits, self.use_kernel))

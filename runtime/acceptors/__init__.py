"""Acceptor implementations (the seam is runtime/acceptor.py)."""

from trtllm_dustin.runtime.acceptors.greedy import GreedyAcceptor, greedy_accept, greedy_accept_ids
from trtllm_dustin.runtime.acceptors.rejection import RejectionAcceptor, rejection_accept
from trtllm_dustin.runtime.acceptors.teacher_forced import TeacherForcedAcceptor

__all__ = ["GreedyAcceptor", "RejectionAcceptor", "TeacherForcedAcceptor", "greedy_accept", "greedy_accept_ids",
           "rejection_accept"]

"""The pipeline's process group: how the stages start, talk and stop.

    PipelineGroup.from_env()   torchrun's env:// contract (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL on
                               GPUs (one per LOCAL_RANK), gloo on the CPU, with a timeout on every operation
    handshake(facts)           every rank states what it was started with (engine manifest sha256, method, limits,
                               the layer split, ...); one line refuses a start whose ranks disagree, and a rank that
                               failed to start (its error travels in the handshake) stops all of them
    send / recv                point-to-point messages, matched in order per pair of ranks (NCCL ignores tags)
    report(error)              a rank that raises writes its error into the rendezvous store and closes its
                               connections, so its peers' next receive fails at once and names it; `with group:`
                               does this for whatever the block raises

Faults end in bounded time: a rank that dies closes its sockets, so its peers' pending receives fail (gloo says
"Connection closed by peer") and each peer then exits in turn, which reaches every rank; a rank that hangs is
caught by the timeout. Either way every rank raises PipelineError, naming the failed rank and its error when the
store has it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT_S", "PipelineError", "PipelineGroup", "torchrun_world"]

DEFAULT_TIMEOUT_S = 300.0  # longest wait for a peer: a whole prefill of a long prompt on the other stages fits
_ERROR_KEY = "trtllm_dustin/pipeline/error/"


class PipelineError(RuntimeError):
    """The pipeline cannot start or could not finish: a rank disagrees, failed, died or stopped answering."""


def torchrun_world() -> int:
    """Processes of this launch as torchrun (or another env:// launcher) declares them; 1 when not launched so."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class PipelineGroup:
    def __init__(self, rank: int, world: int, device: torch.device, store: dist.Store, timeout_s: float) -> None:
        self.rank, self.world, self.device, self.store, self.timeout_s = rank, world, device, store, timeout_s
        self.first, self.last = rank == 0, rank == world - 1
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends in flight and the tensors they read

    @classmethod
    def from_env(cls, device: str | torch.device | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
                 ) -> PipelineGroup:
        """Join the launch described by the environment. device: "cpu" (gloo) or "cuda" (NCCL, this process's GPU
        is cuda:LOCAL_RANK); None: cuda when available."""
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise PipelineError(f"the pipeline needs torchrun's environment ({', '.join(missing)} unset); launch it "
                                "with `torchrun --nproc-per-node N ...`")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=timeout)
        return cls(rank, world, device, store, timeout_s)

    # ---- start --------------------------------------------------------------------------------------------
    def handshake(self, facts: Mapping[str, str], error: str | None = None) -> None:
        """Every rank's facts must equal rank 0's, and no rank may have failed to start (`error`); otherwise every
        rank raises the same one-line PipelineError naming the first difference."""
        gathered: list[tuple[dict[str, str], str | None] | None] = [None] * self.world
        self._guard(lambda: dist.all_gather_object(gathered, (dict(facts), error)), "the start handshake")
        for rank, (_, failed) in enumerate(gathered):
            if failed is not None:
                raise PipelineError(f"rank {rank} could not start: {failed}")
        reference = gathered[0][0]
        for rank, (theirs, _) in enumerate(gathered):
            for key in sorted(set(reference) | set(theirs)):
                if theirs.get(key) != reference.get(key):
                    raise PipelineError(f"rank {rank} was started with {key} {theirs.get(key)}, rank 0 with "
                                        f"{reference.get(key)}; start every rank with the same command and engine")

    # ---- messages -----------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Non-blocking: the tensor is kept alive until its send completes."""
        tensor = tensor.contiguous()
        work = self._guard(lambda: dist.isend(tensor, dst, tag=tag), f"a send to rank {dst}")
        self._pending.append((work, tensor))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv(self, out: torch.Tensor, src: int, tag: int, what: str) -> torch.Tensor:
        """Blocking receive into `out` (contiguous); `what` names the message in errors."""
        self._guard(lambda: dist.irecv(out, src, tag=tag).wait(), f"{what} from rank {src}")
        return out

    def barrier(self) -> None:
        self._guard(dist.barrier, "every rank to arrive")

    def drain(self) -> None:
        """Wait for every send in flight (before the tensors they read are reused or the group closes)."""
        for work, _ in self._pending:
            self._guard(work.wait, "a send to complete")
        self._pending.clear()

    def _guard(self, op, what: str):
        try:
            return op()
        except (RuntimeError, dist.DistError) as e:
            raise PipelineError(f"rank {self.rank}: the pipeline failed while waiting for {what}: "
                                f"{self._peer_errors() or 'a peer died, was killed or stopped answering'} "
                                f"({str(e).splitlines()[0][:200]})") from e

    # ---- stop ---------------------------------------------------------------------------------------------
    def __enter__(self) -> PipelineGroup:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Leaving the block: a clean exit waits for the sends in flight and closes the group; an error is reported
        to the peers first (`report`) and then propagates."""
        if error is None:
            self.drain()
            self.close()
        else:
            self.report(error)

    def report(self, error: BaseException) -> None:
        """This rank failed: leave its error in the store for its peers, then close the group so that they stop."""
        if not isinstance(error, PipelineError):  # a PipelineError is a peer's failure seen here, already reported
            try:
                self.store.set(f"{_ERROR_KEY}{self.rank}", f"{type(error).__name__}: {error}"[:500])
            except (RuntimeError, dist.DistError):
                pass  # the store went with its host (rank 0); the peers see the closed connections alone
        self._pending.clear()
        self.close()

    def _peer_errors(self) -> str:
        """What failed ranks left in the store ('' if none did or the store is gone)."""
        found = []
        for rank in range(self.world):
            key = f"{_ERROR_KEY}{rank}"
            try:
                if rank != self.rank and self.store.check([key]):
                    found.append(f"rank {rank} failed with {self.store.get(key).decode()}")
            except (RuntimeError, dist.DistError):
                return ""
        return "; ".join(found)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

"""The decode loop: one round for every method and every caller, with three seams.

  decoder.py     Decoder: prefill slots, then draft -> estimate -> select -> verify -> accept -> commit per round
  drafter.py     the Drafter seam (drafters/: no draft, an autoregressive draft model and what it attends to)
  selector.py    the Selector seam, the verification-set policy (selectors/: full, Dustin, baselines)
  acceptor.py    the Acceptor seam (acceptors/: greedy, rejection sampling, teacher-forced)
  methods.py     the registry: a method is a (Drafter, Selector) pair (experimental/: the evaluation-only ones)
  build.py       build_runtime: the one factory of a decoder (kernels, tactics, backend, caches, the method's pair)
  inflight.py    in-flight batching over a Decoder's slots
  pipeline/      the same round over pipeline stages (torchrun): decoder.py (PipelineDecoder), stage.py (one rank's
                 layers), selection.py (which methods split, Dustin's S_target per stage), group.py (the
                 process group, start handshake, faults)
  state.py, sampling.py, generation.py, prefill.py, cuda_graph.py, phase_timer.py
"""

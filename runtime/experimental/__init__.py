"""Evaluation-only methods and selectors: measured by benchmarks/eval_quality.py, the benchmarks and the tests, never
offered and never imported by production (generate, serving, build).

Importing this package adds its methods to the registry (runtime/methods.py METHODS), with offered=False:

  methods.py    the evaluation-only methods (oracles, Dustin-H variants, in-pass variants, Dustin-H over LongSpark)
  oracle.py     OracleSelector: the top k by the target's true attention, from an extra full pass per round
  periodic.py   PeriodicFullVerification: every n-th round verifies in full (decided on the host)
  full_feed.py  FullPassFeed: the ring drafter under in-pass selection, fed an extra full pass's hidden states
"""

from trtllm_dustin.runtime.experimental.full_feed import FullFedRingDrafting, FullPassFeed
from trtllm_dustin.runtime.experimental.methods import EXPERIMENTAL_METHODS
from trtllm_dustin.runtime.experimental.oracle import ORACLE_KINDS, LayerSets, OracleSelector, attention_mass, top_k_set
from trtllm_dustin.runtime.experimental.periodic import PeriodicFullVerification

__all__ = ["EXPERIMENTAL_METHODS", "ORACLE_KINDS", "FullFedRingDrafting", "FullPassFeed", "LayerSets", "OracleSelector",
           "PeriodicFullVerification", "attention_mass", "top_k_set"]

"""The evaluation-only methods, registered into runtime/methods.py's METHODS (not offered) when this module is
imported. Each was measured against the offered ones (docs/results.md) and not kept: the oracle ceilings and three
changes to Dustin-H measured against them at equal k (issue 24), Dustin-H with an input-aware m, two in-pass
variants (issue 35), Dustin-H over the LongSpark drafter, and the ring drafter's in-pass selection fed a full pass's
hidden states (issue 38; the ring methods themselves are offered)."""

from __future__ import annotations

from trtllm_dustin.runtime.cuda_graph import PhaseGraphs
from trtllm_dustin.runtime.drafter import Drafter
from trtllm_dustin.runtime.experimental.full_feed import FullFedRingDrafting, FullPassFeed
from trtllm_dustin.runtime.experimental.oracle import OracleSelector
from trtllm_dustin.runtime.experimental.periodic import PeriodicFullVerification
from trtllm_dustin.runtime.methods import (
    FULL_DRAFT,
    Method,
    MethodSetup,
    SelectorFactory,
    baseline_budget,
    dustin_longspark_selector,
    dustin_selector,
    in_pass_selector,
    longspark_drafter,
    register_methods,
)
from trtllm_dustin.runtime.selector import Selector

__all__ = ["EXPERIMENTAL_METHODS", "HISTORY_DECAY", "IN_PASS_LOOKAHEAD_SHARE", "PERIODIC_EVERY"]


def _periodic(every: int) -> SelectorFactory:
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        return PeriodicFullVerification(dustin_selector("h")(setup, drafter), every)
    return build


def _oracle(kind: str) -> SelectorFactory:
    def build(setup: MethodSetup, drafter: Drafter) -> Selector:
        return OracleSelector(kind, baseline_budget(setup)[0], setup.target, setup.target_cache, setup.backend,
                              drafter.tokens)
    return build


HISTORY_DECAY = 0.9  # dustin-h-accum: the running sum's decay per round (a memory of about 10 rounds, 25 tokens)
PERIODIC_EVERY = 4  # dustin-h-periodic: one round in 4 verifies in full
IN_PASS_LOOKAHEAD_SHARE = 0.25  # dustin-ip-la: the share of the free slots the draft's lookahead takes


def _full_fed_ring_drafter(setup: MethodSetup, graphs: PhaseGraphs) -> Drafter:
    return FullFedRingDrafting(setup.ring, setup.target_cache.batch_slots, setup.gamma, graphs,
                               setup.kernels.round_kernels)


def _full_pass_feed(setup: MethodSetup, drafter: Drafter) -> Selector:
    return FullPassFeed(in_pass_selector()(setup, drafter), setup.target, setup.target_cache, setup.backend, drafter)


EXPERIMENTAL_METHODS: dict[str, Method] = {
    "dustin-h-adaptive": Method(FULL_DRAFT, dustin_selector("h", adaptive=True),
                                "Dustin-H with m from the draft's confidence (evaluation only)", needs_dustin=True,
                                sparse=True, offered=False),
    # Closing Dustin's gap to full verification (issue 24; evaluation only, benchmarks/eval_quality.py): the oracle
    # ceilings, and three changes to Dustin-H measured against it at equal k.
    "oracle": Method(FULL_DRAFT, _oracle("all"), "the top k by the target's true attention of the round's queries "
                     "(an extra full pass; evaluation only)", sparse=True, offered=False, eager_only=True),
    "oracle-layer": Method(FULL_DRAFT, _oracle("layer"), "the oracle with a set per layer (evaluation only)",
                           sparse=True, offered=False, eager_only=True),
    "oracle-kv-head": Method(FULL_DRAFT, _oracle("kv-head"), "the oracle with a set per KV head (evaluation only)",
                             sparse=True, offered=False, eager_only=True),
    "dustin-h-accum": Method(FULL_DRAFT, dustin_selector("h", history_decay=HISTORY_DECAY),
                             f"Dustin-H whose S_target sums the committed tokens' attention over rounds (decay "
                             f"{HISTORY_DECAY}; evaluation only)", needs_dustin=True, sparse=True, offered=False),
    "dustin-h-kv-head": Method(FULL_DRAFT, dustin_selector("h", per_kv_head=True),
                               "Dustin-H with a set per KV head (evaluation only)", needs_dustin=True, sparse=True,
                               offered=False),
    "dustin-h-periodic": Method(FULL_DRAFT, _periodic(PERIODIC_EVERY),
                                f"Dustin-H verifying every {PERIODIC_EVERY}th round in full (evaluation only)",
                                needs_dustin=True, sparse=True, offered=False, eager_only=True),
    "dustin-ip-la": Method(FULL_DRAFT, in_pass_selector(lookahead_share=IN_PASS_LOOKAHEAD_SHARE),
                           f"in-pass selection beside the draft's lookahead (m = {IN_PASS_LOOKAHEAD_SHARE:g} of the "
                           "free slots; evaluation only)", needs_dustin=True, sparse=True, offered=False),
    "dustin-ip-dense": Method(FULL_DRAFT, in_pass_selector(dense=True), "in-pass selection with the layers before the "
                              "selection layer verified in full (evaluation only)", needs_dustin=True, sparse=True,
                              offered=False),
    "dustin-h-longspark": Method(longspark_drafter, dustin_longspark_selector("h"), "LongSpark draft, Dustin-H sparse "
                                 "verification (lookahead scored on the target's keys; evaluation only: it did not "
                                 "beat Dustin-T)", needs_draft=False, needs_longspark=True, needs_dustin=True,
                                 sparse=True, offered=False),
    "dustin-ip-ring-full-feed": Method(_full_fed_ring_drafter, _full_pass_feed, "dustin-ip-ring whose drafter reads "
                                       "the hidden states of an extra full pass instead of the sparse verification's "
                                       "(evaluation only: issue 38)", needs_draft=False, needs_ring=True,
                                       needs_dustin=True, sparse=True, offered=False),
}
register_methods(EXPERIMENTAL_METHODS)

"""One registry of methods for every caller: the CLI, the model repository, the serving engine, the quality evaluation
and the benchmarks read runtime/methods.py, and each entry's flags say what building it needs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.speculative import DTYPE, dustin_config

from trtllm_dustin.attention import get_backend
from trtllm_dustin.cli import build_parser
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import random_longspark
from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS, MethodSetup, build_decoder
from trtllm_dustin.serving import ServingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# The registry's names written out here, not read from runtime/methods.py, so that the callers are compared with an
# expectation of their own: a method added, removed or re-flagged there must be added, removed or moved here too.
REGISTERED = ("vanilla", "classic", "magicdec", "dustin-h", "dustin-t", "dustin-d", "dustin-h-sparse-draft",
              "streamingllm", "snapkv", "quest", "dustin-h-adaptive", "oracle", "oracle-layer", "oracle-kv-head",
              "dustin-h-accum", "dustin-h-kv-head", "dustin-h-periodic", "dustin-ip", "dustin-ip-pages",
              "dustin-ip-sparse-draft", "dustin-ip-la", "dustin-ip-dense", "longspark", "dustin-h-longspark",
              "dustin-t-longspark", "dustin-ip-longspark")
EVALUATION_ONLY = {"dustin-h-adaptive", "oracle", "oracle-layer", "oracle-kv-head", "dustin-h-accum",
                   "dustin-h-kv-head", "dustin-h-periodic", "dustin-ip-la", "dustin-ip-dense", "dustin-h-longspark"}
OFFERED = tuple(name for name in REGISTERED if name not in EVALUATION_ONLY)


def _choices(argv_prefix: list[str], option: str) -> tuple[str, ...]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv_prefix[0]]
    return tuple(next(a for a in sub._actions if option in a.option_strings).choices)


def test_the_cli_offers_exactly_the_offered_methods() -> None:
    assert _choices(["generate"], "--method") == OFFERED
    assert _choices(["triton-repo"], "--method") == OFFERED
    assert OFFERED_METHODS == OFFERED and "vanilla" in OFFERED_METHODS
    assert {name for name, m in METHODS.items() if not m.offered} == EVALUATION_ONLY


def test_the_serving_config_takes_every_offered_method_and_no_other() -> None:
    config = ServingConfig(model="preset:tiny-llama", draft="preset:tiny-llama-draft", longspark="random",
                           methods=OFFERED_METHODS, dustin=dustin_config(budget=40, m=4))
    assert ServingConfig.from_json(config.to_json()) == config
    for name, method in METHODS.items():
        if not method.offered:
            with pytest.raises(ConfigError, match=f"{name}.*unknown"):
                ServingConfig(model="preset:tiny-llama", draft="preset:tiny-llama-draft", methods=(name,),
                              dustin=dustin_config(budget=40, m=4))


def test_eval_quality_accepts_every_registered_method() -> None:
    import eval_quality

    assert set(eval_quality.DEFAULT_METHODS) <= set(METHODS)
    methods = next(a for a in eval_quality.build_parser()._actions if "--methods" in a.option_strings)
    assert list(methods.choices) == list(REGISTERED) == list(METHODS)


@pytest.mark.parametrize("name", list(METHODS))
def test_each_entry_says_what_it_needs(name: str) -> None:
    method = METHODS[name]
    target = load_model("preset:tiny-llama", dtype=DTYPE, seed=7).model
    draft = load_model("preset:tiny-llama-draft", dtype=DTYPE, seed=8).model

    def setup(**changes) -> MethodSetup:
        base = dict(target=target, target_cache=KVCache.allocate(target.config, 2, 64, DTYPE, "cpu"),
                    backend=get_backend("reference"), draft=draft,
                    draft_cache=KVCache.allocate(draft.config, 2, 64, DTYPE, "cpu"), dustin=dustin_config(40, 4),
                    longspark=random_longspark(target, seed=1))
        return MethodSetup(**{**base, **changes})

    decoder = build_decoder(name, setup())
    assert decoder.name == name and (decoder.gamma > 0) == method.speculative
    assert (decoder.selector.budget is not None) == method.sparse
    if method.needs_draft:
        with pytest.raises(ConfigError, match="needs a draft model; pass --draft"):
            build_decoder(name, setup(draft=None, draft_cache=None))
    else:
        assert build_decoder(name, setup(draft=None, draft_cache=None)).gamma == (3 if method.needs_longspark else 0)
    if method.needs_longspark:
        with pytest.raises(ConfigError, match="needs a LongSpark drafter; pass --longspark"):
            build_decoder(name, setup(longspark=None))
    else:
        assert build_decoder(name, setup(longspark=None)).name == name
    if method.needs_dustin:
        with pytest.raises(ConfigError, match="trtllm-dustin search"):
            build_decoder(name, setup(dustin=None))
    else:
        assert build_decoder(name, setup(dustin=None)).name == name


def test_an_unknown_method_names_the_choices() -> None:
    target = load_model("preset:tiny-llama", dtype=DTYPE, seed=7).model
    setup = MethodSetup(target=target, target_cache=KVCache.allocate(target.config, 1, 16, DTYPE, "cpu"),
                        backend=get_backend("reference"))
    with pytest.raises(ConfigError, match="'medusa' is unknown; choose one of vanilla, classic"):
        build_decoder("medusa", setup)
    assert torch.equal(setup.target_cache.seqlens, torch.zeros(1, dtype=torch.int32))  # nothing was built

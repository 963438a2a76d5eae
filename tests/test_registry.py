"""One registry of methods for every caller: the CLI, the model repository, the serving engine, the quality evaluation
and the benchmarks read runtime/methods.py, and each entry's flags say what building it needs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.registry import EXPERIMENTAL, OFFERED, REGISTERED
from helpers.speculative import DTYPE, dustin_config

import trtllm_dustin.runtime.experimental  # noqa: F401  (the evaluation-only methods join METHODS)
from trtllm_dustin.attention import get_backend
from trtllm_dustin.cli import build_parser
from trtllm_dustin.config import ConfigError
from trtllm_dustin.kv_cache import KVCache
from trtllm_dustin.models import load_model
from trtllm_dustin.models.longspark import random_longspark
from trtllm_dustin.models.ring_drafter import RingDrafterConfig, random_ring_drafter
from trtllm_dustin.runtime.build import build_decoder
from trtllm_dustin.runtime.methods import METHODS, OFFERED_METHODS, MethodSetup
from trtllm_dustin.serving import ServingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))



def _choices(argv_prefix: list[str], option: str) -> tuple[str, ...]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv_prefix[0]]
    return tuple(next(a for a in sub._actions if option in a.option_strings).choices)


def test_the_cli_offers_exactly_the_offered_methods() -> None:
    assert _choices(["generate"], "--method") == OFFERED
    assert _choices(["triton-repo"], "--method") == OFFERED
    assert OFFERED_METHODS == OFFERED and "vanilla" in OFFERED_METHODS
    assert tuple(name for name, m in METHODS.items() if not m.offered) == EXPERIMENTAL


def test_production_never_imports_the_experimental_registry() -> None:
    """generate, serving and build import neither runtime/experimental/ nor its methods: a fresh process holds the
    offered methods alone."""
    import subprocess

    code = ("import sys\n"
            "import trtllm_dustin.build_engines.engine, trtllm_dustin.cli, trtllm_dustin.serving.engine\n"
            "from trtllm_dustin.runtime.methods import METHODS\n"
            "print(list(METHODS), [m for m in sys.modules if m.startswith('trtllm_dustin.runtime.experimental')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{list(OFFERED)} []"


def test_the_serving_config_takes_every_offered_method_and_no_other() -> None:
    config = ServingConfig(model="preset:tiny-llama", draft="preset:tiny-llama-draft", longspark="random",
                           ring="random", methods=OFFERED_METHODS, dustin=dustin_config(budget=40, m=4))
    assert ServingConfig.from_json(config.to_json()) == config
    for name in EXPERIMENTAL:
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
                    longspark=random_longspark(target, seed=1),
                    ring=random_ring_drafter(target, RingDrafterConfig((0, 1), (0, 2), window=8, block=4)))
        return MethodSetup(**{**base, **changes})

    decoder = build_decoder(name, setup())
    assert decoder.name == name and (decoder.gamma > 0) == method.speculative
    assert (decoder.selector.budget is not None) == method.sparse
    if method.needs_draft:
        with pytest.raises(ConfigError, match="needs a draft model; pass --draft"):
            build_decoder(name, setup(draft=None, draft_cache=None))
    else:
        assert build_decoder(name, setup(draft=None, draft_cache=None)).gamma == \
            (3 if method.needs_longspark or method.needs_ring else 0)
    if method.needs_longspark:
        with pytest.raises(ConfigError, match="needs a LongSpark drafter; pass --longspark"):
            build_decoder(name, setup(longspark=None))
    else:
        assert build_decoder(name, setup(longspark=None)).name == name
    if method.needs_ring:
        with pytest.raises(ConfigError, match="needs a ring drafter; pass --ring"):
            build_decoder(name, setup(ring=None))
    else:
        assert build_decoder(name, setup(ring=None)).name == name
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


def test_build_runtime_allocates_what_the_method_reads_and_decodes_as_build_decoder() -> None:
    """The factory sizes the caches as asked, gives a draft cache only to methods that draft with a model, refuses a
    missing draft before it allocates anything, and its decoder decodes what a hand-built MethodSetup's decodes."""
    from trtllm_dustin.runtime.build import build_runtime
    from trtllm_dustin.runtime.generation import GenerationConfig

    target = load_model("preset:tiny-llama", dtype=DTYPE, seed=7).model
    draft = load_model("preset:tiny-llama-draft", dtype=DTYPE, seed=8).model
    vanilla = build_runtime("vanilla", target, draft=draft, batch_slots=3, max_seq_len=48, dtype=DTYPE)
    assert (vanilla.cache.batch_slots, vanilla.cache.max_seq_len, vanilla.cache.k.dtype) == (3, 48, DTYPE)
    assert vanilla.gamma == 0 and vanilla.backend.name == "reference"
    classic = build_runtime("classic", target, draft=draft, batch_slots=2, max_seq_len=40, dtype=DTYPE, gamma=2)
    dcache = classic.drafter.cache
    assert (dcache.batch_slots, dcache.max_seq_len, dcache.k.dtype, classic.gamma) == (2, 40, DTYPE, 2)
    with pytest.raises(ConfigError, match="needs a draft model; pass --draft"):
        build_runtime("classic", target, batch_slots=2, max_seq_len=-1, dtype=DTYPE)  # refused before allocating
    by_hand = build_decoder("classic", MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, 2, 40, DTYPE, "cpu"),
        backend=get_backend("reference"), draft=draft, draft_cache=KVCache.allocate(draft.config, 2, 40, DTYPE, "cpu"),
        gamma=2))
    prompts, config = [[5, 9, 2, 7], [3, 1]], GenerationConfig(max_new_tokens=10)
    assert classic.generate(prompts, config).tokens == by_hand.generate(prompts, config).tokens

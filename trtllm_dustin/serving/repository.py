"""Writes a Triton model repository: `<out>/<name>/config.pbtxt`, `1/model.py`, `1/serving_config.json`."""

from __future__ import annotations

from pathlib import Path

from trtllm_dustin.serving.config import ServingConfig
from trtllm_dustin.serving.triton_model import INPUTS, OUTPUTS

__all__ = ["MODEL_PY", "config_pbtxt", "write_model_repository"]

MODEL_PY = '''"""Written by `trtllm-dustin triton-repo`; the model itself lives in the installed trtllm_dustin."""

import sys
from pathlib import Path

# The Python backend stub of Triton 2.51 (nvidia-pytriton 0.7.0) garbles BYTES tensors under numpy 2. Where the
# environment has numpy 2, a numpy 1.x installed with `pip install --target $VIRTUAL_ENV/triton-site
# numpy==1.26.4` goes first on this process's path (the stub ignores PYTHONPATH); see docs/serving.md.
# scikit-learn and SciPy builds for numpy 2 cannot load beside that numpy 1.x; the server never needs them, so they
# are marked absent here (transformers then skips its optional sklearn import instead of failing on it).
_SITE = Path(sys.prefix) / "triton-site"
if _SITE.is_dir():
    sys.path.insert(0, str(_SITE))
    for _name in ("sklearn", "scipy"):
        sys.modules.setdefault(_name, None)

from trtllm_dustin.serving.triton_model import TritonPythonModel  # noqa: E402

__all__ = ["TritonPythonModel"]
'''


def _tensor(name: str, data_type: str, dims: list[int], optional: bool = False) -> str:
    lines = [f'    name: "{name}"', f"    data_type: {data_type}", f"    dims: [ {', '.join(map(str, dims))} ]"]
    if optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def config_pbtxt(name: str, config: ServingConfig) -> str:
    """The model configuration: Python backend, one CPU-kind instance (the engine owns the device), batch dimension
    of `max_batch` so Triton's dynamic batcher hands several requests to one execute() call."""
    inputs = ",\n".join(_tensor(n, t, d, o) for n, (t, d, o) in INPUTS.items())
    outputs = ",\n".join(_tensor(n, t, d) for n, (t, _, d, _) in OUTPUTS.items())
    return f"""name: "{name}"
backend: "python"
max_batch_size: {config.max_batch}
model_transaction_policy {{
  decoupled: {"true" if config.decoupled else "false"}
}}
dynamic_batching {{ }}
input [
{inputs}
]
output [
{outputs}
]
instance_group [
  {{
    count: 1
    kind: KIND_CPU
  }}
]
parameters {{
  key: "default_method"
  value: {{ string_value: "{config.method}" }}
}}
"""


def write_model_repository(out_dir: str | Path, config: ServingConfig, name: str = "dustin") -> Path:
    """Write (or overwrite) model `name` into the repository `out_dir`; other models there are left alone.

    Returns the model's directory. Call it twice with different names to serve, e.g., a decoupled (streaming)
    and a non-decoupled model from one server."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"model name {name!r} must be a plain directory name")
    model_dir = Path(out_dir) / name
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(name, config))
    (version_dir / "model.py").write_text(MODEL_PY)
    (version_dir / "serving_config.json").write_text(config.to_json() + "\n")
    return model_dir

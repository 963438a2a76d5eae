"""The largest |together - alone| of test_batched_prefill's K and logits on this GPU (run from the repository root).

What ran on the H200 was this file with the same statements, before it was reformatted for the linter."""

import sys

import torch

sys.path.insert(0, "tests")
import test_batched_prefill as t  # noqa: E402

from trtllm_dustin.attention import get_backend  # noqa: E402
from trtllm_dustin.kv_cache import KVCache  # noqa: E402

for name, dtype in (("reference", torch.float64), ("reference", torch.float32), ("triton", torch.float32)):
    model, backend, prompts = t._model(dtype), get_backend(name), t._prompts()
    alone = KVCache.allocate(model.config, 4, t.MAX_LEN, dtype, t.DEVICE)
    solo = []
    for slots, which, _ in t.JOBS:
        j = t._job(model, alone, backend, [prompts[i] for i in which], slots, 0)
        j.run()
        solo.append(j)
    tog = KVCache.allocate(model.config, 4, t.MAX_LEN, dtype, t.DEVICE)
    tog.k[:, 1, :, :16], tog.v[:, 1, :, :16] = alone.k[:, 1, :, :16], alone.v[:, 1, :, :16]
    jobs = [t._job(model, tog, backend, [prompts[i] for i in w], s, st) for s, w, st in t.JOBS]
    while not all(j.finished for j in jobs):
        t.step_together([j for j in jobs if not j.finished])
    lens = [len(p) for p in prompts]
    dk = max(float((tog.k[:, b, :, :n] - alone.k[:, b, :, :n]).abs().max()) for b, n in enumerate(lens))
    per_pos = [(tog.k[:, 0, :, :37] - alone.k[:, 0, :, :37]).abs().amax(dim=(0, 1, 3))]
    dl = max(float((j.last_logits - s.last_logits).abs().max()) for s, j in zip(solo, jobs, strict=True))
    print(name, dtype, "k", dk, "logits", dl, "slot0 per position", [f"{x:.1e}" for x in per_pos[0].tolist()])

"""Static, preallocated KV cache shared by every decode loop and every attention backend.

Layout, fixed because the kernels in `trtllm_dustin.plugins` read it directly:

    k, v: [num_layers, batch_slots, num_kv_heads, max_seq_len, head_dim], head_dim contiguous
    seqlens: int32 [batch_slots], each slot's committed length L_b

Per layer and KV head a sequence's keys are one contiguous [max_seq_len, head_dim] block, so
full attention streams positions [0, L_b), an index set I reads rows I (a 256-byte row at d=128,
bf16), and sinks + a recent window are two contiguous ranges. New tokens of a forward pass are
written at positions L_b .. L_b+T-1 before attention runs; `seqlens` advances only when the caller
commits them, so rejected speculative tokens are simply overwritten later.

dtype is the model's (bf16 / fp16 / fp32) or float8_e4m3fn, which halves a step's cache reads: values are stored
saturated at +-448 and every reader upcasts them to its query's dtype (`trtllm_dustin.plugins.kv_dtype`). Meant for
a speculative draft's cache, whose precision moves only the acceptance rate, never the target's verdicts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trtllm_dustin.config import ModelConfig
from trtllm_dustin.plugins.kv_dtype import to_cache_dtype

__all__ = ["KVCache", "MemoryPlanError", "available_memory", "check_fits"]


class MemoryPlanError(RuntimeError):
    """The requested weights + cache will not fit in the device's free memory."""


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device` (free device memory, or available host RAM).

    On CUDA, the blocks torch's caching allocator holds but no tensor uses count as free: the driver reports them as
    taken, and a process that frees one batch's caches before allocating the next would otherwise see its free memory
    shrink batch after batch."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "meta":
        return 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(what: str, needed: int, device: torch.device, headroom: float = 0.9,
               fix: str = "lower --batch-size or --max-seq-len") -> None:
    """Raise MemoryPlanError before allocating when `needed` bytes exceed `headroom` of what is free; `fix` names
    the caller's own flags."""
    free = available_memory(device)
    if needed > headroom * free:
        raise MemoryPlanError(
            f"{what} needs {needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free on {device} "
            f"({headroom:.0%} usable); {fix}, or use a larger device")


@dataclass
class KVCache:
    """Preallocated K/V buffers for `batch_slots` sequences of up to `max_seq_len` tokens."""

    k: torch.Tensor  # [num_layers, B, H_kv, S_max, D]
    v: torch.Tensor  # [num_layers, B, H_kv, S_max, D]
    seqlens: torch.Tensor  # int32 [B]: committed tokens per slot

    @staticmethod
    def nbytes_for(config: ModelConfig, batch_slots: int, max_seq_len: int, dtype: torch.dtype) -> int:
        """Bytes that `allocate` would take, for planning before any allocation."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.kv_bytes_per_token(itemsize) * batch_slots * max_seq_len

    @classmethod
    def allocate(cls, config: ModelConfig, batch_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str, check_memory: bool = True) -> KVCache:
        device = torch.device(device)
        if batch_slots < 1:
            raise ValueError(f"batch_slots={batch_slots} must be >= 1")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 1")
        if check_memory:
            check_fits(f"KV cache ({batch_slots} x {max_seq_len} tokens, {config.name})",
                       cls.nbytes_for(config, batch_slots, max_seq_len, dtype), device)
        shape = (config.num_layers, batch_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        return cls(
            # Zeroed, not empty: masked-out V rows still meet a zero softmax weight, and 0 * NaN is NaN.
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            seqlens=torch.zeros(batch_slots, dtype=torch.int32, device=device),
        )

    @property
    def batch_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, [B, H_kv, S_max, D] views."""
        return self.k[index], self.v[index]

    def write(self, index: int, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor) -> None:
        """Store new keys/values k_new, v_new [B, T, H_kv, D] at positions [B, T] of layer `index`."""
        k_layer, v_layer = self.layer(index)
        batch = torch.arange(k_new.shape[0], device=k_new.device)[:, None]  # [B, 1]
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [B, T, H_kv, D].
        k_layer[batch, :, positions] = to_cache_dtype(k_new, k_layer.dtype)
        v_layer[batch, :, positions] = to_cache_dtype(v_new, v_layer.dtype)

    def reset(self) -> None:
        self.seqlens.zero_()

"""Prefix caching: prompts that start with a prefix already prefilled reuse its K/V instead of computing it again.

Long-context users send the same long document with different questions. The cache keeps the K/V of prompt
prefixes in blocks of `block` tokens, keyed by a hash chain (block i's key digests block i - 1's key and block i's
token ids, so equal keys mean equal token prefixes), for every cache a slot's prefill writes: the target's, and a
model drafter's own (`SlotPrefill.caches`).

    match(prompt)        the keys of the longest run of cached blocks the prompt starts with, leaving at least its
                         last token to prefill (its forward gives the first token's logits and the last token's
                         queries and hidden states that the drafter's and selector's prompt-time hooks read)
    load(keys, caches)   copy those blocks into a slot's caches (device copies: no forward)
    store(prompt, caches) after a slot's prefill completes, keep the blocks of its prompt not held yet

Everything else a method keeps per prompt (Dustin's target history, Quest's and the in-pass pages, SnapKV's window
scores, LongSpark's boundary state and summary) is computed by the prompt-time hooks from the cache and the last
token's forward, which run as for a cold prefill: a prompt that reuses a prefix gets the state a cold prefill gives.

Memory: at most `max_bytes` of blocks, least recently used evicted first. A chain's blocks are touched deepest first,
so its root is the most recent and eviction takes the leaves of the least recently used chains before their roots
(a block whose parent is gone could never be matched).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from trtllm_dustin.kv_cache import KVCache

__all__ = ["PrefixCache"]

_ROOT = b"trtllm-dustin prefix v1"


class PrefixCache:
    def __init__(self, max_bytes: int, block: int = 256) -> None:
        if block < 1:
            raise ValueError(f"prefix cache block={block} must be >= 1 token")
        if max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes={max_bytes} must be >= 0")
        self.max_bytes, self.block = int(max_bytes), int(block)
        # key -> one (k, v) pair per cache, each [num_layers, H_kv, block, D]
        self._blocks: OrderedDict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.nbytes = 0
        self.reused_tokens = 0  # prompt tokens served from the cache (load)
        self.stored_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The hash chain of the prompt's full blocks."""
        ids = np.asarray(prompt, dtype=np.int64)
        keys, key = [], _ROOT
        for i in range(len(ids) // self.block):
            key = hashlib.blake2b(key + ids[i * self.block:(i + 1) * self.block].tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def match(self, prompt: Sequence[int], prefilled: int = 1) -> list[bytes]:
        """Keys of the cached blocks the prompt starts with, marked as just used; they leave at least the prompt's
        last `prefilled` positions (>= 1: its last token is always prefilled) to the prefill, which computes the
        hidden states a drafter reads there (the ring drafter's window)."""
        keys = self.keys(prompt[: len(prompt) - max(1, prefilled)])
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        self._touch(keys[:n])
        return keys[:n]

    def load(self, keys: Sequence[bytes], caches: Sequence[KVCache]) -> int:
        """Copy the blocks into positions [0, len(keys) * block) of single-slot caches; return that token count."""
        _check_single(caches)
        for i, key in enumerate(keys):
            entry = self._blocks[key]
            if len(entry) != len(caches):
                raise ValueError(f"the prefix cache holds {len(entry)} caches per block, {len(caches)} given")
            for (dst_k, dst_v), (k, v) in zip(_rows(caches, i * self.block, self.block), entry, strict=True):
                dst_k.copy_(k)
                dst_v.copy_(v)
        self.reused_tokens += len(keys) * self.block
        return len(keys) * self.block

    def store(self, prompt: Sequence[int], caches: Sequence[KVCache]) -> None:
        """Keep the prompt's full blocks (positions [0, len(prompt)) of single-slot caches, just prefilled) that are
        not held yet, evicting the least recently used blocks to stay within max_bytes."""
        _check_single(caches)
        keys = self.keys(prompt)
        self._touch(keys)  # the blocks held already are this chain's: the least recently used go first
        mine = set(keys)
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            views = _rows(caches, i * self.block, self.block)
            size = _nbytes(views)
            while self.nbytes + size > self.max_bytes and self._blocks and next(iter(self._blocks)) not in mine:
                self._evict()
            if self.nbytes + size > self.max_bytes:
                break  # only this chain's own blocks are left to evict: keep its prefix, drop its tail
            self._blocks[key] = [(k.clone(), v.clone()) for k, v in views]
            self.nbytes += size
            self.stored_blocks += 1
        self._touch(keys)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def _touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # deepest first: the chain's root ends most recent
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self) -> None:
        _, entry = self._blocks.popitem(last=False)
        self.nbytes -= _nbytes(entry)
        self.evicted_blocks += 1


def _check_single(caches: Sequence[KVCache]) -> None:
    for cache in caches:
        if cache.batch_slots != 1:
            raise ValueError(f"prefix cache copies take one slot's caches (slot_range), not {cache.batch_slots} "
                             "slots")


def _rows(caches: Sequence[KVCache], start: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Positions [start, start + n) of each single-slot cache: (k, v) views [num_layers, H_kv, n, D]."""
    return [(c.k[:, 0, :, start:start + n], c.v[:, 0, :, start:start + n]) for c in caches]


def _nbytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs)

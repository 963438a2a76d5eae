"""The method registry as the tests expect it, written out here and not read from runtime/methods.py, so that the
registry and its callers are compared with an expectation of their own: a method added, removed or re-flagged there
must be added, removed or moved here too."""

from __future__ import annotations

__all__ = ["EXPERIMENTAL", "OFFERED", "REGISTERED"]

# Production's registry (runtime/methods.py), every one offered, in its order.
OFFERED = ("vanilla", "classic", "magicdec", "dustin-h", "dustin-t", "dustin-d", "dustin-h-sparse-draft",
           "streamingllm", "snapkv", "quest", "dustin-ip", "dustin-ip-pages", "dustin-ip-sparse-draft", "longspark",
           "dustin-t-longspark", "dustin-ip-longspark", "ring", "dustin-ip-ring")
# The evaluation-only methods that runtime/experimental/ adds, in its order.
EXPERIMENTAL = ("dustin-h-adaptive", "oracle", "oracle-layer", "oracle-kv-head", "dustin-h-accum", "dustin-h-kv-head",
                "dustin-h-periodic", "dustin-ip-la", "dustin-ip-dense", "dustin-h-longspark",
                "dustin-ip-ring-full-feed")
# The registry once runtime/experimental/ is imported.
REGISTERED = OFFERED + EXPERIMENTAL

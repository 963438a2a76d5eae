"""Give a ring drafter a subset head: write head_ids.safetensors into its directory (load_ring_drafter applies it).

The ids come from a packaged or trained AR draft's own subset head (its checkpoint's `dustin.head_ids`), so that the
ring drafter proposes from exactly the ids the AR draft baseline proposes from; or, with --tokens, the --count most
frequent ids of a token file from `trtllm-dustin prepare-distill-data` (plus the target's special ids).

    python benchmarks/dev/ring_head_ids.py --ring trtllm_dustin/weights/smollm2_ring --draft-dir \\
        trtllm_dustin/weights/smollm2_draft
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from trtllm_dustin.models.loading import HEAD_IDS
from trtllm_dustin.models.ring_drafter import HEAD_IDS_FILE, save_head_ids
from trtllm_dustin.training.distill import frequent_ids


def draft_head_ids(directory: Path) -> torch.Tensor:
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if HEAD_IDS in f.keys():
                return f.get_tensor(HEAD_IDS).long()
    raise SystemExit(f"--draft-dir {directory}: no subset head there (no {HEAD_IDS} in its safetensors)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring", type=Path, required=True, help="the ring drafter's directory (written into)")
    parser.add_argument("--draft-dir", type=Path, default=None, help="an AR draft's checkpoint: take its head ids")
    parser.add_argument("--tokens", type=Path, default=None, help="or: a token file; its --count most frequent ids")
    parser.add_argument("--count", type=int, default=16384, help="--tokens: how many ids (default: 16384)")
    parser.add_argument("--vocab-size", type=int, default=49152, help="--tokens: the target's (default: SmolLM2's)")
    parser.add_argument("--special", type=int, nargs="*", default=[1, 2], help="--tokens: ids always kept "
                        "(default: SmolLM2's bos and eos, 1 2)")
    args = parser.parse_args()
    if (args.draft_dir is None) == (args.tokens is None):
        raise SystemExit("give one of --draft-dir and --tokens")
    if not (args.ring / "config.json").is_file():
        raise SystemExit(f"--ring {args.ring}: no ring drafter there (config.json missing)")
    if args.draft_dir is not None:
        ids = draft_head_ids(args.draft_dir)
    else:
        if not 0 < args.count < args.vocab_size:
            raise SystemExit(f"--count {args.count} must be in [1, {args.vocab_size})")
        ids = frequent_ids(np.load(args.tokens), args.count, args.vocab_size, always=args.special)
    save_head_ids(args.ring, ids)
    print(f"wrote {args.ring / HEAD_IDS_FILE}: {len(ids)} ids", file=sys.stderr)


if __name__ == "__main__":
    main()

"""trtllm-dustin: draft-augmented sparse verification for long-context speculative decoding."""

__version__ = "0.1.0"

"""Decode loops: vanilla, speculative methods, batching, sampling, CUDA graphs."""

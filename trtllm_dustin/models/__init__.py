"""Model family: one decoder for Llama 3.x, Qwen2.5 and SmolLM2."""

"""Model families, loading from HF dirs / rlx checkpoints / GGUF files, and tiny models for tests."""

"""Generated tasks with rule rewards (prompts.jsonl writers)."""

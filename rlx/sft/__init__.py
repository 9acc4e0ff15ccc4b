"""Supervised fine-tuning on demonstrations (`rlx sft`, a recipe's `[sft]` warm start)."""

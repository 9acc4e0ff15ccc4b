"""Checkpoint dirs and their layouts (single, fsdp, megatron) behind one interface: read, write, shard, merge."""

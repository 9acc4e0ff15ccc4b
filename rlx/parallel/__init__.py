"""Parallelism: process groups and devices, FSDP2, sequence parallelism, batching across ranks, DCP."""

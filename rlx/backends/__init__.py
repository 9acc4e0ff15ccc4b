"""Training backends (FSDP2, megatron-core) behind one interface: build, train, score, save, feed rollouts."""

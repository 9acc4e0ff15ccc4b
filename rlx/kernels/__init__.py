"""Fused compute kernels (logprob + entropy from hidden states) in PyTorch and Triton."""

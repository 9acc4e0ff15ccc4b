"""The megatron-core training backend: tensor x pipeline x data parallel Llama-family actors, critics
and reference models, chosen by a checkpoint's 'megatron' layout (`rlx shard --layout megatron`).

parallel.py sets up megatron's process groups from rlx's context; schedule.py runs micro-batches
through the pipeline stages (rlx's own schedule: megatron's assumes CUDA); forward.py computes
vocab-parallel logprobs/entropy and values on the last stage; trainer.py is the update loop;
checkpoint.py reads and writes the per-rank shards.
"""

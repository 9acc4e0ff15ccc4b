"""Llama-family models on megatron-core: tensor- and pipeline-parallel actor, reference and critic.

`model.py` builds a megatron-core `GPTModel` (one pipeline stage, this rank's tensor-parallel slice)
from a Hugging Face config; `convert.py` maps Hugging Face weights to per-(tp, pp)-rank shards and
back; `compat.py` holds the few changes megatron-core needs to run on a CPU (gloo) process group.
megatron-core is an optional extra: nothing here is imported unless the megatron layout is used.
"""

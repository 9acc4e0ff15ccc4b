"""The layouts rlx ships, by name: where each is implemented and one line about it (no torch import, so command
help lists them instantly). rlx/checkpoints/registry.py imports a layout when it is first used; more can be
registered there at run time."""

from __future__ import annotations

BUILT_IN: dict[str, tuple[str, str]] = {
    "single": (
        "rlx.checkpoints.single:SingleLayout",
        "full weights in safetensors (the folder is also a Hugging Face model dir)",
    ),
    "fsdp": (
        "rlx.checkpoints.fsdp:FsdpLayout",
        "a sharded torch.distributed.checkpoint (dcp/) that any number of ranks reads and writes in parallel "
        "(local or mounted storage)",
    ),
    "megatron": (
        "rlx.checkpoints.megatron:MegatronLayout",
        "one megatron-core state per tensor x pipeline rank, mp_rank_TT_PPP/ (Llama and Qwen2 models)",
    ),
    "lora": (
        "rlx.checkpoints.lora:LoraLayout",
        "LoRA adapters",
    ),
}
LORA = "lora"
"""The layout of checkpoints that hold adapters on a base model (a trainer with adapters writes it)."""
DEFAULT = "single"
"""The layout a plain Hugging Face dir reads as, and `rlx shard` writes by default."""


def describe() -> str:
    """The built-in layouts as one help sentence."""
    return "; ".join(f"'{name}': {text}" for name, (_, text) in BUILT_IN.items())

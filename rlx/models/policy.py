"""A policy's files: weights with Hugging Face names plus the config/tokenizer files that go with them.

`rlx shard`, `rlx train-step` and `rlx ppo` all write checkpoints from a `PolicyFiles`, and load the
initial policy through `load_initial_policy`, so the driver and the separate commands start from
bit-identical weights.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from rlx.engine.checkpoint import aux_files
from rlx.errors import UserError
from rlx.models.loading import (
    ModelSource,
    init_random_model,
    load_causal_lm,
    load_config,
    load_tokenizer,
    resolve_source,
    tied_keys,
)


@dataclass
class PolicyFiles:
    """Everything a checkpoint holds about the model."""

    weights: dict[str, torch.Tensor]
    """Tensors with Hugging Face names; tied duplicates (lm_head under tied embeddings) left out."""
    aux: dict[str, bytes]
    """config.json, tokenizer files, chat template ... byte for byte."""


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict without tied duplicates (as Hugging Face saves it); for an
    FSDP-sharded model the gathered weights on rank 0 ({} on other ranks)."""
    from rlx.engine.training.optim import full_model_state

    skip = tied_keys(model)
    return {k: v for k, v in full_model_state(model).items() if k not in skip}


def generated_aux(model, tokenizer) -> dict[str, bytes]:
    """config.json, generation_config.json and tokenizer files written by transformers, as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return aux_files(Path(tmp))


def load_initial_policy(path: str | Path, init: str = "pretrained", seed: int = 0):
    """(model float32 on CPU, tokenizer, aux files) for a training start point.

    init='pretrained' loads the weights of an HF dir, checkpoint or GGUF file; init='random'
    initialises from the folder's config.json with `seed` (weights in the folder are ignored).
    """
    source = resolve_source(path)
    tokenizer = load_tokenizer(source)
    if init == "random":
        if source.is_gguf:
            raise UserError(f"{path}: init 'random' needs a folder with config.json, not a GGUF file")
        model = init_random_model(load_config(source), seed)
        return model, tokenizer, aux_files(source.folder)
    if init != "pretrained":
        raise UserError(f"unknown init {init!r} (expected 'pretrained' or 'random')")
    model = load_causal_lm(source)
    aux = generated_aux(model, tokenizer) if source.is_gguf else aux_files(source.folder)
    return model, tokenizer, aux


def load_trained_policy(source: ModelSource, role: str = "actor"):
    """(model float32 on CPU, tokenizer, aux files) of a checkpoint or HF dir to continue from.

    role 'critic' loads a value model (see rlx.models.value)."""
    if role == "critic":
        from rlx.models.value import load_value_model

        return load_value_model(source), load_tokenizer(source), aux_files(source.folder)
    return load_causal_lm(source), load_tokenizer(source), aux_files(source.folder)


def build_critic_files(policy, tokenizer, seed: int) -> tuple[torch.nn.Module, dict[str, bytes]]:
    """A value model from `policy` (backbone copied, head seeded) and its config/tokenizer files."""
    from rlx.models.value import build_value_model

    critic = build_value_model(policy, seed)
    return critic, generated_aux(critic, tokenizer)

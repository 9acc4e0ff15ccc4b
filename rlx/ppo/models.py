"""The models of a `rlx ppo` run, built through the training backend: the actor and critic trainers (from the
recipe's model or the run's last checkpoint), the frozen reference, the reward model, and the module the rollout
engine generates with. Nothing here names a backend or a checkpoint layout.

With `[lora]` the actor trains adapters on the frozen policy and the reference is that same module with the adapters
off (no copy); `[critic.lora]` does the same for the critic. A resumed run continues the adapters of its checkpoint."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from rlx.backends.base import Trainer, TrainingBackend
from rlx.checkpoints.files import aux_files
from rlx.checkpoints.loading import (
    build_critic_files,
    check_init,
    load_initial_policy,
    load_model,
    load_processor,
    unfilled_model,
)
from rlx.checkpoints.lora_base import lora_spec
from rlx.models.loading import ModelSource, load_tokenizer, resolve_model
from rlx.ppo.config import PPOConfig
from rlx.rollout.prompts import pad_token_id
from rlx.rollout.registry import engine_class
from rlx.scoring.score import ScoringModels
from rlx.utils.device import resolve_precision

CRITIC_DIR = "critic"


@dataclass
class RunModels:
    """Everything a run holds resident."""

    actor: Trainer
    critic: Trainer | None
    tokenizer: object
    aux: dict[str, bytes]
    """The policy's config/tokenizer files, written into every checkpoint."""
    critic_aux: dict[str, bytes]
    scoring: ScoringModels
    rollout_model: torch.nn.Module
    """What the rollout engine generates with: the actor's own module where the backend has one, else a Hugging
    Face replica the engine refreshes from the trainer after each update."""
    processor: object | None = None
    """A vision-language policy's VisionProcessor (images of prompts and rollouts); None for a text model."""


def build_run_models(
    cfg: PPOConfig, backend: TrainingBackend, start_ckpt: Path | None, policy: tuple[ModelSource, object] | None = None
) -> RunModels:
    """The run's models at its start (`start_ckpt` None) or when resuming from `start_ckpt`; `policy`: (source,
    config) of the model they start from where the caller has resolved it (else it is resolved here)."""
    train_cfg = dataclasses.replace(cfg.train, seed=cfg.seed).with_decay_length(cfg.steps)
    copy_ref = cfg.use_ref and cfg.lora is None  # with LoRA the reference is the actor's base: no copy
    source, config = policy or resolve_model(start_ckpt if start_ckpt is not None else cfg.model.path)  # once
    if start_ckpt is None and _filled_from_rank0(cfg, backend, source, config):
        actor, ref, critic, tokenizer, aux, critic_aux = _initial_from_rank0(cfg, backend, train_cfg, source, config)
        model = None
    elif start_ckpt is None:
        model, tokenizer, aux = load_initial_policy(source, cfg.model.init, cfg.seed, config)
        spec = lora_spec(cfg.lora, cfg.model.path, cfg.model.init, cfg.seed, model)  # before adapters and shards
        ref = copy.deepcopy(model) if copy_ref else None
        critic, critic_aux = _critic(cfg, backend, None, model, tokenizer, aux)  # before the actor shards the model
        actor = backend.build_trainer(model, train_cfg, "the initial policy", **backend.lora_options(spec, "lora"))
    else:
        tokenizer, aux = load_tokenizer(source), aux_files(source.folder)
        ref = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)[0] if copy_ref else None
        critic, critic_aux = _critic(cfg, backend, start_ckpt, None, tokenizer)
        actor = backend.load_trainer(train_cfg, source, config, **backend.lora_options(cfg.lora, "lora"))
        model = None
    processor = load_processor(source, cfg.vision, config)
    rollout_model, device = actor.module, backend.ctx.device
    if rollout_model is None:  # a replica for the engine: the initial policy, or the checkpoint's weights, in the
        # dtype the engine generates in (no float32 copy for a bf16 engine to keep a second replica of)
        rollout_model = model if model is not None else load_model(source, config=config)
        rollout_model = rollout_model.to(device, engine_class(cfg.rollout.engine).model_dtype(cfg.rollout, device))
        rollout_model.requires_grad_(False)  # generation only: the engine may lay its weights out for decoding
    scoring = ScoringModels(
        dtype=resolve_precision(cfg.score.precision, device),
        vocab_size=actor.config.get_text_config().vocab_size,
        pad_token_id=pad_token_id(tokenizer),
        actor=backend.scorer(actor) if cfg.score.old_logprobs == "actor" else None,
        ref=backend.build_reference(ref) if ref is not None else backend.base_reference(actor) if cfg.use_ref else None,
        critic=backend.scorer(critic) if critic is not None else None,
        reward_model=_reward_model(cfg, device),
        processor=processor,
        model_config=actor.config,
    )
    return RunModels(actor, critic, tokenizer, aux, critic_aux, scoring, rollout_model, processor)


def _filled_from_rank0(cfg: PPOConfig, backend: TrainingBackend, source: ModelSource, config) -> bool:
    """Whether a fresh start's ranks other than 0 build the policy unfilled and take its weights from rank 0's
    (`_initial_from_rank0`): FSDP under a launcher, full weights from a model folder (or drawn), experts not split,
    and a critic, if any, built from the policy (not its own folder, no adapters)."""
    critic = cfg.critic
    return (
        backend.name == "fsdp"
        and backend.ctx.world > 1
        and cfg.lora is None
        and (critic is None or (not critic.path and critic.lora is None))
        and cfg.train.ep_degree == 1
        and config is not None
        and not source.is_gguf
    )


def _initial_from_rank0(cfg: PPOConfig, backend: TrainingBackend, train_cfg, source: ModelSource, config):
    """(actor trainer, reference model on the device or None, critic trainer or None, tokenizer, aux, critic aux)
    of a fresh start where only rank 0 loads (or draws) the float32 policy and builds the reference and critic from
    it: the other ranks build them unfilled (memory allocated, not touched: no host memory until written), the
    trainers shard them, and rank 0's weights fill every rank's shards, the reference's whole copy broadcast. Each
    rank loading the whole policy held ranks x 4 bytes a parameter on a host at the start (7B on four GPUs: 113 GiB;
    32B on eight: 976 GiB), up to three times that with a reference and a critic."""
    from rlx.parallel.fsdp import broadcast_module, fill_from_rank0

    device, main = backend.ctx.device, backend.ctx.is_main
    if main:
        model, tokenizer, aux = load_initial_policy(source, cfg.model.init, cfg.seed, config)
    else:
        check_init(source, cfg.model.init)
        model = unfilled_model(source, "actor", config)
        tokenizer, aux = load_tokenizer(source), aux_files(source.folder)  # as load_initial_policy gives them
    full = dict(model.state_dict()) if main else None  # kept whole on rank 0 while the trainer shards the model
    ref = None  # on the host until the trainers are built (the GPU's peak as without this path)
    if cfg.use_ref:
        ref = copy.deepcopy(model) if main else unfilled_model(source, "actor", config)
    critic, critic_aux, critic_full = None, {}, None
    if cfg.critic is not None:  # from the whole policy, before the actor shards it
        critic, critic_aux = build_critic_files(model, tokenizer, cfg.seed, aux, unfilled=not main)
        critic_full = dict(critic.state_dict()) if main else None
    actor = backend.build_trainer(model, train_cfg, "the initial policy")
    fill_from_rank0(actor.state().model_shards(), full, device)
    if critic is not None:
        critic = backend.build_trainer(critic, _critic_train_cfg(cfg), "the new critic")
        fill_from_rank0(critic.state().model_shards(), critic_full, device)
    if ref is not None:
        broadcast_module(ref.requires_grad_(False).to(device))
    return actor, ref, critic, tokenizer, aux, critic_aux


def _critic_train_cfg(cfg: PPOConfig):
    """The critic trainer's config: [critic.train] with the run's seed and learning-rate decay length."""
    return dataclasses.replace(cfg.critic.train, seed=cfg.seed).with_decay_length(cfg.steps)


def _critic(cfg: PPOConfig, backend: TrainingBackend, start_ckpt: Path | None, policy, tokenizer, policy_aux=None):
    """(critic trainer, its config/tokenizer files): from the run's checkpoint, the recipe's critic.path, or built
    from the policy's backbone with a seeded head (with the policy's processor files, `policy_aux`)."""
    if cfg.critic is None:
        return None, {}
    train_cfg = _critic_train_cfg(cfg)
    lora = cfg.critic.lora
    if start_ckpt is not None:
        source, config = resolve_model(start_ckpt / CRITIC_DIR)
        trainer = backend.load_trainer(train_cfg, source, config, **backend.lora_options(lora, "critic.lora"))
        return trainer, aux_files(source.folder)
    if cfg.critic.path:
        source, config = resolve_model(cfg.critic.path, "critic")
        model = load_model(source, "critic", config=config)
        spec = lora_spec(lora, cfg.critic.path, "pretrained", cfg.seed, model, "critic")
        trainer = backend.build_trainer(model, train_cfg, str(source.path), **backend.lora_options(spec, "critic.lora"))
        return trainer, aux_files(source.folder)
    model, aux = build_critic_files(policy, tokenizer, cfg.seed, policy_aux)
    spec = lora_spec(lora, cfg.model.path, cfg.model.init, cfg.seed, model, "critic")
    return backend.build_trainer(model, train_cfg, "the new critic", **backend.lora_options(spec, "critic.lora")), aux


def _reward_model(cfg: PPOConfig, device: torch.device):
    if not cfg.score.reward_model:
        return None
    from rlx.models.reward_model import RewardModel

    source, config = resolve_model(cfg.score.reward_model, "reward model")
    return RewardModel(source, config, device, resolve_precision(cfg.score.precision, device))

"""`rlx train-step`: one PPO update of a checkpoint on a scored batch, written as the next checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for
from rlx.engine.training.config import TrainConfig as C

_METAVARS = {
    "role": "actor|critic",
    "lr_schedule": "constant|linear|cosine",
    "policy_loss": "NAME",
    "loss_agg_mode": "MODE",
    "kl_loss_type": "k1|k2|k3|abs",
    "rollout_is": "none|token|sequence",
    "rollout_rs": "none|token|sequence|geometric",
    "device": "auto|cpu|cuda|npu",
    "precision": "auto|float32|bfloat16",
}


def _opt(name: str):
    return typer.Option(help=help_for(C, name), **({"metavar": _METAVARS[name]} if name in _METAVARS else {}))


def train_step(
    checkpoint: Annotated[
        str, typer.Option(metavar="DIR", help="Checkpoint to update (from `rlx shard` or an earlier train-step).")
    ],
    batch: Annotated[str, typer.Option(metavar="FILE", help="batch.safetensors written by `rlx score`.")],
    out: Annotated[str, typer.Option(metavar="DIR", help="Folder for the next checkpoint (written atomically).")],
    role: Annotated[str, _opt("role")] = C.role,
    lr: Annotated[float, _opt("lr")] = C.lr,
    warmup_steps: Annotated[int, _opt("warmup_steps")] = C.warmup_steps,
    lr_schedule: Annotated[str, _opt("lr_schedule")] = C.lr_schedule,
    lr_decay_steps: Annotated[int, _opt("lr_decay_steps")] = C.lr_decay_steps,
    min_lr_ratio: Annotated[float, _opt("min_lr_ratio")] = C.min_lr_ratio,
    weight_decay: Annotated[float, _opt("weight_decay")] = C.weight_decay,
    epochs: Annotated[int, _opt("epochs")] = C.epochs,
    mini_batch_size: Annotated[int, _opt("mini_batch_size")] = C.mini_batch_size,
    micro_batch_size: Annotated[int, _opt("micro_batch_size")] = C.micro_batch_size,
    shuffle: Annotated[bool, _opt("shuffle")] = C.shuffle,
    policy_loss: Annotated[str, _opt("policy_loss")] = C.policy_loss,
    loss_agg_mode: Annotated[str, _opt("loss_agg_mode")] = C.loss_agg_mode,
    loss_scale_factor: Annotated[int, _opt("loss_scale_factor")] = C.loss_scale_factor,
    clip_ratio_low: Annotated[float, _opt("clip_ratio_low")] = C.clip_ratio_low,
    clip_ratio_high: Annotated[float, _opt("clip_ratio_high")] = C.clip_ratio_high,
    clip_ratio_c: Annotated[float, _opt("clip_ratio_c")] = C.clip_ratio_c,
    tau_pos: Annotated[float, _opt("tau_pos")] = C.tau_pos,
    tau_neg: Annotated[float, _opt("tau_neg")] = C.tau_neg,
    clip_cov_ratio: Annotated[float, _opt("clip_cov_ratio")] = C.clip_cov_ratio,
    clip_cov_lb: Annotated[float, _opt("clip_cov_lb")] = C.clip_cov_lb,
    clip_cov_ub: Annotated[float, _opt("clip_cov_ub")] = C.clip_cov_ub,
    kl_cov_ratio: Annotated[float, _opt("kl_cov_ratio")] = C.kl_cov_ratio,
    ppo_kl_coef: Annotated[float, _opt("ppo_kl_coef")] = C.ppo_kl_coef,
    max_grad_norm: Annotated[float, _opt("max_grad_norm")] = C.max_grad_norm,
    kl_loss_coef: Annotated[float, _opt("kl_loss_coef")] = C.kl_loss_coef,
    kl_loss_type: Annotated[str, _opt("kl_loss_type")] = C.kl_loss_type,
    entropy_coef: Annotated[float, _opt("entropy_coef")] = C.entropy_coef,
    cliprange_value: Annotated[float, _opt("cliprange_value")] = C.cliprange_value,
    rollout_is: Annotated[str, _opt("rollout_is")] = C.rollout_is,
    rollout_is_threshold: Annotated[float, _opt("rollout_is_threshold")] = C.rollout_is_threshold,
    rollout_rs: Annotated[str, _opt("rollout_rs")] = C.rollout_rs,
    rollout_rs_threshold: Annotated[float, _opt("rollout_rs_threshold")] = C.rollout_rs_threshold,
    rollout_rs_threshold_lower: Annotated[float, _opt("rollout_rs_threshold_lower")] = C.rollout_rs_threshold_lower,
    rollout_veto_threshold: Annotated[float, _opt("rollout_veto_threshold")] = C.rollout_veto_threshold,
    logprob_impl: Annotated[str, _opt("logprob_impl")] = C.logprob_impl,
    use_packing: Annotated[bool, _opt("use_packing")] = C.use_packing,
    max_tokens_per_micro_batch: Annotated[int, _opt("max_tokens_per_micro_batch")] = C.max_tokens_per_micro_batch,
    gradient_checkpointing: Annotated[bool, _opt("gradient_checkpointing")] = C.gradient_checkpointing,
    param_offload: Annotated[bool, _opt("param_offload")] = C.param_offload,
    activation_offload: Annotated[bool, _opt("activation_offload")] = C.activation_offload,
    compile: Annotated[bool, _opt("compile")] = C.compile,
    sp_degree: Annotated[int, _opt("sp_degree")] = C.sp_degree,
    seed: Annotated[int, _opt("seed")] = C.seed,
    device: Annotated[str, _opt("device")] = C.device,
    precision: Annotated[str, _opt("precision")] = C.precision,
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
    metrics: Annotated[
        str | None, typer.Option(metavar="FILE", help="Append the step's metrics line to this JSONL file.")
    ] = None,
) -> None:
    """One PPO-family update of the actor (any policy loss, rollout correction, KL loss, entropy bonus)
    or of the critic (clipped value loss): epochs x mini-batches x micro-batches, AdamW, gradient clipping.

    Losses are normalised by each mini-batch's token (or sequence) count, so micro-batching does
    not change the gradient. The optimizer state travels in the checkpoint; the learning rate
    follows the checkpoint's step count. Under torchrun (or srun) the model is FSDP-sharded and
    each mini-batch is split across ranks by work; the result equals a single-process step.
    """
    with reporting("train-step"):
        values = dict(locals())
        names = {f.name for f in dataclasses.fields(C)}
        cfg = build_config(C, **{k: v for k, v in values.items() if k in names})
        from rlx.engine.training.run import run_train_step

        run_train_step(cfg, checkpoint, batch, out, overwrite=overwrite, metrics_path=metrics)

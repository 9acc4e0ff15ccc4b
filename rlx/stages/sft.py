"""Supervised fine-tuning as `rlx sft` runs it (model + demonstrations -> a step-0 checkpoint), and `fine_tune`, the
loop `rlx ppo` also runs for a recipe's `[sft]` warm start (so the two give the same weights).

Each optimizer step takes `batch_size` demonstrations in a seeded order per epoch and collates them like scored
rollouts (prompts left-padded, responses right-padded, `loss_mask` on the assistant's tokens). Under torchrun each
step's demonstrations are split over the ranks by work and the model is FSDP-sharded (rlx/training/trainer.py);
the result equals one process up to float rounding. The checkpoint is the 'single' layout at step 0 with no
optimizer state: what `rlx shard` would write for the fine-tuned weights.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlx.checkpoints import catalog
from rlx.checkpoints.loading import check_init, load_initial_policy
from rlx.checkpoints.meta import CheckpointMeta, provenance
from rlx.checkpoints.registry import save
from rlx.formats.batch import BatchMeta, TrainBatch, collate
from rlx.models.loading import resolve_model
from rlx.observe.tracking import console, log_metrics
from rlx.parallel.dist import DistContext, barrier, setup
from rlx.rollout.lengths import model_context
from rlx.rollout.prompts import pad_token_id, stop_token_ids
from rlx.sft.config import SFTConfig
from rlx.sft.data import SFTSample, read_demonstrations, tokenize_demonstrations
from rlx.sft.trainer import SFTTrainer
from rlx.stages.shard import check_new_output
from rlx.utils.device import derive_seed, resolve_precision


def load_samples(cfg: SFTConfig, tokenizer, config, stop_ids: set[int], quiet: bool = False) -> list[SFTSample]:
    """The demonstrations of `cfg.data` tokenised (errors name FILE:LINE); too-long ones per cfg.on_long_sample."""
    limit = cfg.max_length or model_context(config)
    what = "max_length" if cfg.max_length else "the model's context (max_position_embeddings)"
    demos = read_demonstrations(cfg.data)
    kwargs = cfg.chat_template_kwargs
    found = tokenize_demonstrations(demos, tokenizer, stop_ids, limit, cfg.on_long_sample, what, kwargs)
    if found.num_skipped and not quiet:
        console(f"rlx sft: skipped {found.num_skipped} demonstration(s) longer than {limit} tokens ({cfg.data})")
    return found.samples


def run_sft(cfg: SFTConfig, model: str, out: str, init: str = "pretrained", overwrite: bool = False,
            metrics_path: str | None = None) -> dict:  # fmt: skip
    """`rlx sft`: fine-tune `model` on `cfg.data` and write the result to `out`; returns the last step's metrics."""
    check_new_output(out, overwrite, model)
    source, config = resolve_model(model)
    check_init(source, init)
    ctx = setup(cfg.device)
    policy, tokenizer, aux = load_initial_policy(source, init, cfg.seed, config)
    samples = load_samples(cfg, tokenizer, policy.config, stop_token_ids(policy, tokenizer), quiet=not ctx.is_main)
    trainer, metrics = fine_tune(policy, tokenizer, samples, cfg, ctx, metrics_path)
    meta = CheckpointMeta(
        step=0,
        layout=catalog.DEFAULT,
        provenance=provenance("rlx sft", source.path, data=cfg.data, init=init, seed=cfg.seed),
    )
    save(out, trainer.state(), aux, meta, overwrite=overwrite)
    if ctx.is_main:
        console(f"rlx sft: {len(samples)} demonstrations, loss {metrics.get('sft/loss', float('nan')):.4f} -> {out}")
    barrier()
    return metrics


def fine_tune(model: torch.nn.Module, tokenizer, samples: list[SFTSample], cfg: SFTConfig, ctx: DistContext,
              metrics_path: str | Path | None = None) -> tuple[SFTTrainer, dict]:  # fmt: skip
    """Train `model` on `samples` (epochs x seeded batches, capped by max_steps): (the trainer, the last step's
    metrics). A metrics line per optimizer step goes to `metrics_path`, a progress line to stderr now and then."""
    steps = cfg.num_steps(len(samples))
    trainer = SFTTrainer(model, cfg.train_config(steps), ctx.device, resolve_precision(cfg.precision, ctx.device), ctx)
    pad, vocab = pad_token_id(tokenizer), model.config.get_text_config().vocab_size
    every, started, metrics = max(1, steps // 10), time.perf_counter(), {}
    for step, (epoch, rows) in enumerate(_schedule(len(samples), cfg, steps)):
        batch = _batch([samples[i] for i in rows], pad, vocab)
        metrics = trainer.train_step(batch, step)
        metrics["sft/tokens"] = float(batch.loss_mask.sum())
        metrics["sft/epoch"] = float(epoch)
        if ctx.is_main:
            log_metrics(metrics_path, step + 1, metrics)
            if (step + 1) % every == 0 or step == 0 or step + 1 == steps:
                console(
                    f"rlx sft: step {step + 1}/{steps}, epoch {epoch + 1}, loss {metrics['sft/loss']:.4f}, "
                    f"{time.perf_counter() - started:.0f} s"
                )
    return trainer, metrics


def _schedule(num_samples: int, cfg: SFTConfig, steps: int):
    """(epoch, sample indices) of each optimizer step: a seeded permutation per epoch cut into batches."""
    step = 0
    for epoch in range(cfg.epochs):
        order = list(range(num_samples))
        if cfg.shuffle:
            generator = torch.Generator().manual_seed(derive_seed("sft", cfg.seed, epoch))
            order = torch.randperm(num_samples, generator=generator).tolist()
        for lo in range(0, num_samples, cfg.batch_size):
            if step == steps:
                return
            yield epoch, order[lo : lo + cfg.batch_size]
            step += 1


def _batch(samples: list[SFTSample], pad: int, vocab: int) -> TrainBatch:
    """Samples in the scored-batch layout; the tensors SFT does not read are zeros."""
    tensors = collate(samples, pad)
    zeros = torch.zeros_like(tensors["rollout_logprobs"])
    meta = BatchMeta(
        sample_ids=[s.where for s in samples],
        group_ids=[s.where for s in samples],
        vocab_size=vocab,
        pad_token_id=pad,
        temperature=1.0,
    )
    return TrainBatch(
        **tensors,
        old_logprobs=zeros,
        advantages=zeros,
        returns=zeros,
        token_rewards=zeros,
        rewards=torch.zeros(len(samples)),
        meta=meta,
    )

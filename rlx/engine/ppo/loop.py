"""The PPO loop with resident models: rollout -> score -> train-step, the same artifacts per step.

    RUN_DIR/
      recipe.json                      the resolved recipe (a resumed run must match it)
      metrics.jsonl                    one line per step
      step_000001/                     rollouts.jsonl, scores.jsonl, batch.safetensors
      checkpoints/step_000001/         an rlx checkpoint of the actor (HF dir + optimizer + rlx.json)
      checkpoints/step_000001/critic/  the critic's checkpoint, when there is one

Each stage calls the same engine function as its command, with the same seeds, so the loop and a
shell pipeline of `rlx rollout | score | train-step` give identical weights and metrics.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from pathlib import Path

import torch

from rlx.config import to_dict
from rlx.engine.checkpoint import (
    CheckpointContent,
    CheckpointMeta,
    load_optimizer_state,
    provenance,
    save_checkpoint,
)
from rlx.engine.device import resolve_device, resolve_precision
from rlx.engine.flops import count_flops, count_generate_flops, device_peak_flops, mfu
from rlx.engine.memory import device_peak_bytes, host_rss_bytes, measure_phase, phase_metrics, reset_device_peak
from rlx.engine.parallel.dist import barrier, setup
from rlx.engine.ppo.config import PPOConfig
from rlx.engine.ppo.data import take_prompts
from rlx.engine.ppo.rundir import checkpoint_dir, drop_old_checkpoints, prepare_run_dir, step_dir
from rlx.engine.records import RolloutRecord, read_prompts, write_records
from rlx.engine.rollout.prompts import pad_token_id
from rlx.engine.rollout.run import build_engine
from rlx.engine.scoring.score import (
    Rewards,
    ScoreResult,
    ScoringModels,
    compute_rewards,
    informative_groups,
    score_rollouts,
)
from rlx.engine.tracking import Tracker, console, read_metrics, select_traces
from rlx.engine.training.actor import ActorTrainer
from rlx.engine.training.critic import CriticTrainer
from rlx.errors import UserError
from rlx.models.loading import resolve_source
from rlx.models.policy import build_critic_files, load_initial_policy, load_trained_policy, model_weights

CRITIC_DIR = "critic"


class PPORun:
    """One run directory: the resident actor, reference, critic and rollout engine, and the step loop."""

    def __init__(self, cfg: PPOConfig, run_dir: Path, resume: bool):
        self.cfg, self.run_dir = cfg, run_dir
        self.ctx = setup(cfg.train.device, cfg.train.sp_degree)
        self.device = self.ctx.device
        if resolve_device(cfg.rollout.device).type != self.device.type:
            raise UserError(
                "rollout.device and train.device must agree in `rlx ppo` (the rollout uses the trained model)"
            )
        self.megatron = None  # megatron's context when [megatron] trains the models on megatron-core
        if cfg.megatron is not None:
            from rlx.engine.megatron import ppo as megatron_ppo
            from rlx.engine.megatron.parallel import setup_megatron

            self.megatron = setup_megatron(cfg.train.device, cfg.megatron.tp_degree, cfg.megatron.pp_degree)
        self.start_step, start_ckpt = prepare_run_dir(self.run_dir, to_dict(cfg), resume, self.ctx.is_main)
        meta = CheckpointMeta.read(start_ckpt) if start_ckpt else CheckpointMeta()
        self.data_position = meta.data_position or 0
        self.kl_coef = meta.kl_coef if meta.kl_coef is not None else cfg.score.kl_coef
        if start_ckpt is None:
            model, self.tokenizer, self.aux = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)
            ref = copy.deepcopy(model) if cfg.use_ref else None
        else:
            model, self.tokenizer, self.aux = load_trained_policy(resolve_source(start_ckpt))
            ref = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)[0] if cfg.use_ref else None
        self.critic, self.critic_aux = self._load_critic(start_ckpt, model)  # before the actor is sharded
        train_cfg = dataclasses.replace(cfg.train, seed=cfg.seed).with_decay_length(cfg.steps)
        if self.megatron is not None:
            self.trainer = megatron_ppo.build_trainer(model, train_cfg, self.megatron, start_ckpt)
            self.rollout_model = model.to(self.device)  # the replica rollouts run on, synced after updates
        else:
            dtype = resolve_precision(cfg.train.precision, self.device)
            self.trainer = ActorTrainer(model, train_cfg, self.device, dtype, self.ctx)
            start_state = load_optimizer_state(start_ckpt) if start_ckpt else None
            self.trainer.load_optimizer_state(start_state, str(start_ckpt))
            self.rollout_model = self.trainer.model
        self.models = ScoringModels(
            device=self.device,
            dtype=resolve_precision(cfg.score.precision, self.device),
            vocab_size=model.config.vocab_size,
            pad_token_id=pad_token_id(self.tokenizer),
            actor=self._scoring_model(self.trainer) if cfg.score.old_logprobs == "actor" else None,
            ref=self._reference_model(ref),
            critic=self._scoring_model(self.critic) if self.critic else None,
            reward_model=self._load_reward_model(),
            ctx=self.ctx,
        )
        self.engine = build_engine(cfg.rollout, self.rollout_model, self.tokenizer, self.ctx)
        self.engine_stale = False  # whether the trainer changed the weights since the engine last got them
        self.prompts = read_prompts(cfg.data.prompts)
        self.score_cfg = dataclasses.replace(
            cfg.score, max_response_length=cfg.score.max_response_length or cfg.rollout.max_new_tokens
        )

    def _reference_model(self, ref):
        """The frozen reference: the HF model on the device, or megatron stages cut from it."""
        if ref is None:
            return None
        if self.megatron is not None:
            from rlx.engine.megatron.ppo import reference_model

            return reference_model(ref, self.megatron)
        return ref.requires_grad_(False).to(self.device).eval()

    def _scoring_model(self, trainer):
        """What scoring runs for a trained model: its module, or its megatron stage."""
        if self.megatron is None:
            return trainer.model
        from rlx.engine.megatron.ppo import scoring_model

        return scoring_model(trainer)

    def _load_critic(self, start_ckpt: Path | None, policy) -> tuple[CriticTrainer | None, dict]:
        cfg = self.cfg
        if cfg.critic is None:
            return None, {}
        if start_ckpt is not None:
            model, _, aux = load_trained_policy(resolve_source(start_ckpt / CRITIC_DIR), role="critic")
            state = load_optimizer_state(start_ckpt / CRITIC_DIR)
        elif cfg.critic.path:
            model, _, aux = load_trained_policy(resolve_source(cfg.critic.path, "critic"), role="critic")
            state = None
        else:
            model, aux = build_critic_files(policy, self.tokenizer, cfg.seed)
            state = None
        train_cfg = dataclasses.replace(cfg.critic.train, seed=cfg.seed).with_decay_length(cfg.steps)
        if self.megatron is not None:
            from rlx.engine.megatron.ppo import build_trainer

            checkpoint = start_ckpt / CRITIC_DIR if start_ckpt is not None else None
            return build_trainer(model, train_cfg, self.megatron, checkpoint), aux
        dtype = resolve_precision(cfg.critic.train.precision, self.device)
        trainer = CriticTrainer(model, train_cfg, self.device, dtype, self.ctx)
        trainer.load_optimizer_state(state, str(start_ckpt))
        return trainer, aux

    def _load_reward_model(self):
        if not self.cfg.score.reward_model:
            return None
        from rlx.models.reward_model import RewardModel

        source = resolve_source(self.cfg.score.reward_model, "reward model")
        return RewardModel(source, self.device, resolve_precision(self.cfg.score.precision, self.device))

    def run(self) -> None:
        cfg = self.cfg
        if self.start_step >= cfg.steps:
            if self.ctx.is_main:
                console(f"{self.run_dir}: all {cfg.steps} steps are done")
            return
        tracker = (
            Tracker(cfg.tracking, self.run_dir, to_dict(cfg), start_step=self.start_step)
            if self.ctx.is_main
            else contextlib.nullcontext()
        )
        with tracker:
            finished = False
            try:
                for step in range(self.start_step + 1, cfg.steps + 1):

                    def log(step: int, metrics: dict, traces: list[dict]) -> None:
                        if self.ctx.is_main:
                            tracker.log_traces(step, traces)
                            tracker.log(step, metrics)

                    self.step(step, log)
                finished = True
            finally:
                if finished:  # after a failure the others may be inside a collective: exit, and the launcher
                    barrier()  # stops them; here every rank is done (vllm's shutdown leaves the process group)
                self.engine.close()
        if self.ctx.is_main:
            rewards = [m.get("reward/mean") for m in read_metrics(self.run_dir / "metrics.jsonl")]
            window = min(5, len(rewards))
            console(
                f"done: reward {sum(rewards[:window]) / window:.3f} (first {window} steps) -> "
                f"{sum(rewards[-window:]) / window:.3f} (last {window}); "
                f"final checkpoint {checkpoint_dir(self.run_dir, cfg.steps)}"
            )

    def step(self, step: int, log) -> None:
        """One iteration.  `log(step, metrics, trace rows)` is called once, before the step's checkpoint is
        published: a run killed in between resumes from the step before and writes the line again."""
        cfg, out, step_start = self.cfg, step_dir(self.run_dir, step), time.perf_counter()
        with measure_phase("weight_sync", self.device) as sync:
            self._refresh_engine(step)
        with measure_phase("rollout", self.device) as phase:
            rollouts, rewards, metrics = self._sample(step)
        metrics.update(phase)
        metrics.update(sync)
        released = self.engine.sleep()  # the trainer gets the memory until the next rollout
        if cfg.rollout.engine == "vllm":
            metrics["memory/rollout_engine_released_gb"] = released / 2**30
        with measure_phase("score", self.device) as phase:
            score_cfg = dataclasses.replace(self.score_cfg, kl_coef=self.kl_coef, filter_groups=False)
            result = score_rollouts(rollouts, score_cfg, self.models, cfg.rollout.train_temperature, rewards=rewards)
        metrics.update(result.metrics)
        metrics.update(phase)
        self.kl_coef = result.metrics.get("actor/kl_coef_next", self.kl_coef)
        if cfg.keep_artifacts and self.ctx.is_main:
            write_records(out / "rollouts.jsonl", rollouts)
            write_records(out / "scores.jsonl", result.scores)
            result.batch.save(out / "batch.safetensors")
        with measure_phase("train", self.device) as phase:
            metrics.update(self._train(step, result))
        metrics.update(phase)
        reset_device_peak(self.device)
        save_start = time.perf_counter()

        def finish() -> None:
            now = time.perf_counter()
            metrics.update(phase_metrics("save", now - save_start, device_peak_bytes(self.device), host_rss_bytes()))
            metrics["timing/step_s"] = now - step_start
            metrics.update(self._flops_metrics(rollouts, metrics))
            traces = select_traces(rollouts, result.scores, cfg.tracking.traces_per_step, seed=cfg.seed + step)
            log(step, metrics, traces)

        saving = step % cfg.save_every == 0 or step == cfg.steps
        if saving:
            self._save(step, before_publish=finish)  # rank 0 logs from inside the save
        if not saving or not self.ctx.is_main:
            finish()

    def _flops_metrics(self, rollouts: list[RolloutRecord], metrics: dict) -> dict:
        """Model FLOPs of the step (generation, scoring forwards, training) and MFU against the device peak."""
        config = self.rollout_model.config
        prompt_lens = [len(r.prompt_ids) for r in rollouts]
        response_lens = [len(r.response_ids) for r in rollouts]
        lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
        forwards = sum(m is not None for m in (self.models.actor, self.models.ref, self.models.critic))
        train_passes = self.cfg.train.epochs + (self.cfg.critic.train.epochs if self.cfg.critic else 0)
        phases = {
            "rollout": count_generate_flops(config, prompt_lens, response_lens),
            "score": forwards * count_flops(config, lengths, "forward"),
            "train": train_passes * count_flops(config, lengths, "train"),
        }
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        peak = device_peak_flops(name)
        out = {"perf/flops": sum(phases.values())}
        for phase, flops in phases.items():
            seconds = metrics.get(f"timing/{phase}_s", 0.0)
            if peak and seconds > 0:
                out[f"perf/mfu_{phase}"] = mfu(flops, seconds, peak)
        if peak:
            out["perf/mfu"] = mfu(out["perf/flops"], metrics["timing/step_s"], peak)
        return out

    def _refresh_engine(self, step: int) -> None:
        """Wake the rollout engine and give it the weights the last train step wrote (vllm; a no-op for hf)."""
        if not self.engine_stale:
            return
        if self.megatron is not None:  # the replica gets the stages' weights
            from rlx.engine.megatron.ppo import sync_replica

            sync_replica(self.rollout_model, self.trainer)
        path = None
        if self.cfg.rollout.engine == "vllm" and self.cfg.rollout.weight_sync == "disk":
            path = checkpoint_dir(self.run_dir, step - 1)
        self.engine.wake(model=self.rollout_model if path is None else None, path=path)
        self.engine_stale = False

    def _sample(self, step: int) -> tuple[list[RolloutRecord], Rewards | None, dict]:
        """Rollouts for the step.  With score.filter_groups (DAPO dynamic sampling), batches of prompts
        are sampled until prompts_per_step informative groups are collected (or max_gen_batches)."""
        cfg = self.cfg
        rollout_cfg = dataclasses.replace(cfg.rollout, seed=cfg.seed + step)
        want, kept, kept_rewards, batches = cfg.data.prompts_per_step, [], [], 0
        stats: dict[str, float] = {}
        while True:
            prompts = take_prompts(self.prompts, self.data_position, want, cfg.seed if cfg.data.shuffle else None)
            self.data_position += len(prompts)
            rollouts = self.engine.generate(prompts, rollout_cfg, progress=False)
            batches += 1
            for key in ("rollout/tokens", "timing/generate_s"):
                stats[key] = stats.get(key, 0.0) + self.engine.last_stats[key]
            stats["perf/rollout_tokens_per_s"] = stats["rollout/tokens"] / max(stats["timing/generate_s"], 1e-9)
            if not cfg.score.filter_groups:
                return rollouts, None, stats
            rewards = compute_rewards(rollouts, self.score_cfg, self.models.reward_model)
            trained = [i for i, r in enumerate(rollouts) if not r.is_greedy_baseline]
            good = {
                rollouts[trained[i]].prompt_id
                for i in informative_groups([rollouts[i].prompt_id for i in trained], rewards.task_scores[trained])
            }
            rows = [i for i, r in enumerate(rollouts) if r.prompt_id in good]
            kept += [rollouts[i] for i in rows]
            kept_rewards.append(rewards.select(rows))
            groups = list(dict.fromkeys(r.prompt_id for r in kept))
            if len(groups) >= want or (cfg.data.max_gen_batches and batches >= cfg.data.max_gen_batches):
                break
        keep_ids = set(groups[:want])
        rows = [i for i, r in enumerate(kept) if r.prompt_id in keep_ids]
        merged = Rewards(
            torch.cat([r.scores for r in kept_rewards]),
            [d for r in kept_rewards for d in r.details],
            [e for r in kept_rewards for e in r.errors],
            torch.cat([r.task_scores for r in kept_rewards]),
        )
        stats.update(
            {"dynamic_sampling/gen_batches": float(batches), "dynamic_sampling/kept_groups": float(len(keep_ids))}
        )
        if not rows:
            raise UserError(
                f"step {step}: dynamic sampling found no prompt whose samples got different rewards "
                f"in {batches} batch(es); raise data.max_gen_batches or rollout.n"
            )
        return [kept[i] for i in rows], merged.select(rows), stats

    def _train(self, step: int, result: ScoreResult) -> dict:
        metrics = {}
        warmup = self.cfg.critic.warmup_steps if self.cfg.critic else 0
        if self.critic is not None:
            metrics.update(self.critic.train_step(result.batch, step - 1))
        if step > warmup:
            metrics.update(self.trainer.train_step(result.batch, step - 1 - warmup))
            self.engine_stale = True
        return metrics

    def _save(self, step: int, before_publish=None) -> None:
        """Gather the weights and optimizer states (all ranks take part) and write them on rank 0, calling
        `before_publish()` there once the files are written, before the folder is renamed into place."""
        meta = CheckpointMeta(
            step=step,
            data_position=self.data_position,
            optimizer=self.trainer.optimizer_meta(),
            kl_coef=self.kl_coef,
            provenance=provenance("rlx ppo", self.cfg.model.path, run_dir=str(self.run_dir)),
        )
        if self.megatron is not None:
            from rlx.engine.megatron.ppo import save

            critic_meta = (
                dataclasses.replace(meta, optimizer=self.critic.optimizer_meta(), kl_coef=None) if self.critic else None
            )
            save(checkpoint_dir(self.run_dir, step), self.trainer, self.critic, self.aux, self.critic_aux, meta,
                 critic_meta, before_publish)  # fmt: skip
            drop_old_checkpoints(self.run_dir, self.cfg.keep_checkpoints, self.ctx.is_main)
            return
        weights, optimizer_state = model_weights(self.trainer.model), self.trainer.optimizer_state()
        nested = {}
        if self.critic is not None:
            nested[CRITIC_DIR] = CheckpointContent(
                model_weights(self.critic.model),
                self.critic_aux,
                dataclasses.replace(meta, optimizer=self.critic.optimizer_meta(), kl_coef=None),
                self.critic.optimizer_state(),
            )
        if self.ctx.is_main:
            save_checkpoint(
                checkpoint_dir(self.run_dir, step),
                weights=weights,
                aux=self.aux,
                meta=meta,
                optimizer_state=optimizer_state,
                overwrite=True,
                nested=nested,
                before_publish=before_publish,
            )
        drop_old_checkpoints(self.run_dir, self.cfg.keep_checkpoints, self.ctx.is_main)


def run_ppo(cfg: PPOConfig, run_dir: Path, resume: bool = False) -> None:
    """Run (or resume) the loop in `run_dir`."""
    PPORun(cfg, run_dir, resume).run()

"""The PPO loop with resident models: rollout -> score -> train-step, the same artifacts per step.

    RUN_DIR/
      recipe.json                 the resolved recipe (a resumed run must match it)
      metrics.jsonl               one line per step
      step_000001/                rollouts.jsonl, scores.jsonl, batch.safetensors
      checkpoints/step_000001/    an rlx checkpoint (HF dir + optimizer + rlx.json)

Each stage calls the same engine function as its command, with the same seeds, so the loop and a
shell pipeline of `rlx rollout | score | train-step` give identical weights and metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from pathlib import Path

from rlx.config import to_dict
from rlx.engine.checkpoint import CheckpointMeta, is_checkpoint, load_optimizer_state, provenance, save_checkpoint
from rlx.engine.device import resolve_device, resolve_precision
from rlx.engine.io import write_json
from rlx.engine.ppo.config import PPOConfig
from rlx.engine.ppo.data import take_prompts
from rlx.engine.records import read_prompts, write_records
from rlx.engine.rollout.hf import HFRolloutEngine
from rlx.engine.rollout.prompts import pad_token_id
from rlx.engine.scoring.score import ScoredModels, score_rollouts
from rlx.engine.tracking import console, log_metrics, read_metrics, step_line, truncate_metrics
from rlx.engine.training.actor import ActorTrainer
from rlx.errors import UserError
from rlx.models.loading import resolve_source
from rlx.models.policy import PolicyFiles, load_initial_policy, load_trained_policy, model_weights

RECIPE_NAME = "recipe.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step_{step:06d}"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def last_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint of a run (complete = renamed into place with its rlx.json)."""
    found = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.is_dir() and is_checkpoint(path) and path.name[5:].isdigit():
            found.append((int(path.name[5:]), path))
    return max(found) if found else None


class PPORun:
    """One run directory: the resident actor/ref/rollout engine and the step loop."""

    def __init__(self, cfg: PPOConfig, run_dir: Path, resume: bool):
        self.cfg, self.run_dir = cfg, run_dir
        self.start_step, start_ckpt = self._prepare_dir(resume)
        self.device = resolve_device(cfg.train.device)
        train_dtype = resolve_precision(cfg.train.precision, self.device)
        rollout_device = resolve_device(cfg.rollout.device)
        if rollout_device != self.device:
            raise UserError(
                "rollout.device and train.device must agree in `rlx ppo` (the rollout uses the trained model)"
            )
        self.data_position, optimizer_state, ref = 0, None, None
        if start_ckpt is None:
            model, self.tokenizer, self.aux = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)
            ref = copy.deepcopy(model) if cfg.use_ref else None
        else:
            model, self.tokenizer, self.aux = load_trained_policy(resolve_source(start_ckpt))
            self.data_position = CheckpointMeta.read(start_ckpt).data_position or 0
            optimizer_state = load_optimizer_state(start_ckpt)
            if cfg.use_ref:
                ref, _, _ = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)
        self.trainer = ActorTrainer(model, dataclasses.replace(cfg.train, seed=cfg.seed), self.device, train_dtype)
        self.trainer.load_optimizer_state(optimizer_state, str(start_ckpt))
        self.ref = ref.requires_grad_(False).to(self.device).eval() if ref is not None else None
        self.engine = HFRolloutEngine(
            self.trainer.model, self.tokenizer, self.device, resolve_precision(cfg.rollout.precision, self.device)
        )
        self.prompts = read_prompts(cfg.data.prompts)

    def _prepare_dir(self, resume: bool) -> tuple[int, Path | None]:
        """Check the run dir against the recipe; return (last completed step, its checkpoint)."""
        recipe = to_dict(self.cfg)
        recipe_path = self.run_dir / RECIPE_NAME
        if recipe_path.exists() and not resume:
            raise UserError(
                f"{self.run_dir}: already holds a run; pass --resume to continue it, or choose another --out"
            )
        if recipe_path.exists():
            saved = json.loads(recipe_path.read_text())
            saved["steps"] = recipe["steps"]  # a resumed run may be extended
            if saved != recipe:
                key = _first_difference(saved, recipe)
                raise UserError(
                    f"{self.run_dir}: the recipe differs from the run's at '{key}'; "
                    f"resume with the same recipe or start a new --out"
                )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(recipe_path, recipe)
        for stale in (self.run_dir / "checkpoints").glob(".step_*"):  # temporaries of a killed save
            shutil.rmtree(stale, ignore_errors=True)
        found = last_checkpoint(self.run_dir) if resume else None
        last = found[0] if found else 0
        truncate_metrics(self.run_dir / "metrics.jsonl", last)
        if resume:
            console(
                f"resuming {self.run_dir} after step {last}"
                if found
                else f"no checkpoint in {self.run_dir}; starting at step 1"
            )
        return last, found[1] if found else None

    def run(self) -> None:
        cfg = self.cfg
        if self.start_step >= cfg.steps:
            console(f"{self.run_dir}: all {cfg.steps} steps are done")
            return
        for step in range(self.start_step + 1, cfg.steps + 1):
            metrics = self.step(step)
            console(step_line(step, cfg.steps, metrics))
        rewards = [m.get("reward/mean") for m in read_metrics(self.run_dir / "metrics.jsonl")]
        window = min(5, len(rewards))
        console(
            f"done: reward {sum(rewards[:window]) / window:.3f} (first {window} steps) -> "
            f"{sum(rewards[-window:]) / window:.3f} (last {window}); "
            f"final checkpoint {checkpoint_dir(self.run_dir, cfg.steps)}"
        )

    def step(self, step: int) -> dict:
        """One iteration; returns its metrics (also appended to metrics.jsonl)."""
        cfg, out = self.cfg, step_dir(self.run_dir, step)
        timings = {}
        t0 = step_start = time.perf_counter()
        prompts = take_prompts(
            self.prompts, self.data_position, cfg.data.prompts_per_step, cfg.seed if cfg.data.shuffle else None
        )
        rollout_cfg = dataclasses.replace(cfg.rollout, seed=cfg.seed + step)
        rollouts = self.engine.generate(prompts, rollout_cfg, progress=False)
        metrics = dict(self.engine.last_stats)
        timings["timing/rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        models = ScoredModels(
            actor=self.trainer.model if cfg.score.old_logprobs == "actor" else None,
            ref=self.ref,
            device=self.device,
            dtype=resolve_precision(cfg.score.precision, self.device),
            vocab_size=self.trainer.model.config.vocab_size,
            pad_token_id=pad_token_id(self.tokenizer),
        )
        result = score_rollouts(rollouts, cfg.score, models, cfg.rollout.train_temperature)
        metrics.update(result.metrics)
        timings["timing/score_s"] = time.perf_counter() - t0
        if cfg.keep_artifacts:
            write_records(out / "rollouts.jsonl", rollouts)
            write_records(out / "scores.jsonl", result.scores)
            result.batch.save(out / "batch.safetensors")

        metrics.update(self.trainer.train_step(result.batch, step - 1))
        self.data_position += len(prompts)
        t0 = time.perf_counter()
        if step % cfg.save_every == 0 or step == cfg.steps:
            self._save(step)
        timings["timing/save_s"] = time.perf_counter() - t0
        metrics.update(timings)
        metrics["timing/step_s"] = time.perf_counter() - step_start
        log_metrics(self.run_dir / "metrics.jsonl", step, metrics)
        return metrics

    def _save(self, step: int) -> None:
        files = PolicyFiles(model_weights(self.trainer.model), self.aux)
        meta = CheckpointMeta(
            step=step,
            data_position=self.data_position,
            optimizer=self.trainer.optimizer_meta(),
            provenance=provenance("rlx ppo", self.cfg.model.path, run_dir=str(self.run_dir)),
        )
        save_checkpoint(
            checkpoint_dir(self.run_dir, step),
            weights=files.weights,
            aux=files.aux,
            meta=meta,
            optimizer_state=self.trainer.optimizer_state(),
            overwrite=True,
        )
        if self.cfg.keep_checkpoints:
            older = sorted((self.run_dir / "checkpoints").glob("step_*"))[: -self.cfg.keep_checkpoints]
            for path in older:
                shutil.rmtree(path, ignore_errors=True)


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
    return prefix or "<root>"


def run_ppo(cfg: PPOConfig, run_dir: Path, resume: bool = False) -> None:
    """Run (or resume) the loop in `run_dir`."""
    PPORun(cfg, run_dir, resume).run()

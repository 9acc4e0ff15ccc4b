"""The PPO loop with resident models: rollout -> score -> train-step, the same artifacts per step.

    RUN_DIR/
      recipe.json                      the resolved recipe (a resumed run must match it)
      metrics.jsonl                    one line per step
      .rlx-lock                        the run's lock: pid and host of the process running it
      step_000001/                     rollouts.jsonl, scores.jsonl, batch.safetensors (eval.jsonl with [eval])
      checkpoints/step_000001/         an rlx checkpoint of the actor (HF dir + optimizer + rlx.json)
      checkpoints/step_000001/critic/  the critic's checkpoint, when there is one

Each stage calls the same engine function as its command, with the same seeds, so the loop and a
shell pipeline of `rlx rollout | score | train-step` give identical weights and metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import uuid
from pathlib import Path

import torch

from rlx.agent.generate import build_rollout
from rlx.backends.base import Degrees
from rlx.backends.registry import backend_class
from rlx.checkpoints import catalog
from rlx.checkpoints.base import CheckpointPart
from rlx.checkpoints.loading import CheckpointWeights
from rlx.checkpoints.meta import CheckpointMeta, provenance
from rlx.checkpoints.registry import get_layout, layout_for_backend, prepare_save, read_meta, trained_layout
from rlx.config import to_dict
from rlx.errors import Terminated, UserError
from rlx.evaluation.evaluate import EVAL_FILE, eval_due, evaluate
from rlx.formats.data import take_prompts
from rlx.formats.records import RolloutRecord
from rlx.observe.flops import count_flops, count_generate_flops, device_peak_flops, mfu
from rlx.observe.memory import (
    GcPauses,
    device_peak_bytes,
    host_rss_bytes,
    measure_phase,
    phase_metrics,
    phase_peak_bytes,
    process_age_s,
    reset_device_peak,
)
from rlx.observe.profile import profile_step, profiled_step
from rlx.observe.tracking import Tracker, console, heartbeat, read_metrics, reward_summary, select_traces
from rlx.parallel.dist import barrier, broadcast_object, context
from rlx.ppo.config import PPOConfig
from rlx.ppo.dynamic_sampling import GroupFilter, sampling_metrics
from rlx.ppo.models import CRITIC_DIR, build_run_models
from rlx.ppo.rundir import (
    check_checkpoint_space,
    check_space_before_loading,
    checkpoint_bytes,
    checkpoint_dir,
    checkpoint_write_error,
    drop_old_checkpoints,
    prepare_run_dir,
    step_dir,
)
from rlx.ppo.start import RunInputs, RunLock, StopRequest, check_data_parallel_batches, check_run_inputs
from rlx.ppo.warm_start import warm_start, warm_start_record
from rlx.ppo.writer import BackgroundWriter, write_jsonl_shared
from rlx.rollout.base import RolloutStats, build_engine
from rlx.scoring.score import Rewards, ScoreResult, compute_rewards, score_rollouts
from rlx.training.config import describe_sizes
from rlx.utils.device import resolve_device
from rlx.utils.host_copy import reserve
from rlx.utils.io import write_jsonl


class PPORun:
    """One run directory: the resident actor, reference, critic and rollout engine, and the step loop."""

    def __init__(self, cfg: PPOConfig, run_dir: Path, resume: bool, overwrite: bool = False):
        self.cfg, self.run_dir = cfg, run_dir
        self.setup_metrics = {"timing/setup_process_s": process_age_s()}  # interpreter, imports, recipe
        entered = time.perf_counter()
        grid = cfg.megatron or Degrees()  # [megatron] holds tp_degree and pp_degree
        degrees = Degrees(
            sp_degree=cfg.train.sp_degree,
            tp_degree=grid.tp_degree,
            pp_degree=grid.pp_degree,
            ep_degree=cfg.train.ep_degree,  # the megatron backend's; FSDP reads it from the trainer's config
        )
        self.backend = backend_class(cfg.backend_name).setup(cfg.train.device, degrees)
        self.ctx = self.backend.ctx
        self.device = self.ctx.device
        check_data_parallel_batches(cfg, self.ctx.dp_size, self.ctx.world)  # the ranks are known from here
        if resolve_device(cfg.rollout.device).type != self.device.type:
            raise UserError(
                "rollout.device and train.device must agree in `rlx ppo` (the rollout uses the trained model)"
            )
        self.setup_t0 = time.perf_counter()
        self.setup_metrics["timing/setup_backend_s"] = self.setup_t0 - entered  # device, process group
        inputs = check_run_inputs(cfg, run_dir)  # before anything is written: a failed start leaves no trace
        self.lock = RunLock.take(run_dir, self.ctx)
        try:
            self._start(inputs, resume, overwrite)
        except BaseException:
            self.lock.release()
            raise

    def _start(self, inputs: RunInputs, resume: bool, overwrite: bool) -> None:
        cfg = self.cfg
        record = warm_start_record(cfg, self.device, inputs.source)  # a finished [sft] warm start: reused if the same
        start = prepare_run_dir(self.run_dir, to_dict(cfg), resume, self.ctx.is_main, overwrite, record)
        self.start_step, start_ckpt = start.step, start.checkpoint
        meta = read_meta(start_ckpt) if start_ckpt else CheckpointMeta()
        self.data_position = meta.data_position or 0
        self.kl_coef = meta.kl_coef if meta.kl_coef is not None else cfg.score.kl_coef
        if cfg.lora is None:  # a run that cannot write its first checkpoint stops before loading the models
            check_space_before_loading(self.run_dir, inputs.config, self._saves(), cfg.keep_checkpoints)
        initial = warm_start(cfg, self.run_dir, self.start_step, self.ctx, record, start.warm_start_kept)  # [sft]
        started = time.perf_counter()
        self.setup_metrics["timing/setup_inputs_s"] = started - self.setup_t0  # data checks, run folder, warm start
        fresh = start_ckpt is None and initial is cfg  # starts from the recipe's model, resolved by the checks
        policy = (inputs.source, inputs.config) if fresh else None
        with heartbeat("rlx ppo: building the models" if self.ctx.is_main else None):
            self.models = build_run_models(initial, self.backend, start_ckpt, policy)
        self.trainer, self.critic = self.models.actor, self.models.critic
        self._check_checkpoint_space()
        models_built = time.perf_counter()
        self.engine = self._build_engine()
        self.rollout = build_rollout(self.cfg.rollout, self.engine)  # the engine, or episodes on it (multi-turn)
        # where a start's time goes, reported with the first step: models (load or init, parallelism), engine
        self.setup_metrics |= {
            "timing/setup_models_s": models_built - started,
            "timing/setup_engine_s": time.perf_counter() - models_built,
            "timing/since_process_start_s": process_age_s(),
        }
        self.engine_stale = False  # whether the trainer changed the weights since the engine last got them
        self.writer = BackgroundWriter(enabled=cfg.background_writes, mib_per_s=cfg.write_mib_per_s)
        self.parts_tag = broadcast_object(uuid.uuid4().hex[:12] if self.ctx.is_main else None)
        self.gc_pauses = GcPauses()
        self.prompts, self.eval_prompts = inputs.prompts, inputs.eval_prompts
        self.score_cfg = dataclasses.replace(
            cfg.score, max_response_length=cfg.score.max_response_length or cfg.rollout.sampling.max_new_tokens
        )
        self.stop = StopRequest()
        self.said_uneven = False  # a short step's unequal mini-batches (dynamic sampling) are said once

    def _check_checkpoint_space(self) -> None:
        """Stop before the first step when the run folder cannot hold a checkpoint; warn when it cannot hold what
        keep_checkpoints and save_every will put there (rundir.check_checkpoint_space)."""
        cfg = self.cfg
        saves = self._saves()
        trained = [t.module for t in (self.trainer, self.critic) if t is not None]
        self.checkpoint_bytes = checkpoint_bytes(m for m in trained if isinstance(m, torch.nn.Module))
        warning = check_checkpoint_space(self.run_dir, self.checkpoint_bytes, saves, cfg.keep_checkpoints)
        if warning and self.ctx.is_main:
            console(f"rlx ppo: warning: {warning}")

    def _saves(self) -> list[int]:
        """The steps this run (from its start step) writes a checkpoint at."""
        cfg = self.cfg
        return [s for s in range(self.start_step + 1, cfg.steps + 1) if s % cfg.save_every == 0 or s == cfg.steps]

    def _build_engine(self):
        """The rollout engine the steps generate with (an asynchronous run's trainers have none: async_train.py)."""
        models = self.models
        return build_engine(self.cfg.rollout, models.rollout_model, models.tokenizer, self.ctx, models.processor)

    def run(self) -> None:
        cfg = self.cfg
        profiled_step()  # a bad RLX_PROFILE_STEP stops the run before its first step
        if self.start_step >= cfg.steps:
            if self.ctx.is_main:
                console(f"{self.run_dir}: all {cfg.steps} steps are done")
            return
        tracker = (
            Tracker(cfg.tracking, self.run_dir, to_dict(cfg), start_step=self.start_step)
            if self.ctx.is_main
            else contextlib.nullcontext()
        )
        with tracker, self.stop.on_sigterm():
            finished = False

            def log(step: int, metrics: dict, traces: list[dict]) -> None:
                if self.ctx.is_main:
                    tracker.log_traces(step, traces)
                    tracker.log(step, metrics)

            try:
                if cfg.eval is not None and cfg.eval.before_training and self.start_step == 0:
                    log(0, self._evaluate(0), [])
                for step in range(self.start_step + 1, cfg.steps + 1):
                    with profile_step(step, self.ctx.rank, self.device):
                        self.step(step, log)
                    if step < cfg.steps and self.stop.agreed():
                        self._stop_after(step)
                finished = True
            finally:
                try:
                    self.writer.close()  # the last checkpoint's files; a failed write raises here
                finally:
                    if finished:  # after a failure the others may be inside a collective: exit, and the launcher
                        barrier()  # stops them; here every rank is done (vllm's shutdown leaves the process group)
                    self.engine.close()
                    self.gc_pauses.close()
        if self.ctx.is_main:
            rewards = [m["reward/mean"] for m in read_metrics(self.run_dir / "metrics.jsonl") if "reward/mean" in m]
            console(f"done: {reward_summary(rewards)}; final checkpoint {checkpoint_dir(self.run_dir, cfg.steps)}")

    def _stop_after(self, step: int) -> None:
        """SIGTERM arrived: make sure `step` has a checkpoint, then stop (exit 143) saying how to resume."""
        if step % self.cfg.save_every != 0:
            self.writer.submit(self._prepare_save(step))
        self.writer.flush()  # the checkpoint's files are complete before the message names it
        raise Terminated(f"stopped by SIGTERM after step {step}/{self.cfg.steps}")  # `rlx ppo` says how to continue

    def _evaluate(self, step: int) -> dict:
        """[eval] on the held-out prompts with the current weights (the engine is refreshed now if a train step
        changed them, which the next rollout would otherwise do); eval.jsonl goes into step_NNNNNN/."""
        start = time.perf_counter()
        if self.engine_stale:
            self.engine.wake()
            self.engine.update_weights(self.trainer.weights())
            self.engine_stale = False
        samples, metrics = evaluate(self.cfg.eval, self.engine, self.eval_prompts)
        if self.ctx.is_main:
            write_jsonl(step_dir(self.run_dir, step) / EVAL_FILE, (s.to_json() for s in samples))
        metrics["timing/eval_s"] = time.perf_counter() - start
        return metrics

    def _eval_due(self, step: int) -> bool:
        return step > 0 and eval_due(self.cfg.eval, step, 0, self.cfg.steps)

    def step(self, step: int, log) -> None:
        """One iteration.  `log(step, metrics, trace rows)` is called once, before the step's checkpoint is
        published (the files are written in the background while the next step runs): a run killed in between
        resumes from an earlier checkpoint and writes the line again."""
        cfg, out, step_start = self.cfg, step_dir(self.run_dir, step), time.perf_counter()
        progress = f"step {step}/{cfg.steps}" if self.ctx.is_main else None  # 'still running' lines of a long phase
        with measure_phase("weight_sync", self.device, progress=progress) as sync:
            self._refresh_engine(step)
        with measure_phase("rollout", self.device, progress=progress) as phase:
            rollouts, rewards, metrics = self._sample(step)
        metrics.update(phase)
        metrics.update(sync)
        metrics.update({f"rollout/{k}": float(v) for k, v in self.engine.counters().items()})
        released = self.engine.sleep()  # the trainer gets the memory until the next rollout
        metrics["memory/rollout_engine_released_gb"] = released / 2**30
        with measure_phase("score", self.device, self.engine.unmapped_bytes(), progress) as phase:
            score_cfg = dataclasses.replace(self.score_cfg, kl_coef=self.kl_coef, filter_groups=False)
            models = self.models.scoring
            from_rollout = self._old_logprobs_from_rollout(rollouts)
            if from_rollout:  # exact mode, one update: the actor's forward would give the rollout's logprobs again
                models = dataclasses.replace(models, actor=None)
            temperature = cfg.rollout.sampling.train_temperature
            result = score_rollouts(rollouts, score_cfg, models, temperature, rewards, replicas=self.engine.ctx)
        metrics.update(result.metrics)
        if cfg.exact:
            metrics["score/old_logprobs_from_rollout"] = float(from_rollout)
        metrics.update(phase)
        if result.next_kl_coef is not None:
            self.kl_coef = result.next_kl_coef
        if cfg.keep_artifacts:  # every rank writes its share of the records (rank 0 alone: 2-4 x the 1-GPU work)
            self.writer.submit(lambda: self._write_artifacts(out, rollouts, result, cfg.vision.store_pixels))
        with measure_phase("train", self.device, self.engine.unmapped_bytes(), progress) as phase:
            metrics.update(self._train(step, result))
        metrics.update(phase)
        if self._eval_due(step):
            metrics.update(self._evaluate(step))
        reset_device_peak(self.device)
        save_start = time.perf_counter()
        saving = step % cfg.save_every == 0 or step == cfg.steps
        commit = self._prepare_save(step) if saving else None  # the collective part: gathered weights on the CPU
        if self.setup_metrics:  # the first step of this process: what is alive now (compiled graphs) lives all run
            self.gc_pauses.freeze()
            if not saving:
                self._reserve_snapshot_buffers()
        self.gc_pauses.between_steps(step)  # the collector runs here only, not inside a phase
        now = time.perf_counter()
        # the engine sleeps through the save unless an eval woke it (then it holds nothing unmapped)
        save_peak = phase_peak_bytes(device_peak_bytes(self.device), self.engine.unmapped_bytes())
        metrics.update(phase_metrics("save", now - save_start, save_peak, host_rss_bytes()))
        metrics["timing/step_s"] = now - step_start
        metrics.update(self.gc_pauses.take())
        metrics.update(self.setup_metrics)  # the first step of this process only
        self.setup_metrics = {}
        metrics.update(self._flops_metrics(rollouts, metrics))
        traces = select_traces(rollouts, result.scores, cfg.tracking.traces_per_step, seed=cfg.seed + step)
        log(step, metrics, traces)  # before the checkpoint is published: a kill in between resumes from an earlier one
        if commit is not None:
            self.writer.submit(commit)

    def _old_logprobs_from_rollout(self, rollouts: list[RolloutRecord]) -> bool:
        """Whether the score phase skips the actor's forward: in exact mode the rollout's logprobs are the actor's
        bit for bit, and with one update per batch (one epoch, one mini-batch) the policy has not changed since (not
        under [async]: its rollouts may come from an older policy)."""
        if self.cfg.async_ is not None:
            return False
        one_update = self.cfg.train.updates_once(sum(not r.is_greedy_baseline for r in rollouts))
        return self.cfg.exact and one_update and self.models.scoring.actor is not None

    def _write_artifacts(self, out: Path, rollouts: list[RolloutRecord], result: ScoreResult, store_pixels: bool):
        """The step's rollouts.jsonl and scores.jsonl (each rank encodes its share: write_jsonl_shared) and, from
        rank 0, batch.safetensors; on the writer thread of every rank."""
        rank, world = self.ctx.rank, self.ctx.world
        parts = out / f".parts-{self.parts_tag}"  # this launch's: a killed one's shares are never read
        write_jsonl_shared(out / "rollouts.jsonl", rollouts, rank, world, parts)
        write_jsonl_shared(out / "scores.jsonl", result.scores, rank, world, parts)
        if rank == 0:
            result.batch.save(out / "batch.safetensors", store_pixels=store_pixels)
            for folder in out.glob(".parts-*"):  # this launch's (every share was read) and a killed one's
                shutil.rmtree(folder, ignore_errors=True)

    def _flops_metrics(self, rollouts: list[RolloutRecord], metrics: dict) -> dict:
        """Model FLOPs of the step (generation, scoring forwards, training: every rank's samples) and MFU against the
        peak of all the run's devices (one device's peak x the world size)."""
        config = self.trainer.config
        prompt_lens = [len(r.prompt_ids) for r in rollouts]
        response_lens = [len(r.response_ids) for r in rollouts]
        lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
        scoring = self.models.scoring
        forwards = sum(m is not None for m in (scoring.actor, scoring.ref, scoring.critic))
        trained = [(self.trainer, self.cfg.train.epochs)]
        if self.critic is not None:
            trained.append((self.critic, self.cfg.critic.train.epochs))
        # a LoRA model's frozen base computes no weight gradients
        train = sum(epochs * count_flops(config, lengths, "train_frozen" if getattr(t, "lora", None) else "train")
                    for t, epochs in trained)  # fmt: skip
        phases = {
            "rollout": count_generate_flops(config, prompt_lens, response_lens),
            "score": forwards * count_flops(config, lengths, "forward"),
            "train": train,
        }
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        peak = device_peak_flops(name) * context().world
        out = {"perf/flops": sum(phases.values())}
        for phase, flops in phases.items():
            seconds = metrics.get(f"timing/{phase}_s", 0.0)
            if peak and seconds > 0:
                out[f"perf/mfu_{phase}"] = mfu(flops, seconds, peak)
        if peak:
            out["perf/mfu"] = mfu(out["perf/flops"], metrics["timing/step_s"], peak)
        return out

    def _refresh_engine(self, step: int) -> None:
        """Wake the rollout engine and give it the weights the last train step wrote (from the trainer in memory, or
        with rollout.weight_sync = 'disk' from the step's checkpoint)."""
        if not self.engine_stale:
            return
        self.engine.wake()
        source = self.trainer.weights()
        if self.cfg.rollout.weight_sync == "disk":
            source = CheckpointWeights(checkpoint_dir(self.run_dir, step - 1))
        self.engine.update_weights(source)
        self.engine_stale = False

    def _sample(self, step: int) -> tuple[list[RolloutRecord], Rewards | None, dict]:
        """Rollouts for the step.  With score.filter_groups (DAPO dynamic sampling, dynamic_sampling.py), batches
        of prompts are sampled until prompts_per_step informative groups are collected (or max_gen_batches)."""
        cfg = self.cfg
        sampling = dataclasses.replace(cfg.rollout.sampling, seed=cfg.seed + step)
        want, stats = cfg.data.prompts_per_step, RolloutStats(0, 0.0)
        groups = GroupFilter(want, cfg.data.max_gen_batches)
        while True:
            prompts = take_prompts(self.prompts, self.data_position, want, cfg.seed if cfg.data.shuffle else None)
            self.data_position += len(prompts)
            result = self.rollout.generate(prompts, sampling, progress=False)
            rollouts, stats = result.records, stats + result.stats
            if not cfg.score.filter_groups:
                return rollouts, None, stats.metrics()
            rewards = compute_rewards(rollouts, self.score_cfg, self.models.scoring.reward_model, self.engine.ctx)
            groups.add(rollouts, rewards)
            if not groups.needs_more(len(groups.groups)):
                break
        records, rewards, _ = groups.take(want)
        return records, rewards, {**stats.metrics(), **sampling_metrics(step, records, groups.num_batches)}

    def _train(self, step: int, result: ScoreResult) -> dict:
        self._say_uneven_mini_batches(step, result.batch.size, len(set(result.batch.meta.group_ids)))
        metrics = {}
        warmup = self.cfg.critic.warmup_steps if self.cfg.critic else 0
        if self.critic is not None:
            metrics.update(self.critic.train_step(result.batch, step - 1))
        if step > warmup:
            metrics.update(self.trainer.train_step(result.batch, step - 1 - warmup))
            self.engine_stale = True
        return metrics

    def _say_uneven_mini_batches(self, step: int, samples: int, groups: int) -> None:
        """Dynamic sampling that did not fill its step trains fewer samples than the config check saw (it refuses a
        mini_batch_size that does not divide a full step), which mini_batch_size may not divide: the last optimizer
        step then takes fewer samples. Said once a run, on the main process."""
        cfg = self.cfg
        if self.said_uneven or not self.ctx.is_main:
            return
        for key, train in (("train", cfg.train), ("critic.train", cfg.critic.train if cfg.critic else None)):
            sizes = train.mini_batch_sizes(samples) if train is not None else []
            if len(set(sizes)) > 1:
                self.said_uneven = True
                console(
                    f"rlx ppo: warning: step {step} trains {samples} samples (dynamic sampling found {groups} of the "
                    f"{cfg.data.prompts_per_step} groups informative within data.max_gen_batches = "
                    f"{cfg.data.max_gen_batches}): {key}.mini_batch_size {train.mini_batch_size} cuts them into "
                    f"{describe_sizes(sizes)}, the last on fewer samples; every short step the size does not divide "
                    "is cut so (said once)"
                )

    def _reserve_snapshot_buffers(self) -> None:
        """Pin the host buffers of the first checkpoint's snapshots on the writer thread while the next steps run (that
        checkpoint's step otherwise pinned them itself: 6 GB for the 0.5B bench, 1.8-4 s on an H100's host). The
        default layout copies the trainers' live tensors (`snapshot_state`), the sharded 'fsdp' layout each rank's
        shards (`Layout.host_buffers`); a backend's own layout (megatron's stages) writes its state otherwise."""
        layout = get_layout(self._save_layout())
        if layout.name == catalog.DEFAULT:
            trainers = [t for t in (self.trainer, self.critic) if t is not None]
            layouts = [x for t in trainers for x in t.snapshot_layout()]
        else:
            states = {"": self.trainer.state(), **({CRITIC_DIR: self.critic.state()} if self.critic else {})}
            layouts = layout.host_buffers(states)
        if layouts:
            self.writer.submit(lambda: [reserve(shapes, tag) for shapes, tag in layouts])

    def _save_layout(self) -> str:
        """The checkpoints' layout: checkpoint_layout, or when unset under a launcher the backend's layout whose
        ranks write their own shards in parallel (not with weight_sync 'disk': the engine reloads a Hugging Face
        dir; not with [async]: its trainers are a subgroup), else the backend's own."""
        if self.cfg.checkpoint_layout is not None:
            return self.cfg.checkpoint_layout
        sharded = self.ctx.world > 1 and self.cfg.rollout.weight_sync == "memory" and self.cfg.async_ is None
        return layout_for_backend(self.backend.name, sharded=sharded).name

    def _prepare_save(self, step: int):
        """Gather the actor (critic nested) for the backend's layout now (every rank takes part); returns the write
        of the files, with the rotation of old checkpoints after it, for the background writer."""
        self.writer.flush()  # one checkpoint in memory at a time; a failed earlier write stops the run here
        own_layout = self._save_layout()
        meta = CheckpointMeta(
            step=step,
            layout=trained_layout(self.trainer.state(), own_layout),
            data_position=self.data_position,
            optimizer=self.trainer.optimizer_meta(),
            kl_coef=self.kl_coef,
            provenance=provenance("rlx ppo", self.cfg.model.path, run_dir=str(self.run_dir)),
        )
        nested = {}
        if self.critic is not None:
            critic_meta = dataclasses.replace(
                meta,
                layout=trained_layout(self.critic.state(), own_layout),
                optimizer=self.critic.optimizer_meta(),
                kl_coef=None,
            )
            nested[CRITIC_DIR] = CheckpointPart(self.critic.state(), self.models.critic_aux, critic_meta)
        out = checkpoint_dir(self.run_dir, step)
        write = prepare_save(out, self.trainer.state(), self.models.aux, meta, overwrite=True, nested=nested)

        def commit() -> None:
            try:
                write()
            except Exception as e:  # an I/O failure gets the checkpoint's name; others go on as they are
                described = checkpoint_write_error(out, self.checkpoint_bytes, e)
                if described is None:
                    raise
                raise described from e
            if self.ctx.is_main:
                drop_old_checkpoints(self.run_dir, self.cfg.keep_checkpoints)

        return commit


def run_ppo(cfg: PPOConfig, run_dir: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Run (or resume, or with `overwrite` replace) the loop in `run_dir`, holding its lock throughout."""
    if cfg.async_ is not None:
        raise UserError("a recipe with [async] runs through `rlx ppo` under torchrun (rlx/ppo/async_train.py)")
    run = PPORun(cfg, run_dir, resume, overwrite)
    try:
        run.run()
    finally:
        run.lock.release()

"""What `rlx ppo` checks and takes before it writes anything to its run folder.

`check_data_parallel_batches` checks, once the ranks are known, that each optimizer step's mini-batch feeds every
data-parallel rank. `check_run_inputs` reads and validates everything a run needs up front (the run folder's place,
the model, every [sft] demonstration, every prompt line, the prompt lengths, the reward functions, the eval prompts),
so a bad input stops the start with one line and leaves the folder as it was. `RunLock` then makes the folder this
process's: an exclusive lock (flock) on RUN_DIR/.rlx-lock that names the holder's pid and host; the kernel drops it
when the holder dies, so a killed run's lock is simply taken over. `StopRequest` turns SIGTERM (SLURM preemption)
into a stop after the current step and its checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlx.checkpoints.loading import check_init, load_processor
from rlx.checkpoints.meta import is_checkpoint
from rlx.checkpoints.registry import check_complete
from rlx.errors import Terminated, UserError
from rlx.formats.data import check_window
from rlx.formats.records import PromptRecord, read_prompts
from rlx.models.loading import ModelSource, load_tokenizer, resolve_model, weight_files
from rlx.observe.tracking import console
from rlx.parallel.dist import all_gather_objects, all_reduce
from rlx.ppo.config import PPOConfig
from rlx.rollout.lengths import limit_prompts, model_context
from rlx.scoring.rewards import RewardFunctions
from rlx.stages.sft import load_samples
from rlx.training.config import describe_ranks, sizes_for_ranks
from rlx.utils.files import check_writable

LOCK_NAME = ".rlx-lock"


@dataclass
class RunInputs:
    """The checked prompts of a run (too-long ones already left out with rollout.on_long_prompt = 'filter')."""

    prompts: list[PromptRecord]
    eval_prompts: list[PromptRecord] | None
    source: ModelSource
    """The recipe's model, resolved once for the whole start."""
    config: object
    """Its transformers config, read once."""


def check_run_inputs(cfg: PPOConfig, run_dir: Path) -> RunInputs:
    """Everything a start needs, checked before the run folder is touched (UserError naming what is wrong)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir}: is a file; expected a run folder (new, or one holding a run)")
    check_writable(run_dir / "recipe.json", "run folder")
    source, config = resolve_model(cfg.model.path)
    check_init(source, cfg.model.init)
    tokenizer = load_tokenizer(source)
    if cfg.model.init == "pretrained" and not source.is_gguf:
        if is_checkpoint(source.path):
            check_complete(source.path)
        else:
            weight_files(source.path)
    context = model_context(config)
    if cfg.sft is not None:  # every demonstration read and tokenised (which end-of-turn tokens train: not needed here)
        load_samples(cfg.sft, tokenizer, config, stop_ids=set(), quiet=True)
    prompts = read_prompts(cfg.data.prompts)
    processor = load_processor(source, cfg.vision, config)  # image tokens count against the limits
    prompts = limit_prompts(
        prompts, tokenizer, cfg.rollout, context, cfg.data.prompts, config=config, processor=processor
    )
    check_window(cfg.data.prompts_per_step, len(prompts), cfg.data.prompts, "data.prompts_per_step")
    check_rewards(cfg.score.reward, prompts, cfg.score.reward_model)
    eval_prompts = None
    if cfg.eval is not None:
        eval_prompts = read_prompts(cfg.eval.prompts)
        eval_prompts = limit_prompts(
            eval_prompts, tokenizer, cfg.rollout, context, cfg.eval.prompts,
            max_new_tokens=cfg.eval.sampling.max_new_tokens, config=config, processor=processor,
        )  # fmt: skip
        check_rewards(cfg.eval.reward, eval_prompts, None)
    return RunInputs(prompts, eval_prompts, source, config)


def check_data_parallel_batches(cfg: PPOConfig, dp_size: int, world: int) -> None:
    """Under a launcher, each optimizer step splits its mini-batch over the `dp_size` data-parallel ranks (a
    work-balanced share each, Trainer.local_rows; `world`: the training processes): a mini-batch smaller than the ranks
    leaves one without a sample, which the train step would find only after step 1's rollout. Refused before anything
    is written, naming the key, its value, the ranks and the sizes that work. A mini-batch that does not split into
    equal counts is fine: the shares are balanced by tokens, not counts."""
    if dp_size <= 1:
        return
    pps, n = cfg.data.prompts_per_step, cfg.rollout.sampling.n
    samples = pps * n
    ranks = describe_ranks(dp_size, world)
    if samples < dp_size:
        raise UserError(
            f"data.prompts_per_step: a step's {samples} samples (data.prompts_per_step {pps} x rollout.sampling.n {n}) "
            f"are fewer than {ranks}: each optimizer step needs a sample or more per rank; data.prompts_per_step "
            f"{-(-dp_size // n)} or more"
        )
    for key, train in (("train", cfg.train), ("critic.train", cfg.critic.train if cfg.critic else None)):
        if train is None or min(train.mini_batch_size or samples, samples) >= dp_size:
            continue
        raise UserError(
            f"{key}.mini_batch_size: {train.mini_batch_size} is fewer samples than {ranks}: each optimizer step splits "
            f"its mini-batch over them, a sample or more each; sizes that work (dividing a step's {samples} samples, "
            f"{dp_size} or more): {sizes_for_ranks(samples, dp_size)}, or 0 (the whole step in one optimizer step)"
        )


def check_rewards(specs: list[str], prompts: list[PromptRecord], reward_model: str | None) -> None:
    """The reward functions load, or every prompt's data_source names a built-in (a reward model alone needs
    neither)."""
    functions = RewardFunctions(specs)
    if specs or reward_model:
        return
    for source in sorted({p.data_source for p in prompts}, key=str):
        functions.for_source(source, f"data_source {source!r}")


class RunLock:
    """An exclusive lock on a run folder, held by rank 0 for the whole run (`take`, then `release`)."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, run_dir: Path, ctx) -> RunLock:
        """Lock `run_dir` (created if needed) on rank 0; every rank raises the same UserError when another
        process holds it."""
        fd, error = None, None
        if ctx.is_main:
            try:
                fd = _lock(run_dir / LOCK_NAME)
            except UserError as e:
                error = str(e)
        errors = [e for e in all_gather_objects(error) if e] if ctx.distributed else [error] if error else []
        if errors:
            if fd is not None:
                os.close(fd)
            raise UserError(errors[0])
        return cls(run_dir / LOCK_NAME, fd)

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays, naming no one."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = None


def _lock(path: Path) -> int:
    """flock `path` without waiting and write 'pid host' into it; a UserError naming the holder if it is taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        os.close(fd)
        pid, host = (holder + ["?", "?"])[:2]
        raise UserError(
            f"{path.parent}: in use by another rlx ppo (pid {pid} on host {host}); wait for it to finish or stop "
            f"it (the lock is released when that process exits), or choose another --out"
        ) from None
    except OSError as e:  # a file system without locks (say so rather than run two writers unknowingly)
        os.close(fd)
        raise UserError(f"{path}: cannot lock the run folder ({e.strerror})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


class StopRequest:
    """SIGTERM during a run: noted by the handler, acted on by the loop after the current step (a second SIGTERM
    stops at once)."""

    def __init__(self):
        self.requested = False

    @contextlib.contextmanager
    def on_sigterm(self) -> Iterator[None]:
        """Catch SIGTERM while the block runs (main thread only; the previous handler comes back after)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.requested:
                raise Terminated("terminated by a second SIGTERM")
            self.requested = True
            console("SIGTERM: stopping after this step, once its checkpoint is written")

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def agreed(self) -> bool:
        """Whether any rank got SIGTERM (every rank calls this after each step, so all stop together)."""
        import torch.distributed as dist

        if dist.is_initialized():
            return bool(all_reduce(float(self.requested), "max"))
        return self.requested

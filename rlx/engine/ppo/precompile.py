"""Compilation ahead of need: while a run starts on cold compile caches, a child process compiles its scoring and
training graphs on a small copy of the policy, and the run finds them in the cache when it gets there.

torch.compile keeps what it builds under $RLX_CACHE (rlx/utils/cache.py), keyed by the traced graph and its inputs'
types, not by the model's depth: the decoder layers of a three-layer copy trace to the graphs of the run's own layers
(weights are inputs; `stable_compile_keys` keeps the keys free of the shapes a process saw before). On a fresh CUDA
machine the first step of a 0.5B run spent 17-26 s compiling its score and train phases, after about 50 s of imports,
set-up and the first rollout during which nothing compiled them (bench/RESULTS.md). So `rlx ppo` starts, right after
reading the recipe, a child that builds the copy through the run's own code (backend, models, scoring, trainer; the
recipe's settings, random weights: nothing is read) and runs the actor's and reference's logprobs and one train step
on a synthetic batch. The run waits for it just before its first score phase (by then it is usually done, and its
memory is free again); a child that fails costs a warning line and the run compiles alone. A marker under
$RLX_CACHE/precompile skips the child on the next start of the same setup (whose caches are warm).

The rollout engine's decode graphs are not compiled ahead: the run needs them first, and in a measured cold start a
child compiling them finished 28 s after the run had got to its first rollout (bench/RESULTS.md).

Only where the graphs are the simple case: one process (not under torchrun), the FSDP backend, a text policy without
LoRA, train.compile on, CUDA; RLX_COMPILE_AHEAD=0 turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlx.config import from_dict, to_dict
from rlx.engine.ppo.config import ModelConfig, PPOConfig
from rlx.engine.tracking import console
from rlx.utils.cache import cache_root

PHASES = ("train",)
COPY_LAYERS = 3
"""Decoder layers of the copy: a first (its input the embeddings), a last (its gradient from the final norm) and one
between (input and gradient from compiled layers), whose graphs can each differ (a backward's incoming gradient's
strides are part of what Inductor caches)."""
WAIT_LIMIT_S = 600.0
"""Longest a run waits for a child before it stops it and compiles alone."""


def phases_for(cfg: PPOConfig, device_type: str) -> tuple[str, ...]:
    """The phases a run of `cfg` on `device_type` compiles ahead (none where its graphs are not the simple case)."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    simple = (
        os.environ.get("RLX_COMPILE_AHEAD", "1") != "0"
        and device_type == "cuda"
        and not distributed
        and cfg.async_ is None
        and cfg.backend_name == "fsdp"
        and cfg.lora is None
        and (cfg.critic is None or cfg.critic.lora is None)
        and _model_config(cfg) is not None
    )
    if not simple:
        return ()
    return ("train",) if cfg.train.compile else ()


def _model_config(cfg: PPOConfig) -> dict | None:
    """The policy's config.json for a local text model folder (None for GGUF files, remote and vision models)."""
    path = Path(cfg.model.path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return None if "text_config" in config or "vision_config" in config else config


def marker(cfg: PPOConfig, phase: str) -> Path:
    """The file that says this setup's `phase` was compiled ahead: a digest of the policy's architecture, the
    recipe's score and train settings and the torch version."""
    import torch

    import rlx

    config = dict(_model_config(cfg) or {})
    config.pop("num_hidden_layers", None)
    config.pop("layer_types", None)
    settings = {k: to_dict(getattr(cfg, k)) for k in ("score", "train")}
    key = json.dumps([phase, config, settings, torch.__version__, rlx.__version__], sort_keys=True, default=str)
    return cache_root() / "precompile" / f"{phase}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


class Precompile:
    """The children compiling a run's phases ahead; `wait(phase)` before the run's first phase of that kind."""

    def __init__(self, cfg: PPOConfig, phases: tuple[str, ...]):
        self.work = Path(tempfile.mkdtemp(prefix="rlx-precompile-"))
        spec = self.work / "recipe.json"
        spec.write_text(json.dumps(to_dict(cfg)))
        self.children: dict[str, tuple[subprocess.Popen, Path]] = {}
        for phase in phases:
            log = self.work / f"{phase}.log"
            with open(log, "wb") as out:
                cmd = [sys.executable, "-m", "rlx.engine.ppo.precompile", phase, str(spec), str(marker(cfg, phase))]
                self.children[phase] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), log)
        self.waited_s = 0.0

    def wait(self, phase: str) -> None:
        """Block until the child compiling `phase` has finished (stopped after WAIT_LIMIT_S); a failed child is
        reported with the end of its log."""
        child = self.children.pop(phase, None)
        if child is None:
            return
        proc, log = child
        start = time.perf_counter()
        try:
            code = proc.wait(timeout=WAIT_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        self.waited_s += time.perf_counter() - start
        if code != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            console(f"rlx ppo: compiling the {phase} graphs ahead failed (exit {code}: {tail[0]}); compiling them now")

    def close(self) -> None:
        """Stop the children still running and remove their files."""
        for proc, _ in self.children.values():
            proc.kill()
            proc.wait()
        self.children = {}
        for path in sorted(self.work.iterdir()):
            path.unlink()
        self.work.rmdir()


def start_precompile(cfg: PPOConfig, device_type: str) -> Precompile | None:
    """Start the children for the phases of `cfg` that have no marker yet (None: nothing to compile ahead)."""
    phases = tuple(p for p in phases_for(cfg, device_type) if not marker(cfg, p).exists())
    if not phases:
        return None
    console(f"rlx ppo: cold compile cache: compiling the {' and '.join(phases)} graphs ahead in the background")
    return Precompile(cfg, phases)


def small_copy_config(cfg: PPOConfig, folder: Path) -> PPOConfig:
    """`cfg` for a randomly initialised copy of its policy with COPY_LAYERS layers (config and tokenizer files written
    to `folder`), with what only the run itself needs left out: SFT, eval, the critic, the reward model, dynamic
    sampling."""
    from rlx.engine.checkpoints.files import aux_files

    folder.mkdir(parents=True, exist_ok=True)
    for name, data in aux_files(Path(cfg.model.path)).items():
        (folder / name).write_bytes(data)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = min(COPY_LAYERS, config.get("num_hidden_layers", COPY_LAYERS))
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][: config["num_hidden_layers"]]
    (folder / "config.json").write_text(json.dumps(config))
    score = dataclasses.replace(
        cfg.score,
        reward_model=None,
        filter_groups=False,
        estimator="grpo" if cfg.score.estimator == "gae" else cfg.score.estimator,
    )
    if score.estimator == "remax":
        score = dataclasses.replace(score, estimator="grpo")
    return dataclasses.replace(
        cfg, model=ModelConfig(path=str(folder), init="random"), sft=None, eval=None, critic=None, score=score,
        steps=1,
    )  # fmt: skip


def run_phase(phase: str, cfg: PPOConfig, work: Path) -> None:
    """Build the small copy of `cfg`'s policy and run `phase`'s work on it (compiling, and so filling the cache)."""
    from rlx.engine.backends.base import Degrees
    from rlx.engine.backends.registry import backend_class
    from rlx.engine.ppo.models import build_run_models

    cfg = small_copy_config(cfg, work / "model")
    backend = backend_class(cfg.backend_name).setup(cfg.train.device, Degrees(sp_degree=cfg.train.sp_degree))
    models = build_run_models(cfg, backend, None)
    if phase != "train":
        raise ValueError(f"unknown phase {phase!r}")
    _score_and_train(cfg, models)


def _score_and_train(cfg: PPOConfig, models) -> None:
    """Old (and reference) logprobs and one update on 2 groups of samples of random tokens (61 prompt tokens, 37
    response tokens), rewarded 0, 1, 2, ... so that every group has advantages."""
    import torch

    from rlx.engine.records import RolloutRecord
    from rlx.engine.scoring.score import Rewards, score_rollouts

    gen = torch.Generator().manual_seed(cfg.seed)
    group = max(2, cfg.rollout.n)
    records = []
    for i in range(2 * group):
        ids = torch.randint(0, models.scoring.vocab_size, (61 + 37,), generator=gen).tolist()
        records.append(
            RolloutRecord(
                id=f"p{i // group}/{i % group}", prompt_id=f"p{i // group}", sample_index=i % group, prompt="",
                response="", prompt_ids=ids[:61], response_ids=ids[61:], rollout_logprobs=[-1.0] * 37,
                finish_reason="length", temperature=cfg.rollout.temperature,
            )
        )  # fmt: skip
    rewards = Rewards(torch.arange(len(records), dtype=torch.float32), [{}] * len(records), [None] * len(records))
    score_cfg = dataclasses.replace(cfg.score, max_response_length=cfg.score.max_response_length or 37)
    result = score_rollouts(records, score_cfg, models.scoring, cfg.rollout.train_temperature, rewards=rewards)
    models.actor.train_step(result.batch, 0)


def main(argv: list[str]) -> int:
    """`python -m rlx.engine.ppo.precompile PHASE RECIPE_JSON MARKER`: run PHASE on the small copy, then write
    MARKER."""
    from rlx.utils.cache import configure_compile_caches

    configure_compile_caches()
    phase, spec, done = argv
    if phase not in PHASES:
        raise SystemExit(f"unknown phase {phase!r} (expected one of {', '.join(PHASES)})")
    cfg = from_dict(PPOConfig, json.loads(Path(spec).read_text()))
    with tempfile.TemporaryDirectory(prefix="rlx-precompile-") as work:
        run_phase(phase, cfg, Path(work))
    Path(done).parent.mkdir(parents=True, exist_ok=True)
    Path(done).write_text(f"{phase} compiled ahead {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

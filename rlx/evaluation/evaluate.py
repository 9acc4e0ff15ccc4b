"""Evaluation on held-out prompts: the config, metric math and grading that `rlx eval` (rlx.stages.eval) and the
`[eval]` table of a recipe (`evaluate`, with the run's resident engine) share.

Greedy by default (temperature 0, one response per prompt); with n samples per prompt at a temperature,
pass@k (the unbiased estimator of Chen et al. 2021, k = 1, 2, 4, ... and n) and mean@n. A sample is
correct when its reward reaches `correct_threshold`. The metric math is pure Python below; the call into
the rollout engine is the caller's (a resident engine here, a fresh one in rlx.stages.eval), and rewards come from
the scoring stage's `compute_rewards`.

    DIR/eval.jsonl    one line per sample: id, prompt_id, sample_index, data_source, prompt, response,
                      ground_truth, reward, is_correct, rewards (per function), response_length, finish_reason
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from rlx.config import check, check_choices
from rlx.formats.records import FORMAT_VERSION
from rlx.rollout.config import SamplingParams

EVAL_FILE = "eval.jsonl"


@dataclass(kw_only=True)
class EvalConfig:
    """What to evaluate on and how responses are sampled (`rlx eval`; the `[eval]` table of a recipe)."""

    prompts: str
    """Held-out prompts.jsonl (or verl .parquet); never trained on."""
    every: int = 0
    """`rlx ppo`: evaluate after every this many steps (0 = after the last step only)."""
    before_training: bool = False
    """`rlx ppo`: also evaluate the initial policy (logged at step 0)."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    """How responses are sampled, greedy by default (the recipe's [eval.sampling] table; flat flags --n,
    --temperature, --top-p, --top-k, --max-new-tokens, --stop, --seed). pass@k and mean@n need n > 1 and a
    temperature > 0; each sample has its own stream, as in `rlx rollout`."""
    reward: list[str] = field(default_factory=list)
    """Reward functions as in `rlx score --reward`; empty = the built-in named by each prompt's data_source."""
    correct_threshold: float = 1.0
    """A sample counts as correct (pass@k) when its reward is at least this."""
    on_reward_error: Literal["raise", "zero"] = "raise"
    """A reward function that raises or returns NaN: stop naming the sample, or score it 0 and count it."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(bool(self.prompts), "prompts", "must name a prompts file")
        check(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        check(not self.sampling.remax_baseline, "sampling.remax_baseline", "is a rollout setting (ReMax), not eval's")
        n, temperature = self.sampling.n, self.sampling.temperature
        check(
            n == 1 or temperature > 0,
            "sampling.n",
            f"n = {n} greedy responses would all be the same: give a temperature > 0 for pass@k",
        )

    def rollout_config(self, **engine_settings):
        """The RolloutConfig that samples these responses; `engine_settings` are its other fields (engine,
        device, precision, batch_size...)."""
        from rlx.rollout.config import RolloutConfig

        return RolloutConfig(sampling=self.sampling, **engine_settings)


# ---- metric math (pure functions) ----


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct among n samples: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def k_values(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def group_metrics(rewards: dict[str, list[float]], correct: dict[str, list[bool]], prefix: str) -> dict[str, float]:
    """reward_mean over samples, mean@n (per-prompt mean reward, averaged) and pass@k (averaged over prompts)
    of prompts that each have the same number n of samples (dicts keyed by prompt id)."""
    sizes = {len(v) for v in rewards.values()}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples, got {sorted(sizes)}")
    n = sizes.pop()
    all_rewards = [r for v in rewards.values() for r in v]
    out = {
        f"{prefix}reward_mean": sum(all_rewards) / len(all_rewards),
        f"{prefix}mean@{n}": sum(sum(v) / n for v in rewards.values()) / len(rewards),
        f"{prefix}num_prompts": float(len(rewards)),
    }
    for k in k_values(n):
        out[f"{prefix}pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct.values()) / len(correct)
    return out


def eval_metrics(samples: list[EvalSample]) -> dict[str, float]:
    """val/* metrics of evaluated samples; per data_source too (val/SOURCE/...) when there are several."""
    by_source: dict[str | None, list[EvalSample]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source].append(s)
    out = _metrics_of(samples, "val/")
    out["val/response_length_mean"] = sum(s.response_length for s in samples) / len(samples)
    if len(by_source) > 1:
        for source, part in sorted(by_source.items(), key=lambda kv: str(kv[0])):
            out.update(_metrics_of(part, f"val/{source}/"))
    return out


def _metrics_of(samples: list[EvalSample], prefix: str) -> dict[str, float]:
    rewards: dict[str, list[float]] = defaultdict(list)
    correct: dict[str, list[bool]] = defaultdict(list)
    for s in samples:
        rewards[s.prompt_id].append(s.reward)
        correct[s.prompt_id].append(s.is_correct)
    return group_metrics(rewards, correct, prefix)


def sampling_note(generation_config, sampling: SamplingParams) -> str | None:
    """A line saying where `sampling` departs from the sampling the model's generation_config.json asks for (its
    do_sample with temperature / top_p / top_k, as Qwen and Llama instruct models ship them), or None: rlx eval never
    takes those settings from the model, so a user who expects them is told instead of silently overruled."""
    given = generation_config.to_diff_dict() if generation_config is not None else {}
    if not given.get("do_sample"):
        return None  # the model decodes greedily by default, as rlx eval does
    wanted = {k: given[k] for k in ("temperature", "top_p", "top_k") if given.get(k) is not None}
    if sampling.is_greedy:
        found = ", ".join(f"{k} {v}" for k, v in wanted.items()) or "do_sample"
        return (
            f"the model's generation_config.json samples ({found}); rlx eval decodes greedily unless told: "
            f"give --temperature, --top-p, --top-k (and --n for pass@k) to sample as it does"
        )
    used = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": max(sampling.top_k, 0)}
    differ = [k for k, v in wanted.items() if float(v) != float(used[k])]
    if not differ:
        return None
    return (
        f"sampling with {', '.join(f'{k} {used[k]}' for k in differ)} where the model's generation_config.json "
        f"gives {', '.join(f'{k} {wanted[k]}' for k in differ)} (rlx eval takes only its own options: "
        f"{', '.join('--' + k.replace('_', '-') for k in differ)})"
    )


# ---- records and the stage ----


@dataclass(kw_only=True)
class EvalSample:
    """One line of eval.jsonl: a response to a held-out prompt and its grade."""

    id: str
    prompt_id: str
    sample_index: int
    data_source: str | None
    prompt: Any
    response: str
    ground_truth: Any
    reward: float
    is_correct: bool
    rewards: dict
    response_length: int
    finish_reason: str
    reward_error: str | None = None

    def to_json(self) -> dict:
        out = {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}
        if out["reward_error"] is None:
            del out["reward_error"]
        return out


def grade(rollouts: list, cfg: EvalConfig, replicas=None) -> list[EvalSample]:
    """Rewards of the responses (the scoring stage's reward functions) and whether each is correct; `replicas`: the
    processes holding these same rollouts, which share the reward functions' work (compute_rewards)."""
    from rlx.scoring.config import ScoreConfig
    from rlx.scoring.score import compute_rewards

    score_cfg = ScoreConfig(reward=list(cfg.reward), on_reward_error=cfg.on_reward_error)
    rewards = compute_rewards(rollouts, score_cfg, replicas=replicas)
    samples = []
    for i, r in enumerate(rollouts):
        reward = float(rewards.scores[i])
        samples.append(
            EvalSample(
                id=r.id,
                prompt_id=r.prompt_id,
                sample_index=r.sample_index,
                data_source=r.data_source,
                prompt=r.prompt,
                response=r.response,
                ground_truth=r.ground_truth,
                reward=reward,
                is_correct=rewards.errors[i] is None and reward >= cfg.correct_threshold,
                rewards=rewards.details[i],
                response_length=len(r.response_ids),
                finish_reason=r.finish_reason,
                reward_error=rewards.errors[i],
            )
        )
    return samples


def evaluate(cfg: EvalConfig, engine, prompts: list) -> tuple[list[EvalSample], dict[str, float]]:
    """Graded samples and val/* metrics of `prompts` answered by a resident rollout engine (`rlx ppo`'s [eval]).
    Every sample draws from its own stream seeded by cfg.sampling.seed: nothing of the training stream is used."""
    records = engine.generate(prompts, cfg.sampling, progress=False).records  # the same on every process of engine.ctx
    samples = grade(records, cfg, engine.ctx)
    return samples, graded_metrics(samples)


def graded_metrics(samples: list[EvalSample]) -> dict[str, float]:
    """val/* metrics of graded samples (an async run's rollout ranks each grade a share of the prompts)."""
    metrics = eval_metrics(samples)
    metrics["val/num_reward_errors"] = float(sum(s.reward_error is not None for s in samples))
    return metrics


def eval_due(cfg: EvalConfig | None, step: int, start_step: int, steps: int) -> bool:
    """Whether `rlx ppo` evaluates the weights after `step` (step 0: the initial policy, with before_training; a
    resumed run evaluates none of the steps before its start)."""
    if cfg is None:
        return False
    if step <= start_step:
        return step == start_step == 0 and cfg.before_training
    return step == steps or (cfg.every > 0 and step % cfg.every == 0)

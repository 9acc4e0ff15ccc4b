"""The multi-turn rollout stage, for `rlx rollout --env/--agent` to call: load, run episodes or agents, write.

Until the engines expose the token-level call, multi-turn rollouts run on the hf engine in one
process (through `hf_tokens.HFTokenEngine`).
"""

from __future__ import annotations

from pathlib import Path

from rlx.engine.agent.agents import AgentRollout
from rlx.engine.agent.config import AgentConfig
from rlx.engine.agent.driver import EnvRollout
from rlx.engine.agent.hf_tokens import as_token_engine
from rlx.engine.checkpoints.loading import load_model
from rlx.engine.checkpoints.registry import read_meta_or_default
from rlx.engine.parallel.dist import setup
from rlx.engine.records import read_prompts, write_records
from rlx.engine.rollout.base import build_engine
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.tracking import console, log_metrics
from rlx.errors import UserError
from rlx.models.loading import load_tokenizer, resolve_source
from rlx.models.vision.images import image_refs


def run_multi_turn_rollout(
    cfg: RolloutConfig,
    agent_cfg: AgentConfig,
    model_path: str,
    prompts_path: str,
    out: str,
    agent: str = "",
    num_prompts: int = 0,
    metrics_path: Path | None = None,
) -> dict[str, float]:
    """Episodes of `agent_cfg.env`, or runs of the served `agent`, for the prompts; returns the stats."""
    if bool(agent) == bool(agent_cfg.env):
        raise UserError("multi-turn rollouts take exactly one of --env and --agent")
    if cfg.engine != "hf":
        raise UserError(f"multi-turn rollouts run on the hf engine for now (got --engine {cfg.engine})")
    if num_prompts < 0:
        raise UserError("--num-prompts must be >= 0")
    records = read_prompts(prompts_path)
    records = records[:num_prompts] if num_prompts else records
    with_images = next((r for r in records if image_refs(r.prompt, r.id)), None)
    if with_images is not None:
        raise UserError(f"prompt {with_images.id!r} has image parts: multi-turn rollouts do not take images yet")
    source = resolve_source(model_path)
    tokenizer = load_tokenizer(source)
    engine = build_engine(cfg, load_model(source), tokenizer, setup(cfg.device))
    tokens = as_token_engine(engine)
    if agent:
        runner = AgentRollout(tokens, tokenizer, engine.stop_ids, cfg, agent_cfg, agent)
    else:
        runner = EnvRollout(tokens, tokenizer, engine.stop_ids, cfg, agent_cfg)
    try:
        rollouts = runner.generate(records)
    finally:
        engine.close()
    write_records(out, rollouts)
    stats = runner.last_stats
    log_metrics(metrics_path, read_meta_or_default(source.path).step + 1, stats)
    console(
        f"rlx rollout: {len(rollouts)} multi-turn samples for {len(records)} prompts -> {out} "
        f"({stats['rollout/turns_mean']:.2f} turns each, env reward {stats['env/reward_mean']:.3f})"
    )
    return stats

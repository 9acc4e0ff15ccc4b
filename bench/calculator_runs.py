"""One table row per `rlx ppo recipes/calculator.toml` run: SFT, reward and how often the policy calls the tool.

    python bench/calculator_runs.py runs/calc-s0 runs/calc-s1 runs/calc-s2

Per run: the SFT loss (last step, and the mean of the last 20 steps: with wrong guesses among the demonstrations
a step's loss swings with the batch), the SFT seconds (its train time), the RL reward (first 5 -> last 5 steps,
max), the share of episodes that call the calculator at step 1 and at the last step (read from the step's
rollouts.jsonl: an assistant message with a tool call) and, with ToolChoiceCalculatorEnv's tools, the share whose
first call is the question's operator's tool (`multiply` for "59*63"), the reward of the callers and of the others
at the last step, and the RL seconds (sum of step times).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlx.tasks.calculator import ToolChoiceCalculatorEnv


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def calls_tool(episode: dict) -> bool:
    return any(m.get("role") == "assistant" and m.get("tool_calls") for m in episode.get("messages") or [])


def calls_right_tool(episode: dict) -> bool | None:
    """Whether the first tool call is the one of ToolChoiceCalculatorEnv's tools matching the question's operator;
    None for episodes of other calculators (no tool of that name offered)."""
    messages = episode.get("messages") or []
    calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
    if not calls or calls[0]["function"].get("name") == "calculator":
        return None if calls else False
    question = next(m["content"] for m in messages if m.get("role") == "user")
    return (
        calls[0]["function"].get("name")
        == ToolChoiceCalculatorEnv({"prompt": question, "ground_truth": ""}).right_tool()
    )


def episodes(run: Path, step: int) -> tuple[float, float, float, float | None]:
    """(share calling the tool, mean reward of the callers, of the others, share calling the right tool or None)
    of a step's episodes."""
    rows = read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl")
    callers = [r["env_reward"] for r in rows if calls_tool(r)]
    others = [r["env_reward"] for r in rows if not calls_tool(r)]
    right = [calls_right_tool(r) for r in rows]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    right_share = None if None in right else sum(right) / len(rows)
    return len(callers) / len(rows), mean(callers), mean(others), right_share


def summary(run: Path) -> str:
    sft = read_jsonl(run / "sft_metrics.jsonl")
    losses = [m["sft/loss"] for m in sft]
    sft_s = sum(m.get("timing/sft_train_s", 0.0) for m in sft)
    merged: dict[int, dict] = {}
    for m in read_jsonl(run / "metrics.jsonl"):
        merged.setdefault(m["step"], {}).update(m)
    steps = [m for _, m in sorted(merged.items()) if "reward/mean" in m]
    rewards = [m["reward/mean"] for m in steps]
    k = min(5, len(rewards))
    first, last = steps[0]["step"], steps[-1]["step"]
    call_first, _, _, right_first = episodes(run, first)
    call_last, right_callers, right_others, right_last = episodes(run, last)
    right = "-" if right_first is None or right_last is None else f"{right_first:.2f} -> {right_last:.2f}"
    rl_s = sum(m.get("timing/step_s", 0.0) for m in steps)
    return (
        f"| {run.name} | {len(sft)} | {losses[-1]:.3f} ({sum(losses[-20:]) / len(losses[-20:]):.3f}) | {sft_s:.0f} "
        f"| {sum(rewards[:k]) / k:.3f} -> {sum(rewards[-k:]) / k:.3f} ({max(rewards):.3f}) "
        f"| {call_first:.2f} -> {call_last:.2f} | {right} | {right_callers:.2f} / {right_others:.2f} | {len(steps)} "
        f"| {rl_s:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="rlx ppo run folders")
    args = parser.parse_args()
    print(
        "| run | SFT steps | SFT loss last (mean of last 20) | SFT s | reward first 5 -> last 5 (max) "
        "| tool-call share step 1 -> last | right-tool share step 1 -> last | last step reward: callers / others "
        "| RL steps | RL s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        print(summary(run))


if __name__ == "__main__":
    main()

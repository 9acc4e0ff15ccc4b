"""The user code of recipes/openai_agents_add.toml: an openai-agents Agent with one function tool, and its reward.

rlx runs `agent` once per sample with its model pointed at the sample's base URL; the run's context is the prompt
record (a dict of its own per sample), so the tool can note what it did in it; `reward` scores the run's final
output (None when the run stopped at max_turns).
"""

from agents import Agent, RunContextWrapper, function_tool


@function_tool
def add(ctx: RunContextWrapper[dict], a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    ctx.context.setdefault("add_calls", []).append([a, b])
    return a + b


agent = Agent(name="adder", instructions="Use the add tool, then answer with the number only.", tools=[add])


def reward(output, record: dict) -> float:
    """1 for the right number, else 0 (also when the run stopped at max_turns without an answer)."""
    if output is None:
        return 0.0
    return float(str(output).strip() == str(record["ground_truth"]))

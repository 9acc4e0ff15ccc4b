"""openai-agents agents and rewards that go wrong, for tests/stages/test_openai_agents_ppo.py."""

from agents import Agent, ModelSettings, function_tool


def colder(record: dict) -> Agent:
    """An agent whose model settings ask for another temperature than the run's (the server refuses it)."""
    return Agent(name="cold", instructions="Be brief.", model_settings=ModelSettings(temperature=0.5))


def not_an_agent(record: dict) -> str:
    return "an agent"


def picky_reward(output, record: dict) -> float:
    """Raises for prompt add-1; 1 for any other."""
    if record["id"] == "add-1":
        raise ValueError("no reward for add-1")
    return 1.0


@function_tool
def mul(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def without_add(record: dict) -> Agent:
    """An agent offering `mul` only: a run whose model calls `add` fails in the SDK (ModelBehaviorError)."""
    return Agent(name="mul only", instructions="Be brief.", tools=[mul])

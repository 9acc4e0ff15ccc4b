"""openai-agents agents and rewards that go wrong, for tests/stages/test_openai_agents_ppo.py."""

from agents import Agent, ModelSettings


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

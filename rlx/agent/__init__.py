"""Multi-turn rollouts: environments, tool calls, token-exact trajectories, and an OpenAI-compatible server."""

"""The machinery behind the commands: I/O, rollout, scoring, training, checkpoints and the PPO loop."""

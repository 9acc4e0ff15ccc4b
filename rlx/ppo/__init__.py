"""The `rlx ppo` driver: rollout -> score -> train-step in one process with the models resident."""

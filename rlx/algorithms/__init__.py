"""RL math as pure functions over tensors: advantage estimators, policy losses, KL estimators."""

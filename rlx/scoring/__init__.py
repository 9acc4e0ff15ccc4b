"""Scoring: rewards for rollouts, old/ref logprobs, advantages, and the training batch they make."""

"""Training: the PPO update of the actor, its optimizer, and the settings for both."""

"""rlx: reinforcement-learning post-training for language models as a toolchain of plain commands."""

__version__ = "0.1.0"

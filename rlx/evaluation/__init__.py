"""Held-out evaluation: its config, the pass@k / mean@k metric math and grading (the `rlx eval` runner is
rlx.stages.eval).
"""

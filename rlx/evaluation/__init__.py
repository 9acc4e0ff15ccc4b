"""Held-out evaluation: its config, the pass@k / mean@k metric math and grading (the `rlx eval` runner sits with it
for now).
"""

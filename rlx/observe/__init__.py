"""What a run reports about itself: metric tracking and its sinks, per-phase time and memory, FLOP counts."""

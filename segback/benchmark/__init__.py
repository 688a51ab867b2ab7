"""`segback bench`: training steps of mlx-lm (full / per-layer checkpoint) against segmented
backward, each mode in a process of its own (`cli`)."""

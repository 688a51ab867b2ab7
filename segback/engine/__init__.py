"""The segmented-backward engine: exact LoRA gradients with bounded activation memory."""

from segback.engine.memory import MemoryProbe, memory_stats, reset_peak
from segback.engine.segmented import resolve_segments, value_and_grad

__all__ = ["value_and_grad", "resolve_segments", "memory_stats", "reset_peak", "MemoryProbe"]

"""The segmented-backward engine: the ground floor, importing nothing else of segback."""

from segback.engine.memory import MemoryProbe, memory_stats, reset_peak
from segback.engine.options import EngineOptions, OptionsError
from segback.engine.packing import Packed
from segback.engine.plan_file import Plan, PlanError, segments_of
from segback.engine.segmented import value_and_grad

__all__ = ["EngineOptions", "MemoryProbe", "OptionsError", "Packed", "Plan", "PlanError",
           "memory_stats", "reset_peak", "segments_of", "value_and_grad"]

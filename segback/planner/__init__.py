"""Segment planner: choose the layer ranges and engine options of a segmented backward from the
model's geometry (`geometry`), a memory and time model (`cost`), a search over cuts (`search`)
and, optionally, measurements on the real model (`calibrate`); `plan_segments` returns a
`segback.engine.Plan`."""

from segback.planner.calibrate import fit_coefficients, measure_segment
from segback.planner.cost import Coefficients, CostModel
from segback.planner.geometry import Geometry, read_geometry, resolve_model
from segback.planner.plan import describe, plan_segments

__all__ = ["Coefficients", "CostModel", "Geometry", "describe", "fit_coefficients",
           "measure_segment", "plan_segments", "read_geometry", "resolve_model"]

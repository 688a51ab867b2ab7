"""The plan: the one contract between planner, trainer, bench and engine.

A `Plan` says which layer ranges the backward walks (`segments`), how the engine runs them
(`engine`: `EngineOptions`), what the planner predicted, and what it was made for (`inputs`:
model, sequence length, batch). It round-trips `plan.schema.json` (`to_dict` / `from_dict`), and
`check` refuses a plan made for another model or a shorter sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import jsonschema

from segback.engine.options import EngineOptions, canonical_name

Segments = list[tuple[int, int]]
# Engine options plans carried at their top level before `engine` held them.
TOP_LEVEL_ENGINE = ("attention", "tile", "offload", "light_tile", "boundaries_on_device")


class PlanError(ValueError):
    """A plan that does not fit the model or batch it is used with, or breaks its schema."""


SCHEMA = Path(__file__).with_name("plan.schema.json")  # package data


def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def segments_of(value: Any, num_layers: int) -> Segments:
    """(start, stop) ranges covering 0..num_layers in order, from ranges or layers per segment."""
    if value is None:
        value = num_layers
    if isinstance(value, bool) or isinstance(value, float) or isinstance(value, str):
        raise PlanError(f"segments must be (start, stop) ranges or a whole number of layers "
                        f"per segment, not {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise PlanError("layers per segment must be >= 1")
        return [(s, min(s + value, num_layers)) for s in range(0, num_layers, value)]
    out = []
    for r in value:
        if len(r) != 2 or not all(type(x) is int for x in r):
            raise PlanError(f"a segment is a pair of whole layer numbers [start, stop), not {r!r}")
        out.append((r[0], r[1]))
    pos = 0
    for a, b in out:
        if a != pos or b <= a:
            raise PlanError(f"segments must cover layers 0..{num_layers} in order without gaps; "
                            f"got {out}")
        pos = b
    if pos != num_layers:
        raise PlanError(f"segments end at layer {pos} but the model has {num_layers} layers")
    return out


@dataclass(frozen=True)
class Plan:
    segments: Segments
    engine: EngineOptions = field(default_factory=EngineOptions)
    saved_kv: list[dict] = field(default_factory=list)
    predicted_peak_gb: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    peak_at: str = ""
    segment_gb: list[float] = field(default_factory=list)
    predicted_relative_step_time: float = 1.0
    predicted_host_gb: float = 0.0
    meets_target: bool = True
    meets_time_budget: bool = True
    message: str = "given segments"
    layer_types: list[str] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)
    # context parallelism (`segback plan --context-parallel R`): ranks, order, seq_len (the
    # whole sequence), shard_tokens (what each rank runs), sent_gb_per_step and
    # messages_per_step (each rank's), ring_buffer_gb, balance; empty without it
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def seq_len(self) -> int | None:
        return self.inputs.get("seq_len")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["segments"] = [[a, b] for a, b in self.segments]
        out["engine"] = self.engine.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "plan") -> Plan:
        """A plan from its JSON form, validated against plan.schema.json first (plans written
        before `engine` existed carry its keys at the top level and are read too)."""
        if not isinstance(d, dict):
            raise PlanError(f"{where}: a plan is a JSON object, not {type(d).__name__}")
        d = dict(d)
        legacy = {k: d.pop(k) for k in list(d) if canonical_name(k) in TOP_LEVEL_ENGINE}
        if "engine" not in d and "segments" in d:
            d["engine"] = EngineOptions.from_dict(
                {k: v for k, v in legacy.items() if v is not None}, where).to_dict()
        if isinstance(d.get("inputs"), dict):
            d["inputs"] = {canonical_name(k): v for k, v in d["inputs"].items()}
        try:
            jsonschema.validate(d, schema())
        except jsonschema.ValidationError as e:
            at = "/".join(str(p) for p in e.absolute_path) or "top level"
            raise PlanError(f"{where} does not match plan.schema.json at {at}: {e.message}. "
                            "Make a new plan with `segback plan`.") from None
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["segments"] = [tuple(r) for r in d["segments"]]
        kwargs["engine"] = EngineOptions.from_dict(d["engine"], f"{where}: engine")
        return cls(**kwargs)

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file not found: {path}. Make one with `segback plan`, or "
                            "pass --plan auto.") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{path} is not valid JSON ({e}); make a new plan with "
                            "`segback plan`.") from None
        return cls.from_dict(d, str(path))

    def with_engine(self, engine: EngineOptions) -> Plan:
        return replace(self, engine=engine)

    def check(self, num_layers: int, layer_types: list[str] | None = None,
              model_type: str | None = None, seq_len: int | None = None,
              batch_size: int | None = None) -> Segments:
        """The segments, after refusing a plan made for another model or a shorter sequence."""
        planned_layers = self.inputs.get("num_layers") or (self.segments[-1][1]
                                                           if self.segments else None)
        what = self.inputs.get("model", "another model")
        if planned_layers is not None and planned_layers != num_layers:
            raise PlanError(f"this plan was made for {what} with {planned_layers} layers, but "
                            f"the model has {num_layers}: make a plan for this model")
        planned_type = self.inputs.get("model_type")
        if model_type and planned_type and planned_type != model_type:
            raise PlanError(f"this plan was made for a {planned_type} model ({what}), not "
                            f"{model_type}: make a plan for this model")
        if layer_types and self.layer_types and list(layer_types) != list(self.layer_types):
            raise PlanError(f"this plan was made for {what}, whose attention layers differ "
                            "from this model's: make a plan for this model")
        planned_len = self.context.get("shard_tokens", self.inputs.get("seq_len"))
        if seq_len is not None and planned_len is not None and seq_len > planned_len:
            if self.context:
                raise PlanError(
                    f"this plan was made for shards of {planned_len} tokens (sequences of "
                    f"{self.context['seq_len']} over {self.context['ranks']} context ranks); "
                    f"a shard of {seq_len} would not fit what it predicts: plan for this "
                    "--seq and --context-parallel (or shorten the data)")
            raise PlanError(f"this plan was made for sequences of {planned_len} tokens; a batch "
                            f"of {seq_len} would not fit what it predicts: plan for "
                            f"--seq {seq_len} (or shorten the data)")
        planned_batch = self.inputs.get("batch_size")
        if batch_size is not None and planned_batch is not None and batch_size > planned_batch:
            raise PlanError(f"this plan was made for batches of {planned_batch}, not "
                            f"{batch_size}: plan for --batch-size {batch_size}")
        return segments_of(self.segments, num_layers)


def step_inputs(plan: Any, options: EngineOptions | None = None) -> tuple[Any, Any]:
    """(segments, engine options) for `value_and_grad` at every step: a `Plan`'s own (`options`
    in place of its engine options when given), else `plan` and `options` as they are. A Plan
    is checked once, where it is loaded (`Plan.check`), not at every step."""
    if isinstance(plan, Plan):
        return plan.segments, options or plan.engine
    return plan, options

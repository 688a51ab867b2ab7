"""How the engine runs a step: one typed, validated value, parsed once at the edge.

Every knob of the segmented engine lives here, declared once with its help text. The CLI
(`add_arguments`), a YAML config or a plan file (`EngineOptions.from_dict`) build it; the engine
only reads it. None means "the device's default" (`resolved`), so a plan written on one machine
runs with the defaults of the machine that loads it.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import mlx.core as mx

ATTENTION = ("fused", "chunked")
DEFAULT_HEAD_CHUNK = 1 << 26  # logits per head chunk: 256 MB in float32
AUTO = "auto"  # a value a planner chooses (`parse_value(..., auto=True)`)
# Names plan files and configs used before the present ones; read as those.
OLD_NAMES = {"offload_keep": "boundaries_on_device", "head_max_elements": "head_chunk"}


class OptionsError(ValueError):
    """An engine option with a value the engine cannot run; the message names it."""


def _help(text: str, **meta: Any) -> dict:
    return {"help": text, **meta}


@dataclass(frozen=True)
class EngineOptions:
    attention: str = field(default="fused", metadata=_help(
        "attention kernel: 'fused' (the fastest exact kernel per layer: on CUDA MLX's fused "
        "kernel or segback's flash kernel, both O(L); elsewhere mlx-lm's own, whose backward "
        "is O(L^2) and which tiled layers replace by the chunked one) or 'chunked' (segback's "
        "O(L) kernel of MLX ops)", choices=ATTENTION))
    tile: int | None = field(default=None, metadata=_help(
        "run each layer's token-wise parts this many tokens at a time (sequence-tiled "
        "engine); none = untiled", kind="tokens"))
    light_tile: int | None = field(default=None, metadata=_help(
        "tile of the tiled passes that hold no MLP cotangents (pre pass, its VJP, forward "
        "post pass); none = the tile", kind="tokens"))
    mlp_chunk: int | None = field(default=None, metadata=_help(
        "untiled engine: each layer's MLP keeps only its input and output, and its backward "
        "recomputes it this many tokens at a time; none = kept whole", kind="tokens"))
    offload: bool = field(default=False, metadata=_help(
        "park segment boundaries and per-layer inputs in host memory (tiled engine only)",
        kind="bool"))
    host_table: bool | None = field(default=None, metadata=_help(
        "keep Gemma-4's per-layer embedding table in host memory and gather each step's rows "
        "there; none = with offload or on a CUDA GPU (whose memory it would take)",
        kind="bool"))
    boundaries_on_device: int = field(default=0, metadata=_help(
        "with offload: the boundaries of the last N segments stay on the device (no copies "
        "for them)", kind="count"))
    compile: bool | None = field(default=None, metadata=_help(
        "mx.compile the tile functions; none = on the CPU only (a CUDA first step JIT-builds "
        "every trace's kernels)", kind="bool"))
    share_traces: bool | None = field(default=None, metadata=_help(
        "layers of one structure share compiled tile functions; none = on the GPU only",
        kind="bool"))
    tiles_in_flight: int = field(default=2, metadata=_help(
        "tiles scheduled before waiting for the previous one (1 = evaluate each tile)",
        kind="count", minimum=1))
    prefetch: bool = field(default=False, metadata=_help(
        "bring parked arrays back one layer early on a side stream", kind="bool"))
    head_chunk: int = field(default=DEFAULT_HEAD_CHUNK, metadata=_help(
        "logits per chunk of the loss head (elements)", kind="count", minimum=1))

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise OptionsError(f"attention must be one of {ATTENTION}, not {self.attention!r}")
        for name in ("tile", "light_tile", "mlp_chunk"):
            v = getattr(self, name)
            if v is not None and not (type(v) is int and v >= 1):
                raise OptionsError(f"{name} must be a positive number of tokens or none, "
                                   f"not {v!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("kind") == "bool" and v is not None and type(v) is not bool:
                raise OptionsError(f"{f.name} must be true or false, not {v!r}")
            if f.metadata.get("kind") == "count" and not (
                    type(v) is int and v >= f.metadata.get("minimum", 0)):
                raise OptionsError(f"{f.name} must be an integer >= "
                                   f"{f.metadata.get('minimum', 0)}, not {v!r}")
        if self.light_tile is not None and not self.tile:
            raise OptionsError("light_tile needs a tile size (tile=...): it is part of the "
                               "tiled engine")
        if self.mlp_chunk is not None and self.tile:
            raise OptionsError("mlp_chunk is for the untiled engine: the tiled engine runs its "
                               "MLPs a tile at a time already; drop one of them")
        if self.offload and not self.tile:
            raise OptionsError("offload needs a tile size (tile=...): it is part of the tiled "
                               "engine")
        if self.boundaries_on_device and not self.offload:
            raise OptionsError(f"boundaries_on_device={self.boundaries_on_device} keeps "
                               "boundaries on the device instead of host memory: it needs "
                               "offload=true")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, where: str = "engine options"
                  ) -> EngineOptions:
        """Options from a config or plan mapping; strings as a CLI or YAML gives them."""
        values = parse_options(values, where)
        try:
            return cls(**values)
        except OptionsError as e:
            raise OptionsError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> EngineOptions:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def resolved(self) -> EngineOptions:
        """The device's defaults in place of None (compile on the CPU, shared traces on the
        GPU, the per-layer table in host memory with offload or on CUDA): what a step on this
        machine runs."""
        gpu = mx.default_device() == mx.gpu
        return replace(self,
                       compile=(not gpu) if self.compile is None else self.compile,
                       share_traces=gpu if self.share_traces is None else self.share_traces,
                       host_table=table_on_host(self.host_table, self.offload))


def table_on_host(host_table: bool | None, offload: bool) -> bool:
    """Whether a step parks the per-layer table: as asked, else with offload or where the
    default device has memory of its own (CUDA), the only place parking frees any."""
    if host_table is not None:
        return host_table
    return offload or (mx.default_device() == mx.gpu and mx.cuda.is_available())


def canonical_name(name: str) -> str:
    """An option's present name for `name` (an old one from OLD_NAMES, or itself)."""
    return OLD_NAMES.get(name, name)


def parse_options(values: dict[str, Any] | None, where: str = "engine options",
                  auto: Collection[str] = ()) -> dict[str, Any]:
    """The options given, by their present names, each in its type (strings as a CLI or YAML
    gives them); AUTO stays for the names in `auto`. Unknown names are refused."""
    out: dict[str, Any] = {}
    for k, v in (values or {}).items():  # a present name wins over its old one
        if k in OLD_NAMES:
            out.setdefault(OLD_NAMES[k], v)
        else:
            out[k] = v
    known = {f.name: f for f in fields(EngineOptions)}
    unknown = sorted(set(out) - set(known))
    if unknown:
        raise OptionsError(f"{where}: unknown engine option(s) {', '.join(unknown)}; "
                           f"known: {', '.join(known)}")
    try:
        return {k: parse_value(known[k], v, k in auto) for k, v in out.items()}
    except OptionsError as e:
        raise OptionsError(f"{where}: {e}") from None


def parse_value(f: Any, v: Any, auto: bool = False) -> Any:
    """One option's value from a string, YAML scalar or Python value; 'auto' is AUTO where
    `auto` allows it."""
    kind = f.metadata.get("kind")
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("", "none", "null") and f.default is None:
            return None
        if low == AUTO:
            if auto:
                return AUTO
            raise OptionsError(f"{f.name}=auto asks the planner to choose: plan with it "
                               "(segback plan, or train --plan auto), then run the plan")
        if kind == "bool" and low in ("true", "on", "yes", "1", "false", "off", "no", "0"):
            return low in ("true", "on", "yes", "1")
        if kind in ("tokens", "count"):
            try:
                return int(low)
            except ValueError:
                raise OptionsError(f"{f.name} must be a whole number, not {v!r}") from None
        return v.strip()
    return v


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per option (`--light-tile`, ...), from the declaration above; values stay
    strings (None when not given) for `EngineOptions.from_dict` to parse."""
    for f in fields(EngineOptions):
        if f.name in skip:
            continue
        choices = f.metadata.get("choices")
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            choices=choices, help=f"{f.metadata['help']} (default: "
                            f"{'device default' if f.default is None else f.default})")


def from_args(args: argparse.Namespace, base: EngineOptions | None = None,
              skip: tuple[str, ...] = ()) -> EngineOptions:
    """`base` with the flags the user gave on top (`skip`: flags parsed elsewhere)."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineOptions)
             if f.name not in skip and getattr(args, f.name, None) is not None}
    merged = (base or EngineOptions()).to_dict() | given
    return EngineOptions.from_dict(merged, where="command line")

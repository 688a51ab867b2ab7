"""What the planner chooses among: the engine options a plan's search weighs, typed once.

`segback plan` and `segback train --plan auto` give these as flags or config values;
`SearchSpace.from_dict` reads them (strings included) and every later step passes the object.
A field is a value, or AUTO where the planner is to choose it (`AUTO_FIELDS`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from segback.engine.options import AUTO, EngineOptions, OptionsError, parse_options

AUTO_FIELDS = ("tile", "offload", "boundaries_on_device")


@dataclass(frozen=True)
class SearchSpace:
    """The engine options a plan is searched over. `tile` AUTO weighs untiled plans and every
    size of `search.TILE_SIZES`, `offload` AUTO both, `boundaries_on_device` AUTO keeps as many
    boundaries on the device as the target leaves room for (none without a target)."""

    attention: str = "fused"
    tile: int | str | None = None
    offload: bool | str = False
    light_tile: int | None = None
    boundaries_on_device: int | str = AUTO

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) == AUTO and f.name not in AUTO_FIELDS:
                raise OptionsError(f"{f.name} has no 'auto'; the planner chooses "
                                   f"{', '.join(AUTO_FIELDS)}")
        # Each value as the engine checks it; AUTO stands for a choice that allows the others.
        EngineOptions(attention=self.attention,
                      tile=1 if self.tile in (None, AUTO) else self.tile,
                      light_tile=self.light_tile,
                      offload=True if self.offload == AUTO else self.offload,
                      boundaries_on_device=0 if self.boundaries_on_device == AUTO
                      else self.boundaries_on_device)
        if self.light_tile is not None and self.tile is None:
            raise OptionsError("light_tile needs a tile size (tile=...): it is part of the "
                               "tiled engine")
        if self.offload is True and self.tile is None:
            raise OptionsError("offload needs a tile size (--tile N or --tile auto)")

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "engine options") -> SearchSpace:
        """The space from options as given ("512", "auto", "true", 512, True, ...)."""
        typed = parse_options(values, where, auto=SEARCHED)
        outside = sorted(set(typed) - set(SEARCHED))
        if outside:
            raise OptionsError(f"{where}: the planner does not search {', '.join(outside)}")
        return cls(**typed)


SEARCHED = tuple(f.name for f in fields(SearchSpace))

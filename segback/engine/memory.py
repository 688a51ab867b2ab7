"""Memory probes: peak / active / cache in GB, sampled per step.

`mx.get_peak_memory` is peak *live* memory; MLX's buffer cache is reported separately.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterator

import mlx.core as mx

GB = 1024**3


def memory_stats() -> dict[str, float]:
    """Current peak, active and cache memory in GB."""
    return {
        "peak_gb": mx.get_peak_memory() / GB,
        "active_gb": mx.get_active_memory() / GB,
        "cache_gb": mx.get_cache_memory() / GB,
    }


def reset_peak() -> None:
    mx.reset_peak_memory()


@dataclass
class MemoryProbe:
    """Collects one memory sample per step; `with probe.step():` resets the peak first."""

    samples: list[dict[str, float]] = field(default_factory=list)

    @contextmanager
    def step(self) -> Iterator[dict[str, float]]:
        sample: dict[str, float] = {}
        reset_peak()
        tic = time.perf_counter()
        yield sample
        sample.update(memory_stats(), seconds=time.perf_counter() - tic)
        self.samples.append(sample)

    @property
    def peak_gb(self) -> float:
        return max((s["peak_gb"] for s in self.samples), default=0.0)

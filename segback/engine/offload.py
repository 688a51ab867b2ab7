"""Host-memory parking for the tiled engine's boundaries and per-layer inputs.

MLX-CUDA memory is managed memory and a host copy is slow, so copies must not stall the GPU:
the copy out runs on a worker thread while the device computes (numpy's copy releases the GIL),
from a device copy of its own, so the CPU's reads do not pull away pages the next layer reads.
The copy back stays in the calling thread: `mx.array(numpy)` holds the GIL, and on a worker it
would stall the thread that feeds the GPU. `prefetching` (off by default) starts it one layer
early instead: the host copy lands in a fresh array and a copy kernel on a side stream pulls it
onto the device while the layer before it runs on the main stream. Cheaper still is not
copying: boundaries the planner keeps on the device (`boundaries_on_device`, room made by
parking Gemma-4's per-layer table, segback.engine.host_table). Timings: bench/RESULTS.md.
At most `MAX_PENDING` arrays wait for their copy out, each alive on the device until copied:
without that bound, parking many arrays in a row (the per-layer inputs) would keep them all.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

MAX_PENDING = 2
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segback-offload")
    return _POOL


_SIDE: dict = {}  # device -> the stream prefetches copy on (one per process: streams live on)


def _side_stream() -> mx.Stream:
    device = mx.default_device()
    key = str(device)
    if key not in _SIDE:
        _SIDE[key] = mx.new_stream(device)
    return _SIDE[key]


def _to_host(x: mx.array) -> np.ndarray:
    return np.array(memoryview(x))  # one copy, GIL released; x stays referenced until done


@dataclass
class Parked:
    """An array in host memory, once its copy out (a future) is done."""

    host: Future
    dtype: mx.Dtype
    nbytes: int


@dataclass
class HostStore:
    """Arrays parked in host memory (offload) or kept on the device; counts host bytes."""

    offload: bool
    prefetching: bool = False  # bring parked arrays back a layer early on a side stream
    host_bytes: int = 0
    peak_host_bytes: int = 0
    _pending: deque = field(default_factory=deque)
    _fetched: dict = field(default_factory=dict)  # id(Parked) -> its array, brought back early

    def put(self, x: mx.array, keep: bool = False) -> Any:
        """A handle for `x`: `x` itself if not offloading or `keep`, else a Parked copy."""
        if not self.offload or keep:
            return x
        raw = (x.view(mx.uint16) if x.dtype == mx.bfloat16 else x) + 0  # numpy: no bfloat16
        mx.eval(raw)
        while len(self._pending) >= MAX_PENDING:
            self._pending.popleft().result()
        parked = Parked(_pool().submit(_to_host, raw), x.dtype, raw.nbytes)
        self._pending.append(parked.host)
        self.host_bytes += parked.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return parked

    def get(self, handle: Any) -> mx.array:
        """The array on the device (a parked one stays parked: its device copy is not kept,
        except one `prefetch` made, which this hands over)."""
        if not isinstance(handle, Parked):
            return handle
        x = self._fetched.pop(id(handle), None)
        if x is None:
            x = mx.array(handle.host.result())
        return x.view(mx.bfloat16) if handle.dtype == mx.bfloat16 else x

    def prefetch(self, handle: Any) -> None:
        """Start bringing a parked array back, so that its `get` finds it on the device."""
        if not self.prefetching or not isinstance(handle, Parked) or id(handle) in self._fetched:
            return
        x = mx.array(handle.host.result())
        with mx.stream(_side_stream()):
            x = x + 0  # a device copy: pages move while the main stream computes
        mx.async_eval(x)
        self._fetched[id(handle)] = x

    def drop(self, handle: Any) -> None:
        if isinstance(handle, Parked):
            self.host_bytes -= handle.nbytes
            self._fetched.pop(id(handle), None)

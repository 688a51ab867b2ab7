"""The cost of one context-parallel rank: its shard of a sequence split over R ranks, run by the
segmented engine with ring attention (`segback.engine.context`).

Against a one-device plan of the shard's length, what changes is attention:

- memory: ring attention works in float32. A layer's backward holds float32 copies of Q and dO,
  dQ accumulators, the row LSE and rowsum(dO * O), one chunk's scores against a whole block,
  the key/value block in hand (and its float32 copy) and the next one arriving, each with its
  float32 dK/dV (which travel with it); the untiled engine keeps each layer's LSE until its
  backward. No
  [L, L] mask exists.
- time: each rank scores each chunk of its queries against the range of every block's keys it
  may see; the slowest rank sets the step. A step's unit is one plain forward+backward of the whole
  sequence on one device, divided by R: a plan at 1.0 would scale perfectly.
- communication: per layer, each forward sends R - 1 key/value blocks, each backward R - 1
  key/value blocks and R dK/dV blocks, float32 [B, kv heads, shard, 2 x head dim] each. The
  untiled engine runs every layer's forward twice (the forward, the segment's recompute); the
  tiled one also recomputes the layers inside a segment once more. Keys and values travel in
  the compute dtype, dK/dV in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from segback.engine.chunked import default_chunk_size
from segback.engine.ring_attention import Shards, shard_positions
from segback.planner.cost import ATTENTION_TIME_CUDA, CHUNKED_SCORE_COPIES, CostModel
from segback.planner.geometry import GB, Geometry, LayerGeom

F32 = 4
# Ring attention's backward over its forward, in FLOPs: P recomputed, then dV, dP, dQ, dK (five
# block matmuls against the forward's two).
BWD_RING = 2.5


def scored_pairs(shards: Shards, rank: int, window: int | None, chunk: int) -> int:
    """(query, key) pairs rank's ring attention scores: each chunk of its queries against the
    range of each block's keys it may see, as `ring_forward` does (`_key_range`)."""
    pos = shards.positions[rank]
    starts, stops = np.array(shards.chunks(rank, chunk)).T
    first, last = pos[starts], pos[stops - 1]
    total = 0
    for owner in range(shards.size):
        keys = shards.positions[owner]
        k1 = np.searchsorted(keys, last, side="right")
        k0 = 0 if window is None else np.searchsorted(keys, first - window + 1)
        total += int(((stops - starts) * np.maximum(k1 - k0, 0)).sum())
    return total


class RingCostModel(CostModel):
    """`CostModel` of one rank of R for a sequence of `seq_len` tokens: the shard's length (the
    longest shard), ring attention's memory and work, and the bytes each rank sends.

    `attention_time`: time of one ring-attention FLOP over one FLOP of the linears (None: 1 on
    the CPU, the chunked kernel's `ATTENTION_TIME_CUDA` on CUDA, which ring attention's
    composed float32 matmuls resemble).
    """

    def __init__(self, geom: Geometry, seq_len: int, ranks: int, order: str = "zigzag",
                 batch_size: int = 1, attention: str = "fused", coef: Any = None,
                 tile: int | None = None, offload: bool = False, light_tile: int | None = None,
                 boundaries_on_device: int = 0, prefetch: bool = False,
                 host_table: bool | None = None, mlp_chunk: int | None = None,
                 fast_kernels: bool | None = None, attention_time: float | None = None):
        self.shards = shard_positions(seq_len, ranks, order)  # RingError if too short
        self.ranks, self.order, self.whole = ranks, order, seq_len
        self._attention_time = attention_time
        self._pairs: dict[tuple[int | None, int], int] = {}
        self._reference: float | None = None
        super().__init__(geom, self.shards.padded, batch_size, attention, coef, tile, offload,
                         light_tile, boundaries_on_device, prefetch, host_table, mlp_chunk,
                         fast_kernels)

    # --- memory ---------------------------------------------------------------------------

    def kernel(self, g: LayerGeom) -> str:
        return "ring"

    def chunk(self, g: LayerGeom) -> int:
        """Queries per chunk of scores, as `RingMask` picks it."""
        return default_chunk_size(self.B, g.heads, self.L, self.shards.padded, None)

    def block_bytes(self, g: LayerGeom, dtype_bytes: int | None = None) -> float:
        """One key/value block as it travels, [B, kv heads, shard, Dk + Dv]: K/V in the compute
        dtype, dK/dV (`dtype_bytes=4`) in float32."""
        s = self.g.dtype_bytes if dtype_bytes is None else dtype_bytes
        return float(self.B * self.shards.padded * 2 * g.kv_width * s)

    def ring_buffers(self, g: LayerGeom) -> float:
        """Layer g's blocks in flight in its backward: K/V in hand and arriving, the float32
        copy attended (below float32), and the dK/dV in hand and arriving."""
        copy = self.block_bytes(g, F32) if self.g.dtype_bytes < F32 else 0.0
        return 2 * self.block_bytes(g) + copy + 2 * self.block_bytes(g, F32)

    def ring_buffer_bytes(self) -> float:
        """The worst layer's `ring_buffers`."""
        return max(self.ring_buffers(g) for g in self.g.layers)

    def _attention(self, g: LayerGeom) -> tuple[float, float]:
        B, n, s = self.B, self.L, self.g.dtype_bytes
        lse = B * g.heads * n * F32
        scores = CHUNKED_SCORE_COPIES * B * g.heads * self.chunk(g) * self.shards.padded * F32
        # float32 Q and dO copies, dQ accumulators, rowsum(dO * O), the LSE
        rows = B * n * (3 * g.q_width * F32 + 2 * g.heads * F32)
        transient = rows + self.ring_buffers(g) + scores
        if self.tile:  # Q, dO, dQ, dK, dV in the compute dtype: in whole_sequence_bytes
            return 0.0, float(transient)
        outputs = B * n * (g.q_width + 2 * g.kv_width) * s
        return float(lse), float(transient + outputs)

    def constants(self) -> float:
        if self.tile:
            return super().constants()
        return self.per_layer_input_bytes()  # no mask arrays: ring masks come from positions

    # --- time -----------------------------------------------------------------------------

    @property
    def attention_time(self) -> float:
        if self._attention_time is not None:
            return float(self._attention_time)
        return ATTENTION_TIME_CUDA["chunked"] if self.fast_kernels else 1.0

    def pairs(self, g: LayerGeom) -> int:
        """Scored (query, key) pairs of the slowest rank, at layer g's window."""
        key = (self.window_of(g), self.chunk(g))
        if key not in self._pairs:
            self._pairs[key] = max(scored_pairs(self.shards, r, *key) for r in range(self.ranks))
        return self._pairs[key]

    def window_of(self, g: LayerGeom) -> int | None:
        return g.window if g.window is not None and g.window < self.whole else None

    def balance(self, g: LayerGeom) -> float:
        """Scored pairs of the busiest rank over the mean (1.0: perfectly balanced)."""
        window = self.window_of(g)
        work = [scored_pairs(self.shards, r, window, self.chunk(g)) for r in range(self.ranks)]
        return float(max(work) / np.mean(work))

    def _attention_flops(self, g: LayerGeom, kernel: str) -> tuple[float, float]:
        attn = 4.0 * g.heads * g.head_dim * self.pairs(g) * self.B * self.attention_time
        return attn, BWD_RING * attn

    def reference_flops(self) -> float:
        """A plain forward+backward of the whole sequence on one device (cheapest kernels),
        over R."""
        if self._reference is None:
            whole = CostModel(self.g, self.whole, self.B, self.attention,
                              fast_kernels=self.fast_kernels)
            self._reference = whole.reference_flops() / self.ranks
        return self._reference

    # --- communication --------------------------------------------------------------------

    def forwards(self, segments: Sequence[tuple[int, int]]) -> list[int]:
        """How many times each layer's attention forward runs in a step."""
        if not self.tile:
            return [2] * self.g.num_layers
        last = {b - 1 for _, b in segments}
        return [2 if i in last else 3 for i in range(self.g.num_layers)]

    def sent_bytes(self, segments: Sequence[tuple[int, int]]) -> float:
        """Bytes each rank sends around the ring in one step (key/value and dK/dV blocks)."""
        R = self.ranks
        return float(sum(self.block_bytes(g) * (f + 1) * (R - 1) + self.block_bytes(g, F32) * R
                         for g, f in zip(self.g.layers, self.forwards(segments))))

    def messages(self, segments: Sequence[tuple[int, int]]) -> int:
        """Sends per rank per step."""
        R = self.ranks
        return sum(f * (R - 1) + 2 * R - 1 for f in self.forwards(segments))

    def summary(self, segments: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """What a plan says of its context parallelism (`Plan.context`)."""
        return dict(ranks=self.ranks, order=self.order, seq_len=self.whole,
                    shard_tokens=self.shards.padded,
                    sent_gb_per_step=self.sent_bytes(segments) / GB,
                    messages_per_step=self.messages(segments),
                    ring_buffer_gb=self.ring_buffer_bytes() / GB,
                    balance=max(self.balance(g) for g in self.g.layers))

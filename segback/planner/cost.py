"""Segment planner: choose the layer ranges of a segmented backward from the model's geometry.

Peak memory of one training step (segback.engine.value_and_grad + AdamW) is modelled as a
sequence of events, each adding its transient to what is alive at that moment:

    resting   = weights + LoRA params, grads and AdamW state (float32, 2x); less Gemma-4's
                per-layer embedding table when it is parked in host memory (host_table)
    constants = per-layer inputs (Gemma-4) + materialized [L, L] masks + saved donor K/V
    embed     = prologue: building h0 and the per-layer inputs
    head      = every hidden boundary + the final hidden + dh + one chunk of logits
    segment k = hidden boundaries 0..k + dh + donor K/V cotangents still pending
                + the segment's recomputed activations (+ attention scores) + h_out, dh_in
    peak      = resting + constants + max(events)

The engine frees a boundary once its segment's backward is done, so early segments see fewer
boundaries. Time is counted in FLOPs: the engine recomputes every layer's forward once, and each
segment adds a small fixed overhead. The search is an O(N^3) min-max DP over contiguous cuts for
every segment count, with a branch per choice of which Gemma-4 donors stay uncut from their
sharers (no saved K/V). `--calibrate` scales the analytic activation and attention sizes by a
fit to a 1-layer and a 2-layer segment of the real model, measured at two lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from segback.engine.attention import fast_kernel_for, fused_routed
from segback.engine.chunked import default_chunk_size
from segback.engine.offload import MAX_PENDING
from segback.engine.options import DEFAULT_HEAD_CHUNK as HEAD_MAX_ELEMENTS, table_on_host
from segback.planner.geometry import Geometry, LayerGeom

# Fused attention (mx.fast.scaled_dot_product_attention under grad tracing runs MLX's composed
# fallback on every backend) in units of one [B, H, L, L] array in the compute dtype: each layer
# of a segment keeps ~0.8 copy until its backward, and one layer's backward adds ~2.4 (scores,
# dP, dS). Fitted on CPU llama and gemma4 layers, 1-3 per segment; a lone sdpa on the H200
# (measured: 3.6 GB at 8K, 8 heads, bf16) is 3.4 in all.
FUSED_RETAINED_COPIES = 0.8
FUSED_TRANSIENT_COPIES = 2.4
# Chunked attention (segback.engine.chunked): the backward keeps ~4 float32 [B, H, chunk,
# visible] arrays per chunk, plus float32 dK/dV and dQ over the whole sequence.
CHUNKED_SCORE_COPIES = 4.0
# Loss head: a chunk of logits is held ~4.5 times (logits, log-softmax, grads), ~6.5 with a
# logit softcap (tanh and its derivative), measured on CPU in float32 and bfloat16.
HEAD_COPIES, SOFTCAP_COPIES = 4.5, 2.0
# Per-segment fixed cost (graph build, evals, boundary copies) as a fraction of a step; a rough
# figure: at long L the recompute forward dominates and this barely moves the ratio.
SEGMENT_OVERHEAD = 0.003
# Per-tile fixed cost of the tiled engine (kernel launches, graph building and the host work of
# each tile's layer passes), as that many tokens of those passes: a tile of T tokens costs like
# T + TILE_OVERHEAD_TOKENS. Fitted to e4b steps at tiles 256-1024 on an H100 (bench/RESULTS.md);
# without it the model ranks small tiles as fast as large ones.
TILE_OVERHEAD_TOKENS = 768
# Backward/forward FLOP ratios: a frozen linear only needs dX (1x), attention needs dQ, dK, dV
# and dP (2x) and chunked attention also recomputes its probabilities (3x).
BWD_LINEAR, BWD_ATTN_FUSED, BWD_ATTN_CHUNKED = 1.0, 2.0, 3.0
# The attention kernels a plan's layers run (`CostModel.kernel`): "composed" (MLX's unfused
# path, every key scored into [L, L] arrays), "mlx" (MLX's fused kernel: cuDNN on CUDA),
# "flash" (segback.engine.flash) and "chunked" (segback.engine.chunked). Backward work in
# units of the forward's: cuDNN recomputes S and P once (2.5x); the flash kernels compute
# S and dP twice, in the dK/dV pass and the dQ pass (3.5x).
BWD_ATTN = {"composed": BWD_ATTN_FUSED, "mlx": 2.5, "flash": 3.5, "chunked": BWD_ATTN_CHUNKED}
FAST_KERNELS = ("mlx", "flash")
# Time of one attention FLOP relative to one FLOP of the layers' (quantized) linears, per kernel,
# on CUDA (elsewhere every FLOP counts alike): 4-bit linears run at about 0.19 of the bf16
# matmul rate; attention_bench on one H100 (run h100-run22, bench/RESULTS.md) measured MLX's
# fused kernel at 0.45, the flash kernel at 0.19 (head dim 256, causal; 0.09 at 512), the
# chunked kernel at 0.03-0.07 and MLX's composed path at 0.04 of it.
ATTENTION_TIME_CUDA = {"mlx": 0.42, "flash": 1.0, "composed": 5.0, "chunked": 4.0}


@dataclass
class Coefficients:
    """Multipliers on the analytic sizes (1.0 = uncalibrated): activations (kept ones and one
    layer's backward cotangents), the attention scores each layer keeps until its backward, and
    the scores one layer's backward adds."""

    activation: float = 1.0
    attention: float = 1.0
    attention_transient: float = 1.0
    calibrated: bool = False
    lengths: list[int] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    measured_gb: list[list[float]] = field(default_factory=list)  # [segment][length]


# Plans on CUDA hold more than the analytic activations (mlx-cuda keeps a graph's buffers until
# the graph has run): fitted to 47 measured untiled e4b plans, 2K-8K tokens, batch 1-4, on an
# H100 (bench/RESULTS.md), activations x 1.6 predict every peak within 6.3%, where 1.0 was 13-27%
# low; the same factor on the tiled engine's tile transients puts 19 tiled plans (4K-64K, not
# part of the fit) within 9% (bench/RESULTS.md, run h100-run18). `--calibrate` replaces it.
CUDA_ACTIVATION = 1.6


def device_coefficients() -> Coefficients:
    """The uncalibrated coefficients for a plan on the default device."""
    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return Coefficients(activation=CUDA_ACTIVATION) if cuda else Coefficients()


def _chunk_size(B: int, H: int, L: int, window: int | None) -> int:
    """The query chunk segback.engine.chunked picks for this shape."""
    return default_chunk_size(B, H, L, L, window)


class CostModel:
    """Bytes and FLOPs of every piece of a segmented step for one (geometry, L, B, attention).

    With `tile` (tokens), the step is the sequence-tiled engine's (segback.engine.tiled): every
    layer runs its token-wise parts a tile at a time, attention is chunked, a segment keeps only
    its input boundary (and recomputes those inside it in its backward), every Gemma-4 donor's
    K/V is kept, and with `offload` the boundaries and per-layer inputs live in host memory.
    """

    def __init__(self, geom: Geometry, seq_len: int, batch_size: int = 1,
                 attention: str = "fused", coef: Coefficients | None = None,
                 tile: int | None = None, offload: bool = False,
                 light_tile: int | None = None, boundaries_on_device: int = 0,
                 prefetch: bool = False, host_table: bool | None = None,
                 mlp_chunk: int | None = None, fast_kernels: bool | None = None):
        if attention not in ("fused", "chunked"):
            raise ValueError(f"attention must be 'fused' or 'chunked', not {attention!r}")
        if tile is not None and tile < 1:
            raise ValueError(f"tile must be a positive number of tokens, not {tile}")
        if offload and not tile:
            raise ValueError("offload needs a tile size: it is part of the tiled engine")
        if mlp_chunk is not None and (tile or mlp_chunk < 1):
            raise ValueError("mlp_chunk is a positive number of tokens, for untiled plans only")
        if (light_tile and not tile) or (boundaries_on_device and not offload):
            raise ValueError("light_tile needs a tile size and boundaries_on_device needs offload")
        self.g, self.L, self.B, self.attention = geom, seq_len, batch_size, attention
        # Whether attention="fused" runs the O(L) kernels (MLX's fused, segback's flash): the
        # engine's choice on CUDA (None: as on the default device).
        self.fast_kernels = fused_routed() if fast_kernels is None else bool(fast_kernels)
        self.tile, self.offload = (min(int(tile), seq_len) if tile else None), bool(offload)
        self.light = min(int(light_tile or tile), seq_len) if tile else None
        self.boundaries_on_device = int(boundaries_on_device)
        self.prefetch = self.offload and prefetch
        self.mlp_chunk = min(int(mlp_chunk), seq_len) if mlp_chunk else None
        # Gemma-4's per-layer table in host memory (EngineOptions.host_table; None: the engine's
        # default on the default device)
        self.host_table = table_on_host(host_table, self.offload)
        self.coef = coef or Coefficients()
        s, L, B = geom.dtype_bytes, seq_len, batch_size
        self.hidden_bytes = B * L * geom.hidden * s  # one [B, L, hidden] boundary
        layers = geom.layers
        if self.tile:
            self.act = np.array([self._tiled_layer(g) for g in layers], float)
            self.bwd = np.zeros(len(layers))
        elif self.mlp_chunk:  # the MLP keeps nothing; its VJP holds one chunk's of both
            c = self.mlp_chunk
            self.act = np.array([B * (L * (g.act_elems - 4 * g.inter)) * s for g in layers],
                                float)
            self.bwd = np.array([B * (L * (g.bwd_elems - 4 * g.inter) + c * 8 * g.inter) * s
                                 for g in layers], float)
        else:
            self.act = np.array([B * L * g.act_elems * s for g in layers], float)
            self.bwd = np.array([B * L * g.bwd_elems * s for g in layers], float)
        ret, trans = zip(*(self._attention(g) for g in layers))
        self.attn_retained, self.attn_transient = np.array(ret), np.array(trans)
        self.kv_bytes = {d: 2 * B * L * layers[d].kv_width * s for d in geom.sharers()}
        # A stored segment boundary on the device, and what a segment's backward always holds
        # besides its transient: its own input boundary and dh (untiled), or only dh (tiled:
        # the segment's inputs are part of its transient).
        self.boundary_bytes = 0.0 if self.offload else float(self.hidden_bytes)
        self.fixed_bytes = float(self.hidden_bytes if self.tile else 2 * self.hidden_bytes)
        if self.prefetch:  # the next segment's boundary, fetched back while this one runs
            self.fixed_bytes += self.hidden_bytes

    def _pre_elems(self, g: LayerGeom) -> int:
        """Elements per token of the pre pass's VJP on one light tile: its input, norm and
        projections (Q, own K/V, before and after norms and RoPE) and their cotangents."""
        return 2 * (3 * self.g.hidden + 3 * (g.q_width + 2 * g.kv_own))

    def whole_sequence_bytes(self, g: LayerGeom) -> float:
        """What a tiled layer's backward holds over the whole sequence (bench/
        tiled_layer_memory.py measures it): Q, dO, dQ, the own K, V, float32 dK/dV, their
        update copies and casts, rowsum(dO * O) and the post pass's dh."""
        s = self.g.dtype_bytes
        if self.kernel(g) in FAST_KERNELS:  # dO concatenated once more, dK/dV in the input dtype
            return float(self.B * self.L * (4 * g.q_width * s + 2 * g.kv_own * s
                                             + 2 * g.kv_width * s + g.heads * 8)
                         + self.hidden_bytes)
        return float(self.B * self.L * (3 * g.q_width * s + 2 * g.kv_own * s
                                         + 2 * g.kv_width * (8 + s) + g.heads * 4)
                     + self.hidden_bytes)

    def _tiled_layer(self, g: LayerGeom) -> float:
        """One tiled layer's backward, bytes: Q, dO, dQ and the own K, V over the whole sequence,
        float32 dK/dV accumulators, their update copies and casts, rowsum(dO * O), dh_in, one
        tile's activations and cotangents (the post pass's on a tile, or the pre pass's on a
        light tile), and (offload) the layer's per-layer input fetched back."""
        s, L, B = self.g.dtype_bytes, self.L, self.B
        whole = self.whole_sequence_bytes(g)
        tile = self.coef.activation * B * self.tile * (g.act_elems + g.bwd_elems) * s
        light = self.coef.activation * B * self.light * self._pre_elems(g) * s
        pli = B * L * self.g.per_layer_width // max(1, self.g.num_layers) * s
        # offload: this layer's per-layer input fetched back (and the next one's, prefetching)
        fetched = (2 if self.prefetch else 1) * pli if self.offload else 0
        return float(whole + max(tile, light) + fetched)

    def forward_bytes(self) -> float:
        """The tiled forward's worst layer, bytes: Q, K, V, O over the whole sequence and its
        output, one light tile of the post pass (at most its kept activations: nothing is
        kept, so this bounds what is alive) or the attention forward's scores."""
        s, L, B = self.g.dtype_bytes, self.L, self.B
        worst = 0.0
        for g, attn in zip(self.g.layers, self.attn_transient):
            whole = B * L * (2 * g.q_width + 2 * g.kv_own) * s + self.hidden_bytes
            light = self.coef.activation * B * self.light * g.act_elems * s
            worst = max(worst, whole + max(light, attn / 2))
        return float(worst)

    def window(self, g: LayerGeom) -> int | None:
        return g.window if g.window is not None and g.window < self.L else None

    def kernel(self, g: LayerGeom) -> str:
        """The attention kernel layer `g` runs (BWD_ATTN's names), as the engine picks it
        (`segback.engine.attention.fused_kernel`)."""
        if self.attention == "chunked":
            return "chunked"
        return self.fast_kernel(g) or ("chunked" if self.tile else "composed")

    def fast_kernel(self, g: LayerGeom) -> str | None:
        """The O(L) fused kernel attention="fused" runs for layer `g`, if any."""
        if not self.fast_kernels:
            return None
        return fast_kernel_for(g.head_dim, self.g.dtype_bytes == 2, self.window(g) is not None,
                               self.L)

    def _attention(self, g: LayerGeom) -> tuple[float, float]:
        """(kept until the layer's backward, transient during it) for one layer, in bytes."""
        B, L, s = self.B, self.L, self.g.dtype_bytes
        kernel = self.kernel(g)
        if kernel == "composed":
            scores = B * g.heads * L * L * s
            return FUSED_RETAINED_COPIES * scores, FUSED_TRANSIENT_COPIES * scores
        if kernel in FAST_KERNELS:
            return self._fast_attention(g, kernel)
        window = g.window if g.window is not None and g.window < L else None
        chunk = _chunk_size(B, g.heads, L, window)
        visible = L if window is None else min(L, chunk + window - 1)
        scores = CHUNKED_SCORE_COPIES * B * g.heads * chunk * visible * 4
        if self.tile:  # the whole-sequence arrays are counted in _tiled_layer
            return 0.0, scores
        linear = B * L * (2 * g.kv_width * 4 + g.heads * g.head_dim * s)  # dK, dV f32 + dQ
        return 0.0, scores + linear

    def _fast_attention(self, g: LayerGeom, kernel: str) -> tuple[float, float]:
        """(kept, transient) bytes of an O(L) fused kernel: the row LSE (float32) is kept;
        the backward holds dQ, dK, dV and rowsum(dO * O), cuDNN a float32 dQ too, and MLX's
        kernel, padding the sequence to its 128-token tile, padded copies of Q, K, V, O."""
        B, s = self.B, self.g.dtype_bytes
        L = self.L + (-self.L % 128 if kernel == "mlx" else 0)
        lse = B * g.heads * L * 4
        padded = B * L * (2 * g.q_width + 2 * g.kv_width) * s if L != self.L else 0
        extra = 0 if kernel == "flash" else B * L * g.q_width * 4 + padded
        if self.tile:  # Q, dO, dQ, dK, dV, the LSE: counted in whole_sequence_bytes
            return 0.0, float(extra)
        grads = B * L * (g.q_width + 2 * g.kv_width) * s + lse
        return float(lse + (padded if kernel == "mlx" else 0)), float(grads + extra)

    # --- memory ---------------------------------------------------------------------------

    def per_layer_input_bytes(self) -> float:
        return float(self.B * self.L * self.g.per_layer_width * self.g.dtype_bytes)

    def constants(self) -> float:
        """Alive for the whole step besides the boundaries: per-layer inputs and masks (and, tiled,
        every donor's K/V)."""
        g, L = self.g, self.L
        if self.tile:
            pli = 0.0 if self.offload else self.per_layer_input_bytes()
            return pli + float(sum(self.kv_bytes.values()))
        windows = {x.window for x in g.layers if x.window is not None and x.window < L}
        # bool [L, L] window masks: only where mlx-lm's own attention runs unrouted
        masks = L * L * len(windows) if self.attention == "fused" and not self.fast_kernels \
            else 0
        return float(self.per_layer_input_bytes() + masks)

    def segment_matrix(self) -> np.ndarray:
        """S[a, b]: the transient of segment [a, b)'s backward, for all 0 <= a < b <= N (inf
        elsewhere). Untiled: its activations, attention, h_out and dh_in; tiled: the recomputed
        inputs of its layers up to the one running, plus that layer's backward."""
        n, c = self.g.num_layers, self.coef
        S = np.full((n + 1, n + 1), np.inf)
        if self.tile:
            per_layer = self.act + c.attention_transient * self.attn_transient
            for a in range(n):
                inner = (np.arange(a, n) - a + 1) * self.hidden_bytes
                S[a, a + 1:] = np.maximum.accumulate(inner + per_layer[a:])
            return S
        cum_act = np.concatenate([[0.0], np.cumsum(self.act)])
        cum_ret = np.concatenate([[0.0], np.cumsum(self.attn_retained)])
        for a in range(n):
            peak = np.maximum.accumulate(self.attn_transient[a:])
            bwd = np.maximum.accumulate(self.bwd[a:])
            b = np.arange(a + 1, n + 1)
            S[a, a + 1:] = (c.activation * (cum_act[b] - cum_act[a] + bwd)
                            + c.attention * (cum_ret[b] - cum_ret[a])
                            + c.attention_transient * peak
                            + 2 * self.hidden_bytes)
        return S

    def head_bytes(self) -> float:
        """Transient of the chunked loss head: one chunk of logits, dh and its update copy."""
        g = self.g
        rows = max(1, min(self.B * (self.L - 1), HEAD_MAX_ELEMENTS // g.vocab))
        copies = HEAD_COPIES + (SOFTCAP_COPIES if g.softcap else 0.0)
        return copies * rows * g.vocab * g.dtype_bytes + 2 * self.hidden_bytes

    def embed_bytes(self) -> float:
        """Prologue transient: the per-layer inputs are built through ~3 full-size temporaries
        (tiled: tile by tile, then split per layer, up to MAX_PENDING slices waiting for their
        copy to the host if offloaded)."""
        pli = self.per_layer_input_bytes()
        if self.tile:
            waiting = MAX_PENDING * pli / max(1, self.g.num_layers) if self.offload else 0.0
            return pli + waiting + self.hidden_bytes
        return 3.0 * pli

    def kept(self, n_segments: int) -> int:
        """Boundaries on the device: all without offload, else the last `boundaries_on_device`."""
        return n_segments if not self.offload else min(self.boundaries_on_device, n_segments)

    def host_bytes(self, n_segments: int) -> float:
        """Host memory of the step: the per-layer embedding table if parked, and offloaded, one
        boundary per parked segment and the per-layer inputs."""
        table = float(self.g.table_bytes if self.host_table else 0)
        if not self.offload:
            return table
        parked = n_segments - self.kept(n_segments)
        return float(parked * self.hidden_bytes + self.per_layer_input_bytes()) + table

    def resting(self) -> tuple[float, float]:
        """(weights incl. LoRA factors, LoRA grads + AdamW's two float32 moments), less the
        per-layer embedding table when it is parked in host memory."""
        weights = self.g.weight_bytes - (self.g.table_bytes if self.host_table else 0)
        return float(weights), float(self.g.lora_params * 4 * 3)

    def saved_donors(self, segments: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
        """Donor -> indices of later segments that read its saved K/V (tiled: every donor's K/V
        is kept, and read by the segments of its sharers)."""
        seg_of = {i: k for k, (a, b) in enumerate(segments) for i in range(a, b)}
        out: dict[int, list[int]] = {}
        for d, readers in self.g.sharers().items():
            ks = sorted({seg_of[r] for r in readers if self.tile or seg_of[r] != seg_of[d]})
            if ks:
                out[d] = ks
        return out

    def evaluate(self, segments: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """Predicted peak (bytes), its breakdown and the event where it happens."""
        n_seg = len(segments)
        weights, lora_opt = self.resting()
        saved = self.saved_donors(segments)
        kv_saved = 0.0 if self.tile else sum(self.kv_bytes[d] for d in saved)  # tiled: constant
        const = self.constants() + kv_saved
        hb = self.hidden_bytes
        first_kept = n_seg - self.kept(n_seg)  # boundaries k >= this one live on the device

        def on_device(k: int) -> float:  # bytes of the boundaries of segments 0..k-1
            return max(0, k - first_kept) * hb

        S = self.segment_matrix()
        seg_t = [float(S[a, b]) for a, b in segments]
        events = [("embedding", float(hb), self.embed_bytes() + (0.0 if self.tile else hb)),
                  ("loss head", on_device(n_seg) + hb, self.head_bytes())]
        if self.tile:  # offload: up to MAX_PENDING boundaries' device copies await the host
            waiting = MAX_PENDING * hb if self.offload else 0.0
            events.append(("layer forward", on_device(n_seg) + waiting, self.forward_bytes()))
        for k, (_, b) in enumerate(segments):
            pending = sum(self.kv_bytes[d] for d in saved if d < b)  # dK/dV not yet consumed
            events.append((f"segment {k} backward", on_device(k) + self.fixed_bytes + pending,
                           seg_t[k]))
        name, alive, transient = max(events, key=lambda e: e[1] + e[2])
        peak = weights + lora_opt + const + alive + transient
        return dict(
            peak=peak, peak_at=name,
            breakdown=dict(weights=weights, lora_optimizer=lora_opt, boundaries=const + alive,
                           worst_segment=max(seg_t), head=self.head_bytes()),
            saved=saved, segment_bytes=seg_t,
        )

    # --- time -----------------------------------------------------------------------------

    def _attention_flops(self, g: LayerGeom, kernel: str) -> tuple[float, float]:
        """(forward, backward) attention work of one layer in time-weighted FLOPs: the FLOPs
        its kernel runs (the composed path scores every key, chunks whole chunks, the fused
        kernels skip masked blocks), times the kernel's time per FLOP on this backend."""
        L, B = self.L, self.B
        window = self.window(g)
        if kernel == "composed":
            keys = L
        elif kernel == "chunked":
            chunk = _chunk_size(B, g.heads, L, window)
            keys = (L + chunk) / 2 if window is None else min(L, window + chunk / 2)
        else:
            keys = (L + 1) / 2 if window is None else min(L, window + 32)
        weight = ATTENTION_TIME_CUDA[kernel] if self.fast_kernels else 1.0
        attn = 4.0 * g.heads * g.head_dim * keys * L * B * weight
        ratio = BWD_ATTN[kernel]
        if kernel == "mlx" and self.tile:  # its VJP runs the forward again (for the LSE)
            ratio += 1.0
        return attn, ratio * attn

    def _flops(self, reference: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, backward, q/k/v projection forward) time-weighted FLOPs of each layer for
        the whole batch, with each layer's kernel (`reference`: the cheapest kernel the layer
        could run, the denominator every plan of this model shares, so that plans of any
        engine compare and none is faster than one plain step)."""
        L, B = self.L, self.B
        fwd, bwd, qkv = [], [], []
        for g in self.g.layers:
            quant = 1.0 + 0.02 * g.bits if g.bits else 1.0  # dequantization work, a guess
            lin = g.linear_flops * quant * L * B
            if reference:  # the cheapest kernel this layer could run
                fast = self.fast_kernel(g)
                kernels = ["composed", "chunked"] + ([fast] if fast else [])
                attn, attn_bwd = min((self._attention_flops(g, k) for k in kernels), key=sum)
            else:
                attn, attn_bwd = self._attention_flops(g, self.kernel(g))
            fwd.append(lin + attn)
            bwd.append(BWD_LINEAR * lin + attn_bwd)
            qkv.append(g.qkv_flops * quant * L * B)
        return np.array(fwd), np.array(bwd), np.array(qkv)

    def head_flops(self) -> float:
        """The loss head's forward and dX over the batch's rows."""
        return 2.0 * self.g.hidden * self.g.vocab * self.B * (self.L - 1) * 3

    def reference_flops(self) -> float:
        """Time-weighted FLOPs of one plain forward+backward with the cheapest kernels: the
        unit of `relative_step_time`."""
        ref_fwd, ref_bwd, _ = self._flops(reference=True)
        return float(ref_fwd.sum() + ref_bwd.sum() + self.head_flops())

    def relative_step_time(self, segments: Sequence[tuple[int, int]]) -> float:
        """Segmented step time over one plain forward+backward (same loss head):
        `step_flops` over `reference_flops`, plus a fixed cost per segment (and MLP chunk)."""
        chunks = -(-self.L // self.mlp_chunk) if self.mlp_chunk and not self.tile else 0
        return float(self.step_flops(segments) / self.reference_flops()
                     + SEGMENT_OVERHEAD * (len(segments) + chunks))

    def step_flops(self, segments: Sequence[tuple[int, int]]) -> float:
        """Time-weighted FLOPs of one segmented step (in units of the linears' FLOPs).

        Untiled: the recompute costs one forward in total. Tiled: the forward is the layer's
        own (the post pass's Q/K/V projections feed nothing, so MLX never computes them); a
        layer's backward recomputes Q/K/V and the attention output, runs the post pass, its
        VJP, attention's VJP and the pre pass's VJP (which recomputes Q/K/V once more); and
        each segment first recomputes the inputs of its layers above the first; every tile adds
        a fixed cost (TILE_OVERHEAD_TOKENS).
        """
        fwd, bwd, qkv = self._flops()
        head = self.head_flops()
        if not self.tile:  # chunked MLPs run their forward once more, in their VJP
            again = sum(g.mlp_flops for g in self.g.layers) * self.B * self.L \
                if self.mlp_chunk else 0.0
            plain = fwd.sum() + bwd.sum() + head  # this plan's kernels, without recompute
            return float(plain + fwd.sum() + again)
        vjp = fwd + bwd + qkv  # recompute + post/attention/pre VJPs + the pre-VJP's Q/K/V
        inner = sum(fwd[a:b - 1].sum() for a, b in segments)
        tiles = -(-self.L // self.tile)
        per_tile = (fwd.sum() + vjp.sum()) * TILE_OVERHEAD_TOKENS / (self.B * self.L)
        return float(fwd.sum() + vjp.sum() + inner + head + tiles * per_tile)

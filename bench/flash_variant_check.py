"""Edge cases of the flash kernel variants on the device: each against a float32 reference.

attention_bench.py times whole-block lengths; this runs the shapes where tilings differ (lengths
not a multiple of any block, windows shorter and longer than a block, packed examples, GQA,
fewer queries than keys) for every head dim, and prints per case and variant the error of the
output and each gradient (max |x - ref| / max |ref|, reference = the dense float32 attention
on the upcast inputs). Exit status 1 if a variant's error exceeds `--factor` times v1's (plus
bf16's half-ulp), or is not finite.

    python bench/flash_variant_check.py --variants v1 v2 [--out bench/data/runs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segback.benchmark.provenance import append_rows, with_provenance  # noqa: E402
from segback.engine import flash  # noqa: E402
from segback.engine.masks import Blocks  # noqa: E402

# (B, H, Hkv, Lq, Lk, window, packed example length)
CASES = [
    (1, 2, 2, 200, 200, None, 0),
    (2, 4, 2, 1000, 1000, None, 0),
    (1, 4, 1, 777, 777, 37, 0),
    (1, 2, 2, 1500, 1500, 300, 0),
    (1, 8, 2, 4099, 4099, 512, 0),
    (2, 4, 2, 1200, 1200, None, 250),
    (1, 2, 2, 1100, 1100, 90, 300),
    (1, 2, 1, 300, 700, None, 0),
    (1, 2, 2, 130, 4096, 200, 0),
]


def dense(q, k, v, scale, Lq, Lk, window, seg):
    """Dense attention in float32 with the same mask (the reference)."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    i = np.arange(Lq)[:, None] + (Lk - Lq)
    j = np.arange(Lk)[None]
    vis = j <= i
    if window is not None:
        vis &= j > i - window
    vis = vis[None]
    if seg is not None:
        vis = vis & (seg[:, Lk - Lq:, None] == seg[:, None, :])
    s = (q @ k.swapaxes(-1, -2)) * scale
    s = mx.where(mx.array(vis)[:, None], s, -mx.inf)
    return mx.softmax(s, axis=-1, precise=True) @ v


def errors(case, D: int, variant: str, ref) -> dict[str, float]:
    B, H, Hkv, Lq, Lk, window, packed = case
    mx.random.seed(0)
    q, k, v, ct = (mx.random.normal(s).astype(mx.bfloat16)
                   for s in ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D), (B, H, Lq, D)))
    seg = (np.arange(Lk)[None].repeat(B, 0) // packed).astype(np.int32) if packed else None
    blocks = Blocks(seg) if packed else None
    scale = D ** -0.5

    def fn(q, k, v):
        return flash.flash_attention(q, k, v, scale, window, blocks, variant=variant)

    def reference(q, k, v):
        return dense(q, k, v, scale, Lq, Lk, window, seg)

    if ref is None:
        f32 = [x.astype(mx.float32) for x in (q, k, v, ct)]
        o, g = mx.vjp(reference, f32[:3], [f32[3]])
        ref = [o[0], *g]
    o, g = mx.vjp(fn, [q, k, v], [ct])
    out = {}
    for name, x, w in zip(("o", "dq", "dk", "dv"), [o[0], *g], ref):
        err = (mx.abs(x.astype(mx.float32) - w).max() / mx.abs(w).max()).item()
        out[name] = float(f"{err:.3g}")
    return out, ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(flash.VARIANTS))
    ap.add_argument("--dims", type=int, nargs="+", default=list(flash.HEAD_DIMS))
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--out", default=None, help="append one row per case and variant here "
                    "(e.g. bench/data/runs.jsonl)")
    ap.add_argument("--config-name", default=None, help="row key \"config\"")
    ap.add_argument("--run", default=None, help="row key \"run\"")
    args = ap.parse_args()

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.out:
            append_rows(args.out, [with_provenance(dict(bench="flash_variant_check", **row),
                                                   args.config_name, args.run)])

    ok = True
    for D in args.dims:
        for case in CASES:
            ref, base = None, None
            for variant in args.variants:
                try:
                    err, ref = errors(case, D, variant, ref)
                except Exception as e:  # noqa: BLE001 - a failing kernel is a result here
                    emit(dict(D=D, case=case, variant=variant,
                              error=f"{type(e).__name__}: {str(e)[:300]}"))
                    ok = False
                    continue
                base = base or err
                bad = [n for n, x in err.items()
                       if not math.isfinite(x) or x > args.factor * base[n] + 2 ** -9]
                ok &= not bad
                emit(dict(D=D, case=case, variant=variant, **err, worse=bad or None))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

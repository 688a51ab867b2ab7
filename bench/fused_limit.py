"""Where MLX's fused causal attention stops building on CUDA: forward + backward through
`mx.fast.scaled_dot_product_attention` at one call over all heads, and through segback's
`mlx_causal` (head groups past the limit), at growing lengths. Rows to --out (JSON lines)."""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from segback.engine.attention import mlx_causal, mlx_heads_per_call


def _one_call(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")


def _one(fn, B: int, H: int, Hkv: int, L: int, D: int) -> dict:
    q = mx.random.normal((B, H, L, D)).astype(mx.bfloat16)
    k, v = (mx.random.normal((B, Hkv, L, D)).astype(mx.bfloat16) for _ in range(2))
    scale = D ** -0.5
    loss = mx.value_and_grad(lambda q, k, v: fn(q, k, v, scale).astype(mx.float32).sum(),
                             argnums=(0, 1, 2))
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    try:
        mx.eval(loss(q, k, v))
    except RuntimeError as e:
        return {"ok": False, "error": str(e).splitlines()[0][:300]}
    return {"ok": True, "s": round(time.perf_counter() - t0, 3),
            "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--config-name", default=None)
    p.add_argument("--run", default=None)
    a = p.parse_args()
    H, Hkv = a.heads
    for L in a.lengths:
        for path, fn in (("mlx_causal", mlx_causal), ("one-call", _one_call)):
            row = {"bench": "fused_limit", "config": a.config_name, "run": a.run,
                   "device": str(mx.default_device()), "mlx": mx.__version__, "path": path,
                   "seq": L, "heads": H, "kv_heads": Hkv, "head_dim": a.head_dim,
                   "heads_per_call": H if path == "one-call"
                   else mlx_heads_per_call(1, H, Hkv, L, a.head_dim),
                   **_one(fn, 1, H, Hkv, L, a.head_dim)}
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            mx.clear_cache()


if __name__ == "__main__":
    main()

"""One untiled segment's backward memory, measured against the cost model's prediction.

The planner's untiled peak is resting memory + stored boundaries + the worst segment's backward
transient (`CostModel.segment_matrix`). This script measures that transient alone, as the
engine runs it (segback's stack adapter, attention routed the engine's way, LoRA on every
linear), for segments of 1..N layers at several lengths, with and without the dequantized
matmul, so that a misprediction can be split into its per-layer slope and its fixed part.

    python bench/segment_memory.py --model llama-3.1-8b --seq 4096 8192 --layers 1 2 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="geometry name")
    p.add_argument("--quant-bits", type=int, default=4)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3],
                   help="segment sizes, from the first full-attention layer")
    p.add_argument("--dequant", choices=["both", "true", "false"], default="both")
    p.add_argument("--out", default=None, help="JSON lines file the rows are appended to")
    p.add_argument("--config-name", default="segment-memory")
    p.add_argument("--run", default=None)
    args = p.parse_args(argv)

    import mlx.core as mx

    from segback.benchmark.provenance import append_rows, with_provenance
    from segback.models.dequant_linear import use_dequantized_matmul
    from segback.models.random_init import build_model, geometry_config
    from segback.planner.calibrate import _attention_mode, measure_segment
    from segback.planner.cost import CostModel, device_coefficients
    from segback.planner.geometry import GB, read_geometry

    for dequant in ([True, False] if args.dequant == "both" else [args.dequant == "true"]):
        model = build_model(geometry_config(args.model), dtype=mx.bfloat16,
                            quantize_bits=args.quant_bits)
        if dequant:
            use_dequantized_matmul(model)
        model.freeze()
        geom = read_geometry(model)
        for L in args.seq:
            cost = CostModel(geom, L, 1, "fused", device_coefficients())
            for n in args.layers:
                with _attention_mode(model, "fused") as routed:
                    measured = measure_segment(model, 0, n, L, 1, 8, routed)
                S = cost.segment_matrix()
                row = dict(model=args.model, seq=L, layers=n, dequant_matmul=dequant,
                           measured_gb=round(measured / GB, 3),
                           predicted_gb=round(float(S[0, n]) / GB, 3),
                           activation_gb=round(float(cost.act[:n].sum()) / GB, 3),
                           backward_gb=round(float(cost.bwd[:n].max()) / GB, 3),
                           hidden_gb=round(cost.hidden_bytes / GB, 3),
                           kernels=cost.kernel(geom.layers[0]))
                print(json.dumps(row), flush=True)
                if args.out:
                    append_rows(args.out, [with_provenance(
                        row | {"script": "bench/segment_memory.py"}, args.config_name,
                        args.run)])
        del model
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

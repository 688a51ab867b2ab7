"""One training step with mlx-lm's GELU against segback.models.fast_gelu's, interleaved.

Both variants run the same model, LoRA, batch and plan, alternating step by step (A B A B ...),
so a machine that speeds up or slows down during the run affects both alike. One JSON line per
step, then a summary with the median of each and their ratio.

    python bench/gelu_step.py --model results/gemma3/model --plan results/gemma3/seq2048/plan.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from segback.engine import value_and_grad
    from segback.models.fast_gelu import use_fast_gelu
    from segback.models.load import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--plan", default=None, help="plan JSON (default: one segment)")
    parser.add_argument("--seq", type=int, default=1088, help="tokens in the sequence")
    parser.add_argument("--prompt-frac", type=float, default=0.86,
                        help="share of the sequence masked out of the loss, as --mask-prompt")
    parser.add_argument("--rounds", type=int, default=4, help="steps of each variant")
    args = parser.parse_args()

    model, _ = load(args.model, fast_gelu=False)
    model.freeze()
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    linear_to_lora_layers(model, len(layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    plan = json.loads(Path(args.plan).read_text()) if args.plan else None
    vocab = model.args.vocab_size
    batch = mx.random.randint(0, vocab, (1, args.seq), key=mx.random.key(0))
    lengths = mx.array([[int(args.prompt_frac * args.seq), args.seq - 1]])
    stock = {type(m) for _, m in model.named_modules()}
    use_fast_gelu(model)
    swapped = [(m, m.__class__) for _, m in model.named_modules() if type(m) not in stock]

    def set_fast(on: bool) -> None:
        for module, fast in swapped:
            module.__class__ = fast if on else fast.__bases__[0]

    times: dict[str, list[float]] = {"mlx-lm": [], "segback": []}
    losses: dict[str, float] = {}
    for step in range(2 * args.rounds + 2):  # the first pair warms up
        name = "segback" if step % 2 else "mlx-lm"
        set_fast(name == "segback")
        tic = time.perf_counter()
        (loss, _), grads = value_and_grad(model, batch, lengths, plan)
        mx.eval(loss, grads)
        seconds = time.perf_counter() - tic
        losses[name] = loss.item()
        if step >= 2:
            times[name].append(seconds)
        print(json.dumps({"step": step, "gelu": name, "seconds": round(seconds, 3),
                          "loss": loss.item(), "swapped_mlps": len(swapped)}), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"seq": args.seq, "median_s": {k: round(v, 3) for k, v in med.items()},
                      "ratio": round(med["segback"] / med["mlx-lm"], 3), "loss": losses,
                      "mlx": mx.__version__}))


if __name__ == "__main__":
    main()

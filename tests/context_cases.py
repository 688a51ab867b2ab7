"""The models and rows tests/test_context_parallel.py checks context parallelism on (shared by
the test and the ranks it launches, tests/context_ranks.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
from test_engine import batch_of, lora_model

from segback.models.random_init import geometry_config

T = 38  # 37 positions: divisible by neither 2 nor 4 ranks (nor their 4 and 8 zig-zag pieces)
STEPS = 3  # optimizer steps whose adapter is compared

# name -> (geometry, layers per segment, learning rate). tiny-gemma3's sliding window: 3 keys
# (smaller than every shard) and 30 (larger than every shard, smaller than the sequence). The
# rates move the adapter by ~0.05 in STEPS steps: further, float32 training drifts chaotically
# from float64 (tiny-e4b's sharp softmax first), and no comparison would be tight.
MODELS = {
    "llama": (geometry_config("tiny-llama"), 2, 0.2),
    "window3": (geometry_config("tiny-gemma3", sliding_window=3), 2, 0.02),
    "window30": (geometry_config("tiny-gemma3", sliding_window=30), 3, 0.02),
    "e4b": (geometry_config("tiny-e4b"), 3, 0.002),  # KV-shared layers read other segments' donors
}

# Engine options each rank runs its shard with: tiles of 4-5 tokens split every shard's runs
# (a zig-zag shard has two, 2-10 tokens each), and some tiles end where a run ends.
ENGINES = {
    "untiled": {},
    "tiled": {"tile": 4},
    "offload": {"tile": 5, "offload": True},
}

# case -> (model, engine)
CASES = {name: (name, "untiled") for name in MODELS} | {
    "llama.tiled": ("llama", "tiled"),
    "window3.offload": ("window3", "offload"),
    "e4b.tiled": ("e4b", "tiled"),
    "e4b.offload": ("e4b", "offload"),
}


# (case, order, optimizer steps) the ranks run: every untiled case in both orders, the trained
# adapter compared in one of them, and the tiled ones in the order whose shards have two runs.
RUNS = [(name, order, STEPS if order == "zigzag" else 1)
        for name in MODELS for order in ("zigzag", "contiguous")]
RUNS += [(name, "zigzag", 1) for name in CASES if name not in MODELS]


def case_inputs(name: str) -> tuple:
    """(model, batch, lengths, layers per segment, engine options) of a case; the same in
    every process."""
    model_name, engine = CASES[name]
    config, plan, _ = MODELS[model_name]
    model = lora_model(config)
    batch, lengths = batch_of(int(config["vocab_size"]), T=T)
    mx.eval(batch, lengths)
    return model, batch, lengths, plan, ENGINES[engine]


def optimizer(name: str) -> optim.Optimizer:
    """The optimizer of a case's compared steps: SGD with momentum, whose weights are linear in
    the gradients (so adapters differ by the gradients' rounding, not by Adam's normalisation)."""
    return optim.SGD(learning_rate=MODELS[CASES[name][0]][2], momentum=0.9)

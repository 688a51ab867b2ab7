"""The models and rows tests/test_context_parallel.py checks context parallelism on (shared by
the test and the ranks it launches, tests/context_ranks.py)."""

from __future__ import annotations

import mlx.core as mx
from test_engine import batch_of, lora_model

from segback.models.random_init import geometry_config

T = 38  # 37 positions: divisible by neither 2 nor 4 ranks (nor their 4 and 8 zig-zag pieces)

# name -> (geometry, layers per segment). tiny-gemma3's sliding window: 3 keys (smaller than
# every shard) and 30 (larger than every shard, smaller than the sequence).
CASES = {
    "llama": (geometry_config("tiny-llama"), 2),
    "window3": (geometry_config("tiny-gemma3", sliding_window=3), 2),
    "window30": (geometry_config("tiny-gemma3", sliding_window=30), 3),
    "e4b": (geometry_config("tiny-e4b"), 3),  # KV-shared layers read donors of other segments
}


def case_inputs(name: str) -> tuple:
    """(model, batch, lengths, layers per segment) of a case; the same in every process."""
    config, plan = CASES[name]
    model = lora_model(config)
    batch, lengths = batch_of(int(config["vocab_size"]), T=T)
    mx.eval(batch, lengths)
    return model, batch, lengths, plan

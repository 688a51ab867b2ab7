"""Bound the ops MLX's CUDA backend puts in one graph, before MLX evaluates anything.

MLX's CUDA backend keeps every input of an op alive until the CUDA graph that holds the op has
run, and fills a graph with 20 ops by default. Chunked attention, the tiled engine and chunked
MLPs work one piece at a time so that one piece's transients are alive at once; in a graph of
20 ops several pieces' transients are. segback's CLI therefore runs CUDA work with
`MLX_MAX_OPS_PER_BUFFER=4` unless the user set the variable, and the planner's CUDA
coefficients are fitted to peaks measured that way. MLX reads the variable once, at its first
evaluation.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import mlx.core as mx

ENV = "MLX_MAX_OPS_PER_BUFFER"
CUDA_DEFAULT = 4


def limit_ops_per_buffer(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set MLX_MAX_OPS_PER_BUFFER (unless the user did) on a CUDA machine; return its value."""
    if env.get(ENV):
        return env[ENV]
    if not mx.cuda.is_available():
        return None
    env[ENV] = str(CUDA_DEFAULT)
    return env[ENV]

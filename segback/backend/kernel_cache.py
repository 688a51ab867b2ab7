"""Keep MLX's JIT-built CUDA kernels where the next process finds them.

A first CUDA step compiles every kernel it meets with NVRTC (minutes for e4b, for mlx-lm and
segback alike). MLX caches the binaries in `$MLX_PTX_CACHE_DIR`, by default under the temp
directory, which containers and reboots wipe. The cache is keyed by kernel name only, not by
GPU, so a directory shared by two GPU generations would hand one the other's binaries: segback
points MLX at one directory per MLX version and device, under segback's own cache.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path

import mlx.core as mx

from segback.io import cache_root

ENV = "MLX_PTX_CACHE_DIR"


def kernel_cache_dir(root: Path, mlx_version: str, device_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", device_name).strip("-").lower() or "gpu"
    return root / "mlx-kernels" / f"{mlx_version}-{slug}"


def persist_kernel_cache(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set MLX_PTX_CACHE_DIR (unless the user did) on a CUDA machine; return the directory.

    Must run before the process's first kernel compiles: MLX reads the variable once.
    """
    if env.get(ENV):
        return env[ENV]
    if not mx.cuda.is_available():
        return None
    name = str(mx.device_info().get("device_name", "gpu"))
    path = kernel_cache_dir(cache_root(), mx.__version__, name)
    path.mkdir(parents=True, exist_ok=True)
    env[ENV] = str(path)
    return env[ENV]

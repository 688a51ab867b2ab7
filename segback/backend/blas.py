"""OpenBLAS preload on Linux CPU: mlx's bundled reference BLAS is ~35x slower for float32 matmul.

The CLI re-executes itself once with LD_PRELOAD set when Debian's OpenBLAS is present.
"""

from __future__ import annotations

import os
import platform
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_MARK = "SEGBACK_BLAS_CHECKED"


def find_openblas() -> str | None:
    return next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)


def ensure_openblas() -> None:
    """Re-exec the current process with OpenBLAS preloaded (Linux only, once)."""
    if platform.system() != "Linux" or os.environ.get(_MARK):
        return
    os.environ[_MARK] = "1"
    if os.environ.get("SEGBACK_NO_OPENBLAS"):
        return
    lib = find_openblas()
    if lib is None:
        print("segback: OpenBLAS not found; CPU matmuls will be slow. "
              "Install it with `apt-get install libopenblas0-pthread`.", file=sys.stderr)
        return
    if lib in os.environ.get("LD_PRELOAD", ""):
        return
    preload = ":".join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p)
    print(f"segback: preloading OpenBLAS ({lib})", file=sys.stderr)
    os.environ["LD_PRELOAD"] = preload
    os.execv(sys.executable, [sys.executable, "-m", "segback.cli", *sys.argv[1:]])

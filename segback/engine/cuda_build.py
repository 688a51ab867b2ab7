"""Build a CUDA kernel once per device and keep its binary on disk.

`mx.fast.cuda_kernel` compiles its source with NVRTC in every new process (MLX does not write
custom kernels to its disk cache). A kernel built here is compiled with the same NVRTC MLX
loaded, for the default device's architecture, and its binary stored under
`$MLX_PTX_CACHE_DIR/segback/` (segback's CLI points that variable at its own cache, one
directory per MLX version and GPU: `segback.backend.kernel_cache`), keyed by a hash of the
source, the options and the NVRTC version; `mx.fast.precompiled_cuda_kernel` then loads it in
milliseconds.
Anything missing (no NVRTC found, no headers) returns None: the caller falls back to
`mx.fast.cuda_kernel`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path

CACHE_ENV = "MLX_PTX_CACHE_DIR"


@functools.cache
def _nvrtc() -> tuple[ctypes.CDLL, Path] | None:
    """The NVRTC library MLX loaded (from this process's mappings), and its path."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line
                    and "builtins" not in line and line.split()[-1].startswith("/")})
    for p in paths:
        try:
            return ctypes.CDLL(p), Path(p)
        except OSError:
            continue
    return None


def _includes(lib: Path) -> list[str]:
    """CUDA's header directories beside the NVRTC library (pip's nvidia/cuXX/lib layout)."""
    root = lib.resolve().parent.parent
    dirs = [root / "include", root / "include" / "cccl"]
    return [str(d) for d in dirs if d.is_dir()]


def _version(lib: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(lib: ctypes.CDLL, source: str, name: str, options: list[str]) -> bytes:
    """NVRTC-compile `source` to a cubin; raises RuntimeError with the log on failure."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0,
                              None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}: "
                               f"{log.value.decode(errors='replace')[-2000:]}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cached_cubin(source: str, name: str, arch: str) -> bytes | None:
    """The cubin of `source` for `arch` ("sm_90"), from the disk cache or built now; None if
    NVRTC or CUDA's headers cannot be found here."""
    found = _nvrtc()
    if found is None:
        return None
    lib, path = found
    includes = _includes(path)
    if not includes:
        return None
    cc = int(arch.removeprefix("sm_"))
    target = f"sm_{cc}{'a' if cc >= 90 else ''}"
    options = ["--device-as-default-execution-space", f"--gpu-architecture={target}",
               "-std=c++17"] + [f"--include-path={d}" for d in includes]
    key = hashlib.sha256("\0".join([source, _version(lib), *options[:3]]).encode())
    cache = os.environ.get(CACHE_ENV)
    file = Path(cache) / "segback" / f"{name}-{key.hexdigest()[:24]}.cubin" if cache else None
    if file is not None and file.is_file():
        return file.read_bytes()
    cubin = compile_cubin(lib, source, name, options)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(file)  # atomic: a reader sees the whole binary or none
    return cubin

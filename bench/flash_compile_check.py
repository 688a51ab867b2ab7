"""Compile segback's flash kernels with NVRTC the way `mx.fast.cuda_kernel` does, without a GPU.

Catches syntax and register/shared-memory problems before device time is spent: the source is
assembled as MLX's CUDA backend assembles it (its default header, the kernel header, the
generated signature and template constants), compiled for sm_90a, and ptxas reports registers
and spills for every kernel instantiation.

    python bench/flash_compile_check.py --nvrtc /path/libnvrtc.so.13 \
        --include /path/cu13/include --include /path/mlx-device-headers [--dims 256 512]

The MLX device headers are `mlx/backend/cuda/device/*.cuh` of the matching MLX release.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segback.engine import flash  # noqa: E402

def mlx_style_source(kind: str, dtype: str, consts: dict[str, int]) -> str:
    """The source `mx.fast.cuda_kernel` assembles: MLX's default header, the kernel header, the
    generated signature and template constants, the body."""
    ins, outs, _ = flash.SIGNATURES[kind]
    T = flash.CUDA_TYPES[dtype]

    def ctype(t: str) -> str:
        return T if t == "T" else flash.CUDA_TYPES[t]

    params = [f"    const {ctype(t)}* {n}" for n, t in ins] + \
        [f"    {ctype(t)}* {n}" for n, t in outs]
    src = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
    src += flash._source(kind)
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void custom_kernel_segback_flash_{kind}(\n" + ",\n".join(params) + ") {\n"
    src += f"  using T = {T};\n"
    src += "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    src += "\n" + flash._call(kind) + "\n}\n\n} // namespace mlx::core::cu\n"
    return src


def consts_of(kind: str, D: int, seg: int, ldsm: int = 1) -> dict[str, int]:
    if kind.endswith("_v2"):
        return flash.consts_v2(kind, D, seg)
    cfg = flash._tiles(D)
    if kind == "forward":
        return dict(D=D, DV=D // cfg["fwd_split"], BK=cfg["fwd_bk"], SEG=seg, LDSM=ldsm)
    if kind == "dkdv":
        return dict(D=D, BKV=cfg["bkv"], BQB=cfg["dkdv_bq"], SEG=seg, LDSM=ldsm)
    return dict(D=D, DQ=D // cfg["dq_split"], BK=cfg["dq_bk"], SEG=seg, LDSM=ldsm)


def _smem(kind: str, D: int) -> int:
    """Dynamic shared memory the launch asks for (flash.py's arithmetic)."""
    if kind.endswith("_v2"):
        return flash.smem_v2(kind, D)
    cfg, item = flash._tiles(D), 2
    if kind == "forward":
        dv = D // cfg["fwd_split"]
        return (flash.BQ * (D + 8) + cfg["fwd_bk"] * (D + 8 + dv + 8)) * item
    if kind == "dkdv":
        bkv, bq = cfg["bkv"], cfg["dkdv_bq"]
        return (2 * bkv * (D + 8) + 2 * bq * (D + 8) + 2 * bkv * (bq + 8)) * item + 2 * bq * 4
    return (2 * flash.BQ * (D + 8) + 2 * cfg["dq_bk"] * (D + 8)) * item


def _threads(kind: str, D: int) -> int:
    if kind.endswith("_v2"):
        return flash.threads_v2(kind, D)
    return 256 if kind == "dkdv" else 128


def compile_one(lib, src: str, name: str, includes: list[str]) -> tuple[bool, str]:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0,
                                  None, None) == 0
    opts = ["--device-as-default-execution-space", "--gpu-architecture=sm_90a",
            "--ptxas-options=-v", "-std=c++17"] + [f"--include-path={p}" for p in includes]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--include", action="append", default=[])
    ap.add_argument("--dims", type=int, nargs="*", default=list(flash.HEAD_DIMS))
    ap.add_argument("--kinds", nargs="*", default=["forward", "dkdv", "dq"],
                    help="also forward_v2 dkdv_v2 dq_v2 (variant v2)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--standalone", action="store_true",
                    help="the extern \"C\" source segback builds itself (CUDA headers only); "
                    "default: the source mx.fast.cuda_kernel assembles (needs MLX's headers)")
    ap.add_argument("--seg", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--ldsm", type=int, default=1, choices=[0, 1])
    args = ap.parse_args()
    lib = ctypes.CDLL(args.nvrtc)
    ok_all = True
    for kind in args.kinds:
        for D in args.dims:
            for seg in args.seg:
                consts = consts_of(kind, D, seg, args.ldsm)
                tic = time.perf_counter()
                if args.standalone:  # what segback.engine.cuda_build compiles
                    _, src = flash.kernel_source(kind, args.dtype, consts)
                else:
                    src = mlx_style_source(kind, args.dtype, consts)
                ok, log = compile_one(lib, src, f"{kind}_{D}", args.include)
                ok_all &= ok
                usage = re.findall(r"Used (\d+) registers.*", log)
                spill = re.findall(r"(\d+) bytes spill stores", log)
                print(f"{kind:10s} D={D:3d} seg={seg}: {'ok' if ok else 'FAILED'} "
                      f"registers={usage} spill_stores={spill} smem={_smem(kind, D)} "
                      f"threads={_threads(kind, D)} {time.perf_counter() - tic:.1f} s")
                if not ok or any(int(x) for x in spill):
                    print(log[-4000:])
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segback.engine import flash  # noqa: E402

DTYPE = {"bf16": "__nv_bfloat16", "f16": "__half"}


def signature(name: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]]) -> str:
    args = [f"    const {t}* {n}" for n, t in inputs] + [f"    {t}* {n}" for n, t in outputs]
    return f"__global__ void {name}(\n" + ",\n".join(args) + ") {\n"


def kernel_source(kind: str, D: int, seg: int, dtype: str) -> str:
    cfg = flash._tiles(D)
    T = DTYPE[dtype]
    f32, i32 = "float", "int32_t"
    if kind == "forward":
        ins = [("q", T), ("k", T), ("v", T), ("scale", f32), ("prm", i32), ("kr", i32),
               ("seg", i32)]
        outs = [("o", T), ("lse", f32)]
        consts = dict(D=D, DV=D // cfg["fwd_split"], BK=cfg["fwd_bk"], SEG=seg)
        body = "::sbflash::forward<T, D, DV, BK, SEG>(q, k, v, scale, prm, kr, seg, o, lse);"
    elif kind == "dkdv":
        ins = [("q", T), ("k", T), ("v", T), ("d_o", T), ("lse", f32), ("delta", f32),
               ("scale", f32), ("prm", i32), ("qr", i32), ("seg", i32)]
        outs = [("dk", T), ("dv", T)]
        consts = dict(D=D, BKV=cfg["bkv"], BQB=cfg["dkdv_bq"], SEG=seg)
        body = ("::sbflash::backward_dkdv<T, D, BKV, BQB, SEG>(q, k, v, d_o, lse, delta, scale, "
                "prm, qr, seg, dk, dv);")
    else:
        ins = [("q", T), ("k", T), ("v", T), ("d_o", T), ("lse", f32), ("delta", f32),
               ("scale", f32), ("prm", i32), ("kr", i32), ("seg", i32)]
        outs = [("dq", T)]
        consts = dict(D=D, DQ=D // cfg["dq_split"], BK=cfg["dq_bk"], SEG=seg)
        body = ("::sbflash::backward_dq<T, D, DQ, BK, SEG>(q, k, v, d_o, lse, delta, scale, prm, "
                "kr, seg, dq);")
    src = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
    src += flash._source()
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += signature(f"custom_kernel_segback_flash_{kind}", ins, outs)
    src += f"  using T = {T};\n"
    src += "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    src += "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n"
    return src


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
    ap.add_argument("--kinds", nargs="*", default=["forward", "dkdv", "dq"])
    ap.add_argument("--dtype", default="bf16", choices=DTYPE)
    ap.add_argument("--seg", type=int, nargs="*", default=[0, 1])
    args = ap.parse_args()
    lib = ctypes.CDLL(args.nvrtc)
    ok_all = True
    for kind in args.kinds:
        for D in args.dims:
            for seg in args.seg:
                ok, log = compile_one(lib, kernel_source(kind, D, seg, args.dtype),
                                      f"{kind}_{D}", args.include)
                ok_all &= ok
                usage = re.findall(r"Used (\d+) registers.*", log)
                spill = re.findall(r"(\d+) bytes spill stores", log)
                print(f"{kind:8s} D={D:3d} seg={seg}: {'ok' if ok else 'FAILED'} "
                      f"registers={usage} spill_stores={spill}")
                if not ok or any(int(x) for x in spill):
                    print(log[-4000:])
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()

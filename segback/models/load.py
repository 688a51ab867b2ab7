"""One entry point for every stage: a checkpoint directory or a named random geometry.

On CPU, floating parameters are cast to float32: bfloat16 matmuls run ~35x slower there
(no BLAS path), and checkpoints are often stored in bfloat16 to halve their size.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_map
from mlx_lm.utils import load_model

from segback.models.adapters import mount
from segback.models.dequant_linear import use_dequantized_matmul
from segback.models.family import check_checkpoint
from segback.models.fast_gelu import use_fast_gelu
from segback.models.hub import hub_snapshot
from segback.models.random_init import GEOMETRIES, build_model

GEOMETRY_PREFIX = "geometry:"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def default_dtype() -> mx.Dtype | None:
    """float32 on CPU; None (keep the stored dtype) on GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def cast_floating(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Cast every floating parameter (base, quantization scales, LoRA) to `dtype` in place."""
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating)
                          else p, model.parameters()))
    return model


def _as_dtype(dtype: mx.Dtype | str | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    return getattr(mx, dtype)


def _load_dir(path: Path, adapter_path: str | None) -> tuple[nn.Module, object | None]:
    """mlx_lm.load, except that a checkpoint without tokenizer files loads with tokenizer None
    and that the adapter is checked against the model before it is mounted."""
    try:
        if any((path / f).exists() for f in TOKENIZER_FILES):
            model, tokenizer = mlx_lm.load(str(path))
        else:
            model, tokenizer = load_model(path)[0], None
    except RuntimeError:
        torn = torn_weights(path)
        if torn is None:
            raise
        raise ValueError(f"{torn[0]} cannot be read ({torn[1]}): the file is truncated or "
                         "corrupt (an interrupted copy, download or conversion?); copy it "
                         "again, or run `segback prepare-model` again") from None
    if adapter_path is not None:
        _mount(model, adapter_path)
    return model, tokenizer


def torn_weights(path: Path) -> tuple[Path, str] | None:
    """(file, reason) of the first weight file in checkpoint `path` that MLX cannot read."""
    for f in sorted(path.glob("*.safetensors")):
        try:
            mx.load(str(f))
        except (RuntimeError, ValueError, OSError) as e:
            return f, str(e).removeprefix("[load_safetensors] ")
    return None


def _mount(model: nn.Module, adapter_path: str | Path) -> None:
    """`adapters.mount` (mlx-lm's layers and weights, after checking the adapter: NaN or
    mismatched weights raise AdapterError), in eval mode as mlx_lm.load leaves it."""
    mount(model, adapter_path)
    model.eval()


def load(path_or_geometry: str | Path, adapter_path: str | None = None,
         dtype: mx.Dtype | str | None = None, fast_gelu: bool | None = None,
         dequant_matmul: bool = True) -> tuple[nn.Module, object | None]:
    """Return (model, tokenizer): mlx-lm's loader for a directory, a random model for a geometry.

    A geometry (`tiny-e4b` or `geometry:tiny-e4b`) has no tokenizer, so None is returned for it.
    A directory must hold config.json, of a family segback segments (else UnsupportedModelError,
    before any weights load); the prefix forces the geometry reading of a name.
    `fast_gelu` (default: on the CPU) swaps Gemma-2/3 MLPs' GELU for segback.models.fast_gelu.
    `dequant_matmul` runs quantized linears' long inputs (training, prefill) as
    dequantize-then-matmul (segback.models.dequant_linear); decoding keeps the quantized kernel.
    """
    spec = str(path_or_geometry)
    dtype = _as_dtype(dtype) or default_dtype()
    if fast_gelu is None:
        fast_gelu = mx.default_device() == mx.cpu
    path = Path(spec)
    if not spec.startswith(GEOMETRY_PREFIX) and (path / "config.json").is_file():
        check_checkpoint(path)  # a family segback cannot segment fails before its weights load
        model, tokenizer = _load_dir(path, adapter_path)
        if dtype is not None:
            cast_floating(model, dtype)
            mx.eval(model.parameters())
        if fast_gelu:
            use_fast_gelu(model)
        if dequant_matmul:
            use_dequantized_matmul(model)
        return model, tokenizer

    name = spec.removeprefix(GEOMETRY_PREFIX)
    if name in GEOMETRIES:
        model = build_model(name, dtype=dtype or mx.float32)
        if adapter_path is not None:
            _mount(model, adapter_path)
            cast_floating(model, dtype or mx.float32)
            mx.eval(model.parameters())
        if fast_gelu:
            use_fast_gelu(model)
        return model, None

    if HUB_ID.match(spec) and not path.exists():  # a Hub id, as mlx_lm.load takes it
        try:
            snapshot = hub_snapshot(spec)
        except RuntimeError as e:  # offline or unreachable: one paragraph on what to do
            raise FileNotFoundError(str(e)) from None
        return load(snapshot, adapter_path, dtype, fast_gelu, dequant_matmul)

    reason = (f"{spec!r} is a directory without config.json" if path.is_dir()
              else f"{spec!r} is neither a checkpoint directory nor a known geometry")
    raise FileNotFoundError(
        f"cannot load model: {reason}. Pass a directory containing config.json (e.g. from "
        f"`segback prepare-model`) or a geometry name ({', '.join(sorted(GEOMETRIES))}), "
        f"optionally written as `geometry:NAME`."
    )

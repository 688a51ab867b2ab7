"""Load segback's PEFT export in real PEFT + transformers and compare logits with mlx-lm.

Run where torch, transformers and peft are installed (e.g. the GPU machine); prints one JSON
line. mlx runs on its CPU device in float32 so the comparison is tight.

    python bench/peft_check.py [--out bench/data/runs.jsonl]
"""

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import save_config, save_model

from segback.models.adapters import adapter_config, save_adapter
from segback.benchmark.provenance import append_rows, with_provenance
from segback.models.export import export_peft
from segback.models.random_init import build_model, geometry_config

NEEDS = ("torch", "transformers", "peft")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None,
                   help="also append the row, with its provenance, to this JSON lines file")
    args = p.parse_args()
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"peft_check: needs {', '.join(NEEDS)}; missing here: {', '.join(missing)} "
              "(pip install torch transformers peft)", file=sys.stderr)
        return 2
    mx.set_default_device(mx.cpu)
    tmp = Path(tempfile.mkdtemp())
    cfg = geometry_config("tiny-llama")
    model = build_model(cfg)
    save_model(tmp / "base", model)
    save_config({**cfg, "architectures": ["LlamaForCausalLM"]}, tmp / "base" / "config.json")
    model.freeze()
    lora = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(1)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05,
                          model.trainable_parameters()))
    save_adapter(model, tmp / "adapter", adapter_config("lora", 2, 4, 2.0))
    export_peft(str(tmp / "base"), tmp / "adapter", tmp / "peft")
    ids = np.array([[1, 5, 9, 42, 7, 100, 3, 77]])
    ours = np.array(model(mx.array(ids)))
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp / "base", torch_dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp / "peft").eval()
    with torch.no_grad():
        theirs = peft(torch.tensor(ids)).logits.numpy()
    err = float(np.abs(ours - theirs).max() / np.abs(ours).max())
    row = {"check": "peft_export_logits", "max_rel_err": err,
           "adapter_effect": float(np.abs(ours - np.array(build_model(cfg)(mx.array(ids)))).max()),
           "ok": err < 1e-4}
    print(json.dumps(row), flush=True)
    if args.out:
        append_rows(args.out, [with_provenance(row | {"script": "bench/peft_check.py"})])
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

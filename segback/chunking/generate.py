"""Greedy generation of chunkings for a test set, with mlx-lm.

The prompt is the user turn of `prompt.chat_rows` encoded by `segback.tokens.encode_chat` with
the generation prompt, exactly as in training. Decoding is greedy and stops at any end-of-turn
token the tokenizer knows. Predictions are written once, atomically, at the end: a crash leaves
no partial file for the workflow to mistake for a result.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from segback.chunking.prompt import build_prompt
from segback.io import atomic_write_jsonl, read_jsonl

# End-of-turn markers of common chat formats; those in the vocabulary also stop generation.
END_OF_TURN = ("<end_of_turn>", "<eos>", "<|im_end|>", "<|eot_id|>", "<|end|>",
               "<|endoftext|>", "</s>")


def stop_ids(tokenizer: Any) -> set[int]:
    """EOS ids of the wrapper plus the end-of-turn tokens present in the vocabulary."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return ids


def generate_case(model: Any, tokenizer: Any, case: dict, max_tokens: int) -> dict:
    """One prediction row: the text, its parse (or None), token counts and seconds."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from segback.chunking.scorer import extract_json
    from segback.tokens import encode_chat

    prompt = encode_chat(tokenizer, [{"role": "user", "content": build_prompt(case)}],
                         add_generation_prompt=True)
    tic = time.perf_counter()
    text, n_generated = "", 0
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=0.0)):
        text += response.text
        n_generated = response.generation_tokens
    parsed, _ = extract_json(text)
    return {"id": case["id"], "text": text, "parsed": parsed, "prompt_tokens": len(prompt),
            "generated_tokens": n_generated, "seconds": round(time.perf_counter() - tic, 3)}


def generate_all(model: Any, tokenizer: Any, cases: list[dict], max_tokens: int) -> list[dict]:
    from tqdm import tqdm

    tokenizer.eos_token_ids = stop_ids(tokenizer)
    rows = []
    bar = tqdm(cases, desc="generate", file=sys.stderr)
    for case in bar:
        rows.append(generate_case(model, tokenizer, case, max_tokens))
        bar.set_postfix(prompt=rows[-1]["prompt_tokens"], gen=rows[-1]["generated_tokens"])
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="MLX model dir for mlx_lm.load")
    parser.add_argument("--adapter", default=None, help="LoRA adapter dir (mlx-lm layout)")
    parser.add_argument("--data", required=True, help="cases JSONL (raw or filtered)")
    parser.add_argument("--out", required=True, help="predictions JSONL")
    parser.add_argument("--max-tokens", type=int, default=1024, help="max generated tokens")
    parser.add_argument("--limit", type=int, default=None, help="only the first K cases")


def main(args: argparse.Namespace) -> int:
    from segback.models.load import load  # mlx-lm's loader, float32 on CPU (bf16 is ~35x slower)

    if not Path(args.data).is_file():
        raise SystemExit(f"segback generate: data file not found: {args.data}")
    cases = read_jsonl(args.data)[: args.limit]
    if not cases:
        raise SystemExit(f"segback generate: no cases in {args.data}")
    model, tokenizer = load(args.model, adapter_path=args.adapter)
    rows = generate_all(model, tokenizer, cases, args.max_tokens)
    atomic_write_jsonl(args.out, rows)
    n_json = sum(r["parsed"] is not None for r in rows)
    print(f"segback generate: {len(rows)} cases, {n_json} parsed as JSON -> {args.out}",
          file=sys.stderr)
    return 0

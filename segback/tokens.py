"""The one place chat rows become token ids, for training and generation alike.

Chat template when the tokenizer has one, a plain "User:/Assistant:" rendering otherwise;
`<bos>` exactly once when the tokenizer defines one (Gemma degenerates without it).
"""

from __future__ import annotations

from typing import Any

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def _ids(out: Any) -> list[int]:
    """apply_chat_template may return a list, a BatchEncoding or a dict (transformers 5)."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return ids
    while len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids if ids and ids[0] == bos else [bos, *ids]


def render_plain(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Plain-text rendering for tokenizers without a chat template."""
    text = "".join(f"{PLAIN_ROLES.get(m['role'], m['role'])}: {m['content']}\n\n"
                   for m in messages)
    return text + ("Assistant:" if add_generation_prompt else "")


def encode_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False
                ) -> list[int]:
    """Token ids of `messages` ({role, content} dicts), ready to feed the model."""
    rows = [{"role": m["role"], "content": m["content"]} for m in messages]
    if _has_template(tokenizer):
        ids = _ids(tokenizer.apply_chat_template(
            rows, tokenize=True, add_generation_prompt=add_generation_prompt))
    else:
        ids = list(tokenizer.encode(render_plain(rows, add_generation_prompt)))
    return _with_bos(tokenizer, ids)


def encode_example(tokenizer: Any, messages: list[dict]) -> tuple[list[int], int]:
    """(ids, prompt_len) for a training example whose last message is the completion.

    Only tokens from `prompt_len` on count in the loss (mlx-lm's `--mask-prompt`). Without a
    chat template the completion is closed with EOS so the model learns to stop.
    """
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("a training example must end with an assistant message")
    prompt = encode_chat(tokenizer, messages[:-1], add_generation_prompt=True)
    if _has_template(tokenizer):
        full = encode_chat(tokenizer, messages)
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        body = list(tokenizer.encode(" " + messages[-1]["content"], add_special_tokens=False))
        full = prompt + body + ([eos] if eos is not None else [])
    if full[: len(prompt)] != prompt:
        # Templates that rewrite earlier turns: fall back to the longest common prefix.
        n = 0
        while n < min(len(full), len(prompt)) and full[n] == prompt[n]:
            n += 1
        return full, n
    return full, len(prompt)

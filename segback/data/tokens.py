"""The one place chat rows become token ids, for training and generation alike.

With a chat template, ids come from `tokenizer.apply_chat_template(messages, tools=tools, ...)`
called exactly as mlx-lm's tuner datasets call it, so segback trains on the (ids, offset) pairs
`mlx_lm.lora` would. Two deliberate differences, both no-ops for templates that write
`{{ bos_token }}` (Gemma, Llama):

- `<bos>` exactly once: a tokenizer with a bos token (other than its eos) gets it prepended where
  the template or `encode` left it out, and a doubled one collapsed; Gemma degenerates without it.
  mlx-lm uses the ids as they come.
- Without a chat template (mlx-lm refuses such tokenizers) messages render as plain
  "User: ... / Assistant: ..." text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def _ids(out: Any) -> list[int]:
    """apply_chat_template may return a list, a BatchEncoding or a dict (transformers 5)."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def bos_token_id(tokenizer: Any) -> int | None:
    """The bos id to enforce, or None (none defined, or bos == eos as in GPT-2: not a real bos)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return None if bos is None or bos == getattr(tokenizer, "eos_token_id", None) else bos


def normalize_bos(tokenizer: Any, ids: list[int]) -> tuple[list[int], int]:
    """(ids with `<bos>` exactly once at the front, how far later positions moved)."""
    bos = bos_token_id(tokenizer)
    if bos is None:
        return ids, 0
    doubled = 0
    while doubled + 1 < len(ids) and ids[doubled] == bos and ids[doubled + 1] == bos:
        doubled += 1
    if doubled:
        return ids[doubled:], -doubled
    return (ids, 0) if ids and ids[0] == bos else ([bos, *ids], 1)


def with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """`ids` with the tokenizer's `<bos>` exactly once (`normalize_bos`, offsets not needed)."""
    return normalize_bos(tokenizer, ids)[0]


def plain_content(message: dict) -> str:
    """A message's text for the plain rendering: its content, then its tool calls as JSON."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    parts = [content] if isinstance(content, str) else []
    for call in message.get("tool_calls") or []:
        parts.append(json.dumps(call.get("function", call) if isinstance(call, dict) else call))
    return "\n".join(parts)


def render_plain(messages: list[dict], add_generation_prompt: bool = False,
                 tools: list | None = None) -> str:
    """Plain-text rendering for tokenizers without a chat template."""
    head = f"Tools: {json.dumps(tools)}\n\n" if tools else ""
    text = "".join(f"{PLAIN_ROLES.get(m['role'], m['role'])}: {plain_content(m)}\n\n"
                   for m in messages)
    return head + text + ("Assistant:" if add_generation_prompt else "")


def template_ids(tokenizer: Any, messages: list[dict], tools: list | None = None,
                 add_generation_prompt: bool = False) -> list[int]:
    """The chat template's ids, called with mlx-lm's arguments (ChatDataset.process)."""
    extra = {"add_generation_prompt": True} if add_generation_prompt else {}
    return _ids(tokenizer.apply_chat_template(messages, tools=tools, return_dict=False, **extra))


def encode_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False,
                tools: list | None = None) -> list[int]:
    """Token ids of `messages` (passed to the template as they are), ready to feed the model."""
    if has_template(tokenizer):
        ids = template_ids(tokenizer, messages, tools, add_generation_prompt)
    else:
        ids = list(tokenizer.encode(render_plain(messages, add_generation_prompt, tools)))
    return normalize_bos(tokenizer, ids)[0]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A `text` row as mlx-lm's TextDataset encodes it: `encode(text)`, closed with EOS."""
    ids = list(tokenizer.encode(text))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return normalize_bos(tokenizer, ids)[0]


def _plain_example(tokenizer: Any, messages: list[dict], tools: list | None
                   ) -> tuple[list[int], list[int]]:
    """(full, prompt) ids without a template: the reply follows "Assistant:", closed with EOS."""
    eos = getattr(tokenizer, "eos_token_id", None)
    close = [eos] if eos is not None else []
    if messages[-1]["role"] != "assistant":
        full = encode_chat(tokenizer, messages, tools=tools)
        return full + close, full
    prompt = encode_chat(tokenizer, messages[:-1], add_generation_prompt=True, tools=tools)
    body = list(tokenizer.encode(" " + plain_content(messages[-1]), add_special_tokens=False))
    return prompt + body + close, prompt


def encode_example(tokenizer: Any, messages: list[dict], tools: list | None = None,
                   mask_prompt: bool = True) -> tuple[list[int], int]:
    """(ids, offset) for a training example: only tokens from `offset` on count in the loss.

    `mask_prompt` (mlx-lm's `--mask-prompt`): the offset is the length of the prompt, i.e. all
    but the last message, which must be the assistant's reply. Off: 0, as in mlx-lm, so the whole
    chat counts. Where a template renders the prompt differently inside the full chat (it rewrites
    earlier turns), the offset is their common prefix, so no reply token is ever masked
    (mlx-lm takes the prompt's length regardless).
    """
    if not messages:
        raise ValueError("a training example needs at least one message")
    if mask_prompt and messages[-1].get("role") != "assistant":
        raise ValueError("a training example must end with an assistant message")
    if not has_template(tokenizer):
        full, prompt = _plain_example(tokenizer, messages, tools)
    else:
        full = encode_chat(tokenizer, messages, tools=tools)
        if not mask_prompt:
            return full, 0
        prompt = encode_chat(tokenizer, messages[:-1], add_generation_prompt=True, tools=tools)
    if not mask_prompt:
        return full, 0
    n = 0
    while n < min(len(full), len(prompt)) and full[n] == prompt[n]:
        n += 1
    return full, n


class ByteTokenizer:
    """UTF-8 bytes as token ids, EOS = 0: lets random-geometry models (vocab >= 256) train.

    Only for smoke runs and benchmarks on `segback.models.random_init` models, which ship no
    tokenizer.
    """

    eos_token_id = 0
    bos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")

"""Render a chunking case as a chat: the user prompt and the gold assistant answer.

Token ids come from `segback.data.tokens` (the one place chats are encoded); this module only
produces text, so training and generation see the same prompt.
"""

from __future__ import annotations

import json

INSTRUCTION = """\
Split the conversation below into topical chunks. A chunk is a run of consecutive messages \
about one topic; a new chunk starts at the message where the topic changes. The first chunk \
starts at the first message. Each message is shown as [message id] role.

Answer with JSON only, in this format, listing the chunks in order:
{"chunks": [{"anchor": "<id of the chunk's first message>", \
"label": "<short title, at most 8 words>"}, ...]}"""

REMINDER = "Now answer with the JSON object only."


def transcript(case: dict) -> list[dict]:
    """The chat being chunked: under `transcript` in filtered rows, `messages` in raw ones."""
    return case["transcript"] if "transcript" in case else case["messages"]


def render_transcript(messages: list[dict]) -> str:
    return "\n\n".join(f"[{m['id']}] {m['role']}:\n{m['content']}" for m in messages)


def build_prompt(case: dict) -> str:
    """Instruction, the transcript with ids and roles, and a closing reminder of the format."""
    body = render_transcript(transcript(case))
    return f"{INSTRUCTION}\n\n<conversation>\n{body}\n</conversation>\n\n{REMINDER}"


def gold_completion(case: dict) -> str:
    """The gold answer as compact JSON (fewer tokens to learn and to generate)."""
    chunks = [{"anchor": c["anchor"], "label": c["label"]} for c in case["gold"]["chunks"]]
    return json.dumps({"chunks": chunks}, ensure_ascii=False, separators=(",", ":"))


def chat_rows(case: dict) -> list[dict]:
    """mlx-lm chat format: [user prompt, assistant gold JSON]."""
    return [{"role": "user", "content": build_prompt(case)},
            {"role": "assistant", "content": gold_completion(case)}]

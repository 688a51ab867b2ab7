"""segback generate: batched greedy equals one-at-a-time, JSON stops, row formats, resume."""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_models import write_tiny_gguf

from segback.chunking import generate as g
from segback.chunking.prompt import build_prompt, gold_completion
from segback.chunking.scorer import score_predictions
from segback.io import read_jsonl
from segback.models import prepare as prep
from segback.models.load import load
from segback.data.tokens import encode_chat

END_OF_TURN_ID = 6  # <end_of_turn> in test_models' vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Gemma-3 (sliding window 8) with the tiny GGUF's tokenizer and template."""
    tmp = tmp_path_factory.mktemp("generate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SEGBACK_CACHE", str(tmp / "cache"))
        write_tiny_gguf(tmp / "tiny.gguf")
        prep.prepare("random", "tiny-gemma3", tmp / "model", tokenizer_gguf=str(tmp / "tiny.gguf"),
                     seed=1)
    return tmp / "model"


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(str(model_dir))


def case(cid: str, n: int) -> dict:
    """A filtered chunking case with `n` short messages."""
    msgs = [{"id": f"{cid}-m{i}", "role": ("user", "assistant")[i % 2],
             "content": "hello world " * (i + 1)} for i in range(n)]
    gold = {"chunks": [{"anchor": msgs[0]["id"], "label": "hello"}]}
    row = {"id": cid, "gold": gold, "transcript": msgs}
    row["messages"] = [{"role": "user", "content": build_prompt(row)},
                       {"role": "assistant", "content": gold_completion(row)}]
    return row


# --- the JSON stop ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, answer", [
    ('{"chunks": []} and more', '{"chunks": []}'),
    ('Sure: "x" {"a": "}{", "b": {"c": [1, {}]}}\n```',
     'Sure: "x" {"a": "}{", "b": {"c": [1, {}]}}'),
    ('{"a": "say \\"}\\" ok"} x', '{"a": "say \\"}\\" ok"}'),
    ('{see below} then {"chunks": []} x', '{see below} then {"chunks": []}'),
    ('{"a": NaN} {"b": 1} x', '{"a": NaN} {"b": 1}'),  # NaN is not JSON, as for the scorer
    ('{"a": 1', None),
    ("no json here }", None),
])
def test_json_watch_stops_at_the_closing_brace(text, answer):
    watch = g.JsonWatch()
    stops = [i + 1 for i, ch in enumerate(text) if watch.feed(ch)]  # one character at a time
    assert stops[:1] == ([] if answer is None else [len(answer)])
    assert g.JsonWatch().feed(text) is (answer is not None)


# --- row formats -----------------------------------------------------------------------------

def test_row_request_formats(loaded):
    _, tok = loaded
    filtered = case("c1", 3)
    raw = {k: v for k, v in filtered.items() if k not in ("messages", "transcript")}
    raw["messages"] = filtered["transcript"]
    user = [{"role": "user", "content": build_prompt(filtered)}]
    for row in (filtered, raw):
        r = g.row_request(tok, row, 0)
        assert (r.kind, r.id, r.key) == ("chunking", "c1", "c1")
        assert r.prompt == encode_chat(tok, user, add_generation_prompt=True)
        assert r.reference == gold_completion(filtered)

    chat = {"messages": [{"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "world"}]}
    r = g.row_request(tok, chat, 4)
    assert (r.kind, r.id, r.key, r.reference) == ("chat", 4, "4", "world")
    assert r.prompt == encode_chat(tok, chat["messages"][:1], add_generation_prompt=True)
    r = g.row_request(tok, {"id": 7, "messages": chat["messages"][:1]}, 0)
    assert (r.id, r.reference) == (7, None)

    r = g.row_request(tok, {"prompt": "hello", "completion": "world"}, 1)
    assert (r.kind, r.reference) == ("prompt", "world")
    assert r.prompt == encode_chat(tok, chat["messages"][:1], add_generation_prompt=True)

    r = g.row_request(tok, {"text": "hello world"}, 2)
    assert r.kind == "text" and r.prompt == tok.encode("hello world")  # raw text, one <bos>
    assert r.prompt.count(tok.bos_token_id) == 1

    with pytest.raises(ValueError, match="unknown format"):
        g.row_request(tok, {"question": "?"}, 0)


# --- batched greedy == one at a time ---------------------------------------------------------

def one_at_a_time(model, tok, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """The reference: mlx-lm's own single-sequence greedy loop, as `generate` ran before."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tok.eos_token_ids = g.stop_ids(tok)
    text, n = "", 0
    for response in stream_generate(model, tok, prompt, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=0.0)):
        text += response.text
        n = response.generation_tokens
    return text, n


@pytest.fixture(scope="module")
def quantized(model_dir):
    """The tiny model at 4 bits, prompts of 8+ tokens prefilled as dequantize-then-matmul."""
    from segback.models.dequant_linear import use_dequantized_matmul

    model, tok = load(str(model_dir))
    nn.quantize(model, group_size=32, bits=4)
    assert use_dequantized_matmul(model, min_tokens=8) > 0
    return model, tok


@pytest.mark.parametrize("which", ["loaded", "quantized"])
def test_batched_greedy_equals_one_at_a_time(which, request):
    model, tok = request.getfixturevalue(which)
    words = "hello world he llo wor ld".split()
    rows = [{"id": i, "prompt": " ".join(words[(i * 7 + j) % 6] for j in range(n))}
            for i, n in enumerate([1, 3, 9, 20, 40, 6, 60, 13])]
    requests = [g.row_request(tok, r, i) for i, r in enumerate(rows)]
    assert len({len(r.prompt) for r in requests}) == len(requests)  # all lengths differ
    want = {r.key: one_at_a_time(model, tok, r.prompt, 24) for r in requests}
    assert {n for _, n in want.values()} != {24}  # some stop at end of turn, early

    for batch_size, step in [(1, 2048), (3, 16), (8, 5)]:  # chunked prefill, joins mid-batch
        steps: list[int] = []
        got = {str(r["id"]): r for r in g.generate_rows(
            model, tok, requests, 24, batch_size=batch_size, prefill_step_size=step,
            progress=steps.append)}
        assert {k: (r["text"], r["generated_tokens"]) for k, r in got.items()} == want
        assert sum(steps) == sum(n for _, n in want.values()) and max(steps) <= batch_size
        assert all(r["finish_reason"] == ("length" if r["generated_tokens"] == 24 else "stop")
                   for r in got.values())


# --- JSON stops inside a batch ---------------------------------------------------------------

class Scripted(nn.Module):
    """A model whose greedy next token is table[token, position]: scripted outputs.

    The tiny model still runs underneath, so caches, padding and batching work as for a real
    model; positions come from the first cache, per sequence in a batch.
    """

    def __init__(self, inner: nn.Module, table: mx.array):
        super().__init__()
        self.inner, self.table = inner, table

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self):
        return self.inner.make_cache()

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        logits = self.inner(inputs, cache=cache)
        n = inputs.shape[1]
        pos = mx.reshape(mx.array(cache[0].offset), (-1, 1)) - n + mx.arange(n)
        nxt = self.table[inputs, mx.clip(pos, 0, self.table.shape[1] - 1)]
        return mx.where(mx.arange(logits.shape[-1]) == nxt[..., None], 100.0, 0.0)


def scripted(model, tok, requests, outputs: list[list[int]], filler: int, max_tokens: int
             ) -> Scripted:
    """Each request's greedy output is its `outputs` entry, then `filler` up to `max_tokens`."""
    table: dict[tuple[int, int], int] = {}
    for req, out in zip(requests, outputs):
        prev, pos = req.prompt[-1], len(req.prompt) - 1
        for t in out + [filler] * (max_tokens - len(out)):
            assert table.setdefault((prev, pos), t) == t, "scripts collide: space the prompts"
            prev, pos = t, pos + 1
    width = max(p for _, p in table) + 2
    grid = [[filler] * width for _ in range(len(tok.get_vocab()))]
    for (prev, pos), t in table.items():
        grid[prev][pos] = t
    return Scripted(model, mx.array(grid))


def test_stop_at_json_ends_each_sequence_at_its_json(loaded):
    model, tok = loaded
    texts = ['Sure: {"chunks": [{"anchor": "m1", "label": "a } b"}]} then more',
             'hello {not json} world {"a": "x\\"}"} hello',
             "hello world",
             "world"]
    ends = ['Sure: {"chunks": [{"anchor": "m1", "label": "a } b"}]}',
            'hello {not json} world {"a": "x\\"}"}', None, None]
    outputs = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert [tok.decode(o) for o in outputs] == texts
    outputs[3].append(END_OF_TURN_ID)
    filler = tok.encode("~", add_special_tokens=False)[-1]  # in no script
    requests = [g.row_request(tok, case(f"c{i}", 1 + 5 * i), i) for i in range(4)]
    requests[1].kind = "chat"  # JSON stops apply to chunking cases by default only
    model = scripted(model, tok, requests, outputs, filler, 80)

    for batch_size in (1, 3):
        rows = {r["id"]: r for r in g.generate_rows(model, tok, requests, 80,
                                                    batch_size=batch_size, stop_at_json=True)}
        for i, (text, end) in enumerate(zip(texts, ends)):
            row = rows[f"c{i}"]
            if end is not None:
                assert (row["text"], row["finish_reason"]) == (end, "json")
                assert row["generated_tokens"] == len(tok.encode(end, add_special_tokens=False))
            elif i == 2:
                assert row["text"].startswith(text) and row["finish_reason"] == "length"
            else:
                assert (row["text"], row["finish_reason"]) == (text, "stop")
        assert rows["c0"]["parsed"] == {"chunks": [{"anchor": "m1", "label": "a } b"}]}
        assert "parsed" not in rows["c1"]

    default = {r["id"]: r for r in g.generate_rows(model, tok, requests, 80, batch_size=2)}
    assert default["c0"]["finish_reason"] == "json"
    assert default["c1"]["finish_reason"] == "length"  # a chat row: no JSON stop by default
    off = {r["id"]: r for r in g.generate_rows(model, tok, requests, 80, stop_at_json=False)}
    assert off["c0"]["finish_reason"] == "length" and off["c0"]["text"].startswith(texts[0])


# --- the command: formats, resume ------------------------------------------------------------

def run_main(model_dir, data, out, *extra: str) -> None:
    parser = argparse.ArgumentParser()
    g.add_arguments(parser)
    g.main(parser.parse_args(["--model", str(model_dir), "--data", str(data), "--out", str(out),
                              "--max-tokens", "8", *extra]))


def without_seconds(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_resume_generates_only_the_missing_rows(model_dir, tmp_path, monkeypatch):
    rows = [case("a", 2), {"messages": [{"role": "user", "content": "hello"}]},
            case("b", 4), {"id": "t", "text": "hello world"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = tmp_path / "full.jsonl"
    run_main(model_dir, data, full, "--batch-size", "2")
    want = read_jsonl(full)
    assert [r["id"] for r in want] == ["a", 1, "b", "t"]  # data order; index when no id
    assert "parsed" in want[0] and "parsed" not in want[1]
    assert not g.partial_path(full).exists()
    summary = score_predictions([rows[0], rows[2]], want)
    assert summary["n_missing"] == 0 and summary["n_extra_predictions"] == 2

    # A killed run: the header, two finished rows, and a torn line.
    out = tmp_path / "out.jsonl"
    parser = argparse.ArgumentParser()
    g.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--data", str(data), "--out", str(out),
                              "--max-tokens", "8"])
    partial = g.partial_path(out)
    partial.write_text("".join(json.dumps(r) + "\n" for r in [g.settings(args), want[3], want[0]])
                       + '{"id": "b", "te')
    asked: list[str] = []
    real = g.generate_rows

    def spy(model, tok, requests, *a, **k):
        asked.extend(r.key for r in requests)
        yield from real(model, tok, requests, *a, **k)

    monkeypatch.setattr(g, "generate_rows", spy)
    run_main(model_dir, data, out, "--batch-size", "3")
    assert sorted(asked) == ["1", "b"]
    assert without_seconds(read_jsonl(out)) == without_seconds(want)
    assert not partial.exists()

    # A partial file from other settings is not resumed.
    partial.write_text("".join(json.dumps(r) + "\n" for r in [g.settings(args), want[0]]))
    asked.clear()
    run_main(model_dir, data, out, "--max-tokens", "4")
    assert sorted(asked) == ["1", "a", "b", "t"]


def test_read_only_output_is_one_line(model_dir, tmp_path, monkeypatch, capsys):
    """`segback generate --out` on a read-only filesystem: the scratch file cannot be made and
    its cleanup raises EROFS too; the user reads one line naming the file, no traceback."""
    import errno
    from pathlib import Path

    from segback import io as sio
    from segback.cli import main

    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps(case("a", 2)) + "\n")
    out = tmp_path / "ro" / "predictions.jsonl"

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(sio.os, "open", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    rc = main(["generate", "--model", str(model_dir), "--data", str(data), "--out", str(out),
               "--max-tokens", "4"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("segback generate")]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("segback generate: error: cannot write ") and \
        "Read-only file system" in err[0]

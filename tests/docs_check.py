"""Reading the docs for the tests that hold them to the code.

The docs are README.md, CHANGELOG.md and every Markdown file under docs/ (files added there are read
too). What is read from them, and checked by tests/unit/test_docs.py:

- code: fenced blocks and inline code spans, each with its file and line;
- ``sluice`` command lines in code (also ``python -m sluice_cli.cli``, ``.venv/bin/sluice`` and
  ``make serve ARGS="..."``), whose ``--flags`` must be options of that command's parser, and code
  spans that are a bare ``--flag``, which must be an option of some ``sluice`` command;
- defaults: a table with a "default" column whose row starts with a ``--flag``, and
  "``--flag`` (default X)" in prose;
- metric names (``sluice:...``, ``sluice_gateway:...``), Redis keys (``sluice:{tag}...``), error
  codes next to an HTTP status (``503 engine_lost``) or an engine error (``error draining``);
- relative links, and the headings their anchors name.

tests/integration/test_metrics_documented.py reads docs/metrics.md's tables with ``metric_tables``
and checks them against live processes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "CHANGELOG.md"  # names what was, not what is: not held to today's flags, keys and metrics


def doc_files() -> list[Path]:
    """README.md, CHANGELOG.md and docs/**/*.md."""
    return [ROOT / "README.md", HISTORY, *sorted((ROOT / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Code:
    """A piece of code in a doc: a line of a fenced block, or an inline span."""

    path: Path
    line: int
    text: str
    block: bool

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


FENCE = re.compile(r"^\s*(```|~~~)")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")


# A fenced block with another info string (```text, ```python, ```json) is a diagram or a program,
# not a command line: its lines are not code here.
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh"}


def split_doc(path: Path) -> tuple[list[Code], list[tuple[int, str]]]:
    """(code, prose lines with their code spans kept) of one doc. A shell block's lines joined
    where they end in a backslash, so a command continued on the next line is one line."""
    code: list[Code] = []
    prose: list[tuple[int, str]] = []
    in_block = False
    shell = True
    pending = ""
    pending_line = 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
            shell = line.strip().lstrip("`~").strip().lower() in SHELL_BLOCKS
            continue
        if in_block and not shell:
            continue
        if in_block:
            if not pending:
                pending_line = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            code.append(Code(path, pending_line, pending + line, True))
            pending = ""
            continue
        prose.append((number, line))
        for m in SPAN.finditer(line):
            code.append(Code(path, number, m.group(2).strip(), False))
    return code, prose


# --- the sluice commands and their parsers -------------------------------------------------------

_DUMP_PARSERS = """
import argparse, importlib, json, sys
from sluice_cli.cli import COMMANDS
out = {}
for words, (module_name, help_text) in COMMANDS.items():
    parser = argparse.ArgumentParser(prog="sluice " + " ".join(words))
    importlib.import_module(module_name).add_arguments(parser)
    flags = {}
    for action in parser._actions:
        default = action.default
        if isinstance(default, (list, tuple)) and not default:
            default = None  # an empty repeatable option: nothing to compare
        if default is not None and not isinstance(default, (bool, int, float, str)):
            default = str(default)
        if default == argparse.SUPPRESS:
            default = None
        for option in action.option_strings:
            flags[option] = default
    out[" ".join(words)] = flags
json.dump(out, sys.stdout)
"""


@cache
def command_flags() -> dict[str, dict[str, object]]:
    """``{"serve": {"--port": 8000, ...}, "bench offline": {...}}``: every option of every command
    of ``sluice_cli.cli.COMMANDS`` with its default, as the parsers build them in a process whose
    environment sets no SLUICE_* variable (a knob may take its default from one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") and k not in ("REDIS_URL",)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run([sys.executable, "-c", _DUMP_PARSERS], cwd=ROOT, env=env, capture_output=True,
                            text=True, check=False, timeout=300)
    assert result.returncode == 0, f"building the sluice commands' parsers failed:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout)


_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PREFIXES = {"sudo", "nohup", "exec", "env", "time"}
_SEPARATORS = re.compile(r"\s(?:\|\|?|&&|;)\s|;$|\s&$")


@dataclass(frozen=True)
class Invocation:
    """``sluice WORDS... --flags`` found in the docs: the command's words (each may be ``a|b``
    alternatives) and the flags given to it."""

    code: Code
    words: tuple[str, ...]
    flags: tuple[str, ...]


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False)
    except ValueError:  # an unbalanced quote in prose-like code: split on spaces
        return text.split()


def invocations(code: Code) -> list[Invocation]:
    """The ``sluice`` command lines in one piece of code."""
    found = []
    for part in _SEPARATORS.split(code.text):
        tokens = _tokens(part)
        while tokens and (_ENV.match(tokens[0]) or tokens[0] in _PREFIXES or tokens[0] == "taskset"
                          or tokens[0] == "timeout"):
            first = tokens.pop(0)
            if first == "taskset" and tokens[:1] == ["-c"]:
                tokens = tokens[2:]
            elif first == "timeout" and tokens:
                tokens.pop(0)
        if not tokens:
            continue
        program = tokens[0]
        if program.split("/")[-1] == "sluice":
            rest = tokens[1:]
        elif program.split("/")[-1].startswith("python") and tokens[1:3] == ["-m", "sluice_cli.cli"]:
            rest = tokens[3:]
        elif program == "make" and "serve" in tokens[1:]:
            args = next((t[len("ARGS="):] for t in tokens if t.startswith("ARGS=")), "")
            rest = ["serve", *_tokens(args)]
        else:
            continue
        words = []
        for token in rest:
            if token.startswith("-") or not re.fullmatch(r"[a-z][a-z0-9|-]*", token):
                break
            words.append(token)
        flags = tuple(t.split("=", 1)[0] for t in rest[len(words):] if t.startswith("--") and t != "--")
        found.append(Invocation(code, tuple(words), flags))
    return found


def resolve(words: tuple[str, ...]) -> list[str] | None:
    """The commands (of ``command_flags``) that ``words`` names, expanding ``a|b`` alternatives;
    a group's words alone (``sluice bench``) name every command of the group; None when they name
    none."""
    commands = command_flags()
    options = [[]]
    for word in words:
        options = [o + [alt] for o in options for alt in word.split("|")]
    named = []
    for option in options:
        for n in range(len(option), 0, -1):
            if " ".join(option[:n]) in commands:
                named.append(" ".join(option[:n]))
                break
        else:
            group = [c for c in commands if c.split()[: len(option)] == option]
            if not group:
                return None
            named += group
    return named


# --- defaults ------------------------------------------------------------------------------------

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3}


def default_matches(cell: str, default: object) -> bool:
    """Whether a doc's words for a default (a table cell, a parenthesis) say ``default``."""
    text = cell.replace("`", "").replace("\u202f", " ").strip().lower()
    if isinstance(default, bool):
        return any(w in re.findall(r"[a-z]+", text) for w in (("on", "true", "yes") if default else
                                                               ("off", "false", "no", "none")))
    if isinstance(default, int | float):
        numbers = []
        for m in re.finditer(r"(-?\d[\d,]*(?:\.\d+)?)\s*([kmg]i?b)?\b", text):
            value = float(m.group(1).replace(",", ""))
            numbers.append(value * _UNITS.get(m.group(2) or "", 1))
        if default in numbers:
            return True
        return default == 0 and bool(re.search(r"\b(off|none|no limit|disabled|unlimited)\b", text))
    return str(default).lower() in text


def table_rows(prose: list[tuple[int, str]]) -> list[tuple[int, list[str], list[str]]]:
    """(line, header cells, row cells) of every Markdown table row."""
    rows = []
    header: list[str] | None = None
    for number, line in prose:
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = [c.lower() for c in cells]
        elif not all(re.fullmatch(r":?-+:?", c) for c in cells if c):
            rows.append((number, header, cells))
    return rows


# --- names the code defines ----------------------------------------------------------------------

@cache
def metric_names() -> dict[str, str]:
    """Every metric family the engine and the gateway define -> the module that defines it."""
    import ast

    from prometheus_client import CollectorRegistry

    from gateway.metrics import Metrics

    names = {}
    engine = ROOT / "engine_service" / "service" / "metrics.py"
    for node in ast.walk(ast.parse(engine.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"sluice:[a-z0-9_]+", node.value):
            names[node.value] = "engine_service/service/metrics.py"
    registry = CollectorRegistry()
    Metrics(registry=registry)
    for family in registry.collect():
        names[family.name] = "gateway/metrics.py"
    return names


METRIC_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def metric_defined(name: str) -> bool:
    names = metric_names()
    if name in names:
        return True
    return any(name.endswith(s) and name[: -len(s)] in names for s in METRIC_SUFFIXES)


@cache
def key_patterns() -> dict[str, str]:
    """Every Redis key and channel name ``sluice/wire/contract.py`` makes, placeholders as ``*``
    -> the name in contract.py that makes it."""
    import inspect

    from sluice.wire import contract

    out = {}
    for name, value in vars(contract).items():
        if isinstance(value, str) and value.startswith(contract.PREFIX + ":"):
            out[value] = name
        elif inspect.isfunction(value) and value.__module__ == contract.__name__:
            params = inspect.signature(value).parameters.values()
            args = [424242 if p.annotation in (int, "int") else f"\0{p.name}\0" for p in params]
            try:
                made = value(*args)
            except Exception:  # noqa: BLE001 - not a key maker
                continue
            # a list maker (request_streams: one key a shard) makes one key of each kind: its first
            for key in [made] if isinstance(made, str) else made[:1] if isinstance(made, list) else []:
                if isinstance(key, str) and key.startswith(contract.PREFIX + ":"):
                    out[re.sub(r"\0[^\0]*\0|424242", "*", key)] = f"{name}()"
    return out


KEY = re.compile(r"sluice:\{[^`\s]*")
METRIC = re.compile(r"(?<![\w:])(sluice(?:_gateway)?:(?!\{)[a-zA-Z_][a-zA-Z0-9_:]*)")


def normalize_key(text: str) -> str:
    """A doc's key with its placeholders (``<model>``, ``<id>``) as ``*``; trailing punctuation off."""
    return re.sub(r"<[^>]*>", "*", text).rstrip(".,;:)")


def key_known(doc_key: str) -> bool:
    patterns = key_patterns()
    if doc_key in patterns:
        return True
    if "*" in doc_key:
        return False
    return any(re.fullmatch(re.escape(p).replace(r"\*", r"[^:{}]+"), doc_key) for p in patterns)


# --- links ---------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text, flags=re.UNICODE)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_block = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_block = not in_block
        if in_block:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def metric_tables(part: str) -> dict[str, dict[str, set[str] | None]]:
    """docs/metrics.md's tables in ``part``: metric -> {label: allowed values, or None when any
    value is allowed}."""
    out: dict[str, dict[str, set[str] | None]] = {}
    has_labels = False
    for line in part.splitlines():
        if line.startswith("| metric |"):
            has_labels = "| labels |" in line
            continue
        m = re.match(r"^\| `((?:sluice|sluice_gateway):[a-z0-9_:]+)` \|(.*)$", line)
        if not m:
            continue
        labels: dict[str, set[str] | None] = {}
        cell = m.group(2).split(" | ")[0] if has_labels else ""
        names = re.findall(r"`([a-z_]+)`", cell)
        if "=" in cell:
            labels[names[0]] = set(names[1:])
        else:
            labels.update({n: None for n in names})
        out[m.group(1)] = labels
    return out

"""Docstrings and --help texts hold no benchmark figures: figures go stale with the next change, so
they live in README.md / docs next to the command that reproduces them. A docstring may
still say *that* something is faster and point to where the figure is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine_service", "gateway", "sluice", "sluice_cli")
# a measured time per call or step, a rate, or a relative speed
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?\s?(?:µs|us|ms|tokens/s|tok/s|[GM]B/s)\b"
    r"|\b\d+(?:\.\d+)?\s?%\s(?:less|more|faster|slower)\b"
    r"|\b\d+(?:\.\d+)?\s?[x×]\s(?:faster|slower)\b"
)
# Modules other helpers own and are moving their figures out of; each must still
# hold one, so that this list only ever shrinks.
PENDING = {
    "engine_service/model/compiled.py",
    "engine_service/model/prepacked.py",
    "engine_service/model/hugepages.py",
    "engine_service/model/quantization.py",
    "engine_service/sampling/grammar.py",
}


def _texts(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((getattr(node, "lineno", 1), doc))
        if isinstance(node, ast.Call):
            helps = [k.value for k in node.keywords if k.arg in ("help", "description", "epilog")]
            if isinstance(node.func, ast.Name) and node.func.id == "knob" and len(node.args) > 1:
                helps.append(node.args[1])  # engine_service.config's flag help
            for h in helps:
                for part in ast.walk(h):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        out.append((part.lineno, part.value))
    return out


def offenders() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith("_pb2.py") or "bench" in path.parts:
                continue  # generated code; the benchmark commands print figures by design
            rel = path.relative_to(ROOT).as_posix()
            for line, text in _texts(ast.parse(path.read_text(encoding="utf-8"))):
                for m in FIGURE.finditer(text):
                    found.setdefault(rel, []).append(f"{rel}:{line}: {m.group(0)!r}")
    return found


def test_no_benchmark_figures_in_docstrings_or_help_texts():
    found = offenders()
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, "figures belong in README/docs next to their command:\n" + "\n".join(
        line for lines in new.values() for line in lines)
    assert PENDING <= set(found), f"no figures left in {sorted(PENDING - set(found))}: drop them from PENDING"


def test_the_pattern_finds_figures():
    for text in ("took 187 µs", "5-8 µs a call", "~18 GB/s", "takes 19% less time", "2.6x faster", "64.7 tokens/s"):
        assert FIGURE.search(text), text
    for text in ("a 5 s heartbeat", "at most 16 completions", "n in [1, 16]", "faster per token"):
        assert not FIGURE.search(text), text

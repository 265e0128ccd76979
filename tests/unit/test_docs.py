"""The docs say what the code does: every flag, default, metric name, Redis key and error code that
README.md, CHANGELOG.md and docs/ name is checked against the code that defines it, every relative
link resolves, and no page reads as a development diary. The rules and what they read are in
tests/docs_check.py; each failure names the file, the line and what to change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluice.wire.error_codes import TABLE
from sluice.wire.error_codes import Code as ErrorCode
from tests import docs_check as dc

DOCS = dc.doc_files()
CURRENT = [p for p in DOCS if p != dc.HISTORY]  # CHANGELOG.md names what was


def _code(paths: list[Path]) -> list[dc.Code]:
    return [c for p in paths for c in dc.split_doc(p)[0]]


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(f"  {p}" for p in problems)


def test_every_sluice_command_line_names_a_command_and_its_flags():
    commands = dc.command_flags()
    problems = []
    for code in _code(CURRENT):
        for inv in dc.invocations(code):
            if not inv.words or any(w.isupper() or w in ("COMMAND", "X") for w in inv.words):
                continue  # `sluice --help`, `sluice COMMAND`: no command named
            named = dc.resolve(inv.words)
            if named is None:
                problems.append(f"{code.where}: `sluice {' '.join(inv.words)}` is no command of "
                                f"sluice_cli/cli.py COMMANDS ({', '.join(sorted(commands))})")
                continue
            for flag in inv.flags:
                if flag != "--help" and not any(flag in commands[c] for c in named):
                    problems.append(f"{code.where}: `sluice {' / '.join(named)}` has no option {flag} "
                                    f"(fix the docs, or the flag's name in its parser)")
    assert not problems, _report(problems, "flags the commands do not have")


def test_every_bare_flag_in_code_is_an_option_of_a_sluice_command():
    """A code span that is only a flag (`--max-queue-len`, `--dtype bfloat16`) names a Sluice flag;
    another tool's flag is written with its command (`redis-cli --cluster create`)."""
    every = {flag for flags in dc.command_flags().values() for flag in flags}
    problems = []
    for code in _code(CURRENT):
        if code.block or not code.text.startswith("--"):
            continue
        flag = code.text.split()[0].split("=", 1)[0].rstrip(",")
        if flag not in every:
            problems.append(f"{code.where}: `{code.text}`: no sluice command has {flag} (write another "
                            "tool's flag with its command, or fix the name)")
    assert not problems, _report(problems, "bare flags no sluice command has")


def _defaults(flag: str) -> list[tuple[str, object]]:
    return [(c, flags[flag]) for c, flags in dc.command_flags().items() if flag in flags]


INLINE_DEFAULT = re.compile(r"`(--[a-z0-9-]+)`\s*\(default:?\s*`?([^`)]+)`?\)")


def test_documented_defaults_are_the_parsers():
    """A table with a "default" column whose row starts with a `--flag`, and "`--flag` (default X)"
    in prose, say the default the flag's parser has (any command that has the flag)."""
    problems = []
    for path in CURRENT:
        _, prose = dc.split_doc(path)
        stated: list[tuple[int, str, str]] = []
        for line, header, cells in dc.table_rows(prose):
            column = next((i for i, h in enumerate(header) if h.strip("* ") == "default"), None)
            first = re.match(r"`(--[a-z0-9-]+)", cells[0]) if cells else None
            if column is not None and first and column < len(cells):
                stated.append((line, first.group(1), cells[column]))
        for line, text in prose:
            stated += [(line, m.group(1), m.group(2)) for m in INLINE_DEFAULT.finditer(text)]
        for line, flag, cell in stated:
            defaults = _defaults(flag)
            if not defaults:
                problems.append(f"{dc.rel(path)}:{line}: {flag} is no option of any sluice command")
                continue
            if cell.strip() in ("—", "-") and any(d is None for _, d in defaults):
                continue  # "no default" is what some command's parser has (None)
            checkable = [(c, d) for c, d in defaults if d is not None and "$" not in cell]
            if checkable and not any(dc.default_matches(cell, d) for _, d in checkable):
                said = ", ".join(f"`sluice {c}`: {d!r}" for c, d in checkable)
                problems.append(f"{dc.rel(path)}:{line}: {flag}'s default: the docs say {cell!r}, the parser {said}")
    assert not problems, _report(problems, "defaults the parsers do not have")


def test_every_metric_name_is_defined_by_the_metrics_modules():
    problems = []
    for code in _code(CURRENT):
        for name in dc.METRIC.findall(code.text):
            if name in ("sluice:", "sluice_gateway:"):
                continue  # the prefix itself
            if not dc.metric_defined(name.rstrip(":")):
                problems.append(f"{code.where}: `{name}` is neither a metric of engine_service/service/metrics.py "
                                "or gateway/metrics.py nor a Redis key (keys carry a hash tag: sluice:{family}:...)")
    assert not problems, _report(problems, "metric names the code does not define")


def test_every_redis_key_is_one_the_contract_makes():
    problems = []
    for code in _code(CURRENT):
        for raw in dc.KEY.findall(code.text):
            key = dc.normalize_key(raw)
            if not dc.key_known(key):
                known = "\n      ".join(sorted(dc.key_patterns()))
                problems.append(f"{code.where}: `{raw}` is no key or channel of sluice/wire/contract.py; it makes:\n"
                                f"      {known}")
    assert not problems, _report(problems, "Redis keys the contract does not make")


STATUS_CODE_SPAN = re.compile(r"^([45]\d\d) ([a-z][a-z_]+)$")
STATUS_THEN_CODE = re.compile(r"\b([45]\d\d) `([a-z][a-z_]+)`")
ENGINE_ERROR = re.compile(r"^error ([a-z][a-z_]+)$")


def test_error_codes_are_the_tables():
    """`503 engine_lost` (or 503 `engine_lost`) is a code of sluice/wire/error_codes.py with that
    status; `error draining` a code an engine sends."""
    problems = []

    def check(where: str, status: int | None, name: str) -> None:
        try:
            code = ErrorCode(name)
        except ValueError:
            problems.append(f"{where}: {name!r} is no code of sluice/wire/error_codes.py")
            return
        if status is not None and TABLE[code].status != status:
            problems.append(f"{where}: {name} is a {TABLE[code].status}, not a {status} (sluice/wire/error_codes.py)")
        if status is None and code.wire is None:
            problems.append(f"{where}: {name} is the gateway's own code; an engine's error event never carries it")

    for path in CURRENT:
        code_pieces, prose = dc.split_doc(path)
        for piece in code_pieces:
            if m := STATUS_CODE_SPAN.match(piece.text):
                check(piece.where, int(m.group(1)), m.group(2))
            elif m := ENGINE_ERROR.match(piece.text):
                check(piece.where, None, m.group(1))
        for line, text in prose:
            for m in STATUS_THEN_CODE.finditer(text):
                check(f"{dc.rel(path)}:{line}", int(m.group(1)), m.group(2))
    assert not problems, _report(problems, "error codes unlike the table")


# Docs other engineers are writing at the same time: a link to one passes while it does not exist
# here (take it out of this set once it is merged).
WRITTEN_IN_PARALLEL: set[str] = set()


def test_relative_links_resolve():
    problems = []
    for path in DOCS:
        for line, text in dc.split_doc(path)[1]:
            text = dc.SPAN.sub("", text)
            for target in dc.LINK.findall(text):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                if not dest.exists() and dest.is_relative_to(dc.ROOT) and dc.rel(dest) in WRITTEN_IN_PARALLEL:
                    continue
                if not dest.exists():
                    problems.append(f"{dc.rel(path)}:{line}: the link {target} names no file")
                elif anchor and dest.suffix == ".md" and anchor not in dc.anchors(dest):
                    problems.append(f"{dc.rel(path)}:{line}: the link {target}: {dc.rel(dest)} has no heading "
                                    f"whose anchor is #{anchor}")
    assert not problems, _report(problems, "broken links")


# A development diary: work named by the session that did it, not by what it does.
# (the first and second rounds of a bench's `--rounds` are no diary; later ordinals name sessions)
ORDINALS = "third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth"
NOT_A_WORD = r"(?![\w-])"  # "round" but not "round-trips", "stop" but not "stop-word"
DIARY = re.compile(rf"\bstops? \d+\b|\bissues? \d+\b|\b(?:this|that|the next|the previous|last) (?:round|stop){NOT_A_WORD}"
                   rf"|\b(?:{ORDINALS}) round{NOT_A_WORD}", re.IGNORECASE)
# In the docs also "round N" (not "--rounds N", a flag, nor "rounds 0.95", figures)
DIARY_IN_DOCS = re.compile(DIARY.pattern + r"|(?<!-)\brounds? \d+\b(?![.,]\d)", re.IGNORECASE)


def test_no_development_diary_in_the_docs():
    problems = [f"{dc.rel(path)}:{number}: {m.group(0)!r}: say what the code does, not when it was done "
                "(history lives in git and CHANGELOG.md, by date)"
                for path in DOCS for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                for m in DIARY_IN_DOCS.finditer(line)]
    assert not problems, _report(problems, "diary phrases in the docs")


SOURCES = ("engine_service", "gateway", "sluice", "sluice_cli", "sluice_bench", "tests", "scripts", "deploy")
SOURCE_SUFFIXES = {".py", ".c", ".h", ".cpp", ".sh", ".yaml", ".yml", ".toml"}
# Files other engineers own that still hold diary phrases in their comments or docstrings; each
# must still hold one, so that this list only ever shrinks.
PENDING = {
    "engine_service/core/spec_decode.py",
    "engine_service/model/hugepages.py",
    "engine_service/model/kernels/decode_stack.c",
    "engine_service/model/kernels/decode_stack.h",
    "engine_service/model/kernels/kv_ahead.h",
    "engine_service/model/kernels/one_row_prefetch.h",
    "engine_service/model/kernels/packed_gemv.c",
    "engine_service/model/kernels/packed_gemv.h",
    "engine_service/model/kernels/paged_decode_attention.c",
    "engine_service/model/kernels/stack_phases.h",
    "engine_service/model/kernels/team_barrier.h",
    "engine_service/model/runner.py",
    "engine_service/model/stub.py",
    "gateway/broker.py",
    "gateway/responses/background.py",
    "sluice/wire/connection.py",
    "sluice/wire/contract.py",
    "sluice_bench/anchor.py",
}


def diary_in_sources() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in SOURCES:
        for path in sorted((dc.ROOT / top).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or "_pb2" in path.name or path.name == "test_docs.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for m in DIARY.finditer(line):
                    found.setdefault(dc.rel(path), []).append(f"{dc.rel(path)}:{number}: {m.group(0)!r}")
    return found


def test_no_development_diary_in_comments_and_docstrings():
    found = diary_in_sources()
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, _report([line for lines in new.values() for line in lines],
                            "diary phrases in comments or docstrings: say what the code does and why")
    assert PENDING <= set(found), f"no diary phrase left in {sorted(PENDING - set(found))}: drop them from PENDING"


# --- the rules themselves -------------------------------------------------------------------------

def test_the_rules_find_what_they_should(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Run `sluice serve --port 9000` or\n\n```bash\nsluice engine --model M \\\n  --grpc-port 1\n"
                   "OMP_PROC_BIND=true taskset -c 0 sluice bench serve --rounds 3 | tee x\n```\n"
                   "see [a](other.md#x), `503 engine_lost`, 404 `model_not_found`.\n", encoding="utf-8")
    code, prose = dc.split_doc(doc)
    invs = [i for c in code for i in dc.invocations(c)]
    assert [(i.words, i.flags) for i in invs] == [(("serve",), ("--port",)), (("engine",), ("--model", "--grpc-port")),
                                                  (("bench", "serve"), ("--rounds",))]
    assert dc.resolve(("engine|serve",)) == ["engine", "serve"] and dc.resolve(("nonsense",)) is None
    assert dc.default_matches("4 MiB", 4 << 20) and dc.default_matches("on", True) and not dc.default_matches("600", 60)
    assert dc.default_matches("0 (off)", 0) and dc.default_matches("`float32`", "float32")
    assert dc.key_known(dc.normalize_key("sluice:{q:<model>:<shard>}:requests"))
    assert dc.key_known("sluice:{registry}:engine:e1") and not dc.key_known("sluice:{registry}:gateways")
    assert not dc.key_known(dc.normalize_key("sluice:{registry}:model:<name>:x"))
    assert dc.metric_defined("sluice:num_preemptions_total") and dc.metric_defined("sluice_gateway:requests_lost_total")
    assert not dc.metric_defined("sluice:model") and not dc.metric_defined("sluice:num_requests_running_total_x")
    assert dc.METRIC.findall("`sluice:model:{model}`, `sluice:engines`") == ["sluice:model:", "sluice:engines"]
    assert dc.METRIC.findall("rate(sluice:prefix_cache_hits_total[5m]) sluice:{registry}:engines") == [
        "sluice:prefix_cache_hits_total"]
    assert dc.slug("The `sluice bench serve` (v2): 50% off") == "the-sluice-bench-serve-v2-50-off"
    for text in ("stop 54's landing", "in stops 55–61", "this round", "the sixth round", "issue 26 item 5"):
        assert DIARY.search(text), text
    for text in ("--rounds 3", "a stop string", "round-robin", "rounds of 20 steps", "redis-py #4287",
                 "that round-trips", "fifteen rounds 0.95 or more", "the first round's prompts"):
        assert not DIARY_IN_DOCS.search(text), text
    assert DIARY_IN_DOCS.search("round 3 measured")


@pytest.mark.parametrize("text", ["`--no-such-flag`", "`sluice serve --no-such-flag`", "`sluice frobnicate`"])
def test_a_wrong_flag_or_command_is_found(tmp_path, text):
    doc = tmp_path / "x.md"
    doc.write_text(f"Try {text}.\n", encoding="utf-8")
    code = dc.split_doc(doc)[0]
    every = {f for flags in dc.command_flags().values() for f in flags}
    invs = [i for c in code for i in dc.invocations(c)]
    bare = [c.text for c in code if c.text.startswith("--")]
    assert (bare and bare[0] not in every) or any(
        dc.resolve(i.words) is None or any(f not in dc.command_flags()[dc.resolve(i.words)[0]] for f in i.flags)
        for i in invs)

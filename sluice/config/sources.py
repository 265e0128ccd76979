"""Where a knob's value comes from, and the one rule that picks it.

    command-line flag  >  environment variable (knobs that have one)  >  --config file  >  default

A secret's ``--FLAG-file PATH`` (or the ``KEY-file`` key in a config file) counts as its flag (or
its config key): the value is read from the file, so it never sits on a command line. Bad input is
a ``ConfigError`` with a one-line message naming the file and line, the flag or the variable;
the CLI prints it and exits 2.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.config.knobs import Knob, KnobSet

SOURCES = ("default", "file", "env", "flag")


class ConfigError(ValueError):
    """Configuration input that cannot be used: the message names where it came from."""


@dataclass(frozen=True)
class Source:
    kind: str  # one of SOURCES
    detail: str = ""  # the file, variable or flag it came through

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


DEFAULT = Source("default")


@dataclass(frozen=True)
class Setting:
    knob: Knob
    value: Any
    source: Source


@dataclass(frozen=True)
class FileEntry:
    value: Any
    line: int
    key: str  # as written


@dataclass(frozen=True)
class ConfigFile:
    path: str
    entries: dict[str, FileEntry]  # normalized key → entry


def load_config_file(path: str | os.PathLike[str], knobs: KnobSet) -> ConfigFile:
    """A YAML mapping of the command's flag names (``-`` or ``_``) to values; every key known,
    every value of its knob's type (a secret's ``KEY-file`` key names a file holding it)."""
    import yaml

    name = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {name}: {exc.strerror or exc}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if data is None:
        return ConfigFile(name, {})
    if not isinstance(data, dict):
        raise ConfigError(f"{name}:1: a config file is a mapping of flag names to values (block-size: 32), "
                          f"not {type(data).__name__}")
    lines = {}
    for key_node, _ in root.value:  # the mapping's nodes, for the line of each key
        lines.setdefault(str(key_node.value), key_node.start_mark.line + 1)
    by_key = knobs.by_key()
    entries: dict[str, FileEntry] = {}
    for key, value in data.items():
        line = lines.get(str(key), 1)
        if not isinstance(key, str):
            raise ConfigError(f"{name}:{line}: a key is a flag name, not {key!r}")
        norm = key.strip().removeprefix("--").replace("-", "_")
        knob = by_key.get(norm)
        if knob is None:
            raise ConfigError(f"{name}:{line}: unknown key {key!r} for {knobs.command}{_suggest(norm, by_key)}")
        if norm in entries:
            raise ConfigError(f"{name}:{line}: {key!r} repeats {entries[norm].key!r} (line {entries[norm].line})")
        if norm.endswith("_file") and norm != knob.key:  # a secret's file
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name}:{line}: {key} expects a file path (a string), got {value!r}")
        else:
            try:
                value = knob.check(value)
            except ValueError as exc:
                raise ConfigError(f"{name}:{line}: {key}: {exc}") from None
        entries[norm] = FileEntry(value, line, key)
    return ConfigFile(name, entries)


def _suggest(norm: str, by_key: Mapping[str, Knob]) -> str:
    close = difflib.get_close_matches(norm, list(by_key), n=1, cutoff=0.6)
    return f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""


def read_secret_file(knob: Knob, path: str, origin: str) -> Any:
    """A secret's value from the file at ``path``: its text without the trailing newline; for a
    list (``--api-key-file``) one item a line, blank lines and ``#`` comments skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{origin} {path}: cannot read it: {exc.strerror or exc}") from None
    if knob.kind == "list":
        value: Any = [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]
    else:
        value = text.strip()
    if not value:
        raise ConfigError(f"{origin} {path}: the file is empty")
    try:
        return knob.check(value)
    except ValueError as exc:
        raise ConfigError(f"{origin} {path}: {exc}") from None


def env_setting(knob: Knob, environ: Mapping[str, str]) -> Setting | None:
    for var in knob.env:
        text = environ.get(var)
        if text:  # set and not empty
            try:
                return Setting(knob, knob.parse_text(text), Source("env", var))
            except ValueError as exc:
                raise ConfigError(f"${var} ({knob.flag}): {exc}") from None
    return None


def resolve(knobs: KnobSet, *, flags: Mapping[str, Any], flag_files: Mapping[str, str],
            config: ConfigFile | None, environ: Mapping[str, str] | None = None) -> dict[str, Setting]:
    """Every knob's value and where it came from. ``flags``: the values given on the command line
    (by knob name); ``flag_files``: the secrets' ``--FLAG-file`` paths given there."""
    environ = os.environ if environ is None else environ
    out: dict[str, Setting] = {}
    for knob in knobs:
        if knob.name in flags and knob.name in flag_files:
            raise ConfigError(f"give {knob.flag} or {knob.file_flag}, not both")
        if knob.name in flags:
            out[knob.name] = Setting(knob, flags[knob.name], Source("flag", knob.flag))
            continue
        if knob.name in flag_files:
            path = flag_files[knob.name]
            out[knob.name] = Setting(knob, read_secret_file(knob, path, knob.file_flag),
                                     Source("flag", f"{knob.file_flag} {path}"))
            continue
        from_env = env_setting(knob, environ)
        if from_env is not None:
            out[knob.name] = from_env
            continue
        if config is not None:
            entry = config.entries.get(knob.key)
            file_entry = config.entries.get(knob.key + "_file") if knob.secret else None
            if entry is not None and file_entry is not None:
                raise ConfigError(f"{config.path}:{file_entry.line}: give {entry.key} or {file_entry.key}, not both")
            if entry is not None:
                out[knob.name] = Setting(knob, entry.value, Source("file", config.path))
                continue
            if file_entry is not None:
                origin = f"{config.path}:{file_entry.line}: {file_entry.key}"
                # a relative path is the config file's neighbour, wherever the command runs
                path = str(Path(config.path).parent / file_entry.value)
                out[knob.name] = Setting(knob, read_secret_file(knob, path, origin),
                                         Source("file", f"{config.path}, {file_entry.key} {file_entry.value}"))
                continue
        out[knob.name] = Setting(knob, _copy(knob.default), DEFAULT)
    return out


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value

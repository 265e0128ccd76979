"""Knobs on the command line: one flag per knob (with its default, help, choices and environment
variable in ``--help``), ``--config FILE``, a secret's ``--FLAG-file PATH``; after parsing,
``resolve_args`` applies the precedence (``sluice.config.sources``) and leaves every knob's
effective value on the namespace, with its source beside it.

argparse is given the real defaults, so ``--help`` shows them and a namespace parsed without
resolving still holds sensible values; which flags were really given is recorded by the actions
themselves (a default and a flag that repeats it are different sources).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from typing import Any

from sluice.config.knobs import Knob, KnobSet, knobs_of
from sluice.config.sources import Setting, load_config_file, resolve

_KNOBS = "_sluice_knobs"  # the namespace's KnobSet (set_defaults)
_GIVEN = "_sluice_given"  # dests given on the command line (the recording actions)
_RESOLVED = "_sluice_settings"  # the resolved settings, once resolved

CONFIG_HELP = ("YAML file of settings: keys are the long flag names, with - or _ (block-size: 32); "
               "a flag or an environment variable wins over it (docs/configuration.md)")


def _recording(base: type[argparse.Action], cache: dict[type, type] = {}) -> type[argparse.Action]:  # noqa: B006
    """``base`` that also notes its dest as given on the command line."""
    if base not in cache:
        class Recorded(base):  # type: ignore[misc, valid-type]
            def __call__(self, parser, namespace, values, option_string=None):
                super().__call__(parser, namespace, values, option_string)
                given = getattr(namespace, _GIVEN, None)
                if given is None:
                    given = set()
                    setattr(namespace, _GIVEN, given)
                given.add(self.dest)

        Recorded.__name__ = f"Recorded{base.__name__}"
        cache[base] = Recorded
    return cache[base]


_STORE = _recording(argparse._StoreAction)
_APPEND = _recording(argparse._AppendAction)
_BOOL = _recording(argparse.BooleanOptionalAction)


def file_dest(knob: Knob) -> str:
    return knob.name + "__file"


def _converter(knob: Knob):
    def convert(text: str) -> Any:
        try:
            return knob.parse_text(text, choices=False)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = knob.kind
    return convert


def _help(knob: Knob) -> str:
    text = knob.help.replace("%", "%%")  # argparse formats help with %
    if knob.env:
        text += " (env " + ", ".join("$" + v for v in knob.env) + ")"
    if knob.default is None or knob.default == []:
        return text
    return text + " (default: %(default)s)"


def add_knob(group: Any, knob: Knob) -> None:
    """The flag of one knob (and a secret's ``--FLAG-file``) on a parser or argument group."""
    common: dict[str, Any] = {"dest": knob.name, "help": _help(knob)}
    if knob.metavar:
        common["metavar"] = knob.metavar
    elif knob.choices is None and knob.kind != "bool":  # the flag's name, not the field's
        common["metavar"] = knob.flag_name.upper().replace("-", "_")
    if knob.kind == "bool":
        group.add_argument(knob.flag, action=_BOOL, default=knob.default, **common)
    elif knob.kind == "list":
        group.add_argument(knob.flag, action=_APPEND, default=list(knob.default), type=_converter_item(knob),
                           **common)
    else:
        group.add_argument(knob.flag, action=_STORE, default=knob.default, type=_converter(knob),
                           choices=list(knob.choices) if knob.choices is not None else None, **common)
    if knob.secret:
        item = " (one a line)" if knob.kind == "list" else ""
        group.add_argument(knob.file_flag, action=_STORE, dest=file_dest(knob), default=None, metavar="PATH",
                           help=f"read {knob.flag} from this file{item} instead, so that it is on no command line")


def _converter_item(knob: Knob):
    def convert(text: str) -> str:
        return text

    convert.__name__ = "str"
    return convert


def add_arguments(parser: argparse.ArgumentParser, knobs: KnobSet, *, config_flag: bool = True) -> None:
    """Every knob of ``knobs`` as a flag, grouped by section (a section's ``knob_title``), plus
    ``--config FILE``; the namespace then carries the KnobSet for ``resolve_args``."""
    if config_flag:
        parser.add_argument("--config", metavar="FILE", default=None, help=CONFIG_HELP)
    for section in knobs.sections:
        title = getattr(section, "knob_title", section.__name__)
        group = parser.add_argument_group(title)
        for k in knobs_of(section):
            if knobs.knobs.get(k.name) is k:  # its first definition, where it is shown
                add_knob(group, k)
    parser.set_defaults(**{_KNOBS: knobs})


def add_section_arguments(parser: argparse.ArgumentParser | Any, section: type, *, title: str | None = None,
                          only: Iterable[str] | None = None) -> None:
    """The flags of one section's knobs (``only``: those named), no ``--config`` and no resolution:
    for a bench that passes a few engine knobs on."""
    knobs = {k.name: k for k in knobs_of(section) if k.cli}
    if only is not None:
        only = tuple(only)
        unknown = sorted(set(only) - set(knobs))
        if unknown:
            raise ValueError(f"not {getattr(section, 'knob_title', section.__name__)} flags: {', '.join(unknown)}")
    group = parser.add_argument_group(title or getattr(section, "knob_title", section.__name__)) \
        if isinstance(parser, argparse.ArgumentParser) else parser
    for k in knobs.values():
        if only is None or k.name in only:
            add_knob(group, k)


def resolve_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Setting] | None:
    """Apply the precedence to a namespace parsed by ``add_arguments``' parser: each knob's
    effective value replaces the parsed one. Returns the settings (value and source by knob
    name); None for a namespace without knobs. Idempotent. Raises ConfigError."""
    done = getattr(args, _RESOLVED, None)
    if done is not None:
        return done
    knobs: KnobSet | None = getattr(args, _KNOBS, None)
    if knobs is None:
        return None
    given = getattr(args, _GIVEN, None) or set()
    flags = {k.name: getattr(args, k.name) for k in knobs if k.name in given}
    flag_files = {k.name: getattr(args, file_dest(k)) for k in knobs if k.secret and file_dest(k) in given}
    path = getattr(args, "config", None)
    config = load_config_file(path, knobs) if path else None
    settings = resolve(knobs, flags=flags, flag_files=flag_files, config=config, environ=environ)
    for name, setting in settings.items():
        setattr(args, name, setting.value)
    setattr(args, _RESOLVED, settings)
    return settings


def settings_of(args: argparse.Namespace) -> dict[str, Setting]:
    settings = resolve_args(args)
    if settings is None:
        raise ValueError("this namespace was not parsed with sluice.config.add_arguments")
    return settings


def from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """``cls(...)`` from a namespace's values of its knobs (resolved first where it can be)."""
    resolve_args(args)
    values = {k.name: getattr(args, k.name) for k in knobs_of(cls) if k.cli and hasattr(args, k.name)}
    return cls(**values, **extra)


def flag_argv(knob: Knob, value: Any) -> list[str]:
    """The command-line words that set ``knob`` to ``value``."""
    if knob.kind == "bool":
        if value is None:
            return []
        return [knob.flag if value else "--no-" + knob.flag_name]
    if knob.kind == "list":
        return [w for item in value for w in (knob.flag, str(item))]
    if value is None:
        return []
    if isinstance(value, dict):
        return [knob.flag, json.dumps(value)]
    return [knob.flag, str(value)]


def changed_argv(knobs: Iterable[Knob], values: Mapping[str, Any]) -> list[str]:
    """Flags for the knobs whose value differs from the default (secrets excluded: they never go
    on a command line), so the receiving command's own defaults stay the single source."""
    out: list[str] = []
    for k in knobs:
        if k.secret or k.name not in values:
            continue
        value = values[k.name]
        if value != k.default:
            out += flag_argv(k, value)
    return out


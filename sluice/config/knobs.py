"""A knob: one configuration value of a Sluice command, defined once as a dataclass field.

``knob(default, help, ...)`` makes the field; ``knobs_of(cls)`` reads every knob of a dataclass
back as a ``Knob`` (its name, type from the annotation, default, help, choices, bounds, environment
variables, whether it is a secret). Everything else is derived from that: the command-line flags
(``sluice.config.argv``), the ``--config`` file keys (``sluice.config.sources``), the effective
configuration ``sluice config --print`` shows and docs/configuration.md (``sluice.config.render``).

A knob's names: the field ``block_size``, the flag ``--block-size`` (``flag=`` when they differ, as
``heartbeat_ttl_s`` is ``--heartbeat-ttl``), and the config-file key: the flag's name with ``-`` or
``_`` (``block-size: 32`` or ``block_size: 32``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# How a knob's value is written and checked, from its annotation.
KINDS = ("str", "int", "float", "bool", "list", "json")
KIND_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
              "list": "a list of strings", "json": "a mapping or its JSON text"}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def knob(default: Any, help: str, *, choices: Iterable[Any] | None = None, env: str | tuple[str, ...] = (),
         secret: bool = False, cli: bool = True, flag: str | None = None, metavar: str | None = None,
         bounds: tuple[float | None, float | None] | None = None, shadows: bool = False,
         field_default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is a configuration knob.

    ``choices``: the values it may take; ``bounds``: ``(low, high)`` for a number (either None: open);
    ``env``: the environment variable(s) that set it (the first set one wins); ``secret``: masked
    wherever it is shown, and it also takes ``--FLAG-file PATH``; ``cli=False``: not on the command
    line nor in a config file (a programmatic field); ``flag``: the long flag without ``--`` when
    it is not the field's name; ``shadows``: this command's own definition of a knob that another
    section of the same command defines too (``sluice serve --host`` over the gateway's);
    ``field_default``: the dataclass's own default where a program building it wants another than
    the command's (``ServiceSettings()`` in a test starts no gRPC server: ``grpc_port`` 0, while
    ``sluice engine`` listens on 50051)."""
    meta = {"knob": {"default": default, "help": help, "choices": tuple(choices) if choices is not None else None,
                     "env": (env,) if isinstance(env, str) else tuple(env), "secret": secret, "cli": cli,
                     "flag": flag, "metavar": metavar, "bounds": bounds, "shadows": shadows},
            "help": help, "cli": cli}  # the plain keys for readers of dataclasses.fields
    own = default if field_default is dataclasses.MISSING else field_default
    if isinstance(own, list):
        return field(default_factory=functools.partial(list, own), metadata=meta)
    return field(default=own, metadata=meta)


@dataclass(frozen=True)
class Knob:
    """One knob, as ``knob()`` and the field's annotation describe it."""

    name: str  # the field
    kind: str  # one of KINDS
    optional: bool  # None is a value (the annotation has ``| None``)
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    env: tuple[str, ...] = ()
    secret: bool = False
    cli: bool = True
    flag_name: str = ""  # without the dashes
    metavar: str | None = None
    bounds: tuple[float | None, float | None] | None = None
    shadows: bool = dataclasses.field(default=False, compare=False)
    owner: str = dataclasses.field(default="", compare=False)  # the dataclass that defines it

    @property
    def flag(self) -> str:
        return "--" + self.flag_name

    @property
    def key(self) -> str:
        """Its config-file key, normalized (``_`` for ``-``)."""
        return self.flag_name.replace("-", "_")

    @property
    def file_flag(self) -> str:
        """A secret's ``--FLAG-file``: its value read from a file."""
        return self.flag + "-file"

    # --- values ---

    def parse_text(self, text: str, *, choices: bool = True) -> Any:
        """A value written as text (a flag's argument, an environment variable): converted to the
        knob's type and checked (``choices=False``: not against the choices, which argparse checks
        itself with its own message). ValueError with what was expected otherwise."""
        if self.kind == "int":
            try:
                value: Any = int(text)
            except ValueError:
                raise ValueError(f"{text!r} is not an integer") from None
        elif self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{text!r} is not a number") from None
        elif self.kind == "bool":
            word = text.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(f"{text!r} is not true or false ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")
            value = word in TRUE_WORDS
        elif self.kind == "list":
            value = [text]
        else:
            value = text
        return self.check(value, choices=choices)

    def check(self, value: Any, *, choices: bool = True) -> Any:
        """``value`` (from a config file or already typed) as the knob takes it: the knob's type, one
        of its choices, inside its bounds. ValueError saying what was expected otherwise."""
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"expected {KIND_NAMES[self.kind]}, got null")
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {_shown(value)}")
        elif self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"expected an integer, got {_shown(value)}")
        elif self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"expected a number, got {_shown(value)}")
            value = float(value)
        elif self.kind == "str":
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"expected a string, got {_shown(value)}")
            value = str(value)
        elif self.kind == "list":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"expected a list of strings, got {_shown(value)}")
        elif self.kind == "json":
            if not isinstance(value, (str, dict)):
                raise ValueError(f"expected a mapping or its JSON text, got {_shown(value)}")
        if self.choices is not None:
            if isinstance(value, str):  # choices read case-insensitively: --log-level INFO
                value = next((c for c in self.choices if isinstance(c, str) and c.lower() == value.lower()), value)
            if choices and value not in self.choices:
                raise ValueError(f"{value!r} is not one of {', '.join(map(str, self.choices))}")
        if self.bounds is not None and self.kind in ("int", "float"):
            low, high = self.bounds
            if (low is not None and value < low) or (high is not None and value > high):
                if high is None:
                    raise ValueError(f"{value} is below {_bound(low)}, the least it may be")
                if low is None:
                    raise ValueError(f"{value} is above {_bound(high)}, the most it may be")
                raise ValueError(f"{value} is outside [{_bound(low)}, {_bound(high)}]")
        return value


def _shown(value: Any) -> str:
    kind = {dict: "a mapping", list: "a list", bool: "a boolean", str: "a string"}.get(type(value),
                                                                                     type(value).__name__)
    return f"{value!r} ({kind})"


def _bound(value: float | None) -> str:
    return "" if value is None else str(int(value)) if float(value).is_integer() else f"{value:g}"


def _kind(annotation: Any) -> tuple[str, bool]:
    """(kind, optional) of a field's annotation: ``int | None`` → ("int", True)."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    members = [a for a in args if a is not type(None)] if args and typing.get_origin(annotation) is not list \
        else [annotation]
    if dict in members or any(typing.get_origin(m) is dict for m in members):
        return "json", optional
    base = members[0]
    if typing.get_origin(base) is list:
        return "list", optional
    for kind, python_type in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if base is python_type:
            return kind, optional
    raise TypeError(f"a knob cannot have the type {annotation!r}")


@functools.cache
def knobs_of(cls: type) -> tuple[Knob, ...]:
    """Every knob field of dataclass ``cls`` (fields made without ``knob()`` are not knobs)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("knob")
        if meta is None:
            continue
        kind, optional = _kind(hints[f.name])
        default = meta["default"]
        out.append(Knob(name=f.name, kind=kind, optional=optional, default=default, help=meta["help"],
                        choices=meta["choices"], env=meta["env"], secret=meta["secret"], cli=meta["cli"],
                        flag_name=meta["flag"] or f.name.replace("_", "-"), metavar=meta["metavar"],
                        bounds=meta["bounds"], shadows=meta["shadows"], owner=cls.__name__))
    return tuple(out)


class KnobSet:
    """The knobs of one command, from the dataclasses (sections) it is configured by, in order.

    Two sections may name the same knob when both define it alike (``redis_url`` in the engine
    service's and the gateway's settings: one shared definition); otherwise the earlier section's
    definition must say ``shadows=True`` (``sluice serve``'s own ``--host``), so a knob added to one
    section never silently changes another command."""

    def __init__(self, command: str, sections: Iterable[type]) -> None:
        self.command = command
        self.sections = tuple(sections)
        self.knobs: dict[str, Knob] = {}
        self.shadowed: dict[str, list[Knob]] = {}
        for section in self.sections:
            for k in knobs_of(section):
                if not k.cli:
                    continue
                have = self.knobs.get(k.name)
                if have is None:
                    self.knobs[k.name] = k
                elif have != k:
                    if not have.shadows:
                        raise TypeError(f"{command}: {k.owner}.{k.name} and {have.owner}.{have.name} define the "
                                        f"knob {k.flag} differently; share one definition or mark the first "
                                        "shadows=True")
                    self.shadowed.setdefault(k.name, []).append(k)
        flags: dict[str, Knob] = {}
        for k in self.knobs.values():
            for name in (k.key, *((k.key + "_file",) if k.secret else ())):
                if name in flags:
                    raise TypeError(f"{command}: {k.flag} and {flags[name].flag} share the key {name}")
                flags[name] = k

    def __iter__(self):
        return iter(self.knobs.values())

    def __len__(self) -> int:
        return len(self.knobs)

    def by_key(self) -> dict[str, Knob]:
        """Config-file keys (normalized) → knob; a secret's ``KEY_file`` included."""
        out = {}
        for k in self.knobs.values():
            out[k.key] = k
            if k.secret:
                out[k.key + "_file"] = k
        return out

    def env_vars(self) -> list[str]:
        return [name for k in self.knobs.values() for name in k.env]


# A mask for a secret's value wherever it is shown.
MASK = "***"


def mask(knob_: Knob, value: Any, redact_url: Callable[[str], str] | None = None) -> Any:
    """A secret's value as it may be shown: a URL keeps all but its password, anything else is
    ``***`` (an unset secret shows as unset)."""
    if not knob_.secret or value in (None, "", []):
        return value
    if isinstance(value, list):
        return [MASK] * len(value)
    if isinstance(value, str) and "://" in value:
        if redact_url is None:
            from sluice.wire.connection import redact as redact_url
        return redact_url(value)
    return MASK

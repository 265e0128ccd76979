"""Knobs written out: a command's effective configuration (``sluice config --print``: every value
with its source, secrets masked, as YAML a ``--config`` file takes) and the reference tables of
docs/configuration.md."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from sluice.config.knobs import Knob, mask
from sluice.config.sources import Setting


def yaml_scalar(value: Any) -> str:
    """``value`` as YAML writes it on one line."""
    import yaml

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value)  # JSON is YAML
    text = yaml.safe_dump(str(value), default_style=None, width=1 << 20).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def effective_config(command: str, settings: Mapping[str, Setting]) -> str:
    """One line a knob, ``key: value  # source``, secrets masked: what the command would run with."""
    lines = [f"# {command}: the effective configuration (value  # source: default, file, env or flag; "
             "secrets masked)"]
    rows = [(s.knob.flag_name + ":", yaml_scalar(mask(s.knob, s.value)), str(s.source)) for s in settings.values()]
    key_width = max((len(r[0]) for r in rows), default=0)
    value_width = min(max((len(r[1]) for r in rows), default=0), 32)
    for key, value, source in rows:
        lines.append(f"{key:<{key_width}} {value:<{value_width}}  # {source}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _default(knob: Knob) -> str:
    if knob.default is None or knob.default == []:
        return "—"
    return f"`{yaml_scalar(knob.default)}`"


TYPE_WORDS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "list of strings",
              "json": "JSON object"}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _type(knob: Knob) -> str:
    if knob.choices is not None:
        return " | ".join(f"`{c}`" for c in knob.choices)
    name = TYPE_WORDS[knob.kind]
    if knob.bounds is not None:
        low, high = knob.bounds
        if low is not None and high is not None:
            name += f" in [{_number(low)}, {_number(high)}]"
        elif low is not None:
            name += f" ≥ {_number(low)}"
        elif high is not None:
            name += f" ≤ {_number(high)}"
    if knob.optional and knob.kind not in ("bool", "list"):
        name += ", or unset"
    return name


def knob_table(knobs: Iterable[Knob]) -> str:
    """A markdown table: flag, config key, environment variable, type, default, help."""
    rows = ["| flag | config key | env | type | default | help |", "|---|---|---|---|---|---|"]
    for k in knobs:
        flag = f"`{k.flag}`" + (f"<br>`{k.file_flag} PATH`" if k.secret else "")
        key = f"`{k.flag_name}`" + (f"<br>`{k.flag_name}-file`" if k.secret else "")
        env = "<br>".join(f"`{v}`" for v in k.env) or "—"
        text = k.help
        if k.secret:
            text = text.rstrip(".") + ". **Secret**: masked by `sluice config --print`; `sluice serve` hands it to its " \
                "children in a 0600 file"
        rows.append(f"| {flag} | {key} | {env} | {_cell(_type(k))} | {_cell(_default(k))} | {_cell(text)} |")
    return "\n".join(rows) + "\n"

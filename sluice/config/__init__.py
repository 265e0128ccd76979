"""One definition per configuration knob, for every Sluice command.

A knob is a dataclass field made with ``knob(default, help, ...)`` (``sluice.config.knobs``); a
command is configured by a few such dataclasses (its ``KnobSet``): ``sluice engine`` by the
engine service's ``ServiceSettings`` and the engine's ``EngineConfig``, ``sluice gateway`` by
``GatewayConfig``, ``sluice serve`` by its own ``ServeSettings`` and all three. From the knobs
come the flags (``sluice.config.argv``), ``--config FILE`` and the precedence (flag > environment
variable > config file > default; ``sluice.config.sources``), ``sluice config --print`` and
docs/configuration.md (``sluice.config.render``).

**Adding a knob is one line** in the dataclass of the component that reads it, e.g.::

    max_queue_len: int | None = knob(None, "answer 429 when a model's queue holds this many requests")

and it is then a flag, a config-file key and a documented row, in every command that has the
section, ``sluice serve`` included (which forwards it to the process it starts).

Torch-free and light: every command imports it to build ``--help``.
"""

from sluice.config.argv import (
    add_arguments,
    add_section_arguments,
    changed_argv,
    flag_argv,
    from_args,
    resolve_args,
    settings_of,
)
from sluice.config.knobs import Knob, KnobSet, knob, knobs_of, mask
from sluice.config.sources import ConfigError, Setting, Source, load_config_file, resolve

__all__ = [
    "ConfigError",
    "Knob",
    "KnobSet",
    "Setting",
    "Source",
    "add_arguments",
    "add_section_arguments",
    "changed_argv",
    "flag_argv",
    "from_args",
    "knob",
    "knobs_of",
    "load_config_file",
    "mask",
    "resolve",
    "resolve_args",
    "settings_of",
]

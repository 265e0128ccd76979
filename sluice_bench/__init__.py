"""Sluice's benchmarks: each module is one ``sluice bench`` subcommand (``sluice_cli/cli.py`` maps the
words to the modules), with ``add_arguments(parser)`` and ``run(args) -> int`` like every command.

This package sits above every other (docs/architecture.md): it may import the engine, the gateway
and the ground package; nothing in the product imports it. What the benches share:

- ``stack``: the one way a bench starts and stops processes on this machine (a private
  ``redis-server`` or a local Redis Cluster, ``sluice engine`` and ``sluice gateway`` processes);
- ``results``: the one result format (a JSON document that names its bench, command and machine);
- ``plots``: the charts drawn from those documents (``sluice bench plot``);
- ``modes``: the engine modes every model bench takes by name.
"""

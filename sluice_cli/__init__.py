"""Entry points: the ``sluice`` console script and the commands that tie the components together.

This package sits on top of every layer (see docs/architecture.md): it may import ``sluice``,
``engine_service`` and ``gateway``. It imports a component only inside the command that needs it,
so that the gateway image (no torch) can run ``sluice gateway`` and ``--help`` stays instant.

- ``sluice_cli.cli``: the ``sluice`` console script (``python -m sluice_cli.cli``).
- ``sluice_cli.serve``: ``sluice serve`` (Redis + engine + gateway on one machine).
"""

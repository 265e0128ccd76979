"""Sluice: shared code that both the gateway and the engine import (no torch here).

The ground layer: it imports neither ``engine_service`` nor ``gateway`` (the CLI lives in the
top package ``sluice_cli``).

- ``sluice.paths``: where prepared models and caches live.
- ``sluice.wire``: the protobuf messages and the Redis contract between gateway and engine.
- ``sluice.text``: tokenizer, chat template, incremental detokenizer and stop strings.
"""

__version__ = "0.1.0"

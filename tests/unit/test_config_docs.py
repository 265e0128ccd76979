"""docs/configuration.md is generated from the knob definitions (`sluice config --markdown`): the
committed page is what the generator writes now, and it names every knob of every command."""

from __future__ import annotations

from pathlib import Path

from sluice_cli import config_command, serve
from sluice_cli.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"


def test_the_committed_page_is_fresh():
    assert PAGE.read_text() == config_command.markdown(), (
        "docs/configuration.md is stale: run `sluice config --markdown > docs/configuration.md`")


def test_every_knob_of_every_command_has_a_row():
    text = PAGE.read_text()
    for name in config_command.COMMANDS:
        for k in config_command._module(name).KNOBS:
            assert f"| `{k.flag}`" in text, f"sluice {name} {k.flag} is not documented"
            for var in k.env:
                assert f"`{var}`" in text, var
    assert "`--api-key-file PATH`" in text and "`--admin-token-file PATH`" in text
    # the defaults in the table are the knobs' own
    assert "| `--max-num-seqs` | `max-num-seqs` | — | integer | `256` |" in text
    assert "| `--host` | `host` | — | string | `127.0.0.1` |" in text  # serve's own, before the gateway's 0.0.0.0
    assert "| `--host` | `host` | — | string | `0.0.0.0` |" in text


def test_the_cli_writes_the_page(capsys):
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == PAGE.read_text()
    assert len(serve.KNOBS) > 50

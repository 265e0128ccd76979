"""The served anchor's llama-server (sluice_bench.llama_server, anchor_served): where the binary comes
from, the flags that give it its best footing, and the refusals before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sluice_bench import anchor, llama_server


def test_the_command_gives_a_slot_and_an_http_thread_to_every_stream():
    cmd = llama_server.command(Path("/opt/llama-server"), Path("/m/x.gguf"), 8123, slots=64, ctx_per_slot=208,
                               threads=2)
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert cmd[0] == "/opt/llama-server" and flags["-m"] == "/m/x.gguf" and flags["--port"] == "8123"
    assert flags["--parallel"] == "64" and int(flags["--ctx-size"]) == 64 * 208  # each slot holds a request
    assert int(flags["--threads-http"]) >= 64 + 1  # no connection waits for an HTTP thread
    assert flags["--threads"] == flags["--threads-batch"] == "2"


def test_the_binary_is_the_one_named_then_the_environments_then_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(llama_server.BINARY_ENV, raising=False)
    assert llama_server.find(None) is None  # nothing built yet
    named = tmp_path / "named"
    named.write_text("#!/bin/sh\n")
    with pytest.raises(llama_server.LlamaServerError, match="not an executable file"):
        llama_server.find(named)
    named.chmod(0o755)
    assert llama_server.find(named) == named
    monkeypatch.setenv(llama_server.BINARY_ENV, str(named))
    assert llama_server.find(None) == named
    monkeypatch.delenv(llama_server.BINARY_ENV)
    cached = llama_server.cached_binary()
    cached.parent.mkdir(parents=True)
    cached.write_text("")
    assert llama_server.find(None) == cached


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    anchor.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "message"), [
    (["--served", "--served-rounds", "0"], "--served-rounds must be at least 1"),
    (["--served", "--served-prompts-per-stream", "0"], "--served-prompts-per-stream must be at least 1"),
])
def test_bad_served_arguments_are_refused(argv, message, capsys):
    assert anchor.run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


def test_served_without_a_llama_server_says_how_to_get_one(tmp_path, monkeypatch):
    from sluice_bench import anchor_served

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(llama_server.BINARY_ENV, raising=False)
    with pytest.raises(SystemExit, match="--build-llama-server"):
        anchor_served.run(_args("--served"), tmp_path / "x.gguf")
    with pytest.raises(SystemExit, match="--concurrency: positive integers"):
        binary = tmp_path / "llama-server"
        binary.write_text("")
        binary.chmod(0o755)
        anchor_served.run(_args("--served", "--concurrency", "0", "--llama-server", str(binary)), tmp_path / "x.gguf")


@pytest.mark.parametrize(("first_error", "answered", "tries"), [
    ("ClientOSError: Can not write request body", False, 2),  # the server had closed the pooled connection
    ("ServerDisconnectedError: Server disconnected", False, 2),
    ("ServerDisconnectedError: Server disconnected", True, 1),  # it answered, then dropped: a failure
    ("HTTP 503: b'busy'", True, 1),
    ("TimeoutError: ", False, 1),
])
def test_a_request_on_a_connection_the_server_closed_is_sent_once_more(monkeypatch, first_error, answered, tries):
    import asyncio

    from sluice_bench import serve

    calls = []

    async def once(client, url, model, req, args, start):
        calls.append(start)
        if len(calls) == 1:
            return serve.RequestResult(error=first_error), answered
        return serve.RequestResult(ok=True, output_tokens=3), True

    monkeypatch.setattr(serve, "_send_once", once)
    res = asyncio.run(serve.send_one(None, "u", "m", serve.BenchRequest([1], 1, 3), None, t0=0.0))
    assert len(calls) == tries and res.ok == (tries == 2)
    assert len(set(calls)) == 1  # the second try's time counts from the first

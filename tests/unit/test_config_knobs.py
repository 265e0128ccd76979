"""sluice.config: one definition per knob for every command; a value comes from the command line,
else the environment, else a --config file, else the default, and says which; bad input is one
line and exit code 2; secrets are masked and never forwarded on a command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_service.config import EngineConfig
from engine_service.service import main as engine_main
from engine_service.service.settings import ServiceSettings
from gateway import main as gateway_main
from gateway.config import GatewayConfig
from sluice.config import (
    ConfigError,
    KnobSet,
    add_arguments,
    knob,
    knobs_of,
    resolve_args,
    settings_of,
)
from sluice_cli import cli, serve

# every variable a knob of these commands reads: cleared, so that a test sets only its own
KNOB_ENV = sorted(set(serve.KNOBS.env_vars()) | set(engine_main.KNOBS.env_vars()) | set(gateway_main.KNOBS.env_vars()))


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch) -> None:
    for var in KNOB_ENV:
        monkeypatch.delenv(var, raising=False)


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    resolve_args(args)
    return args


def sources(args: argparse.Namespace) -> dict[str, str]:
    return {name: s.source.kind for name, s in settings_of(args).items()}


def write(tmp_path: Path, text: str, name: str = "sluice.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- precedence and sources ---------------------------------------------------------------

def test_flag_beats_env_beats_file_beats_default(tmp_path, monkeypatch):
    config = write(tmp_path, "max-num-seqs: 64\nblock_size: 32\ndtype: float16\nseed: 5\n")
    monkeypatch.setenv("SLUICE_DTYPE", "bfloat16")
    args = parse(engine_main, ["--config", config, "--seed", "7"])
    assert (args.seed, args.dtype, args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == \
        (7, "bfloat16", 32, 64, 2048)
    got = sources(args)
    assert (got["seed"], got["dtype"], got["block_size"], got["max_num_seqs"], got["max_num_batched_tokens"]) == \
        ("flag", "env", "file", "file", "default")
    detail = settings_of(args)
    assert str(detail["dtype"].source) == "env (SLUICE_DTYPE)" and str(detail["seed"].source) == "flag (--seed)"
    assert str(detail["block_size"].source) == f"file ({config})"
    # what the command builds from them
    cfg = engine_main.engine_config_from_args(args)
    assert (cfg.seed, cfg.dtype, cfg.block_size, cfg.max_num_seqs) == (7, "bfloat16", 32, 64)


def test_a_flag_that_repeats_the_default_still_beats_the_file(tmp_path):
    config = write(tmp_path, "block-size: 32\nenable-prefix-caching: false\n")
    args = parse(engine_main, ["--config", config, "--block-size", "16", "--enable-prefix-caching"])
    assert (args.block_size, args.enable_prefix_caching) == (16, True)
    assert sources(args)["block_size"] == sources(args)["enable_prefix_caching"] == "flag"


def test_yaml_keys_take_dashes_or_underscores_and_a_leading_double_dash(tmp_path):
    config = write(tmp_path, "max-num-seqs: 3\nmax_model_len: 100\n--kv-cache-dtype: bfloat16\n"
                             "heartbeat_ttl: 2.5\ngateway-lost-after: 0\n")
    args = parse(engine_main, ["--config", config])
    assert (args.max_num_seqs, args.max_model_len, args.kv_cache_dtype) == (3, 100, "bfloat16")
    settings = engine_main.settings_from_args(args)
    assert (settings.heartbeat_ttl_s, settings.gateway_lost_after_s) == (2.5, 0.0)  # flag names, not field names


def test_gateway_and_serve_read_the_same_file_keys(tmp_path):
    config = write(tmp_path, "max-queue-len: 9\napi-key: [k1, k2]\nresumable-streams: false\nport: 9001\n")
    gw = gateway_main.config_from_args(parse(gateway_main, ["--config", config]))
    assert (gw.max_queue_len, gw.api_keys, gw.resumable_streams, gw.port) == (9, ["k1", "k2"], False, 9001)
    args = parse(serve, ["--config", config, "--api-key", "k3"])
    assert (args.max_queue_len, args.api_keys, args.port) == (9, ["k3"], 9001)  # the flag's list replaces the file's


def test_environment_variables_of_the_knobs(monkeypatch):
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://:pw@h:1/0")
    monkeypatch.setenv("SLUICE_API_KEY", "sk-env")
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", "tok-env")
    monkeypatch.setenv("SLUICE_ENFORCE_EAGER", "0")
    gw = gateway_main.config_from_args(parse(gateway_main, []))
    assert (gw.redis_url, gw.api_keys) == ("redis://:pw@h:1/0", ["sk-env"])
    args = parse(engine_main, [])
    assert engine_main.settings_from_args(args).redis_url == "redis://:pw@h:1/0"  # the engine reads it too
    assert (args.admin_token, args.enforce_eager) == ("tok-env", False)
    # the flag still wins
    assert parse(gateway_main, ["--redis-url", "redis://x:1/0"]).redis_url == "redis://x:1/0"
    # the uvicorn workers' fallback when no SLUICE_GATEWAY_CONFIG was handed down
    monkeypatch.delenv("SLUICE_GATEWAY_CONFIG", raising=False)
    assert GatewayConfig.from_env().api_keys == ["sk-env"]


def test_serve_takes_redis_url_and_its_older_variable(monkeypatch):
    assert parse(serve, []).redis_url is None  # a private Redis
    monkeypatch.setenv("REDIS_URL", "redis://old:1/0")
    assert parse(serve, []).redis_url == "redis://old:1/0"
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://new:1/0")
    args = parse(serve, [])
    assert args.redis_url == "redis://new:1/0" and str(settings_of(args)["redis_url"].source) == "env (SLUICE_REDIS_URL)"


def test_secret_files_from_flags_and_from_the_config_file(tmp_path):
    (tmp_path / "keys").write_text("# the tenants' keys\nsk-one\n\nsk-two\n")
    (tmp_path / "token").write_text("tok-file\n")
    (tmp_path / "url").write_text("redis://:pw@h:2/0\n")
    gw = parse(gateway_main, ["--api-key-file", str(tmp_path / "keys"), "--redis-url-file", str(tmp_path / "url")])
    assert (gw.api_keys, gw.redis_url) == (["sk-one", "sk-two"], "redis://:pw@h:2/0")
    assert str(settings_of(gw)["api_keys"].source) == f"flag (--api-key-file {tmp_path / 'keys'})"
    config = write(tmp_path, "admin-token-file: token\nredis_url_file: url\n")  # relative: beside the file
    args = parse(engine_main, ["--config", config])
    assert (args.admin_token, args.redis_url) == ("tok-file", "redis://:pw@h:2/0")
    assert sources(args)["admin_token"] == "file"


# --- bad input: one line, naming the file and line, the key, the flag or the variable ---------

@pytest.mark.parametrize("text,message", [
    ("block-size: [1,\nseed: 2\n", r"sluice\.yaml:3: not valid YAML"),
    ("seed: 1\n  block-size: 2\n", r"sluice\.yaml:2: not valid YAML"),
    ("seed: 1\nmax-num-seq: 64\n", r"sluice\.yaml:2: unknown key 'max-num-seq' for sluice engine "
                                   r"\(did you mean 'max-num-seqs'\?\)"),
    ("zzz: 1\n", r"sluice\.yaml:1: unknown key 'zzz' for sluice engine$"),
    ("\n\nblock-size: big\n", r"sluice\.yaml:3: block-size: expected an integer, got 'big' \(a string\)"),
    ("enable-prefix-caching: maybe\n", r"sluice\.yaml:1: enable-prefix-caching: expected true or false"),
    ("max-queue-wait: [1]\n", r"max-queue-wait: expected a number, got \[1\] \(a list\)"),
    ("dtype: int3\n", r"sluice\.yaml:1: dtype: 'int3' is not one of auto, float32, bfloat16, float16"),
    ("queue-shards: 0\n", r"sluice\.yaml:1: queue-shards: 0 is outside \[1, 1024\]"),
    ("block-size: 8\nblock_size: 9\n", r"sluice\.yaml:2: 'block_size' repeats 'block-size' \(line 1\)"),
    ("- block-size\n", r"sluice\.yaml:1: a config file is a mapping of flag names to values"),
    ("admin-token: a\nadmin-token-file: /x\n", r"sluice\.yaml:2: give admin-token or admin-token-file, not both"),
])
def test_bad_config_files_are_refused_with_the_file_and_line(tmp_path, text, message):
    config = write(tmp_path, text)
    parser = argparse.ArgumentParser()
    engine_main.add_arguments(parser)
    with pytest.raises(ConfigError, match=message) as exc:
        resolve_args(parser.parse_args(["--config", config]))
    assert "\n" not in str(exc.value)


def test_bad_values_from_the_environment_name_the_variable(monkeypatch):
    monkeypatch.setenv("SLUICE_ENFORCE_EAGER", "perhaps")
    with pytest.raises(ConfigError, match=r"\$SLUICE_ENFORCE_EAGER \(--enforce-eager\): 'perhaps' is not true or false"):
        parse(engine_main, [])
    monkeypatch.setenv("SLUICE_ENFORCE_EAGER", "1")
    monkeypatch.setenv("SLUICE_DTYPE", "float8")
    with pytest.raises(ConfigError, match=r"\$SLUICE_DTYPE \(--dtype\): 'float8' is not one of"):
        parse(engine_main, [])


def test_secret_given_twice_or_from_a_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="give --admin-token or --admin-token-file, not both"):
        parse(engine_main, ["--admin-token", "a", "--admin-token-file", "/nonexistent"])
    with pytest.raises(ConfigError, match=r"--api-key-file /nonexistent: cannot read it: No such file"):
        parse(gateway_main, ["--api-key-file", "/nonexistent"])
    (tmp_path / "empty").write_text("\n# nothing\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        parse(gateway_main, ["--api-key-file", str(tmp_path / "empty")])


@pytest.mark.parametrize("command", ["engine", "gateway", "serve"])
def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys, command):
    config = write(tmp_path, "max-queue-lenn: 3\n" if command != "engine" else "max-num-seqz: 3\n")
    assert cli.main([command, "--config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"sluice {command}: error: {config}:1: unknown key"), err
    assert "did you mean" in err


def test_argparse_refuses_bad_flags_with_the_flag_named(capsys):
    parser = argparse.ArgumentParser()
    gateway_main.add_arguments(parser)
    for argv, flag in ((["--port", "http"], "--port"), (["--workers", "0"], "--workers"),
                       (["--log-level", "loud"], "--log-level")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


# --- sluice config --print ------------------------------------------------------------------

def test_print_shows_every_value_with_its_source_and_masks_secrets(tmp_path, capsys, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("sk-secret-one\nsk-secret-two\n")
    config = write(tmp_path, f"redis-url: redis://user:hunter2@redis:6379/0\napi-key-file: {keys}\nport: 9000\n"
                             "max-num-seqs: 8\n")
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", "tok-very-secret")
    assert cli.main(["config", "--print", "serve", "--config", config, "--port", "9100"]) == 0
    out = capsys.readouterr().out
    for secret in ("hunter2", "sk-secret-one", "sk-secret-two", "tok-very-secret"):
        assert secret not in out
    lines = {line.split(":", 1)[0]: line for line in out.splitlines() if not line.startswith("#")}
    assert "redis://user:***@redis:6379/0" in lines["redis-url"] and f"# file ({config})" in lines["redis-url"]
    assert "['***', '***']" in lines["api-key"]
    assert "# file" in lines["api-key"] and "***" in lines["admin-token"] and "# env (SLUICE_ADMIN_TOKEN)" in lines["admin-token"]
    assert lines["port"].split("#")[0].split(":", 1)[1].strip() == "9100" and "# flag (--port)" in lines["port"]
    assert "# file" in lines["max-num-seqs"] and "# default" in lines["block-size"]
    assert set(lines) == {k.flag_name for k in serve.KNOBS}  # every knob of serve, once


def test_print_defaults_to_serve_and_its_output_is_a_config_file(tmp_path, capsys):
    assert cli.main(["config", "--print", "--max-num-seqs", "12", "--no-resumable-streams"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# sluice serve:")
    again = write(tmp_path, "".join(line + "\n" for line in out.splitlines()
                                    if not line.startswith(("#", "redis-url", "admin-token", "api-key"))))
    args = parse(serve, ["--config", again])
    assert (args.max_num_seqs, args.resumable_streams) == (12, False)
    assert sources(args)["max_num_seqs"] == "file"


def test_print_refuses_bad_input_like_the_command(tmp_path, capsys):
    config = write(tmp_path, "workers: many\n")
    assert cli.main(["config", "--print", "gateway", "--config", config]) == 2
    assert "sluice gateway: error:" in capsys.readouterr().err


# --- one definition per knob ----------------------------------------------------------------

OLD_FLAGS = {  # every flag the commands took before the knobs: kept, with their defaults
    "engine": {"--redis-url": "redis://localhost:6379/0", "--grpc-port": 50051, "--grpc-host": "127.0.0.1",
               "--admin-token": None, "--metrics-port": 0, "--metrics-host": "127.0.0.1", "--engine-id": None,
               "--max-queue-wait": 0.0, "--drain-grace-s": 30.0, "--heartbeat-ttl": 5.0,
               "--gateway-lost-after": 5.0, "--queue-shards": 16, "--shard-prefix-blocks": 8,
               "--steal-after-ms": 200, "--log-level": "info"},
    "gateway": {"--redis-url": "redis://localhost:6379/0", "--host": "0.0.0.0", "--port": 8000, "--workers": 1,
                "--api-key": [], "--max-queue-len": None, "--request-timeout-s": 600.0,
                "--max-body-bytes": 4 * 1024 * 1024, "--retry-after-s": 1, "--trust-request-chat-template": False,
                "--resumable-streams": True, "--event-log-ttl-s": 600, "--responses-ttl-s": 86400.0,
                "--log-level": "info"},
    "serve": {"--host": "127.0.0.1", "--port": 8000, "--workers": 1, "--redis-url": None, "--grpc-port": 50051,
              "--api-key": [], "--metrics-port": 0, "--ready-timeout": 600.0, "--reserved-cpus": 0},
}


@pytest.mark.parametrize("command", sorted(OLD_FLAGS))
def test_existing_flags_keep_their_names_and_defaults(command):
    module = {"engine": engine_main, "gateway": gateway_main, "serve": serve}[command]
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    args = parse(module, [])
    for flag, default in OLD_FLAGS[command].items():
        assert flag in by_flag, f"sluice {command} lost {flag}"
        assert getattr(args, by_flag[flag].dest) == default, flag


def test_serve_takes_every_engine_service_and_gateway_knob_with_its_default():
    own = {k.name for k in knobs_of(serve.ServeSettings)}
    for section in (ServiceSettings, EngineConfig, GatewayConfig):
        for k in knobs_of(section):
            if not k.cli:
                continue
            assert k.name in serve.KNOBS.knobs, f"sluice serve has no {k.flag}"
            if k.name not in own:
                assert serve.KNOBS.knobs[k.name] == k, k.name  # the very same definition
    assert set(serve.KNOBS.shadowed) == own & {k.name for s in (ServiceSettings, GatewayConfig) for k in knobs_of(s)}
    assert set(serve.KNOBS.shadowed) == {"host", "redis_url"}


def test_a_knob_defined_twice_differently_is_an_error_unless_it_shadows():
    @dataclass
    class A:
        port: int = knob(1, "a's port")

    @dataclass
    class B:
        port: int = knob(2, "b's port")

    @dataclass
    class C:
        port: int = knob(3, "c's own port", shadows=True)

    with pytest.raises(TypeError, match="define the knob --port differently"):
        KnobSet("x", [A, B])
    knobs = KnobSet("x", [C, A, B])
    assert knobs.knobs["port"].default == 3 and [k.default for k in knobs.shadowed["port"]] == [1, 2]


def test_adding_a_knob_is_one_line():
    """A field made with knob() is a flag, a config key, an environment variable and a --print
    line of a command, with no other code."""

    @dataclass
    class Section:
        keys_file: str | None = knob(None, "a file of keys", env="X_KEYS_FILE")
        max_things: int = knob(4, "at most this many", bounds=(1, 10))

    knobs = KnobSet("sluice x", [Section])
    parser = argparse.ArgumentParser()
    add_arguments(parser, knobs)
    args = parser.parse_args(["--max-things", "5"])
    settings = resolve_args(args, environ={"X_KEYS_FILE": "/k"})
    assert (args.keys_file, args.max_things) == ("/k", 5)
    assert {n: str(s.source) for n, s in settings.items()} == {"keys_file": "env (X_KEYS_FILE)",
                                                                "max_things": "flag (--max-things)"}
    assert "--keys-file" in parser.format_help() and "$X_KEYS_FILE" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-things", "11"])


def test_internal_tunables_are_not_knobs():
    names = {k.name for k in knobs_of(ServiceSettings)}
    assert "reclaim_interval_s" not in names and "heartbeat_interval_s" not in names
    assert "card_ttl_s" not in {k.name for k in knobs_of(GatewayConfig)}
    # and a program still builds the dataclasses as before: no gRPC server unless asked for
    assert ServiceSettings().grpc_port == 0 and ServiceSettings().engine_id
    assert next(k for k in knobs_of(ServiceSettings) if k.name == "grpc_port").default == 50051


# --- sluice serve forwards everything, secrets in 0600 files ---------------------------------

def test_serve_forwards_knobs_and_keeps_secrets_off_the_command_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_DTYPE", "bfloat16")
    args = parse(serve, ["--api-key", "sk-abc", "--api-key", "sk-def", "--admin-token", "tok-123",
                         "--max-queue-len", "7", "--queue-shards", "4", "--max-num-seqs", "3", "--host", "0.0.0.0",
                         "--log-level", "debug", "--heartbeat-ttl", "2"])
    values = {n: s.value for n, s in settings_of(args).items()}
    secret_dir = tmp_path / "run"
    secret_dir.mkdir(mode=0o700)
    engine = serve.child_argv("engine", engine_main.KNOBS, values, str(secret_dir),
                              fixed={"redis_url": "redis://:pw@127.0.0.1:1/0"})
    gateway = serve.child_argv("gateway", gateway_main.KNOBS, values, str(secret_dir),
                               fixed={"redis_url": "redis://:pw@127.0.0.1:1/0", "host": values["host"]})
    for argv in (engine, gateway):
        assert not any(s in word for word in argv for s in ("sk-abc", "sk-def", "tok-123", ":pw@")), argv
    # the children parse back exactly what serve resolved
    e = parse(engine_main, engine)
    g = parse(gateway_main, gateway)
    assert (e.admin_token, e.redis_url, e.queue_shards, e.max_num_seqs, e.dtype, e.log_level) == \
        ("tok-123", "redis://:pw@127.0.0.1:1/0", 4, 3, "bfloat16", "debug")
    assert engine_main.settings_from_args(e).heartbeat_ttl_s == 2.0
    assert (g.api_keys, g.max_queue_len, g.host, g.redis_url, g.log_level) == \
        (["sk-abc", "sk-def"], 7, "0.0.0.0", "redis://:pw@127.0.0.1:1/0", "debug")
    assert "--max-num-seqs" not in gateway and "--max-queue-len" not in engine  # each child gets its own knobs
    for path in secret_dir.iterdir():  # only this user reads them
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # the children's environment holds no knob variable: their flags are the whole configuration
    assert "SLUICE_DTYPE" not in serve.child_env()


def test_serve_checks_its_ports_before_starting_anything(capsys):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        for flag in ("--port", "--grpc-port", "--metrics-port"):
            assert cli.main(["serve", flag, str(port), "--model", "/nonexistent"]) == 2
            err = capsys.readouterr().err
            assert f"{flag} {port}: cannot listen on 127.0.0.1:{port}: the address is already in use" in err, err
            assert "private Redis" not in err  # nothing was started


def test_gateway_refuses_a_port_in_use_naming_the_flag(capsys):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert cli.main(["gateway", "--host", "127.0.0.1", "--port", str(port),
                         "--redis-url", "redis://127.0.0.1:1/0"]) == 2


def test_engine_admin_server_does_not_share_its_port():
    """grpc's default SO_REUSEPORT let a second server bind a port another already listened on;
    the admin server turns it off, so the second is refused, naming --grpc-port."""
    from engine_service.service.admin import AdminServer
    from sluice.ports import PortInUse

    class Worker:
        on_serving_change: list = []

    first = AdminServer(Worker(), "e1", "m", 0)
    first.start()
    try:
        with pytest.raises(PortInUse, match=rf"--grpc-port {first.port}: cannot listen on 127.0.0.1:{first.port}"):
            AdminServer(Worker(), "e2", "m", first.port)
    finally:
        first.stop(grace=0)


def test_knob_dataclasses_have_help_for_every_knob():
    for section in (serve.ServeSettings, ServiceSettings, EngineConfig, GatewayConfig):
        for k in knobs_of(section):
            assert k.help.strip(), f"{section.__name__}.{k.name} has no help"
            assert dataclasses.is_dataclass(section)


def test_secret_file_permissions_of_serve(tmp_path):
    path = serve._secret_file(str(tmp_path), "x", "s3cret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and Path(path).read_text() == "s3cret\n"

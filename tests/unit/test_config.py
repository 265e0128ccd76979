"""Engine knobs are defined once (EngineConfig) and reach every entry point with the same name and default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine_service.config import (
    EngineConfig,
    SchedulerConfig,
    add_engine_arguments,
    engine_cli_args,
    engine_config_from_args,
)


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


def _entry_points():
    from engine_service.service import main as engine_main
    from sluice_cli import serve

    return {"sluice engine": engine_main, "sluice serve": serve}


@pytest.fixture(autouse=True)
def _no_knob_environment(monkeypatch) -> None:
    """tests/conftest.py sets SLUICE_DTYPE and SLUICE_ENFORCE_EAGER (knobs' variables, which a
    command applies over its defaults): these tests ask for the flags and defaults alone."""
    for var in ("SLUICE_DTYPE", "SLUICE_ENFORCE_EAGER"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("command", ["sluice engine", "sluice serve"])
def test_every_engine_knob_is_a_flag_with_the_same_default(command: str) -> None:
    parser = _parser(_entry_points()[command])
    args = parser.parse_args([])
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("cli", True):  # knob(cli=False): off the command line (stub_model)
            assert f.name not in vars(args) or command == "sluice engine", f.name
            continue
        assert hasattr(args, f.name), f"{command} has no --{f.name.replace('_', '-')}"
        assert getattr(args, f.name) == f.default, f.name
    assert engine_config_from_args(args) == EngineConfig()


def test_flags_parse_into_the_config_and_round_trip_to_the_engine() -> None:
    from engine_service.service import main as engine_main
    from sluice_cli import serve

    argv = ["--model", "/m", "--block-size", "32", "--watermark-blocks", "3", "--no-enable-prefix-caching",
            "--dtype", "bfloat16", "--kv-cache-memory", "1000", "--seed", "7"]
    cfg = engine_config_from_args(_parser(serve).parse_args(argv))
    assert cfg == EngineConfig(model="/m", block_size=32, watermark_blocks=3, enable_prefix_caching=False,
                               dtype="bfloat16", kv_cache_memory=1000, seed=7)
    # `sluice serve` forwards exactly the non-default knobs; `sluice engine` parses them back.
    forwarded = engine_cli_args(cfg)
    assert "--max-num-seqs" not in forwarded and "--no-enable-prefix-caching" in forwarded
    assert engine_config_from_args(_parser(engine_main).parse_args(forwarded)) == cfg


def test_bad_flag_values_are_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int3"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "big"])


def test_help_lists_knobs_with_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    text = parser.format_help()
    assert "--watermark-blocks" in text and "1% of the pool" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "(default: 2048)" in text


@pytest.mark.parametrize("bench", ["latency", "offline"])
def test_the_benches_take_the_engine_flags_they_pass_through_from_the_config(bench: str) -> None:
    """``sluice bench latency|offline`` generate the engine flags they pass on (BENCH_ENGINE_FLAGS)
    from EngineConfig: the same choices and defaults as ``sluice engine``, a bad value refused."""
    import importlib

    from sluice_bench.modes import BENCH_ENGINE_FLAGS

    parser = _parser(importlib.import_module(f"sluice_bench.{bench}"))
    engine = argparse.ArgumentParser()
    add_engine_arguments(engine)
    for name in BENCH_ENGINE_FLAGS:
        mine = next(a for a in parser._actions if a.dest == name)
        theirs = next(a for a in engine._actions if a.dest == name)
        assert (mine.option_strings, mine.choices, mine.default) == (theirs.option_strings, theirs.choices,
                                                                      theirs.default), name
    args = parser.parse_args(["--quantization", "int4", "--attention-backend", "torch"])
    assert (args.quantization, args.attention_backend, args.kv_cache_dtype) == ("int4", "torch", "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
    with pytest.raises(ValueError, match="not engine flags: blok_size"):
        add_engine_arguments(argparse.ArgumentParser(), only=("block_size", "blok_size"))


def test_llm_keywords_are_the_config_fields() -> None:
    cfg = EngineConfig.from_kwargs(block_size=8, enable_prefix_caching=False)
    assert cfg.block_size == 8 and cfg.enable_prefix_caching is False
    with pytest.raises(TypeError, match="unknown engine argument.*blok_size.*block_size"):
        EngineConfig.from_kwargs(blok_size=8)


def test_scheduler_defaults_are_the_engine_defaults() -> None:
    s = SchedulerConfig(num_blocks=10)
    e = EngineConfig()
    assert (s.block_size, s.max_num_seqs, s.max_num_batched_tokens, s.enable_prefix_caching) == (
        e.block_size, e.max_num_seqs, e.max_num_batched_tokens, e.enable_prefix_caching)


def test_generation_config_switch() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).generation_config == "auto"
    assert engine_config_from_args(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--generation-config", "model"])

"""The model's dialects on the card (sluice.wire.dialects): the engine's flags, detection from the
chat template, the card's fields, and an unknown name refused at start listing the known ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_service.config import EngineConfig, add_engine_arguments, engine_config_from_args
from sluice.wire import card as wire_card
from sluice.wire import dialects
from sluice.wire.card import CardError, ModelCard

QWEN3 = ("{%- if tools %}<tools>{{ tool | tojson }}</tools> <tool_call>\n{\"name\": <function-name>}</tool_call>"
         "{%- endif %}{{- '<think>\\n\\n</think>\\n\\n' if enable_thinking is false }}")
R1_DISTILL = "{{'<｜Assistant｜>' + content}}{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
MISTRAL = "{{ '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' + calls }}"
LLAMA31 = ('<|start_header_id|>ipython<|end_header_id|>{{ "Respond in the format {\\"name\\": function name, '
           '\\"parameters\\": dictionary of argument name and its value}" }}<|python_tag|>')
LLAMA32_PYTHONIC = ("<|start_header_id|>system<|end_header_id|>You should only return the function call in "
                    "the format [func_name1(params_name1=params_value1, params_name2=params_value2...)]")


@pytest.mark.model
def test_detection_from_the_chat_template(model_dir: Path):
    assert dialects.resolve(QWEN3) == ("hermes", "qwen3")
    assert dialects.resolve(R1_DISTILL) == ("hermes", "deepseek_r1")
    assert dialects.resolve(MISTRAL) == ("mistral", None)
    assert dialects.resolve(LLAMA31) == ("llama3_json", None)
    assert dialects.resolve(LLAMA32_PYTHONIC) == ("pythonic", None)
    assert dialects.resolve({"default": "plain", "tool_use": MISTRAL}) == ("mistral", None)
    smol = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert dialects.resolve(smol) == ("hermes", None)  # the default tools prompt's format; no thinking
    assert dialects.resolve(None) == ("hermes", None)
    # the flags win over detection; `none` turns reasoning off
    assert dialects.resolve(QWEN3, "pythonic", "deepseek_r1") == ("pythonic", "deepseek_r1")
    assert dialects.resolve(QWEN3, None, "none") == ("hermes", None)


def test_unknown_names_are_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'xlam'; known: hermes, llama3_json, mistral, "
                                         "pythonic"):
        dialects.resolve(None, "xlam")
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'; known: deepseek_r1, qwen3, none"):
        dialects.resolve(None, None, "granite")


def test_the_engine_flags_refuse_an_unknown_parser(capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--tool-call-parser", "mistral", "--reasoning-parser", "qwen3"])
    config = engine_config_from_args(args)
    assert (config.tool_call_parser, config.reasoning_parser) == ("mistral", "qwen3")
    assert EngineConfig().tool_call_parser is None  # default: detected from the chat template
    for flag, value in (("--tool-call-parser", "xlam"), ("--reasoning-parser", "granite")):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([flag, value])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"invalid choice: '{value}'" in err
        known = dialects.TOOL_CALL_PARSERS if flag == "--tool-call-parser" else dialects.REASONING_PARSERS
        assert all(f"'{name}'" in err for name in known), err


def _model(tmp_path: Path, model_dir: Path, template: str | None = None) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.model
def test_the_card_names_the_parsers(tmp_path: Path, model_dir: Path):
    from engine_service.service.main import model_card

    d = _model(tmp_path, model_dir, QWEN3)
    card = ModelCard.from_model_dir(d, name="q", max_model_len=64, vocab_size=49152, eos_token_ids=[2])
    assert (card.tool_call_parser, card.reasoning_parser) == ("hermes", "qwen3")
    fields = card.encode()
    assert fields[wire_card.F_TOOL_CALL_PARSER] == "hermes" and fields[wire_card.F_REASONING_PARSER] == "qwen3"
    assert ModelCard.decode(fields) == card
    # what the engine publishes follows its flags
    engine = SimpleNamespace(model_dir=d, max_model_len=64, vocab_size=49152, eos_token_ids=[2],
                             config=EngineConfig(tool_call_parser="pythonic", reasoning_parser="none"))
    flagged = model_card(engine, "q")
    assert (flagged.tool_call_parser, flagged.reasoning_parser) == ("pythonic", None)
    assert ModelCard.decode(flagged.encode()).reasoning_parser is None  # "none" stays none, not re-detected
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral, pythonic"):
        ModelCard.from_model_dir(d, name="q", max_model_len=64, vocab_size=49152, eos_token_ids=[2],
                                 tool_call_parser="xlam")
    # a card of an older engine, without the fields: what its chat template shows
    old = {k: v for k, v in fields.items() if k not in (wire_card.F_TOOL_CALL_PARSER, wire_card.F_REASONING_PARSER)}
    assert (ModelCard.decode(old).tool_call_parser, ModelCard.decode(old).reasoning_parser) == ("hermes", "qwen3")
    with pytest.raises(CardError, match="unknown tool-call parser 'xlam'"):
        ModelCard.decode({**fields, wire_card.F_TOOL_CALL_PARSER: "xlam"})

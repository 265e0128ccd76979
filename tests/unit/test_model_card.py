"""sluice.wire owns the contract: the model card codec, the enums, cancel, the lost rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.text.tokenizer import Tokenizer, read_chat_template
from sluice.wire import card as wire_card
from sluice.wire import codec, contract, policy
from sluice.wire.card import CardError, ContractMismatch, ModelCard, sampling_defaults
from sluice.wire.messages_pb2 import Cancel, ErrorCode, FinishReason


def _dir(tmp_path: Path, **files: str) -> Path:
    for name, text in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


# -- where the chat template lives ------------------------------------------------------------


def test_chat_template_precedence(tmp_path: Path) -> None:
    cfg = json.dumps({"chat_template": "from-config"})
    assert read_chat_template(_dir(tmp_path / "a", tokenizer_config_json=cfg)) is None  # wrong name: no file
    assert read_chat_template(_dir(tmp_path / "b", **{"tokenizer_config.json": cfg})) == "from-config"
    both = _dir(tmp_path / "c", **{"tokenizer_config.json": cfg, "chat_template.jinja": "from-jinja"})
    assert read_chat_template(both) == "from-jinja"  # transformers: the file wins over the config
    legacy = _dir(tmp_path / "d", **{"chat_template.json": json.dumps({"chat_template": "from-json"})})
    assert read_chat_template(legacy) == "from-json"
    named = _dir(tmp_path / "e", **{"chat_template.jinja": "default-t",
                                    "additional_chat_templates__tool_use.jinja": "tool-t"})
    assert read_chat_template(named) == {"default": "default-t", "tool_use": "tool-t"}
    listed = json.dumps({"chat_template": [{"name": "default", "template": "d"}, {"name": "rag", "template": "r"}]})
    assert read_chat_template(_dir(tmp_path / "f", **{"tokenizer_config.json": listed})) == {"default": "d", "rag": "r"}
    assert read_chat_template(_dir(tmp_path / "g", **{"tokenizer_config.json": "{}"})) is None


# -- the card codec ---------------------------------------------------------------------------


@pytest.mark.model
def test_card_round_trips_through_the_redis_hash(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_text((model_dir / name).read_text())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(template)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))

    card = ModelCard.from_model_dir(d, name="m", max_model_len=2048, vocab_size=49152, eos_token_ids=[2])
    assert card.chat_template == template
    fields = card.encode()
    assert set(fields) == {v for k, v in vars(wire_card).items() if k.startswith("F_")}
    raw = {k.encode(): v.encode() for k, v in fields.items()}  # what redis-py returns
    back = ModelCard.decode(raw)
    assert back == card
    assert back.sampling_defaults() == {"temperature": 0.6, "top_p": 0.9}
    # the decoded card's tokenizer renders what the directory's tokenizer renders
    msgs = [{"role": "user", "content": "hi"}]
    assert back.tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        Tokenizer.from_dir(d).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # the fingerprint moves with the content
    assert ModelCard(**{**card.__dict__, "max_model_len": 1024}).encode()[wire_card.F_FINGERPRINT] != \
        fields[wire_card.F_FINGERPRINT]


def test_decode_refuses_another_contract_version_and_malformed_cards() -> None:
    fields = ModelCard(name="m", max_model_len=8, vocab_size=10, eos_token_ids=[1], tokenizer_json="{}").encode()
    with pytest.raises(ContractMismatch, match=r"contract version 1, this gateway speaks version \d+.*same Sluice release"):
        ModelCard.decode({**fields, wire_card.F_CONTRACT_VERSION: "1"})
    with pytest.raises(ContractMismatch, match="version unknown"):
        ModelCard.decode({k: v for k, v in fields.items() if k != wire_card.F_CONTRACT_VERSION})
    with pytest.raises(CardError, match="malformed"):
        ModelCard.decode({**fields, wire_card.F_MAX_MODEL_LEN: "lots"})
    with pytest.raises(CardError, match="malformed"):
        ModelCard.decode({k: v for k, v in fields.items() if k != wire_card.F_TOKENIZER_JSON})


def test_card_carries_the_queue_sharding() -> None:
    card = ModelCard(name="m", max_model_len=8, vocab_size=10, eos_token_ids=[1], tokenizer_json="{}",
                     queue_shards=12, block_size=32, shard_prefix_blocks=4)
    back = ModelCard.decode(card.encode())
    assert (back.queue_shards, back.block_size, back.shard_prefix_blocks) == (12, 32, 4)
    assert ModelCard(name="m", max_model_len=8, vocab_size=10, eos_token_ids=[1],
                     tokenizer_json="{}").queue_shards == contract.DEFAULT_QUEUE_SHARDS > 1
    for bad in ("0", "-3", str(contract.MAX_QUEUE_SHARDS + 1), "many"):
        with pytest.raises(CardError, match="malformed"):
            ModelCard.decode({**card.encode(), wire_card.F_QUEUE_SHARDS: bad})


def test_sampling_defaults_from_generation_config() -> None:
    assert sampling_defaults({"temperature": 0.7, "top_k": 20.0, "top_p": True, "max_length": 5}) == {
        "temperature": 0.7, "top_k": 20}
    assert sampling_defaults({"do_sample": False, "temperature": 0.9})["temperature"] == 0.0
    assert sampling_defaults({}) == {}


# -- enums, cancel, the lost rule ------------------------------------------------------------


def test_error_codes_and_finish_reasons_are_enums_with_short_names() -> None:
    for name, value in vars(contract).items():
        if name.startswith("ERR_"):
            assert ErrorCode.Name(value).startswith("ERROR_CODE_")
            assert codec.error_code(codec.error_code_name(value)) == value
    assert codec.error_code_name(contract.ERR_DEADLINE) == "deadline_exceeded"
    assert codec.error_code("no such code") == contract.ERR_INTERNAL
    assert codec.error_code_name(999) == "unknown"
    for short in ("stop", "length", "abort"):
        assert codec.finish_reason_name(codec.finish_reason(short)) == short
    assert codec.finish_reason("length") == FinishReason.FINISH_REASON_LENGTH
    assert codec.finish_reason_name(0) is None
    with pytest.raises(ValueError, match="unknown finish reason"):
        codec.finish_reason("eos")
    ev = codec.finished_event("r", 0, "stop", stop_token_id=2)
    assert ev.WhichOneof("terminal") == "finished" and codec.is_terminal(ev)
    ev = codec.error_event("r", "context_length_exceeded", "too long")
    assert ev.WhichOneof("terminal") == "error" and ev.error.code == contract.ERR_CONTEXT_LENGTH
    assert codec.is_terminal(ev) and not codec.is_terminal(codec.Event(request_id="r", token_ids=[1]))


def test_cancel_messages_go_to_each_owner_only() -> None:
    keys, args = codec.cancel_script_call("gw", ["a", "b", "c"])
    assert keys == [k for r in ("a", "b", "c") for k in (contract.cancelled_key("gw", r), contract.owner_key("gw", r))]
    assert args == [contract.CANCEL_MARKER_TTL_S]
    messages = codec.cancel_messages(["a", "b", "c"], [b"e1", b"", "e2"])  # b: queued, nobody holds it
    assert set(messages) == {contract.cancel_channel("e1"), contract.cancel_channel("e2")}
    assert list(Cancel.FromString(messages[contract.cancel_channel("e1")]).request_ids) == ["a"]
    assert list(Cancel.FromString(messages[contract.cancel_channel("e2")]).request_ids) == ["c"]
    assert codec.cancel_messages(["a"], [b""]) == {}


def test_lost_on_delivery() -> None:
    assert policy.lost_on_delivery(emitted=False, deliveries=1, attempt=0) is None
    assert "emitted tokens" in policy.lost_on_delivery(emitted=True, deliveries=1, attempt=0)
    assert policy.lost_on_delivery(emitted=False, deliveries=contract.MAX_ATTEMPTS, attempt=0) is None
    assert "not retrying" in policy.lost_on_delivery(emitted=False, deliveries=contract.MAX_ATTEMPTS + 1, attempt=0)
    assert "not retrying" in policy.lost_on_delivery(emitted=False, deliveries=1, attempt=contract.MAX_ATTEMPTS)

"""The chat template reaches the gateway wherever the model directory keeps it.

A directory saved by a recent ``transformers`` keeps its template in ``chat_template.jinja``, not in
``tokenizer_config.json``; older processors kept ``chat_template.json``. The engine's model card
(``sluice.wire.card.ModelCard.from_model_dir``, what ``sluice engine`` publishes) must carry it, and
the gateway must render the same prompt as transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from sluice.wire import card as wire_card
from sluice.wire import contract
from sluice.wire.connection import connect
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_support import MODEL, FakeEngine

make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]

# Distinct from the model's own template, so a test can tell which one was used.
CUSTOM = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} [custom]\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2? "}]


def _model_dir(src: Path, dst: Path, where: str) -> Path:
    """A tokenizer directory whose chat template lives only in ``where``."""
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    original = config.pop("chat_template")
    if where == "jinja":
        (dst / "chat_template.jinja").write_text(CUSTOM)
    elif where == "jinja-over-config":  # both: the .jinja file wins, as in transformers
        config["chat_template"] = original
        (dst / "chat_template.jinja").write_text(CUSTOM)
    elif where == "json":
        (dst / "chat_template.json").write_text(json.dumps({"chat_template": CUSTOM}))
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture
def engine_for(redis_client, redis_url):
    engines: list[FakeEngine] = []

    def start(model_dir: Path) -> FakeEngine:
        engines.append(FakeEngine(redis_url, model_dir).start())
        return engines[-1]

    yield start
    for e in engines:
        e.stop()


def _chat(gateway) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0})


@pytest.mark.parametrize("where", ["jinja", "jinja-over-config", "json"])
def test_gateway_renders_the_template_transformers_renders(where, model_dir, tmp_path, engine_for, make_gateway):
    import transformers

    d = _model_dir(Path(model_dir), tmp_path / where, where)
    engine = engine_for(d)
    gateway = make_gateway()
    r = _chat(gateway)
    assert r.status_code == 200, r.text
    (sent,) = engine.requests

    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    # transformers' tokenizers read chat_template.jinja themselves; chat_template.json only through
    # processors, so there the template is handed over explicitly.
    explicit = {"chat_template": CUSTOM} if where == "json" else {}
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **explicit)
    assert "[custom]" in text
    assert list(sent.prompt_token_ids) == hf.encode(text, add_special_tokens=False)


def test_a_directory_without_a_template_is_a_clear_400(model_dir, tmp_path, engine_for, make_gateway):
    engine_for(_model_dir(Path(model_dir), tmp_path / "none", "none"))
    r = _chat(make_gateway())
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_gateway_refuses_an_engine_of_another_contract_version(model_dir, engine_for, make_gateway, redis_url):
    engine_for(Path(model_dir))
    gateway = make_gateway(card_ttl_s=0.0)
    assert _chat(gateway).status_code == 200
    r = connect(redis_url)
    r.hset(contract.model_card_key(MODEL), wire_card.F_CONTRACT_VERSION, str(contract.CONTRACT_VERSION - 1))
    r.close()
    resp = _chat(gateway)
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["code"] == "contract_mismatch"
    assert f"contract version {contract.CONTRACT_VERSION - 1}" in err["message"] and "same Sluice release" in err["message"]


def test_unset_sampling_fields_stay_unset_on_the_wire(model_dir, engine_for, make_gateway):
    # the engine applies the model's generation_config.json defaults to them (--generation-config auto)
    engine = engine_for(Path(model_dir))
    r = httpx.post(f"{make_gateway().url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "top_p": 0.5})
    assert r.status_code == 200, r.text
    (sent,) = engine.requests
    for name in ("temperature", "top_k", "min_p", "repetition_penalty"):
        assert not sent.params.HasField(name), name
    assert sent.params.HasField("top_p") and abs(sent.params.top_p - 0.5) < 1e-6

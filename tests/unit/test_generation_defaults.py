"""generation_config.json supplies the sampling defaults a request leaves unset (vLLM's
``--generation-config auto``); ``vllm`` ignores it. Offline here; the HTTP path leaves the fields
unset on the wire (tests/integration/test_gateway_chat_template_dirs.py) and the engine applies the
same rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_service import LLM, SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def greedy_dir(model_dir: Path, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("greedy-model")
    for f in Path(model_dir).iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 7, "eos_token_id": 2}))
    return d


def test_unset_fields_take_the_models_defaults(greedy_dir: Path) -> None:
    prompts = ["Once upon a time"]
    llm = LLM(greedy_dir, kv_cache_memory=16 << 20)
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_k": 7}

    def run(params: SamplingParams) -> list[int]:
        return llm.generate(prompts, params)[0].outputs[0].token_ids

    greedy = run(SamplingParams(temperature=0.0, max_tokens=8))
    assert run(SamplingParams(seed=3, max_tokens=8)) == greedy  # temperature left unset: the model's 0
    # explicit values win over the model's defaults
    hot = run(SamplingParams(temperature=1.0, top_k=-1, seed=3, max_tokens=8))
    assert hot != greedy
    # --generation-config vllm: the engine keeps no model defaults, so unset means vLLM's neutral ones
    llm.engine.sampling_defaults = {}
    assert run(SamplingParams(seed=3, max_tokens=8)) == hot


def test_params_remember_what_was_left_unset() -> None:
    p = SamplingParams(top_p=0.5)
    assert p.temperature == 1.0 and "temperature" in p.unset_fields and "top_p" not in p.unset_fields
    q = p.with_model_defaults({"temperature": 0.6, "top_p": 0.9, "top_k": 50})
    assert (q.temperature, q.top_p, q.top_k) == (0.6, 0.5, 50)
    assert p.with_model_defaults({}) is p
    assert q.for_child(1).unset_fields == q.unset_fields

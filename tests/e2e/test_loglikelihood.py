"""A loglikelihood request (lm-eval's and vLLM users' ``/v1/completions`` with ``echo: true``,
``logprobs: 1``, ``max_tokens: 0``) against real processes: the prompt comes back scored by the
model, without generated text."""

from __future__ import annotations

import math

import httpx
import pytest

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]


def score(stack, prompt: str) -> dict:
    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
        "model": stack.model_name, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0,
        "temperature": 0})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    return choice


def test_echo_with_max_tokens_0_scores_the_prompt(stack):
    paris, rome = score(stack, "The capital of France is Paris"), score(stack, "The capital of France is Rome")
    for choice, word in ((paris, "Paris"), (rome, "Rome")):
        lp = choice["logprobs"]
        assert choice["text"].endswith(f"France is {word}") and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["token_logprobs"][0] is None
        assert all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in lp["token_logprobs"][1:])
        assert lp["text_offset"][0] == 0
    # the same model scores the same prefix the same; the answers differ, and the model knows better
    shared = len(paris["logprobs"]["tokens"]) - 1
    assert paris["logprobs"]["token_logprobs"][1:shared] == pytest.approx(rome["logprobs"]["token_logprobs"][1:shared],
                                                                          abs=1e-4)
    assert paris["logprobs"]["token_logprobs"][-1] > rome["logprobs"]["token_logprobs"][-1]

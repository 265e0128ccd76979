"""SamplingParams validation: every out-of-range value is refused with an error naming it."""

from __future__ import annotations

import math

import pytest

from engine_service.core.sampling_params import SamplingParams


def test_defaults_are_valid_and_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert not p.greedy and p.sampling_type == "random"
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == "seeded"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"temperature": 2.5}, "temperature"),
        ({"n": 17}, "n"),
        ({"repetition_penalty": 100.5}, "repetition_penalty"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": ["x" * 4097]}, "stop"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": True}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_out_of_range_values_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"logit_bias": {0: -100, 7: 100.0}},
        {"seed": -12345},
        {"stop": "###"},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_json_shaped_inputs_are_normalised():
    p = SamplingParams(logit_bias={"42": 5.0, "7": -100}, stop="END", stop_token_ids=(3, 4))
    assert p.logit_bias == {42: 5.0, 7: -100}
    assert p.stop == ["END"]
    assert p.stop_token_ids == [3, 4]


def test_verify_checks_ids_against_the_vocabulary():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[0, 99]).verify(100)
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).verify(100)
    with pytest.raises(ValueError, match=r"^stop_token_ids"):
        SamplingParams(stop_token_ids=[5, 100]).verify(100)


def test_clone_replace_and_children():
    p = SamplingParams(n=3, seed=10, logit_bias={1: 2.0}, stop_token_ids=[5])
    c = p.clone()
    assert c == p and c.logit_bias is not p.logit_bias and c.stop_token_ids is not p.stop_token_ids
    r = p.replace(temperature=0.5)
    assert r.temperature == 0.5 and p.temperature == 1.0
    with pytest.raises(ValueError, match=r"^top_p"):
        p.replace(top_p=2.0)
    children = [p.for_child(i) for i in range(3)]
    assert [ch.seed for ch in children] == [10, 11, 12]
    assert all(ch.n == 1 for ch in children)
    assert SamplingParams(n=2).for_child(1).seed is None

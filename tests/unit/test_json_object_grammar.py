"""The bounded ``json_object`` grammar (sluice.structured.JsonObjectLimits), with llguidance and
the default model's tokenizer only (no model, no engine, no HTTP): the loops the greedy default
model fell into in JSON mode can no longer run until ``max_tokens``; the grammar closes them.
A ``json_schema`` of ``{"type": "object"}`` stays unbounded.
"""

from __future__ import annotations

import json

import llguidance
import pytest

from sluice.structured import JSON_OBJECT_LIMITS, JsonObjectLimits, compile_grammar, json_object_grammar

pytestmark = pytest.mark.model  # the tokenizer is the default model's

LIM = JSON_OBJECT_LIMITS


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def lltok(model_dir, tokenizer):
    return llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=tokenizer.get_vocab_size())


def _matcher(lltok, kind="json_object", spec=""):
    matcher = llguidance.LLMatcher(lltok, compile_grammar(kind, spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _feed(matcher, tokenizer, *pieces: str) -> None:
    """Consume ``pieces`` (each tokenized on its own, so a piece ends on a token boundary)."""
    for piece in pieces:
        tokens = tokenizer.encode(piece, add_special_tokens=False).ids
        assert matcher.consume_tokens(tokens), f"refused {piece!r}: {matcher.get_error()}"


def _allows(matcher, tokenizer, text: str) -> bool:
    tokens = tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.validate_tokens(tokens) == len(tokens)


def test_endless_array_is_closed_after_max_items(lltok, tokenizer):
    # the default model's loop on "Describe a city as a JSON object." (greedy)
    m = _matcher(lltok)
    _feed(m, tokenizer, '{"Cities": [', '{"name": "New York", "population": 8.5}')
    for _ in range(LIM.max_items - 1):
        assert _allows(m, tokenizer, ', "Las Vegas"')
        _feed(m, tokenizer, ', "Las Vegas"')
    assert not _allows(m, tokenizer, ", ")
    assert m.compute_ff_bytes() == b"]"  # only the close is left
    _feed(m, tokenizer, "]}")
    assert m.is_stopped()  # the object is complete: EOS only


def test_repeated_members_are_closed_after_max_members(lltok, tokenizer):
    # "Describe a planet ...": the same member again and again
    m = _matcher(lltok)
    member = '"habitable_conditions": "Nyx-1 is a planet in the habitable planet system."'
    _feed(m, tokenizer, '{"planet": {', member)
    for _ in range(LIM.max_members - 1):
        _feed(m, tokenizer, ", " + member)
    assert not _allows(m, tokenizer, ", ")
    assert m.compute_ff_bytes() == b"}"


def test_runaway_string_is_closed_after_max_string_chars(lltok, tokenizer):
    # "Describe a book ...": a URL that repeats a fragment of digits forever
    m = _matcher(lltok)
    _feed(m, tokenizer, '{"coverImageUrl": "')
    url = "https://www.amazon.com/dp/A.J.C.A." + "10000001000000001/" * 20
    _feed(m, tokenizer, url[:LIM.max_string_chars])
    assert not _allows(m, tokenizer, "1")
    assert m.compute_ff_bytes().startswith(b'"')
    # a member name is bounded too, and an escape counts as one character
    m = _matcher(lltok)
    _feed(m, tokenizer, '{"', "k" * LIM.max_key_chars)
    assert not _allows(m, tokenizer, "k") and m.compute_ff_bytes() == b'": '
    m = _matcher(lltok)
    _feed(m, tokenizer, '{"a": "', "\\n" * LIM.max_string_chars)
    assert m.compute_ff_bytes().startswith(b'"')


def test_nesting_and_numbers_are_bounded(lltok, tokenizer):
    m = _matcher(lltok)
    _feed(m, tokenizer, '{"a": ' * LIM.max_depth)
    assert not _allows(m, tokenizer, '{"')  # no deeper container...
    assert _allows(m, tokenizer, "{}") and _allows(m, tokenizer, "[]")  # ...but empty ones
    m = _matcher(lltok)
    _feed(m, tokenizer, '{"n": ', "9" * LIM.max_int_digits)
    assert not _allows(m, tokenizer, "9")
    _feed(m, tokenizer, ".5e10}")
    assert m.is_stopped()


def test_everything_within_the_limits_is_accepted(lltok, tokenizer):
    doc = {"name": "Bacon and Honey", "n": -12.5e3, "ok": True, "none": None, "empty": {}, "list": [],
           "ingredients": ["bread", "bacon", {"nested": [1, 2, {"deep": "x"}]}],
           "quote": 'say "hi"\n\u00e9'}
    m = _matcher(lltok)
    _feed(m, tokenizer, json.dumps(doc, ensure_ascii=False))  # llguidance refuses \u escapes of printables
    assert m.is_stopped() and not m.is_error()


def test_json_schema_any_object_keeps_its_meaning(lltok, tokenizer):
    m = _matcher(lltok, "json", '{"type": "object"}')
    _feed(m, tokenizer, '{"a": [' + ", ".join(["1"] * (LIM.max_items + 4)))
    assert _allows(m, tokenizer, ", 1")  # a schema the user wrote is not bounded by JSON mode's limits


def test_limits_shape_the_grammar():
    small = json_object_grammar(JsonObjectLimits(max_depth=2, max_members=3, max_items=2))
    assert "{0,2}" in small and "{0,1}" in small and "object2" not in small
    with pytest.raises(ValueError):
        json_object_grammar(JsonObjectLimits(max_items=0))
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", small)) == ""

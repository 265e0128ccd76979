"""``sluice.text.chars_per_token``: the bound holds on the default model's tokenizer over adversarial
texts (a text of C characters is never fewer than C / L tokens), and every tokenizer feature that
could break it makes the bound refuse (None) — each shown to break it for real where it can be."""

from __future__ import annotations

import copy
import json
import math
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from sluice.text import chars_per_token
from sluice.text.chars_per_token import max_chars_per_token
from sluice.text.tokenizer import Tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def spec(model_dir) -> dict:
    return json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _holds(tok: Tokenizer, text: str, bound: int) -> None:
    for add_special in (False, True):
        n = len(tok.encode(text, add_special_tokens=add_special))
        assert n >= math.ceil(len(text) / bound), (n, len(text), text[:80])


def test_the_default_tokenizer_has_a_bound_from_its_longest_token(tok, spec) -> None:
    bound = tok.max_chars_per_token
    longest = max(len(t) for t in spec["model"]["vocab"])
    assert bound == max_chars_per_token(spec) == longest  # SmolLM2: byte-level BPE, no normalizer
    assert bound == 81  # "\n" and 80 spaces


def test_the_bound_holds_on_adversarial_texts(tok) -> None:
    bound = tok.max_chars_per_token
    texts = [
        *(" " * n for n in (1, 2, 15, 16, 79, 80, 81, 82, 500, 4096)),
        *("\n" + " " * n for n in (79, 80, 81, 200)),
        "\t" * 3000, "\n" * 3000, "\r\n" * 1000, (" " * 80 + "\n") * 50, ("\n" + " " * 80) * 50,
        "-" * 5000, "=" * 5000, "#" * 5000, "*" * 5000, "_" * 5000, "/" * 5000, "." * 5000,
        "<|im_start|>" * 300, "<|im_end|>" * 300, "<|endoftext|>" * 300, "<|im_start|>user\n" * 200,
        "0123456789" * 300, "a" * 5000, "ab" * 2500, "the " * 2000, "".join(chr(0x4E00 + i) for i in range(3000)),
        "🙂" * 2000, "👨‍👩‍👧‍👦" * 300, "e\u0301" * 2000, "\u1100\u1161\u11a8" * 1000, "\x00\x01\x7f" * 1000,
        "\ufeff" * 2000, "\u200b" * 2000,
    ]
    for text in texts:
        _holds(tok, text, bound)


def test_the_bound_holds_on_every_vocabulary_token_repeated(tok) -> None:
    """Each token's own text, three times over: the texts most likely to come out as few tokens."""
    bound = tok.max_chars_per_token
    for tid in range(tok.vocab_size):
        piece = tok.decode([tid])
        if piece:
            text = piece * 3
            assert len(tok.encode(text, add_special_tokens=False)) >= math.ceil(len(text) / bound), (tid, piece)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from([" ", "\n", "\t", "-", "a", "e", "\u0301", "0", "<|im_start|>", "你", "🙂",
                                 "the", " " * 40, "\n" + " " * 60]), max_size=400).map("".join)
       | st.text(max_size=2000))
def test_the_bound_holds_on_random_texts(tok, text) -> None:
    _holds(tok, text, tok.max_chars_per_token)


def test_the_composition_factors_are_unicode_s_longest_decompositions() -> None:
    longest = {form: max(len(unicodedata.normalize(form, chr(c))) for c in range(sys.maxunicode + 1)
                         if not 0xD800 <= c <= 0xDFFF) for form in ("NFD", "NFKD")}
    assert longest == {"NFD": chars_per_token.NFD_MAX_EXPANSION, "NFKD": chars_per_token.NFKD_MAX_EXPANSION}
    # and the tokenizer library composes as Unicode says: NFC folds at most 4 characters into one
    # (reached by an alpha with three marks), NFKC within its 18
    alpha = "\u03b1\u0313\u0300\u0345"
    assert len(normalizers.NFC().normalize_str(alpha * 100)) * chars_per_token.NFD_MAX_EXPANSION == len(alpha) * 100
    for text in (alpha, "\u1100\u1161\u11a8", "e\u0301", "\u017f\u0307", "\ufdfa", "\u3300"):
        for form, factor in ((normalizers.NFC(), chars_per_token.NFD_MAX_EXPANSION),
                             (normalizers.NFKC(), chars_per_token.NFKD_MAX_EXPANSION)):
            assert len(form.normalize_str(text * 100)) * factor >= len(text) * 100, text


def _with(spec: dict, **changes) -> dict:
    out = copy.deepcopy(spec)
    for path, value in changes.items():
        node = out
        *parents, last = path.split("__")
        for key in parents:
            node = node[key]
        node[last] = value
    return out


def _count(spec: dict, text: str) -> int:
    return len(HFTokenizer.from_str(json.dumps(spec)).encode(text, add_special_tokens=False).ids)


def test_what_can_delete_or_fuse_text_makes_the_bound_refuse_and_really_would_break_it(spec) -> None:
    bound = max_chars_per_token(spec)
    spaces = " " * 1000
    breaking = {
        # the pre-tokenizer drops whitespace: a text of spaces is no token at all
        "Whitespace pre-tokenizer": (_with(spec, pre_tokenizer={"type": "Whitespace"}), spaces),
        "Split removing": (_with(spec, pre_tokenizer={"type": "Split", "pattern": {"String": " "},
                                                      "behavior": "Removed", "invert": False}), spaces),
        # the normalizer strips it
        "Strip normalizer": (_with(spec, normalizer={"type": "Strip", "strip_left": True, "strip_right": True}), spaces),
        "regex Replace": (_with(spec, normalizer={"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}), spaces),
        # an added token that swallows the whitespace after it
        "rstrip added token": (_with(spec, added_tokens=[{**spec["added_tokens"][1], "rstrip": True},
                                                         *spec["added_tokens"][2:]]), "<|im_start|>" + spaces),
        # truncation keeps the first tokens only
        "truncation": (_with(spec, truncation={"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                                               "stride": 0}), "word " * 200),
    }
    for name, (changed, text) in breaking.items():
        assert max_chars_per_token(changed) is None, name
        assert _count(changed, text) < math.ceil(len(text) / bound), name  # the bound would have been wrong


def test_other_unproven_tokenizers_have_no_bound(spec) -> None:
    wordpiece = {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                 "max_input_chars_per_word": 100, "vocab": {"[UNK]": 0, "a": 1}}
    no_alphabet = {**spec["model"], "vocab": {k: v for k, v in spec["model"]["vocab"].items() if k != "Ġ"}}
    for changed in (
        _with(spec, model=wordpiece),  # a word it does not know, however long, is one [UNK]
        _with(spec, model={**no_alphabet, "unk_token": None}),  # a byte it lacks would vanish
        _with(spec, model={**no_alphabet, "fuse_unk": True}),  # a run of them would be one token
        _with(spec, normalizer={"type": "StripAccents"}),
        _with(spec, normalizer={"type": "Precompiled", "precompiled_charsmap": ""}),
        _with(spec, normalizer={"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip"}]}),
        _with(spec, pre_tokenizer={"type": "WhitespaceSplit"}),
        _with(spec, pre_tokenizer={"type": "BertPreTokenizer"}),
        _with(spec, pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "CharDelimiterSplit",
                                                                            "delimiter": " "}]}),
    ):
        assert max_chars_per_token(changed) is None


def test_normalizers_that_only_shrink_so_far_scale_the_bound(spec) -> None:
    base = max_chars_per_token(spec)
    assert max_chars_per_token(_with(spec, normalizer={"type": "NFC"})) == 4 * base
    assert max_chars_per_token(_with(spec, normalizer={"type": "NFKC"})) == 18 * base
    assert max_chars_per_token(_with(spec, normalizer={
        "type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                                            {"type": "Lowercase"}, {"type": "NFD"}]})) == base
    halving = {"type": "Replace", "pattern": {"String": "  "}, "content": " "}
    assert max_chars_per_token(_with(spec, normalizer=halving)) == 2 * base
    # a byte-fallback (SentencePiece-like) BPE without byte-level: the <0xNN> tokens complete its alphabet
    sp = _with(spec, pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                                    "split": False})
    sp["model"] = {**sp["model"], "unk_token": None, "byte_fallback": True,
                   "vocab": {**sp["model"]["vocab"], **{f"<0x{b:02X}>": 60000 + b for b in range(256)}}}
    assert max_chars_per_token(sp) == base
    del sp["model"]["vocab"]["<0x41>"]
    assert max_chars_per_token(sp) is None


@given(st.integers(0, 10**7), st.integers(1, 200), st.integers(1, 10**5), st.integers(0, 10**5),
       st.one_of(st.none(), st.integers(1, 10**5)))
def test_the_context_rule_before_tokenizing_refuses_only_what_tokenizing_would(chars, per_token, context, extra,
                                                                                 max_tokens) -> None:
    """Whatever the text's real token count (at least chars / per_token), refused by the length alone
    means refused once tokenized, whatever max_tokens; not refused means it may still fit."""
    from sluice.wire import limits

    at_least = -(-chars // per_token)
    early = limits.check_context_chars(chars, per_token, context)
    if early is not None:
        assert early.code == "context_length_exceeded" and early.param == "prompt"
        assert limits.check_context(at_least + extra, max_tokens, context) is not None
    else:
        assert limits.check_context(at_least, None, context) is None
    assert limits.check_context_chars(chars, None, context) is None  # no bound known: nothing refused early


def test_the_live_tokenizer_gives_what_its_tokenizer_json_gives(spec) -> None:
    """``spec_of`` (what ``Tokenizer.max_chars_per_token`` reads, from the loaded object) agrees with
    the file on the default tokenizer and on variants of it."""
    from sluice.text.chars_per_token import spec_of

    variants = [spec, _with(spec, normalizer={"type": "NFC"}), _with(spec, pre_tokenizer={"type": "Whitespace"}),
                _with(spec, normalizer={"type": "Strip", "strip_left": True, "strip_right": True}),
                _with(spec, added_tokens=[{**spec["added_tokens"][1], "rstrip": True}, *spec["added_tokens"][2:]]),
                _with(spec, model={**spec["model"], "fuse_unk": True}),
                _with(spec, truncation={"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0})]
    for variant in variants:
        live = HFTokenizer.from_str(json.dumps(variant))
        assert max_chars_per_token(spec_of(live)) == max_chars_per_token(variant)

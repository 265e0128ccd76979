"""A proven bound on how many characters one token of a tokenizer can cover, read off its
``tokenizer.json``: a text of C characters encodes to at least ``ceil(C / L)`` tokens. The gateway
uses it to refuse a prompt that cannot fit the model's context before tokenizing it.

Why ``L`` holds (for the tokenizers :func:`max_chars_per_token` accepts; for any other it answers
None and nothing is refused early):

1. The **normalizer** cannot shrink the text by more than a known factor ``f``: ``Prepend``, ``NFD``,
   ``NFKD``, ``Lowercase`` and a ``ByteLevel`` normalizer map every character to one or more
   (``f = 1``); a ``Replace`` of a string of ``a`` characters by one of ``b >= 1`` shrinks it at most
   ``a / b`` times. ``NFC`` and ``NFKC`` compose: since ``NFD(NFC(s)) = NFD(s)`` and no character
   decomposes into more than 4 (``NFD``) or 18 (``NFKD``) characters, ``len(NFC(s)) >= len(NFD(s)) / 4
   >= len(s) / 4`` (18 for ``NFKC``). A sequence multiplies its factors. Anything that can delete
   text (``Strip``, ``StripAccents``, ``BertNormalizer``'s control-character cleaning,
   ``Precompiled``, a regex ``Replace``) is not accepted.
2. The **pre-tokenizer** splits the normalized text without dropping any of it: ``ByteLevel``,
   ``Metaspace``, ``Digits``, ``UnicodeScripts``, and ``Split`` / ``Punctuation`` unless their
   behaviour is ``removed`` (or the split is inverted). ``Whitespace``, ``WhitespaceSplit``,
   ``BertPreTokenizer`` and ``CharDelimiterSplit`` drop characters and are not accepted. Under
   ``ByteLevel`` the units the model sees are the text's UTF-8 bytes, at least one per character.
3. The **model** is a ``BPE`` that covers every unit with some token: each token's string in the
   vocabulary spells the units it covers (bytes under ``ByteLevel``, where every vocabulary
   character stands for one byte; characters otherwise, a ``continuing_subword_prefix`` or
   ``end_of_word_suffix`` only making the string longer), so no token covers more units than its
   string is long. A unit the vocabulary lacks must not vanish or merge with its neighbours: the
   byte alphabet is complete (``ByteLevel``, or the 256 ``<0xNN>`` tokens of ``byte_fallback``), or
   an unknown unit becomes its own ``unk_token`` (``fuse_unk`` false).
4. **Added tokens** are matched in the text first; each covers its own content. One with
   ``lstrip`` / ``rstrip`` also swallows the whitespace around it (any amount), so a tokenizer with
   one is not accepted. No ``truncation`` may be configured (it drops tokens).

So a text of ``C`` characters has at least ``C / f`` normalized characters, at least that many
units, and each token covers at most ``V`` of them, ``V`` the longest vocabulary string or added
token: ``tokens >= C / (f * V)``, and ``L = ceil(f * V)``. Special tokens a post-processor adds only
add to the count. ``tests/unit/test_chars_per_token.py`` checks the bound on the default model's
tokenizer over adversarial texts, and the refusals.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

# The most characters one character decomposes into (UAX #15; checked against Python's
# ``unicodedata`` by the unit test): what composition (NFC, NFKC) can fold back into one.
NFD_MAX_EXPANSION = 4
NFKD_MAX_EXPANSION = 18

_KEEPS_LENGTH = frozenset({"Prepend", "NFD", "NFKD", "Lowercase", "ByteLevel"})
_COMPOSES = {"NFC": NFD_MAX_EXPANSION, "NFKC": NFKD_MAX_EXPANSION}
_SPLITS_ONLY = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


def _shrink_factor(normalizer: Mapping[str, Any] | None) -> float | None:
    """How many times the normalizer can shrink a text at most (None: it may delete text)."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in normalizer.get("normalizers") or []:
            f = _shrink_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _KEEPS_LENGTH:
        return 1.0
    if kind in _COMPOSES:
        return float(_COMPOSES[kind])
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        if set(pattern) != {"String"} or not isinstance(content, str) or not content:
            return None
        return max(1.0, len(pattern["String"]) / len(content))
    return None


def _splits_without_dropping(pre: Mapping[str, Any] | None) -> tuple[bool, bool]:
    """(the pre-tokenizer drops nothing, it is byte-level)."""
    if pre is None:
        return True, False
    kind = pre.get("type")
    if kind == "Sequence":
        byte_level = False
        for part in pre.get("pretokenizers") or []:
            ok, bl = _splits_without_dropping(part)
            if not ok:
                return False, False
            byte_level = byte_level or bl
        return True, byte_level
    if kind in _SPLITS_ONLY:
        return True, kind == "ByteLevel"
    if kind in ("Split", "Punctuation"):
        behavior = str(pre.get("behavior", "Isolated")).lower()
        return behavior != "removed" and not pre.get("invert", False), False
    return False, False


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte → character map: the 256 characters a byte-level vocabulary spells bytes with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def max_chars_per_token(spec: Mapping[str, Any]) -> int | None:
    """``L`` for the tokenizer whose ``tokenizer.json`` is ``spec`` (parsed): no token of it covers
    more than ``L`` characters of the text given to ``encode``, so ``C`` characters are at least
    ``ceil(C / L)`` tokens. None when the tokenizer is not one the module doc proves it for."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation"):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    splits_ok, byte_level = _splits_without_dropping(spec.get("pre_tokenizer"))
    if factor is None or not splits_ok:
        return None
    added = [t for t in spec.get("added_tokens") or [] if isinstance(t, Mapping)]
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    vocab = model.get("vocab")
    if not isinstance(vocab, Mapping) or not vocab:
        return None
    if byte_level:
        complete = all(ch in vocab for ch in _byte_level_alphabet())
    elif model.get("byte_fallback"):
        complete = all(f"<0x{b:02X}>" in vocab for b in range(256))
    else:
        complete = False
    if not complete and (model.get("unk_token") is None or model.get("fuse_unk")):
        return None  # an unknown unit would vanish, or a run of them become one token
    longest = max(len(token) for token in vocab)
    longest = max([longest, *(len(str(t.get("content", ""))) for t in added)])
    return max(1, math.ceil(factor * longest))


def spec_of(tokenizer: Any) -> dict[str, Any]:
    """The parts of a ``tokenizers.Tokenizer``'s ``tokenizer.json`` that :func:`max_chars_per_token`
    reads, taken from the live object (a tenth of the time of serializing and parsing the whole
    file, whose merges the bound does not need)."""
    model = tokenizer.model
    spec_model: dict[str, Any] = {"type": type(model).__name__, "vocab": tokenizer.get_vocab(with_added_tokens=False)}
    for name in ("unk_token", "fuse_unk", "byte_fallback"):
        spec_model[name] = getattr(model, name, None)

    def part(component: Any) -> Any:
        return None if component is None else json.loads(component.__getstate__())

    added = [{"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip}
             for t in tokenizer.get_added_tokens_decoder().values()]
    return {"model": spec_model, "normalizer": part(tokenizer.normalizer), "pre_tokenizer": part(tokenizer.pre_tokenizer),
            "added_tokens": added, "truncation": tokenizer.truncation}

"""Incremental detokenization: text deltas from a growing list of token ids.

Decoding one token at a time breaks on two things: byte-level tokenizers split a multi-byte UTF-8
character (an emoji, a CJK character) across tokens, so a lone token decodes to U+FFFD; and
SentencePiece-style tokenizers decide a token's leading space from its left neighbour. The scheme
here is vLLM's (after TGI): keep two offsets into the ids,

- ``prefix_offset``: start of a short window of already emitted tokens, decoded for context;
- ``read_offset``: end of what has been emitted,

and on each new token decode ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``. The
difference is the new text, emitted only when it is not empty and does not end in U+FFFD (an
unfinished character); otherwise the token waits for the next one. :meth:`flush` emits whatever is
left at the end, so the concatenated deltas equal ``decode(ids)`` of the whole output (a
trailing replacement character included, when the model really stopped mid-character).

No torch: the gateway and the offline ``LLM`` share this. The tokenizer is anything with
``decode(ids, skip_special_tokens=...)`` (``sluice.text.tokenizer.Tokenizer`` or a raw
``tokenizers.Tokenizer``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# How many already emitted tokens are decoded again for context (vLLM uses 5).
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns token ids, fed one or a few at a time, into text deltas that never split a character.

    ``prompt_ids`` (optional) give left context so that the first output token decodes as it would
    after the prompt (leading spaces of SentencePiece tokenizers); they are never emitted.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids: list[int] = context
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._text_parts: list[str] = []

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text_parts)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one token; return the new text it completes ("" while a character is unfinished)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ids)
            self._text_parts.append(delta)
            return delta
        return ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Emit the text of tokens still held back (the output ended mid-character)."""
        if self.read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        if delta:
            self._text_parts.append(delta)
        return delta


# --- the bytes of one token, for logprobs ------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """The raw bytes a vocabulary token stands for.

    Handles byte-level BPE tokens (GPT-2 alphabet, e.g. ``Ġhello``), SentencePiece byte-fallback
    tokens (``<0xE2>``) and SentencePiece word pieces (``▁hello``).
    """
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    if token and all(c in _BYTE_DECODER for c in token):
        return bytes(_BYTE_DECODER[c] for c in token)
    return token.replace("\u2581", " ").encode("utf-8")


def token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A single token's display text and bytes, as logprobs report them.

    The text is the token decoded alone; when that is not valid UTF-8 on its own (part of a
    character) it is written as ``bytes:\\xNN...`` the way OpenAI's API does.
    """
    try:
        raw = tokenizer.convert_ids_to_tokens([int(token_id)])
        tok = raw[0] if isinstance(raw, list) else raw
    except Exception:  # noqa: BLE001 - a tokenizer without the method
        tok = None
    text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
    if tok is None:
        data = text.encode("utf-8")
    else:
        data = token_bytes(tok)
        try:
            decoded = data.decode("utf-8")
        except UnicodeDecodeError:
            decoded = None
        if decoded is not None and decoded != text and REPLACEMENT_CHAR not in text:
            # e.g. a special token or a normalizer that rewrites text: trust decode
            data = text.encode("utf-8")
    if REPLACEMENT_CHAR in text:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    return text, data

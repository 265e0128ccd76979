"""Incremental detokenizer and stop-string matcher (sluice.text)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from sluice.text.detokenizer import IncrementalDetokenizer, _bytes_to_unicode, token_bytes, token_text
from sluice.text.stop import StopMatcher

TEXTS = [
    "Hello world!",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧 in one go",
    "中文字符与日本語のテキスト，한국어도",
    "mixed: ünïcödé ß → ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "   leading and trailing spaces   ",
]


class Wrapped:
    """A raw ``tokenizers.Tokenizer`` behind the decode(ids, skip_special_tokens=...) interface."""

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tok.id_to_token(i) for i in ids]


def byte_level_tokenizer() -> Wrapped:
    """GPT-2 style byte-level BPE with no merges: every byte is its own token (worst case splits)."""
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Wrapped(tok)


def byte_fallback_tokenizer() -> Wrapped:
    """SentencePiece/Llama style: ``▁`` word marks, a few pieces, and <0xNN> byte fallback."""
    pieces = ["<unk>", "▁", "▁Hello", "▁world", "!"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += list("abcdefghijklmnopqrstuvwxyz")
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Wrapped(tok)


def stream(tok, ids, prompt_ids=None, chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.add_many(ids[i : i + chunk]))
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode_and_never_splits(make, text):
    tok = make()
    ids = tok.encode(text)
    for chunk in (1, 2, 3):
        deltas = stream(tok, ids, chunk=chunk)
        assert "".join(deltas) == tok.decode(ids)
        assert all("\ufffd" not in d for d in deltas), deltas
    if any(ord(c) > 127 for c in text):
        # multi-byte characters span several tokens here: some token emitted nothing
        assert "" in stream(tok, ids)[:-1]


def test_truncated_output_flushes_replacement_at_the_end_only():
    tok = byte_level_tokenizer()
    ids = tok.encode("ok 🙂")[:-2]  # the emoji cut mid-character, as when max_tokens hits
    deltas = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def test_prompt_context_is_not_emitted():
    tok = byte_fallback_tokenizer()
    prompt = tok.encode("Hello")
    out = tok.encode("Hello world!")[len(prompt) :]
    detok = IncrementalDetokenizer(tok, prompt)
    text = detok.add_many(out) + detok.flush()
    assert text == " world!"
    assert detok.output_ids == out


def test_random_unicode_roundtrip():
    rng = random.Random(0)
    tok = byte_level_tokenizer()
    alphabet = "aé中🙂 ∑𝔘\n"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        deltas = stream(tok, ids, chunk=rng.randint(1, 4))
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.model
def test_smollm2_tokenizer(model_dir):
    from sluice.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    held_back = False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in deltas)
        held_back = held_back or "" in deltas[:-1]
    assert held_back, "expected some character split across SmolLM2 tokens"
    # logprob token texts: a partial character is reported as bytes
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    parts = [token_text(tok, i) for i in ids]
    assert b"".join(b for _, b in parts) == "🙂".encode()
    assert all(t.startswith("bytes:") for t, _ in parts)


def test_token_bytes_forms():
    assert token_bytes("Ġhello") == b" hello"
    assert token_bytes("<0xE2>") == b"\xe2"
    assert token_bytes("▁hello") == b" hello"


# --- stop strings ------------------------------------------------------------------------------


def feed_all(matcher: StopMatcher, deltas: list[str]) -> tuple[str, str | None]:
    out = []
    for d in deltas:
        res = matcher.feed(d)
        out.append(res.text)
        if res.stopped:
            return "".join(out), res.stop
    out.append(matcher.flush())
    return "".join(out), None


def test_stop_across_deltas_is_not_emitted():
    m = StopMatcher(["STOP"])
    emitted = []
    for d in ["Hello S", "T", "O", "P and more"]:
        emitted.append(m.feed(d))
    assert [r.text for r in emitted] == ["Hello ", "", "", ""]
    assert emitted[-1].stop == "STOP"
    assert m.feed("later").text == ""


def test_held_prefix_released_when_not_a_stop():
    m = StopMatcher(["STOP"])
    assert m.feed("a ST").text == "a "
    assert m.feed("x").text == "STx"
    assert m.feed("S").text == ""
    assert m.flush() == "S"


def test_multiple_stops_earliest_wins():
    text, stop = feed_all(StopMatcher(["world", "lo w"]), ["Hel", "lo wor", "ld"])
    assert (text, stop) == ("Hel", "lo w")
    text, stop = feed_all(StopMatcher(["\n\n", "###"]), ["a\n", "b##", "#c\n\n"])
    assert (text, stop) == ("a\nb", "###")


def test_include_stop_str_in_output():
    text, stop = feed_all(StopMatcher(["</s>"], include_stop_str_in_output=True), ["x<", "/s", "> tail"])
    assert (text, stop) == ("x</s>", "</s>")


def test_no_stops_passthrough_and_multibyte():
    m = StopMatcher(None)
    assert not m
    assert m.feed("abc").text == "abc"
    text, stop = feed_all(StopMatcher(["你好"]), ["Hello 你", "好 world"])
    assert (text, stop) == ("Hello ", "你好")


def test_stop_with_detokenizer_across_tokens():
    tok = byte_level_tokenizer()
    ids = tok.encode("say 你好 now")
    detok, m = IncrementalDetokenizer(tok), StopMatcher(["好 n"])
    out = []
    for t in ids:
        res = m.feed(detok.add(t))
        out.append(res.text)
        if res.stopped:
            break
    assert "".join(out) == "say 你"

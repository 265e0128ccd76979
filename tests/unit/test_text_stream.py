"""sluice.text.stream.TextStream: detokenize + stop strings, the component gateway and offline API share."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.text.stream import TextStream
from sluice.text.tokenizer import Tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_whole_text_without_stops(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world! ünïcödé 🙂 the end", add_special_tokens=False)
    s = TextStream(tok, [])
    pieces = [s.add(t).text for t in ids]
    pieces.append(s.finish().text)
    assert "".join(pieces) == s.text == tok.decode(ids) and not s.stopped


def test_stop_string_across_tokens_is_held_then_cut(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    s = TextStream(tok, [], stop=["three"])
    out = []
    for t in ids:
        res = s.add(t)
        out.append(res.text)
        if res.stopped:
            break
    assert s.stop == "three" and "".join(out) == s.text == "one two "
    inc = TextStream(tok, [], stop=["three"], include_stop_str_in_output=True)
    inc.add_many(ids)
    assert inc.text == "one two three"


def test_finish_releases_a_held_prefix(tok: Tokenizer) -> None:
    ids = tok.encode("see you at thr", add_special_tokens=False)
    s = TextStream(tok, [], stop=["three"])
    held = s.add_many(ids)
    assert not held.stopped and not s.text.endswith("thr")  # "thr" may start the stop string
    assert not s.finish().stopped and s.text == "see you at thr"

"""``sluice.text.tokenizer``: ids identical to transformers' tokenizer, from the GGUF and from our directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.text.tokenizer import Tokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159 and 1,000,000 is a million.",
    "phone: +1 (555) 012-3456, 007, 0.5e-10, x²",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\tmore\ttabs\n\n\nthree newlines\r\nwindows line",
    "     \n   \n\t  ",
    "Ünïcödé: naïve café, Straße, ĳ, Ωμέγα, кириллица",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 🙂👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ZWJ",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); } // C code",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><repo_name>x<file_sep>y",
    "<|im_start|><|im_start|> <|im_end|>  <|im_end|>\n",
    "I'm sure they'll say it's John's, we've seen you're right, I'd",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "",
    "a",
    " ",
    "🙂",
    "x" * 300 + " " + "ab" * 100,
]




@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers_from_gguf_and_from_dir(ours, hf_dir, hf_gguf, add_special_tokens) -> None:
    for text in TEXTS:
        mine = ours.encode(text, add_special_tokens=add_special_tokens)
        assert mine == hf_gguf.encode(text, add_special_tokens=add_special_tokens), text
        assert mine == hf_dir.encode(text, add_special_tokens=add_special_tokens), text


def test_digits_are_split_one_by_one(ours) -> None:
    ids = ours.encode("12345")
    assert ours.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    assert ours.decode(ids) == "12345"


def test_no_bos_is_added_and_special_tokens_are_single_ids(ours) -> None:
    assert ours.encode("hi")[0] != ours.bos_token_id
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_end|>") == [2]
    assert ours.encode("<|endoftext|>") == [0]


def test_decode_round_trips(ours, hf_gguf) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == hf_gguf.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == hf_gguf.decode(ids, skip_special_tokens=True)
    assert ours.decode([1, 4093, 198, 6004, 2], skip_special_tokens=True) == "user\nhi"


def test_convert_ids_to_tokens_matches(ours, hf_gguf) -> None:
    ids = ours.encode("Hello 世界 🙂 <|im_end|>")
    assert ours.convert_ids_to_tokens(ids) == hf_gguf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"


def test_special_tokens_and_sizes(ours, hf_gguf, hf_dir) -> None:
    assert ours.vocab_size == len(hf_gguf) == 49152
    assert ours.bos_token == "<|im_start|>" and ours.bos_token_id == 1
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.eos_token_ids == [2]
    assert ours.special_ids == frozenset(range(17))
    # (transformers' GGUF tokenizer lists only bos/eos/unk here; from our directory it lists all 17)
    assert set(ours.all_special_ids) == set(hf_dir.all_special_ids)
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


def test_from_strings_equals_from_dir(model_dir: Path, ours) -> None:
    tok = Tokenizer.from_strings(
        (model_dir / "tokenizer.json").read_text(), (model_dir / "tokenizer_config.json").read_text()
    )
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text)
    assert tok.eos_token_ids == [2]
    assert tok.chat_template == ours.chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == ours.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )


def test_eos_ids_merge_generation_config(model_dir: Path) -> None:
    tok = Tokenizer.from_strings(
        (model_dir / "tokenizer.json").read_text(),
        (model_dir / "tokenizer_config.json").read_text(),
        json.dumps({"eos_token_id": [2, 0]}),
    )
    assert tok.eos_token_ids == [2, 0]


def test_add_bos_token_config_is_honoured(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    tok = Tokenizer.from_strings((model_dir / "tokenizer.json").read_text(), json.dumps(cfg))
    assert tok.encode("hi")[0] == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.encode("<|im_start|>hi")[:2] == [1, tok.encode("hi", add_special_tokens=False)[0]]


def test_gateway_side_import_has_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, sluice.text.tokenizer, sluice.text.chat_template; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

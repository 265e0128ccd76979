"""``sluice.text.chat_template``: the rendered prompt is identical to transformers' ``apply_chat_template``."""

from __future__ import annotations

import pytest

from sluice.text.chat_template import ChatTemplateError, compile_chat_template, render_chat_template

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Say hello."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to 3.\nThen stop."},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "  spaces  \n\n"},
        {"role": "assistant", "content": "ok"},
    ],
    [
        {"role": "user", "content": "中文 🙂 <b>html</b> & \"quotes\""},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "def f():\n    return 1"},
        {"role": "assistant", "content": "That returns 1."},
    ],
    [{"role": "assistant", "content": "I speak first."}],
]




@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_matches_transformers(ours, hf_dir, hf_gguf, conv, add_generation_prompt) -> None:
    messages = CONVERSATIONS[conv]
    mine = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    for ref in (hf_gguf, hf_dir):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert mine == expected
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    ref_ids = hf_gguf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == list(ref_ids)


@pytest.mark.model
def test_default_system_prompt(ours) -> None:
    prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_system = ours.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert "SmolLM" not in with_system
    assert with_system.startswith("<|im_start|>system\nS<|im_end|>\n")
    assert not ours.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    ).endswith("assistant\n")


@pytest.mark.model
def test_continue_final_message_matches_transformers(ours, hf_gguf) -> None:
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My answer is"}]
    mine = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    ref = hf_gguf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert mine == ref
    assert mine.endswith("<|im_start|>assistant\nMy answer is")


def test_hf_environment_features() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}:{{ m['content'] }}\n"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{{ tools | tojson }}|{{ extra }}|{{ {'a': '<é>'} | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}"
        "{% generation %}|gen{% endgeneration %}"
    )
    out = render_chat_template(
        template,
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        tools=[{"name": "f"}],
        special_tokens={"bos_token": "<s>"},
        extra=42,
    )
    assert out == '<s>USER:a\nASSISTANT:b\n[{"name": "f"}]|42|{"a": "<é>"}|4|2|gen'


def test_trim_and_lstrip_blocks() -> None:
    template = "{% for m in messages %}\n    {% if true %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "x\n"


def test_raise_exception_gives_value_error() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="Conversation must start with user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])


def test_syntax_error_and_bad_messages_give_value_error() -> None:
    with pytest.raises(ValueError, match="syntax error"):
        render_chat_template("{% for m in messages %}", [])
    with pytest.raises(ValueError):
        render_chat_template("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        render_chat_template("{{ x }}", ["not a dict"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template("", [])


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(ValueError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ValueError):
        render_chat_template("{{ messages.append(1) }}", [])  # immutable sandbox


def test_template_is_compiled_once() -> None:
    compile_chat_template.cache_clear()
    template = "{{ messages | length }}"
    for _ in range(3):
        render_chat_template(template, [{"role": "user", "content": "x"}])
    info = compile_chat_template.cache_info()
    assert info.misses == 1 and info.hits == 2


def test_caller_messages_are_not_modified() -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    snapshot = [dict(m) for m in messages]
    render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", messages,
                         add_generation_prompt=False, continue_final_message=True)
    assert messages == snapshot

"""Reasoning parsers (gateway.reasoning): ``<think>…</think>`` → ``reasoning_content``, whole and
split at every position, alone and in front of tool calls; and the constraint that applies to
the answer only, checked with llguidance against the default model's tokenizer."""

from __future__ import annotations

import pytest

from gateway import reasoning, tool_parsers, tools
from gateway.chat_output import ChatOutputStream, Dialects, parse_chat_output
from sluice.structured import StructuredOutputsParams
from sluice.wire import dialects

THINKING_PROMPT = "<|im_start|>assistant\n<think>\n"  # a template that opened the reasoning
PLAIN_PROMPT = "<|im_start|>assistant\n"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _stream(parser: str, prompt: str, spec=None) -> ChatOutputStream:
    return ChatOutputStream(Dialects(tool_parsers.get("hermes"), reasoning.get(parser)), spec, prompt)


def check(parser: str, prompt: str, text: str, want_reasoning, want_content, spec=None, calls=()):
    out = parse_chat_output(_stream(parser, prompt, spec), text)
    got_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in out.tool_calls]
    assert (out.reasoning_content, out.content, got_calls) == (want_reasoning, want_content, list(calls))
    pieces_list = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) or [""]]
    for pieces in pieces_list:
        stream = _stream(parser, prompt, spec)
        r = c = ""
        deltas = []
        for i, piece in enumerate(pieces):
            got = stream.feed(piece)
            if i == len(pieces) - 1:
                got += stream.finish()
            r, c, deltas = r + got.reasoning, c + got.content, deltas + got.tool_calls
        merged = [(d["function"]["name"], d["function"]["arguments"]) for d in tools.merge_tool_deltas(deltas)]
        assert (r if stream.thought else None, c or (None if (merged or stream.thought) else c), merged) == \
            (want_reasoning, want_content, list(calls)), pieces


def test_the_registry_holds_the_names_the_engine_accepts():
    assert set(reasoning.PARSERS) == set(dialects.REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert reasoning.get(None) is None
    with pytest.raises(KeyError, match="known: deepseek_r1, qwen3"):
        reasoning.get("granite")


def test_deepseek_r1_reasons_from_the_start():
    check("deepseek_r1", THINKING_PROMPT, "Okay, 2+2.\n</think>\n\nThe answer is 4.", "Okay, 2+2.\n",
          "The answer is 4.")
    check("deepseek_r1", PLAIN_PROMPT, "<think>\nHmm</think>Yes", "\nHmm", "Yes")  # a repeated tag dropped
    check("deepseek_r1", PLAIN_PROMPT, "still thinking </thi", "still thinking </thi", None)  # cut by length
    check("deepseek_r1", PLAIN_PROMPT, "<th", "<th", None)
    check("deepseek_r1", PLAIN_PROMPT, "a < b </think>", "a < b ", None)


def test_qwen3_reasons_only_when_the_output_or_the_prompt_opens_the_tag():
    check("qwen3", PLAIN_PROMPT, "<think>\nhm\n</think>\n\nHi there", "\nhm\n", "Hi there")
    check("qwen3", PLAIN_PROMPT, "Hi there, <think> is a tag", None, "Hi there, <think> is a tag")
    check("qwen3", PLAIN_PROMPT, " \n<thin", None, " \n<thin")
    check("qwen3", THINKING_PROMPT, "x</think>y", "x", "y")
    # enable_thinking false: the template closed an empty block itself, the answer is content
    check("qwen3", PLAIN_PROMPT + "<think>\n\n</think>\n\n", "Paris.", None, "Paris.")


def _reasoning_tokens(parser: str, prompt: str, pieces: list[str]) -> int:
    """The parser's count over tokens that spell ``pieces`` (token i is pieces[i])."""
    ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]
    return reasoning.get(parser).reasoning_tokens(prompt, "".join(pieces), ends)


def test_reasoning_tokens_count_up_to_the_token_that_ends_the_reasoning():
    # the end tag split over three tokens: the count takes the one that completes it
    answered = ["Okay", ", 2+2", ".\n", "</", "think", ">", "\n\n", "The answer", " is 4."]
    assert _reasoning_tokens("deepseek_r1", THINKING_PROMPT, answered) == 6
    assert _reasoning_tokens("deepseek_r1", PLAIN_PROMPT, ["<think>", "\nHmm", "</think>Yes"]) == 3
    # cut by length inside the reasoning: every token is reasoning
    assert _reasoning_tokens("deepseek_r1", PLAIN_PROMPT, ["still", " thinking", " </thi"]) == 3
    assert _reasoning_tokens("qwen3", PLAIN_PROMPT, ["<th", "ink>", "\nhm\n", "</think>", "\n\n", "Hi"]) == 4
    # no reasoning: none, whatever the text holds
    assert _reasoning_tokens("qwen3", PLAIN_PROMPT, ["Hi there", ", <think>", " is a tag", "</think>"]) == 0
    assert _reasoning_tokens("qwen3", PLAIN_PROMPT + "<think>\n\n</think>\n\n", ["Paris", "."]) == 0
    assert _reasoning_tokens("qwen3", THINKING_PROMPT, ["x", "</think>", "y"]) == 2
    assert _reasoning_tokens("qwen3", THINKING_PROMPT, []) == 0  # nothing said, nothing counted
    # a token whose text the stream held back (a partial character, a stop-string candidate) and
    # released with the next one: the end tag is credited to the token that released it
    assert _reasoning_tokens("deepseek_r1", THINKING_PROMPT, ["a", "", "</think>b", "c"]) == 3


def test_reasoning_in_front_of_tool_calls():
    auto = tools.parse_tools([WEATHER], "auto", None)
    check("qwen3", PLAIN_PROMPT, '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", '
          '"arguments": {"city": "Oslo"}}</tool_call>', "I need the weather.", None, auto,
          [("get_weather", '{"city": "Oslo"}')])
    # a <tool_call> inside the reasoning is reasoning, not a call
    check("qwen3", PLAIN_PROMPT, '<think>maybe <tool_call>{"name": "x"}</tool_call>?</think>No.',
          'maybe <tool_call>{"name": "x"}</tool_call>?', "No.", auto)
    named = tools.parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    check("deepseek_r1", THINKING_PROMPT, 'Oslo it is.</think>\n{"city": "Oslo"}', "Oslo it is.", None, named,
          [("get_weather", '{"city": "Oslo"}')])


@pytest.fixture(scope="module")
def matcher_for(model_dir):
    import llguidance
    from tokenizers import Tokenizer

    text = (model_dir / "tokenizer.json").read_text()
    hf = Tokenizer.from_str(text)
    tok = llguidance.LLTokenizer(text, n_vocab=49152, eos_token=[2])

    def accepts(params: StructuredOutputsParams, output: str) -> bool:
        m = llguidance.LLMatcher(tok, params.to_grammar(), log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(hf.encode(output, add_special_tokens=False).ids) and m.is_accepting()

    return accepts


CONSTRAINTS = [
    (StructuredOutputsParams(json={"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"], "additionalProperties": False}),
     '{"city": "Oslo"}', '{"town": "Oslo"}'),
    (StructuredOutputsParams(json_object=True), '{"a": [1, 2]}', "[1, 2]"),
    (StructuredOutputsParams(regex=r"[0-9]{3}/[a-z]+"), "123/abc", "12/abc"),
    (StructuredOutputsParams(choice=["yes", "no }"]), "no }", "maybe"),
    (StructuredOutputsParams(grammar='root ::= "A" | "B" "}"'), "B}", "C"),  # GBNF
    (StructuredOutputsParams(grammar='start: item+\nitem: "x" | "y"'), "xyx", "xz"),  # Lark
]


@pytest.mark.model
@pytest.mark.parametrize("params, good, bad", CONSTRAINTS, ids=[c[0].kind for c in CONSTRAINTS])
def test_a_constraint_applies_to_the_answer_not_the_reasoning(matcher_for, params, good, bad):
    r1 = reasoning.get("deepseek_r1").answer_constraint(params, THINKING_PROMPT)
    assert r1.kind == "grammar"
    thought = "Let me think: {not JSON} [nor] <b>this</b>\n"
    assert matcher_for(r1, f"{thought}</think>\n\n{good}")
    assert matcher_for(r1, f"<think>{thought}</think>{good}")
    assert not matcher_for(r1, f"{thought}</think>\n\n{bad}")
    assert not matcher_for(r1, good)  # the reasoning is not optional when the prompt opened it
    assert matcher_for(params, good) and not matcher_for(params, bad)  # the original is unchanged
    q = reasoning.get("qwen3").answer_constraint(params, PLAIN_PROMPT)
    assert matcher_for(q, good)  # the model may answer without thinking
    assert matcher_for(q, f"<think>{thought}</think>\n{good}")
    assert not matcher_for(q, f"{thought}</think>{good}")  # reasoning must open with the tag
    assert not matcher_for(q, f"<think>{thought}</think>{bad}")


@pytest.mark.model
def test_the_forced_tool_schema_applies_after_the_reasoning(matcher_for):
    named = tools.parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    wrapped = reasoning.get("qwen3").answer_constraint(tools.tool_constraint(named), THINKING_PROMPT)
    assert matcher_for(wrapped, 'Oslo.</think>\n{"city": "Oslo"}')
    assert not matcher_for(wrapped, 'Oslo.</think>\n{"city": 3}')

"""Reasoning in ``<think>…</think>``: split out of the text as ``reasoning_content`` (vLLM's
field), streamed or not (the non-streamed answer is the stream fed the whole text), and kept out
of an output constraint's way.

A parser says whether the output starts inside the reasoning (:meth:`ThinkParser.thinks_from_start`,
given the rendered prompt: a template that ends the generation prompt with ``<think>`` has opened
it already). Otherwise the reasoning is there only when the output begins with ``<think>``.
Text up to ``</think>`` is reasoning (a repeated opening tag dropped); after it, the leading
whitespace is dropped and the rest is the answer. Reasoning cut by ``max_tokens`` has no answer.
"""

from __future__ import annotations

import json
from typing import ClassVar

from gateway.tool_parsers.base import partial_suffix
from sluice.structured import StructuredOutputsParams

START, END = "<think>", "</think>"


class ReasoningStream:
    """One choice's text → (reasoning, content) pieces as it arrives."""

    def __init__(self, thinks_from_start: bool) -> None:
        # opening: in the reasoning, an opening tag may still come; maybe: reasoning only if the
        # output begins with the tag; reasoning; gap: the whitespace after </think>; answer
        self.state = "opening" if thinks_from_start else "maybe"
        self.buffer = ""
        self.thought = False  # the output had reasoning

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        while self.buffer:
            if self.state in ("opening", "maybe"):
                head = self.buffer.lstrip()
                if head.startswith(START):
                    self.buffer, self.state, self.thought = head[len(START):], "reasoning", True
                elif START.startswith(head):
                    break  # undecided
                elif self.state == "opening":
                    self.state, self.thought = "reasoning", True
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                pos = self.buffer.find(END)
                if pos >= 0:
                    reasoning += self.buffer[:pos]
                    self.buffer, self.state = self.buffer[pos + len(END):], "gap"
                    continue
                keep = partial_suffix(self.buffer, END)
                reasoning += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            elif self.state == "gap":
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "answer"
            else:
                content, self.buffer = content + self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "opening":  # only whitespace or part of the tag came
            self.thought = True
            return rest, ""
        if self.state == "reasoning":
            return rest, ""
        if self.state == "gap":
            return "", ""
        return "", rest


class ThinkParser:
    name: ClassVar[str]

    def thinks_from_start(self, prompt: str) -> bool:
        """Whether the output starts inside the reasoning, given the rendered prompt."""
        return prompt.rstrip().endswith(START)

    def stream(self, prompt: str) -> ReasoningStream:
        return ReasoningStream(self.thinks_from_start(prompt))

    def reasoning_tokens(self, prompt: str, text: str, ends: list[int]) -> int:
        """How many of an output's tokens its reasoning took (OpenAI's ``reasoning_tokens``): up
        to and including the one whose text completes ``</think>``; all of them when the
        reasoning never ended (cut by ``max_tokens``); none when the output had no reasoning.
        ``text`` is the output the client saw, ``ends[i]`` the length of its part through token i."""
        # Why the text and not the token ids: decoding the output's heads again, once a probe,
        # cost ~90 ms a 30k-token choice on the event loop; a slice of the text costs a parse.

        def ended(k: int) -> bool:  # the reasoning had ended within the first k tokens
            stream = self.stream(prompt)
            stream.feed(text[:ends[k - 1]] if k else "")
            return stream.state in ("gap", "answer") and stream.thought

        stream = self.stream(prompt)
        stream.feed(text)
        stream.finish()
        if not stream.thought:
            return 0
        n = len(ends)
        if not ended(n):
            return n
        lo, hi = 1, n  # ended(k) is monotone in k: the smallest k for which it holds
        while lo < hi:
            mid = (lo + hi) // 2
            if ended(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def split(self, prompt: str, text: str) -> tuple[str | None, str]:
        """(reasoning or None when the output had none, answer) of a finished text."""
        stream = self.stream(prompt)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2 if stream.thought else None), c1 + c2

    def answer_constraint(self, params: StructuredOutputsParams, prompt: str) -> StructuredOutputsParams:
        """``params`` applied to the answer only: a Lark grammar (llguidance's) of free reasoning
        up to ``</think>``, whitespace, then the original constraint nested whole."""
        if self.thinks_from_start(prompt):
            start = "start: think_body GAP answer"
        else:  # the model may answer without thinking; if it thinks, it opens with the tag
            start = f"start: ({json.dumps(START)} think_body GAP)? answer"
        return StructuredOutputsParams(grammar="\n".join([
            "%llguidance {}",
            start,
            f"think_body[lazy]: THINK_TEXT {json.dumps(END)}",
            r"THINK_TEXT: /(.|\n)*/",
            r"GAP: /[ \t\r\n]*/",
            "answer: " + _nested(params.to_grammar()),
        ]) + "\n")


def _nested(grammar: str) -> str:
    """A compiled constraint (``sluice.structured.compile_grammar``'s output: Lark text, or
    llguidance's JSON with one grammar) as one Lark expression: ``%json {...}`` or ``%lark {...}``."""
    if grammar.lstrip().startswith("{"):
        (inner,) = json.loads(grammar)["grammars"]
        if inner.get("json_schema") is not None:
            return "%json " + json.dumps(inner["json_schema"])
        grammar = inner["lark_grammar"]
    return "%lark {\n" + grammar + "\n}"

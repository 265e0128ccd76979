"""Tool calling and structured outputs at the gateway (torch-free), one concern a module:

* ``spec``: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` validated into a ``ToolSpec``;
* ``constraint``: ``response_format`` / ``structured_outputs`` and forced tool choices as the
  ``StructuredOutputsParams`` decoding follows, checked to compile;
* ``render``: tools and tool history into the chat template, in the model's dialect;
* ``stream``: a completion's text → content and ``tool_calls``, streamed or not, through the
  model's tool-call parser (``gateway.tool_parsers``).
"""

from gateway.tools.constraint import constraint_for, tool_constraint
from gateway.tools.render import render_messages, template_tools
from gateway.tools.spec import ToolSpec, parse_tools
from gateway.tools.stream import ToolStream, merge_tool_deltas

__all__ = ["ToolSpec", "ToolStream", "constraint_for", "merge_tool_deltas", "parse_tools",
           "render_messages", "template_tools", "tool_constraint"]

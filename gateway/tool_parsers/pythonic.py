"""``pythonic``: the whole output is a Python list of calls with keyword arguments,
``[get_weather(city="Paris"), add(a=1, b=2)]`` (Llama 3.2 / 4, vLLM's ``PythonicToolParser``),
optionally between Llama 4's ``<|python_start|>`` and ``<|python_end|>``. Read with ``ast``, never
evaluated: argument values must be literals."""

from __future__ import annotations

import ast
import json

from gateway.tool_parsers.base import ParsedCall, ToolParser, loads, scan_at_start

START, END = "<|python_start|>", "<|python_end|>"
_NAMES = {"true": True, "false": False, "null": None}  # JSON spellings models use in Python calls


def _literal(node: ast.AST):
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


def _name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        inner = _name(func.value)
        return None if inner is None else f"{inner}.{func.attr}"
    return None


class PythonicParser(ToolParser):
    name = "pythonic"
    instructions = (
        "You can call functions. The available functions, as JSON schemas:\n{tools}\n"
        "To call functions, answer with only a Python list of calls with keyword arguments, and "
        "nothing else: [func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)]"
    )

    def scan(self, text: str, at_start: bool) -> tuple[int, int | None]:
        return scan_at_start(text, at_start, (START, "["))

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        text = region.strip()
        if text.startswith(START):
            text = text[len(START):]
        if text.rstrip().endswith(END):
            text = text.rstrip()[:-len(END)]
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            name = _name(node.func) if isinstance(node, ast.Call) else None
            if name is None or node.args or any(k.arg is None for k in node.keywords):
                return None
            try:
                arguments = {k.arg: _literal(k.value) for k in node.keywords}
                text_args = json.dumps(arguments, ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError):
                return None
            calls.append(ParsedCall(name, text_args))
        return calls

    def format_call(self, call: ParsedCall) -> str:
        return self.format_calls([call])

    def format_calls(self, calls: list[ParsedCall]) -> str:
        def one(c: ParsedCall) -> str:
            try:
                args = loads(c.arguments)
            except ValueError:
                args = {}
            items = args.items() if isinstance(args, dict) else []
            return f"{c.name}(" + ", ".join(f"{k}={v!r}" for k, v in items) + ")"

        return "[" + ", ".join(one(c) for c in calls) + "]"

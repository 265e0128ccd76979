"""``sluice.wire.limits.Depth`` (the request nesting bound, ``NESTING``): levels counted from the
value, the path of the first value too deep, and no recursion whatever the depth."""

from __future__ import annotations

from sluice.wire import limits


def lists(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_levels_are_counted_from_the_value():
    bound = limits.Depth("p", 3)
    assert bound.problem("text") is None and bound.problem(7) is None
    assert bound.problem({}) is None and bound.problem({"a": {"b": [1, 2]}}) is None  # 3 levels
    where, message = bound.problem({"a": {"b": [[1]]}})
    assert where == "p.a.b[0]" and message == "p.a.b[0] nests objects and arrays more than 3 levels deep; " \
                                              "at most 3 are allowed"


def test_the_path_names_the_parameter_and_its_first_steps():
    where, message = limits.Depth("p", 2).problem([{"x": 1}, {"deep": {"er": {"est": []}}}], "tools")
    assert where == "tools[1].deep" and message.startswith("tools[1].deep nests")
    where, message = limits.Depth("p", 4).problem({"a": {"b": {"c": {"d": {"e": {}}}}}}, "q")
    assert where == "q.a.b.c" and message.startswith("q.a.b.c... nests")


def test_no_recursion_at_any_depth():
    assert limits.NESTING.problem(lists(limits.NESTING.max_levels)) is None
    where, _ = limits.NESTING.problem(lists(100_000), "x")  # far past the interpreter's recursion limit
    assert where == "x[0][0][0]"

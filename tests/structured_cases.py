"""Fifty varied JSON-schema prompts for the structured-output tests (offline and HTTP).

Each schema is built to finish within a small ``max_tokens``: strings have a ``maxLength``,
arrays a ``maxItems``, numbers bounds, so a valid document always fits the budget; between them
they cover nested objects, arrays (of scalars and of objects), enums, required and optional
fields, booleans and bounded integers and numbers.
"""

from __future__ import annotations

MAX_TOKENS = 96

_SUBJECTS = ["a cat", "a city", "a book", "a car", "a planet", "a song", "a recipe", "a tree", "a river",
             "a teacher"]


def _name(max_len: int = 12) -> dict:
    return {"type": "string", "maxLength": max_len}


def _schemas() -> list[dict]:
    enum = {"type": "string", "enum": ["small", "medium", "large"]}
    color = {"enum": ["red", "green", "blue", "black"]}
    shapes = [
        # 0: flat, required, bounded integer
        {"type": "object", "properties": {"name": _name(), "age": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["name", "age"], "additionalProperties": False},
        # 1: enum + boolean
        {"type": "object", "properties": {"size": enum, "alive": {"type": "boolean"}},
         "required": ["size", "alive"], "additionalProperties": False},
        # 2: nested object
        {"type": "object", "properties": {
            "title": _name(),
            "location": {"type": "object", "properties": {"city": _name(10), "floor": {
                "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "floor"],
                "additionalProperties": False}},
         "required": ["title", "location"], "additionalProperties": False},
        # 3: array of enums
        {"type": "object", "properties": {"colors": {"type": "array", "items": color, "minItems": 1, "maxItems": 3}},
         "required": ["colors"], "additionalProperties": False},
        # 4: bounded number
        {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                                          "label": _name(8)},
         "required": ["score", "label"], "additionalProperties": False},
        # 5: array of objects
        {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50},
                                             "tag": color}, "required": ["id", "tag"],
            "additionalProperties": False}}},
         "required": ["items"], "additionalProperties": False},
        # 6: optional field next to required ones
        {"type": "object", "properties": {"name": _name(), "nickname": _name(8),
                                          "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
         "required": ["name", "rating"], "additionalProperties": False},
        # 7: two levels of nesting with an enum inside
        {"type": "object", "properties": {"meta": {"type": "object", "properties": {
            "kind": enum, "owner": {"type": "object", "properties": {"name": _name(10)}, "required": ["name"],
                                    "additionalProperties": False}}, "required": ["kind", "owner"],
            "additionalProperties": False}},
         "required": ["meta"], "additionalProperties": False},
        # 8: array of bounded integers + boolean
        {"type": "object", "properties": {"values": {"type": "array", "items": {
            "type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4}, "ok": {"type": "boolean"}},
         "required": ["values", "ok"], "additionalProperties": False},
        # 9: exclusive bounds, string enum, required subset
        {"type": "object", "properties": {"temperature": {"type": "number", "exclusiveMinimum": -50,
                                                          "exclusiveMaximum": 60},
                                          "unit": {"type": "string", "enum": ["C", "F"]}, "note": _name(10)},
         "required": ["temperature", "unit"], "additionalProperties": False},
    ]
    return shapes


def cases(count: int = 50) -> list[tuple[str, dict]]:
    """``count`` (prompt, schema) pairs: 10 schema shapes × 10 subjects, taken in a stride so the
    first 50 cover every shape five times with different subjects."""
    shapes = _schemas()
    out = []
    for i in range(count):
        schema = shapes[i % len(shapes)]
        subject = _SUBJECTS[(i // len(shapes) + 3 * i) % len(_SUBJECTS)]
        out.append((f"Describe {subject} as a JSON object.", schema))
    return out

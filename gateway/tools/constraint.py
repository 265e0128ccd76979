"""The request's output constraint: ``response_format`` (text / json_object / json_schema) and
vLLM's ``structured_outputs`` become one ``StructuredOutputsParams``, checked to compile (a 400
naming the parameter otherwise) before anything is queued; a forced ``tool_choice`` becomes the
JSON schema its calls follow."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway import errors
from sluice.structured import StructuredOutputError, StructuredOutputsParams

if TYPE_CHECKING:
    from gateway.tools.spec import ToolSpec


def invalid_value(message: str, param: str) -> errors.OpenAIError:
    return errors.invalid(message, param=param, code="invalid_value")


def checked(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """``params`` once its grammar compiles; a 400 naming ``param`` otherwise."""
    try:
        params.to_grammar()
    except StructuredOutputError as exc:
        raise invalid_value(str(exc).replace(f"structured_outputs.{params.kind}", param, 1)
                            if param != "structured_outputs" else str(exc), param) from None
    return params


def constraint_for(response_format: Any, structured_outputs: Any) -> StructuredOutputsParams | None:
    """The request's output constraint, or None. Raises a 400 naming the parameter."""
    if response_format is not None and structured_outputs is not None:
        if not (isinstance(response_format, dict) and response_format.get("type") == "text"):
            raise invalid_value("Give either 'response_format' or 'structured_outputs', not both.",
                                "response_format")
    if structured_outputs is not None:
        try:
            params = StructuredOutputsParams.from_dict(structured_outputs)
        except StructuredOutputError as exc:
            raise invalid_value(str(exc), "structured_outputs") from None
        return checked(params, f"structured_outputs.{params.kind}")
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise invalid_value("'response_format' must be an object with a 'type'.", "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid_value("'response_format.json_schema' is required for type 'json_schema'.",
                                "response_format.json_schema")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name-only json_schema: any object
        if not isinstance(schema, dict):
            raise invalid_value("'response_format.json_schema.schema' must be a JSON schema object.",
                                "response_format.json_schema.schema")
        return checked(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
    raise invalid_value(f"Unsupported 'response_format' type {kind!r}; supported: 'text', 'json_object', "
                        "'json_schema'.", "response_format.type")


def tool_constraint(spec: ToolSpec) -> StructuredOutputsParams:
    """The JSON schema decoding follows for ``required`` (an array of calls, at most one without
    ``parallel_tool_calls``) or a named function (its parameters: the output is the arguments)."""
    if spec.choice == "named":
        return StructuredOutputsParams(json=spec.by_name[spec.named]["parameters"])
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "arguments": fn["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, fn in spec.by_name.items()]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not spec.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)

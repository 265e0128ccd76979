"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error answer is built by :func:`error` from ``sluice.wire.error_codes``: the code decides the
HTTP status, the OpenAI ``type``, whether ``Retry-After`` is sent and the default message; the
helpers below only fill in the message and the parameter.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.wire import limits
from sluice.wire.card import CardError, ContractMismatch
from sluice.wire.error_codes import TABLE, Code


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error(code: Code | str, message: str | None = None, *, param: str | None = None,
          retry_after_s: int = 1) -> OpenAIError:
    """The answer for ``code`` (``sluice.wire.error_codes.TABLE``), with ``message`` or the code's
    default; a retryable code carries ``Retry-After: retry_after_s``."""
    code = Code(code)
    spec = TABLE[code]
    headers = {"Retry-After": str(retry_after_s)} if spec.retryable else None
    return OpenAIError(spec.status, message or spec.message, type=spec.type, param=param, code=code.value,
                       headers=headers)


def invalid(message: str, param: str | None = None, code: Code | str = Code.INVALID_VALUE) -> OpenAIError:
    """A 400: ``param`` names the offending parameter."""
    return error(code, message, param=param)


def from_problem(problem: limits.Problem) -> OpenAIError:
    """A request the limits refuse (``sluice.wire.limits``): the table's message, naming the field."""
    if problem.code is Code.INVALID_REQUEST:
        message = f"Invalid value for '{problem.param}': {problem.message}." if problem.param else problem.message
        return invalid(message, param=problem.param)
    return error(problem.code, problem.message, param=problem.param)


def model_not_found(model: str) -> OpenAIError:
    return error(Code.MODEL_NOT_FOUND, f"The model `{model}` does not exist or you do not have access to it.",
                 param="model")


def no_engine(model: str | None = None, retry_after_s: int = 1) -> OpenAIError:
    message = f"No engine serving model `{model}` is alive; try again later." if model else "No engine is alive."
    return error(Code.NO_ENGINE, message, retry_after_s=retry_after_s)


def queue_full(model: str, retry_after_s: int) -> OpenAIError:
    return error(Code.QUEUE_FULL, f"The queue for model `{model}` is full; retry after {retry_after_s} s.",
                 retry_after_s=retry_after_s)


def redis_down(exc: Exception | None = None, retry_after_s: int = 1) -> OpenAIError:
    message = (f"The queue (Redis) is unavailable: {type(exc).__name__}" if exc is not None
               else "Redis is not answering.")
    return error(Code.REDIS_UNAVAILABLE, message, retry_after_s=retry_after_s)


def engine_lost(model: str, retry_after_s: int = 1) -> OpenAIError:
    return error(Code.ENGINE_LOST, f"The engine serving model `{model}` was lost.", retry_after_s=retry_after_s)


def deadline_exceeded() -> OpenAIError:
    return error(Code.DEADLINE_EXCEEDED)


def unauthorized() -> OpenAIError:
    return error(Code.INVALID_API_KEY)


def body_too_large(limit: int) -> OpenAIError:
    return error(Code.REQUEST_TOO_LARGE, f"The request body exceeds the limit of {limit} bytes.")


def gateway_busy(retry_after_s: int) -> OpenAIError:
    """A large request refused because the prepare pool holds as many as it takes (``gateway.prepare_pool``)."""
    return error(Code.GATEWAY_BUSY, f"The gateway is preparing as many large requests as it takes at once; retry "
                 f"after {retry_after_s} s.", retry_after_s=retry_after_s)


def invalid_json() -> OpenAIError:
    return invalid(
        "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP "
        "library correctly. The OpenAI API expects a JSON payload.)",
        code=Code.INVALID_JSON,
    )


def body_too_deep() -> OpenAIError:
    """JSON nested deeper than Python's parser recurses (RecursionError): a 400, never a 500."""
    return invalid("We could not parse the JSON body of your request: its arrays and objects are nested too "
                   "deeply.", code=Code.INVALID_JSON)


def from_engine(code: int, message: str, retry_after_s: int = 1) -> OpenAIError:
    """An engine's ``Error`` event (the proto ``ErrorCode``)."""
    c = Code.from_wire(code)
    return error(c, message or c.value, retry_after_s=retry_after_s)


def from_card_error(model: str, exc: CardError) -> OpenAIError:
    """A model card this gateway cannot use: written by an engine of another contract version
    (``contract_mismatch``), or malformed (``bad_model_card``)."""
    if isinstance(exc, ContractMismatch):
        return error(Code.CONTRACT_MISMATCH, str(exc))
    return error(Code.BAD_MODEL_CARD, f"The model card of `{model}` cannot be read: {exc}")


# A validation error's context key naming the parameter more precisely than its location (a path
# inside the field: gateway.protocol.check_nesting).
PARAM_CTX = "sluice_param"


def _param_of(loc: tuple | list) -> str | None:
    if loc and loc[0] in ("body", "query", "path"):  # where FastAPI found it, not part of the name
        loc = loc[1:]
    parts = [str(p) for p in loc]
    # drop pydantic's union-branch tags (e.g. "str", "list[int]", "function-after[...]")
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float", "list")]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


# pydantic's type errors (strict validation, see protocol.py) -> what the field expects
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "string_type": "a string", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object"}


def json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, int):
        return "an integer"
    if isinstance(x, float):
        return "a number"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, list):
        return "an array"
    return "an object"


def validation_error(errors: list[Any]) -> OpenAIError:
    """The 400 for pydantic's (or FastAPI's) validation errors of a request: the first one, its
    parameter named."""
    if not errors:
        return invalid("Invalid request.")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return invalid_json()
    param = (err.get("ctx") or {}).get(PARAM_CTX) or _param_of(err.get("loc", ()))
    if err.get("type") == "missing" and param:
        msg = f"Missing required parameter: '{param}'."
        code = Code.MISSING_REQUIRED_PARAMETER
    elif param is None and err.get("type") in ("model_attributes_type", "dict_type"):
        msg = "The request body must be a JSON object."
        code = Code.INVALID_JSON
    elif param and err.get("type") == "extra_forbidden":  # OpenAI's answer to a parameter it does not know
        msg = f"Unknown parameter: '{param}'."
        code = Code.UNKNOWN_PARAMETER
    elif param and err.get("type") == "unsupported_parameter":  # one of OpenAI's that Sluice does not serve
        msg = f"Unsupported parameter: '{param}' {err.get('msg')}."
        code = Code.UNSUPPORTED_PARAMETER
    elif param and err.get("type") in _EXPECTED:
        msg = (f"Invalid type for '{param}': expected {_EXPECTED[err['type']]}, but got "
               f"{json_type(err.get('input'))} instead.")
        code = Code.INVALID_TYPE
    else:
        detail = str(err.get("msg", "invalid value"))
        msg = f"Invalid value for '{param}': {detail}." if param else f"Invalid request: {detail}."
        code = Code.INVALID_VALUE
    return invalid(msg, param=param, code=code)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body" on deep JSON
            return body_too_deep().response()
        code = {404: Code.NOT_FOUND, 405: Code.METHOD_NOT_ALLOWED}.get(exc.status_code)
        if code is not None:
            err = error(code, str(exc.detail))
            err.headers = getattr(exc, "headers", None)
            return err.response()
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error(Code.INTERNAL, f"Internal error: {type(exc).__name__}").response()

"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.wire import codec, contract


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


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def no_engine(model: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        503,
        f"No engine serving model `{model}` is alive; try again later.",
        type="service_unavailable_error",
        code="no_engine",
        headers={"Retry-After": str(retry_after_s)},
    )


def queue_full(model: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(
        429,
        f"The queue for model `{model}` is full; retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def service_unavailable(message: str, code: str, retry_after_s: int = 1) -> OpenAIError:
    """A 503 the client should retry (``Retry-After``)."""
    return OpenAIError(503, message, type="service_unavailable_error", code=code,
                       headers={"Retry-After": str(retry_after_s)})


def request_lost(code: str, message: str, retry_after_s: int = 1) -> OpenAIError:
    """The request cannot complete (its queue entry or part of its output was lost with Redis)."""
    return service_unavailable(message, code, retry_after_s)


def deadline_exceeded() -> OpenAIError:
    return OpenAIError(
        504, "The request did not complete before its deadline.", type="timeout_error", code="deadline_exceeded"
    )


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "Incorrect API key provided. Pass it as `Authorization: Bearer <key>`.",
        code="invalid_api_key",
    )


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large")


def body_too_deep() -> OpenAIError:
    """JSON nested deeper than Python's parser recurses (RecursionError): a 400, never a 500."""
    return invalid("We could not parse the JSON body of your request: its arrays and objects are nested too "
                   "deeply.", code="invalid_json")


# Engine Error.code (the contract's ErrorCode) -> (HTTP status, OpenAI type). The OpenAI `code`
# is the enum's short name (codec.error_code_name), e.g. "deadline_exceeded".
ENGINE_ERRORS: dict[int, tuple[int, str]] = {
    contract.ERR_INVALID_REQUEST: (400, "invalid_request_error"),
    contract.ERR_CONTEXT_LENGTH: (400, "invalid_request_error"),
    contract.ERR_KV_CACHE_TOO_SMALL: (400, "invalid_request_error"),
    contract.ERR_DEADLINE: (504, "timeout_error"),
    contract.ERR_ENGINE_LOST: (503, "service_unavailable_error"),
    contract.ERR_DRAINING: (503, "service_unavailable_error"),
    contract.ERR_INTERNAL: (500, "internal_error"),
    contract.ERR_CONTRACT_MISMATCH: (503, "service_unavailable_error"),
}


def from_engine(code: int, message: str, retry_after_s: int = 1) -> OpenAIError:
    status, type_ = ENGINE_ERRORS.get(code, (500, "internal_error"))
    name = codec.error_code_name(code)
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return OpenAIError(status, message or name, type=type_, code=name, headers=headers)


def contract_mismatch(message: str) -> OpenAIError:
    """A gateway and an engine of different contract versions (``sluice.wire.card.ContractMismatch``)."""
    return OpenAIError(503, message, type="service_unavailable_error", code="contract_mismatch")


def _param_of(loc: tuple | list) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
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


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if not errors:
            return invalid("Invalid request.").response()
        err = errors[0]
        if err.get("type") == "json_invalid":
            return invalid(
                "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
                "using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                code="invalid_json",
            ).response()
        param = _param_of(err.get("loc", ()))
        if err.get("type") == "missing" and param:
            msg = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        elif param is None and err.get("type") in ("model_attributes_type", "dict_type"):
            msg = "The request body must be a JSON object."
            code = "invalid_json"
        elif param and err.get("type") in _EXPECTED:
            msg = (f"Invalid type for '{param}': expected {_EXPECTED[err['type']]}, but got "
                   f"{json_type(err.get('input'))} instead.")
            code = "invalid_type"
        else:
            detail = str(err.get("msg", "invalid value"))
            msg = f"Invalid value for '{param}': {detail}." if param else f"Invalid request: {detail}."
            code = "invalid_value"
        return invalid(msg, param=param, code=code).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body" on deep JSON
            return body_too_deep().response()
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), type_, None, code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"Internal error: {type(exc).__name__}", "internal_error"), status_code=500)

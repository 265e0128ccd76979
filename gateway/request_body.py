"""A request body from bytes to its validated model, bounded before pydantic sees it.

:func:`parse` is what FastAPI does with a JSON body (``json.loads``, then the route's model with
``from_attributes``, errors answered by ``errors.validation_error``), with the body's shape bounded
in between (``gateway.body_shape``). It is a prepare job: on the event loop for a small body, in a
prepare-pool worker for a large one (``gateway.preparation.parse_body``), with the same answers.

:class:`BoundedBodyRoute` is the route class of every endpoint with a JSON body: it parses the body
that way and hands FastAPI the model, which FastAPI then takes as it is (a validated instance is
not validated again); the route keeps its body model, so ``/openapi.json`` documents it as before.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError

from gateway import body_shape, errors
from gateway.body_checks import check_body


@functools.cache
def _adapter(model: type[BaseModel]) -> TypeAdapter:
    return TypeAdapter(model)


def parse(_ctx: Any, model: type[BaseModel], raw: bytes, check_text: bool) -> BaseModel:
    """``raw`` as a ``model``, or the OpenAIError (a 400) that refuses it. ``check_text``: also the
    UTF-8 and lone-surrogate checks (``gateway.body_checks``), which the middleware makes on the
    event loop for a body that is not sent to the prepare pool."""
    if check_text and (refusal := check_body(raw)) is not None:
        raise refusal
    try:
        data = json.loads(raw)
    except ValueError:
        raise errors.invalid_json() from None
    except RecursionError:  # nested deeper than the parser recurses
        raise errors.body_too_deep() from None
    if (problem := body_shape.check(data, model.__name__)) is not None:
        raise problem
    try:
        return _adapter(model).validate_python(data, from_attributes=True)
    except ValidationError as exc:
        raise errors.validation_error(exc.errors(include_url=False)) from None


class _ParsedRequest(Request):
    """The request with its body read and parsed already (what FastAPI's handler asks of it)."""

    def __init__(self, request: Request, raw: bytes, parsed: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self._raw, self._parsed = raw, parsed

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._parsed


class BoundedBodyRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is parsed by :func:`parse`, on the event loop or in the
    prepare pool by its size (``gateway.preparation``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = getattr(self.body_field, "field_info", None)
        model = getattr(model, "annotation", None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def parse_then_handle(request: Request) -> Response:
            from gateway import preparation  # the route module is imported before the pool's

            raw = await request.body()
            if not raw:
                return await handler(request)
            parsed = await preparation.parse_body(request, model, raw)
            return await handler(_ParsedRequest(request, raw, parsed))

        return parse_then_handle

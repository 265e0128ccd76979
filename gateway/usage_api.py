"""``GET /v1/organization/usage/completions``: the caller's own usage, in the shape of OpenAI's
Usage API, answered by any gateway from what the engines record in Redis (``sluice.wire.usage``).

A key sees its own tenant's usage and nobody else's (a deployment without keys: the default
tenant's, which is everybody's). Usage is kept per UTC hour for ``usage.RETENTION_S``, so buckets
are whole UTC hours (``1h``) or days (``1d``) holding ``start_time``; ``1m`` buckets are refused.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from gateway import errors, serving
from gateway.protocol import ErrorResponse
from sluice.wire import contract, usage

router = APIRouter(tags=["usage"])

# bucket width: (seconds, default buckets per page, most buckets per page), as OpenAI's API
WIDTHS = {"1h": (3600, 24, 168), "1d": (86400, 7, 31)}
GROUPINGS = ("model",)
# OpenAI's filters and groupings that have no meaning here (no projects, users or batches): a 400
# naming them rather than an answer that silently ignores them.
UNSUPPORTED = ("project_ids", "user_ids", "api_key_ids", "batch")
KNOWN = ("start_time", "end_time", "bucket_width", "group_by", "models", "limit", "page", *UNSUPPORTED)


def _values(request: Request, name: str) -> list[str]:
    """A parameter's values, given as ``name=a&name=b``, ``name[]=a`` or ``name=a,b``."""
    raw = request.query_params.getlist(name) + request.query_params.getlist(f"{name}[]")
    return [v for value in raw for v in value.split(",") if v]


def _integer(request: Request, name: str, low: int, high: int | None = None) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise errors.invalid(f"Invalid value for '{name}': expected an integer, got {value[:40]!r}.", param=name) from None
    if number < low or (high is not None and number > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise errors.invalid(f"Invalid value for '{name}': must be {bound}, got {number}.", param=name)
    return number


def _result(u: usage.Usage | None, model: str | None) -> dict[str, Any]:
    return {"object": "organization.usage.completions.result",
            "input_tokens": u.prompt_tokens if u else 0, "output_tokens": u.completion_tokens if u else 0,
            "input_cached_tokens": u.cached_tokens if u else 0, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": u.requests if u else 0,
            "project_id": None, "user_id": None, "api_key_id": None, "model": model, "batch": None}


@router.get("/v1/organization/usage/completions", responses={
    200: {"description": "a page of usage buckets (OpenAI's Usage API shape), the caller's tenant only"},
    **{status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "invalid parameter"), (401, "missing or wrong API key"), (503, "Redis unavailable"))}})
async def completions_usage(request: Request) -> Response:
    unknown = sorted({k.removesuffix("[]") for k in request.query_params} - set(KNOWN))
    if unknown:
        raise errors.invalid(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                             code="unknown_parameter")
    for name in UNSUPPORTED:
        if _values(request, name):
            raise errors.invalid(f"'{name}' is not supported: this server has no projects, users or batches; "
                                 "a key sees its own tenant's usage.", param=name, code="unsupported_parameter")
    start = _integer(request, "start_time", 0)
    if start is None:
        raise errors.invalid("Missing required parameter: 'start_time'.", param="start_time",
                             code="missing_required_parameter")
    now = int(time.time())
    end = _integer(request, "end_time", start + 1)
    end = now if end is None else end
    width_name = request.query_params.get("bucket_width", "1d")
    if width_name not in WIDTHS:
        why = "usage is kept per hour" if width_name == "1m" else "expected one of 1h, 1d"
        raise errors.invalid(f"Invalid value for 'bucket_width': {why}, got {width_name[:20]!r}.",
                             param="bucket_width")
    width, default_limit, most = WIDTHS[width_name]
    limit = _integer(request, "limit", 1, most) or default_limit
    group_by = _values(request, "group_by")
    for g in group_by:
        if g not in GROUPINGS:
            raise errors.invalid(f"Invalid value for 'group_by': {g[:40]!r} (this server groups by model only).",
                                 param="group_by")
    models = set(_values(request, "models"))
    first = start // width * width
    page = request.query_params.get("page")
    if page is not None:
        if not page.isdigit() or int(page) % width or not first <= int(page) < end:
            raise errors.invalid("Invalid value for 'page': not a page of this query.", param="page")
        first = int(page)
    buckets = [b for b in range(first, end, width)][:limit]
    following = buckets[-1] + width if buckets else end
    tenant = serving.principal_of(request).tenant
    spans = [usage.hours(max(b, start), min(b + width, end) - 1) for b in buckets]
    redis = request.app.state.broker.redis
    try:
        pipe = redis.pipeline(transaction=False)
        for hours in spans:
            for hour in hours:
                pipe.hgetall(contract.usage_key(tenant, hour))
        replies = iter(await pipe.execute() if any(spans) else [])
    except (RedisError, OSError) as exc:
        raise serving.redis_down(exc) from exc
    data = []
    for bucket, hours in zip(buckets, spans, strict=True):
        per_model: dict[str, usage.Usage] = {}
        for _ in hours:
            for u in usage.parse(tenant, next(replies)):
                if not models or u.model in models:
                    per_model.setdefault(u.model, usage.Usage(tenant, u.model)).add(u)
        if group_by:
            results = [_result(u, model) for model, u in sorted(per_model.items())]
        else:
            total = usage.Usage(tenant, "")
            for u in per_model.values():
                total.add(u)
            results = [_result(total, None)] if per_model else []
        data.append({"object": "bucket", "start_time": bucket, "end_time": bucket + width, "results": results})
    more = following < end
    return JSONResponse({"object": "page", "data": data, "has_more": more,
                         "next_page": str(following) if more else None})

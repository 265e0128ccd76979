"""Where a request's preparation runs: on the event loop, or in the prepare pool.

A request whose body (or, for ``/v1/responses``, whose stored history) is at least
``prepare_pool_threshold_bytes``, or that asks for an output constraint, is prepared in the prepare
pool (``gateway.prepare_pool``): its JSON parsed and bounded (``gateway.request_body.parse``; by
the body's size only), its tools and constraint compiled, its prompt rendered, checked by the
characters-per-token bound and tokenized (the jobs of ``gateway.prompts``), each in a worker
process, so the event loop only waits. A smaller one runs the same jobs on the event loop, as fast
as before: no process hop; a text of 8192 characters or more is tokenized in a thread with the GIL
released (``serving.encode``). Without a pool (``prepare_pool_workers`` 0) everything runs on the
loop, bounded all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from gateway import prompts, request_body, serving
from gateway.config import GatewayConfig
from gateway.prepare_pool import PreparePool


def pool_of(request: Request) -> PreparePool | None:
    return getattr(request.app.state, "prepare_pool", None)


def offloaded(config: GatewayConfig, size: int) -> bool:
    """Whether work on ``size`` bytes (or characters) goes to the prepare pool."""
    return config.prepare_pool_workers > 0 and size >= config.prepare_pool_threshold_bytes


def body_size(request: Request) -> int:
    """The size of the request's JSON body (0 when it was not read by ``request_body``)."""
    return getattr(request.state, "body_bytes", 0)


# How much heavier a byte of a request with an output constraint weighs: its schema, tools and
# grammar are converted in Python (the grammar engine itself releases the GIL: a 44 KB schema
# holds the event loop under 7 ms), so such a body goes to the pool at an eighth of the threshold.
# Small constrained requests stay on the loop: fifty concurrent ones must not fill the pool.
CONSTRAINT_WEIGHT = 8


def size_of(request: Request, body: Any, history_chars: int = 0) -> int:
    """What decides where ``body`` (the request's validated body) is prepared: its size in bytes
    (times ``CONSTRAINT_WEIGHT`` with an output constraint, ``prompts.constrained``), or the
    characters of the stored history it continues."""
    weight = CONSTRAINT_WEIGHT if prompts.constrained(body) else 1
    return max(body_size(request) * weight, history_chars)


async def parse_body(request: Request, model: type[BaseModel], raw: bytes) -> BaseModel:
    """``raw`` parsed as ``model`` (``request_body.parse``), in the pool when it is large."""
    request.state.body_bytes = len(raw)
    pool = pool_of(request)
    large = offloaded(serving.config_of(request), len(raw))  # the middleware left the text checks to us
    if pool is not None and large:
        return await pool.run(request_body.parse, None, model, raw, True)
    return request_body.parse(None, model, raw, large)


def run_in_worker(ctx: prompts.CardContext, job: Callable[..., Any], *args: Any) -> Any:
    """A prompt job and the tokenizing of its prompts, in a prepare-pool worker."""
    result = job(ctx, *args)
    for prompt in prompts.prompts_of(result):
        prompts.tokenized(ctx, prompt, ctx.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens))
    return result


async def run(request: Request, card: Any, job: Callable[..., Any], *args: Any, size: int) -> Any:
    """A prompt job of ``gateway.prompts`` for ``card`` (a LoadedCard), its prompts tokenized: in the
    pool when ``size`` (the request's bytes or characters) is large, else on the event loop."""
    pool = pool_of(request)
    if pool is not None and offloaded(serving.config_of(request), size):
        return await pool.run(run_in_worker, card, job, *args)
    result = job(card, *args)
    for prompt in prompts.prompts_of(result):
        ids = await serving.encode(card.tokenizer, prompt.text, add_special_tokens=prompt.add_special_tokens)
        prompts.tokenized(card, prompt, list(ids))
    return result
